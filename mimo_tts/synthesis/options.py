"""Run options: one pass (flag > env > profile > default) into typed, self-checking parts.

`resolve` reads every option once, from the `OptionValues` a caller gives (the CLI's commands
build them from their flags; the library and the server give a mapping of option names), and
returns `Settings`: what to say and how to sample (`SynthesisOptions`, the library's options),
how Stage-0/1 run (`EngineOptions`), where the output goes (`RunOptions`, the CLI's), the
device `Placement` and the checkpoint names, with the source of every value. Each dataclass
validates itself (UsageError, exit 2). Values are tested with `is not None`, so an explicit 0
or false wins. Device and checkpoint fields have environment variables;
`devices.resolve_placement` and `checkpoints.pick_names` apply them in this same pass. No
torch here.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import get_args, get_type_hints

from mimo_tts.codec.config import STREAM_MODES
from mimo_tts.errors import (
    CheckpointError,
    InputError,
    MimoTTSError,
    OptionTypeError,
    UsageError,
    short_repr,
)
from mimo_tts.lm.config import LM_QUANTS, MAX_GROUPS, SamplerConfig
from mimo_tts.lm.engine import DEFAULT_ENGINE
from mimo_tts.lm.engine import ENGINES as ENGINE_SPECS
from mimo_tts.lm.tasks import TASKS, TTS_EN_TEMPLATES, TTS_ZH_TEMPLATES
from mimo_tts.lm.vllm import VLLM_BOUNDS, setting_problem
from mimo_tts.presets import TINY, checkpoint_dtype
from mimo_tts.runtime.checkpoints import DEFAULT_MODEL, DEFAULT_TOKENIZER, TOKENIZER_PATH_ENV
from mimo_tts.runtime.devices import Placement, resolve_placement
from mimo_tts.synthesis.audio import (
    FORMATS,
    SAMPLE_RATE,
    PromptAudio,
    check_format_rate,
    output_format,
    prompt_audio_of,
)
from mimo_tts.synthesis.voices import check_name

MAX_SEED = 2**64 - 1  # torch generators take seeds in [0, 2**64)
MAX_TEMPERATURE = 100.0  # finite: inf/NaN would turn the softmax into NaN
MAX_THREADS = 256  # torch/OpenMP crash or abort on absurd thread counts
MAX_SAMPLE_RATE = 192000  # the highest rate libsndfile's FLAC writer takes
ENGINES = tuple(ENGINE_SPECS)
CAPTION_FORMATS = ("srt", "vtt")
# Options resolved with their env variables by devices.py, in resolve_placement's order.
PLACEMENT_FIELDS = ("lm_device", "tokenizer_device", "dtype", "tokenizer_dtype", "cuda_graph")


DEFAULT_TASK = "tts_sft"
# os.PathLike values of these fields are kept as str
PATH_FIELDS = frozenset({"output_dir", "output", "prompt_audio", "model", "tokenizer"})
_KIND_WORDS = {bool: "true or false", int: "an integer", float: "a real number",
               str: "a string"}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


@cache
def _field_kinds(cls) -> dict[str, tuple[tuple[type, ...], bool]]:
    """Field name -> (the types it holds when set, whether None is allowed)."""
    hints = {name: get_args(hint) or (hint,) for name, hint in get_type_hints(cls).items()}
    return {f.name: (tuple(t for t in hints[f.name] if t is not type(None)),
                     type(None) in hints[f.name]) for f in fields(cls)}


def check_types(options) -> None:
    """Each field of an options dataclass holds its annotated type, or an OptionTypeError
    names it: bools are not numbers and numbers not bools; integral numbers are stored as int
    and real ones as float (numpy scalars included), path fields' `os.PathLike` as str."""
    for name, (kinds, optional) in _field_kinds(type(options)).items():
        value = getattr(options, name)
        if value is None and optional:
            continue
        fixed = _of_kind(name, value, kinds)
        if fixed is not value:
            object.__setattr__(options, name, fixed)  # frozen: normalised once, when built


def _of_kind(name: str, value, kinds: tuple[type, ...]):
    kind = kinds[0]
    if kind is bool and isinstance(value, bool):
        return value
    if kind in (int, float) and not isinstance(value, bool):
        if isinstance(value, numbers.Integral):
            return int(value) if kind is int else _real(value)
        if kind is float and isinstance(value, numbers.Real):
            return _real(value)
    if kind is str and name in PATH_FIELDS and isinstance(value, os.PathLike):
        value = os.fspath(value)
    if kind not in (bool, int, float) and isinstance(value, kinds):
        return value
    raise OptionTypeError(f"{name} must be {_KIND_WORDS.get(kind, kind.__name__)}, not "
                          f"{type(value).__name__} {short_repr(value)}")


def _real(value) -> float:
    try:
        return float(value)
    except OverflowError:  # an int past float's range: out of every option's range too
        return float("inf") if value > 0 else float("-inf")


def task_for(instruct, prompt_audio, voice=None) -> str:
    """The task a run takes when none is named: a voice prompt or a stored voice clones
    (tts_sft_with_audio, with or without an instruction), an instruction alone styles
    (tts_sft_with_instruct)."""
    if prompt_audio is not None or voice is not None:
        return "tts_sft_with_audio"
    return "tts_sft_with_instruct" if instruct is not None else DEFAULT_TASK


@dataclass(frozen=True)
class SynthesisOptions:
    """What to say and how to sample it: the library's options (`MiMoTTS.synthesize`)."""

    task: str = DEFAULT_TASK  # resolve: the inputs' task (`task_for`) when not given
    instruct: str | None = None
    # A file path, or in the library samples in memory: `(samples, sample_rate)` (numpy or
    # torch, [S] or [C, S], floats) is stored as a read-only `PromptAudio`.
    prompt_audio: str | PromptAudio | None = None
    template: int | None = None
    seed: int = 0
    temperature: float | None = None  # None: the task's default (spec §4.6)
    top_k: int | None = None
    top_p: float | None = None
    audio_temperature: float | None = None
    audio_top_k: int | None = None
    audio_top_p: float | None = None
    max_new_groups: int | None = None
    max_chars: int = 300  # split longer text on sentence ends; 0 never splits
    # Stage-1 pushes when streaming: the first after this many groups (0.8 s of audio), then
    # doubling up to stream_max_chunk_groups (None: the mode's default, see overlap.chunk_cap).
    stream_chunk_groups: int = 5
    stream_max_chunk_groups: int | None = None
    # Streaming decoder: "incremental" decodes every frame once with bounded state, closest to
    # the one-shot decode (codec/incremental.py); "official" re-decodes overlapping windows
    # (the official `streaming_decode`, spec §7.2).
    stream_mode: str = "incremental"
    # A voice of the registry (`synthesis/voices.py`): its stored prompt codes, as the same
    # file given as prompt_audio would be encoded.
    voice: str | None = None
    # One piece per sentence (long ones cut at clause punctuation), so that each gets a cue
    # with exact times (`synthesis/captions.py`); the audio differs from a run without.
    captions: bool = False

    def __post_init__(self):
        object.__setattr__(self, "prompt_audio", prompt_audio_of(self.prompt_audio))
        check_types(self)
        if self.voice is not None:
            check_name(self.voice)
            _check(self.prompt_audio is None,
                   "--voice and --prompt-audio both give the voice prompt; give one")
        _check(self.max_chars >= 0, "--max-chars must be >= 0 (0 disables splitting)")
        _check(0 <= self.seed <= MAX_SEED, "--seed must be in [0, 2**64 - 1]")
        _check(self.max_new_groups is None or self.max_new_groups >= 1,
               "--max-new-groups must be >= 1")
        _check(self.stream_chunk_groups >= 1, "stream_chunk_groups must be >= 1")
        _check(self.stream_max_chunk_groups is None
               or self.stream_max_chunk_groups >= self.stream_chunk_groups,
               "stream_max_chunk_groups must be >= stream_chunk_groups")
        _check(self.stream_mode in STREAM_MODES,
               f"--stream-mode must be one of {', '.join(STREAM_MODES)}")
        for name in ("temperature", "audio_temperature"):
            value = getattr(self, name)
            _check(value is None or 0 <= value <= MAX_TEMPERATURE,
                   f"{name} must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy)")
        for name in ("top_p", "audio_top_p"):
            value = getattr(self, name)
            _check(value is None or 0 < value <= 1, f"{name} must be in (0, 1]")
        for name in ("top_k", "audio_top_k"):
            _check(getattr(self, name) is None or getattr(self, name) >= 0, f"{name} must be >= 0")
        count = min(len(TTS_EN_TEMPLATES), len(TTS_ZH_TEMPLATES))
        _check(self.template is None or 0 <= self.template < count,
               f"--template must be in [0, {count - 1}]")
        spec = TASKS.get(self.task)
        _check(spec is not None, f"unknown --task {self.task!r}; choose one of {', '.join(TASKS)}")
        _check(not (self.prompt_audio and spec.prompt_audio == "none"),
               f"--prompt-audio: task {spec.name} takes no voice prompt; use tts_sft_with_audio")
        _check(not (self.voice and spec.prompt_audio == "none"),
               f"--voice: task {spec.name} takes no voice prompt; use tts_sft_with_audio")
        _check(not (self.instruct and spec.instruct == "none"),
               f"--instruct: task {spec.name} takes no instruction; use tts_sft_with_instruct")

    def check_item(self, instruct=None, prompt_audio=None, where: str | None = None) -> None:
        """An item's inputs (its own, else these options') against the task, before anything
        is read or generated: a missing one is an InputError naming the flag that gives it."""
        spec, at = TASKS[self.task], f"{where}: " if where else ""
        if spec.prompt_audio == "required" and not (prompt_audio or self.prompt_audio
                                                     or self.voice):
            raise InputError(f"{at}task {spec.name} needs a voice prompt: give --prompt-audio "
                             "FILE (or prompt_audio in a JSONL item)")
        if spec.instruct == "required" and not (instruct or self.instruct):
            raise InputError(f"{at}task {spec.name} needs a style instruction: give --instruct "
                             "TEXT (or instruct in a JSONL item)")

    def sampler_settings(self) -> dict:
        """The sampler values as given (None: the task's default)."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "audio_temperature": self.audio_temperature, "audio_top_k": self.audio_top_k,
                "audio_top_p": self.audio_top_p}

    def samplers(self):
        """(text, audio) SamplerConfig: the task's defaults with these options' overrides."""
        text, audio = TASKS[self.task].samplers()

        def pick(base, temperature, top_k, top_p):
            return SamplerConfig(base.temperature if temperature is None else temperature,
                                 base.top_k if top_k is None else (top_k or None),
                                 base.top_p if top_p is None else top_p)

        return (pick(text, self.temperature, self.top_k, self.top_p),
                pick(audio, self.audio_temperature, self.audio_top_k, self.audio_top_p))

    def generation_options(self, seed: int):
        """The finished GenerationOptions: samplers, seed, group cap and the task's stop set."""
        from mimo_tts.lm.generate import GenerationOptions

        text, audio = self.samplers()
        return GenerationOptions(text_sampler=text, audio_sampler=audio, seed=seed,
                                 max_new_groups=self.max_new_groups or MAX_GROUPS,
                                 stop_tokens=TASKS[self.task].stop_tokens)


@dataclass(frozen=True)
class EngineOptions:
    """How the stages run: the Stage-0 engine, its vLLM settings and per-stage CPU threads."""

    engine: str = DEFAULT_ENGINE  # a name of `lm.engine.ENGINES`
    # CPU threads per stage (torch intra-op threads, set per thread): None leaves torch's
    # default, except that streaming with both stages on the CPU splits the cores between them.
    lm_threads: int | None = None
    tokenizer_threads: int | None = None
    # Skip the memory preflight (mimo_tts.memory) that refuses, with exit 4, a run whose
    # estimate exceeds the available memory.
    no_memory_check: bool = False
    lm_quant: str | None = None  # opt-in int8 weight-only LM on CPU (mimo_tts/lm/quant.py)
    # vLLM settings stay None unless given (None: VLLMOptions' defaults, see lm/vllm/launch.py).
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    tensor_parallel_size: int | None = None
    max_model_len: int | None = None  # groups, prompt included
    kv_cache_mib: int | None = None  # profile only; default 64 MiB on CPU, else the utilisation

    def __post_init__(self):
        check_types(self)
        for name in ("lm_threads", "tokenizer_threads"):
            value = getattr(self, name)
            _check(value is None or 1 <= value <= MAX_THREADS,
                   f"--{name.replace('_', '-')} must be in [1, {MAX_THREADS}]")
        _check(self.engine in ENGINES, f"--engine must be one of {', '.join(ENGINES)}")
        _check(self.lm_quant is None or self.lm_quant in LM_QUANTS,
               f"--lm-quant must be one of {', '.join(LM_QUANTS)}")
        for spec in ENGINE_SPECS.values():  # options of one engine need that engine
            given = [name for name in spec.options if getattr(self, name) is not None]
            _check(self.engine == spec.name or not given,
                   f"--{given[0].replace('_', '-') if given else ''} applies to --engine "
                   f"{spec.name} only")
        for name in VLLM_BOUNDS:  # the engine's own bounds, checked before it starts
            problem = setting_problem(name, getattr(self, name))
            _check(problem is None, f"--{name.replace('_', '-')} {problem}")


@dataclass(frozen=True)
class RunOptions:
    """Where a batch run's output goes and how items are grouped: the CLI's options."""

    batch_size: int = 1
    output_dir: str = "output_audio"
    output: str | None = None
    format: str = "wav"  # with `output`: the file's extension's (resolve_options)
    sample_rate: int = SAMPLE_RATE
    save_codes: bool = False
    overwrite: bool = False
    stream: bool = False
    raw: bool = False
    # Caption files beside each output ("srt", "vtt" or "srt,vtt"); sets `captions`.
    caption_formats: str | None = None

    def __post_init__(self):
        check_types(self)
        if self.caption_formats is not None:
            names = [n.strip().lower() for n in self.caption_formats.split(",")]
            _check(bool(names) and all(n in CAPTION_FORMATS for n in names)
                   and len(set(names)) == len(names),
                   f"--captions takes {', '.join(CAPTION_FORMATS)} or both, comma-separated; "
                   f"got {self.caption_formats!r}")
            object.__setattr__(self, "caption_formats", ",".join(names))
        _check(self.format in FORMATS, f"--format must be one of {', '.join(FORMATS)}")
        _check(8000 <= self.sample_rate <= MAX_SAMPLE_RATE,
               f"--sample-rate must be in [8000, {MAX_SAMPLE_RATE}]")
        _check(self.batch_size >= 1, "--batch-size must be >= 1")
        check_format_rate(self.format, self.sample_rate)

    def check_combinations(self) -> RunOptions:
        """Flags that exclude each other (checked by `resolve` once every value is valid)."""
        _check(not (self.raw and self.output not in (None, "-")),
               "--raw writes PCM to stdout; it cannot be combined with -o FILE")
        _check(not (self.stream and self.batch_size > 1),
               "--stream generates one prompt at a time; drop --batch-size")
        _check(not (self.raw and self.sample_rate != SAMPLE_RATE),
               "--raw streams 24 kHz PCM; --sample-rate cannot be used with it")
        _check(not (self.caption_formats and self.to_stdout),
               "--captions writes files beside each output; it cannot be used with stdout "
               "(-o - or --raw)")
        _check(not (self.raw and self.format != "wav"),
               f"--raw streams PCM16 without a container; --format {self.format} cannot be "
               "used with it")
        return self

    @property
    def to_stdout(self) -> bool:
        return self.raw or self.output == "-"


@dataclass(frozen=True)
class CheckpointNames:
    """Which checkpoints, each as (name, source), and whether a missing one may be fetched."""

    lm: tuple[str, str]
    tokenizer: tuple[str, str]
    allow_download: bool = False


# Built in this order, so the first of several bad values is reported as before the split.
GROUPS = {"run": RunOptions, "synthesis": SynthesisOptions, "engine": EngineOptions}


def _value_type(hint) -> type:
    """The type an option field holds when set (`int | None` -> int)."""
    return next(t for t in get_args(hint) or (hint,) if t is not type(None))


@dataclass(frozen=True)
class OptionValues:
    """The options a caller gives, by name (None: not given, so env, profile or default
    decide): what the CLI's commands build from their flags and `resolve` reads. Every field is
    an option group's field, a placement field or a checkpoint field, of that field's type."""

    # SynthesisOptions
    task: str | None = None
    instruct: str | None = None
    prompt_audio: str | None = None
    template: int | None = None
    seed: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    audio_temperature: float | None = None
    audio_top_k: int | None = None
    audio_top_p: float | None = None
    max_new_groups: int | None = None
    max_chars: int | None = None
    stream_chunk_groups: int | None = None
    stream_max_chunk_groups: int | None = None
    stream_mode: str | None = None
    voice: str | None = None
    captions: bool | None = None
    # EngineOptions
    engine: str | None = None
    lm_threads: int | None = None
    tokenizer_threads: int | None = None
    no_memory_check: bool | None = None
    lm_quant: str | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    tensor_parallel_size: int | None = None
    max_model_len: int | None = None
    kv_cache_mib: int | None = None
    # RunOptions
    batch_size: int | None = None
    output_dir: str | None = None
    output: str | None = None
    format: str | None = None
    sample_rate: int | None = None
    save_codes: bool | None = None
    overwrite: bool | None = None
    stream: bool | None = None
    raw: bool | None = None
    caption_formats: str | None = None
    # the placement (PLACEMENT_FIELDS) and the checkpoints
    lm_device: str | None = None
    tokenizer_device: str | None = None
    dtype: str | None = None
    tokenizer_dtype: str | None = None
    cuda_graph: bool | None = None
    model: str | None = None
    tokenizer: str | None = None
    allow_download: bool | None = None

    def __post_init__(self):
        check_types(self)

    @classmethod
    def of(cls, values: OptionValues | Mapping[str, object]) -> OptionValues:
        """Option values from a mapping of option names (the library's and the server's)."""
        if isinstance(values, OptionValues):
            return values
        unknown = sorted(set(values) - OPTION_NAMES)
        _check(not unknown, f"unknown option(s) {', '.join(map(repr, unknown))}")
        return cls(**values)

    def given(self) -> dict[str, object]:
        """The options that were given, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


OPTION_NAMES = frozenset(f.name for f in fields(OptionValues))
# Profile key -> the type its value must have (an option field's own annotation).
PROFILE_TYPES = {f.name: _value_type(get_type_hints(OptionValues)[f.name])
                 for f in fields(OptionValues)}
PROFILE_KEYS = frozenset(PROFILE_TYPES)


@dataclass(frozen=True)
class Settings:
    """Every option of a run, resolved once; `sources[name]` says where each value came from."""

    synthesis: SynthesisOptions = field(default_factory=SynthesisOptions)
    engine: EngineOptions = field(default_factory=EngineOptions)
    run: RunOptions = field(default_factory=RunOptions)
    placement: Placement | None = None
    checkpoints: CheckpointNames | None = None
    sources: Mapping[str, str] = field(default_factory=dict)

    def replace(self, **changes) -> Settings:
        """A copy with some option fields changed (each group validates again)."""
        groups = {name: getattr(self, name) for name in GROUPS}
        for key, value in changes.items():
            group = next((g for g, cls in GROUPS.items()
                          if key in {f.name for f in fields(cls)}), None)
            _check(group is not None, f"unknown option {key!r}")
            groups[group] = replace(groups[group], **{key: value})
        groups["run"].check_combinations()
        return replace(self, **groups)


def resolve(given: OptionValues | Mapping[str, object],
            profile: Mapping[str, object] | None = None, env: Mapping[str, str] | None = None,
            probe=None) -> Settings:
    """given > env > profile > default for every option, in one pass (usage errors raised).

    `given`: `OptionValues`, or a mapping of option names (`mimo_tts.load`, the server)."""
    given = OptionValues.of(given)
    return place(resolve_options(given, profile), given, profile, env, probe)


def resolve_options(given: OptionValues | Mapping[str, object],
                    profile: Mapping[str, object] | None = None) -> Settings:
    """The option groups alone (given > profile > default); no placement or checkpoints yet."""
    given = OptionValues.of(given)
    profile = profile or {}
    sources: dict[str, str] = {}
    groups = {}
    try:
        for name, cls in GROUPS.items():
            values = {}
            for spec in fields(cls):
                value, source = _pick(spec.name, given, profile)
                if value is not None:
                    values[spec.name] = value
                sources[spec.name] = source
            if cls is SynthesisOptions and "task" not in values:  # no --task: the inputs say
                values["task"] = task_for(values.get("instruct"), values.get("prompt_audio"),
                                          values.get("voice"))
            if cls is SynthesisOptions and groups["run"].caption_formats and not values.get(
                    "captions"):  # caption files need a cue per sentence
                values["captions"] = True
            groups[name] = _build(cls, values, [k for k in values if sources[k] == "config"],
                                  profile)
    except OptionTypeError:
        raise
    except TypeError as exc:
        raise UsageError(f"bad option value: {exc}") from None
    run = groups["run"]
    if run.output is not None:  # `-o x.flac` writes FLAC; a --format that disagrees is refused
        given = run.format if sources["format"] != "default" else None
        groups["run"] = replace(run, format=output_format(run.output, given))
    groups["run"].check_combinations()
    return Settings(**groups, sources=sources)


def place(settings: Settings, given: OptionValues,
          profile: Mapping[str, object] | None = None, env: Mapping[str, str] | None = None,
          probe=None) -> Settings:
    """Add the devices (flag > env > profile > default, `devices.py`) and the checkpoint names
    (`checkpoints.pick_names`) to option groups from `resolve_options`."""
    profile = profile or {}
    env = os.environ if env is None else env
    sources = dict(settings.sources)
    try:
        lm, tok = pick_names(given.model, given.tokenizer, profile, env)
        error = None
    except MimoTTSError as exc:  # raised after the placement's own errors, as before
        lm = tok = None
        error = exc
    # `--dtype auto` follows the checkpoints' own torch_dtype (config.json)
    dtypes = (None, None) if error else (checkpoint_dtype(*lm, "model", env),
                                         checkpoint_dtype(*tok, "tokenizer", env))
    placement = resolve_placement(*(getattr(given, name) for name in PLACEMENT_FIELDS),
                                  profile=profile, env=env, probe=probe,
                                  checkpoint_dtypes=dtypes)
    if error:
        raise error
    sources.update({name: choice.source for name, choice in vars(placement).items()})
    download, sources["allow_download"] = _pick("allow_download", given, profile)
    sources.update({"model": lm[1], "tokenizer": tok[1]})
    return replace(settings, placement=placement,
                   checkpoints=CheckpointNames(lm, tok, bool(download)), sources=sources)


def pick_names(model: str | None, tokenizer: str | None, profile: Mapping | None = None,
               env: Mapping[str, str] | None = None) -> tuple[tuple[str, str], tuple[str, str]]:
    """(name, source) for the LM and the tokenizer: flag > env > profile > default (the tiny
    preset's LM comes with the tiny preset's tokenizer)."""
    env = os.environ if env is None else env
    profile = profile or {}
    lm = _first((model, "flag"), (profile.get("model"), "config"), (DEFAULT_MODEL, "default"))
    tok_env = env.get(TOKENIZER_PATH_ENV) or None
    if tok_env is not None and not Path(tok_env).expanduser().is_dir():
        raise CheckpointError(f"{TOKENIZER_PATH_ENV}={tok_env!r} is not a directory; it must "
                              "point to a local copy of the MiMo-Audio tokenizer")
    default_tok = TINY if lm[0] == TINY else DEFAULT_TOKENIZER
    tok = _first((tokenizer, "flag"), (tok_env, f"env {TOKENIZER_PATH_ENV}"),
                 (profile.get("tokenizer"), "config"), (default_tok, "default"))
    return lm, tok


def _first(*candidates):
    return next((str(v), s) for v, s in candidates if v is not None)


def _build(cls, values: dict, from_profile: list[str], profile: Mapping):
    """`cls(**values)`; an error that one profile value alone causes names its file and key."""
    try:
        return cls(**values)
    except UsageError as exc:
        for key in from_profile:
            try:
                cls(**{k: v for k, v in values.items() if k != key})
            except UsageError:
                continue
            raise UsageError(f"{getattr(profile, 'path', 'config profile')}: {key} = "
                             f"{short_repr(values[key])}: {exc}") from None
        raise


def _pick(name: str, given: OptionValues, profile: Mapping) -> tuple[object, str]:
    if getattr(given, name) is not None:
        return getattr(given, name), "flag"
    if profile.get(name) is not None:
        return profile[name], "config"
    return None, "default"
