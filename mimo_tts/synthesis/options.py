"""The option groups, each a frozen dataclass that checks its own values (UsageError, exit 2;
a wrong-typed value is OptionTypeError naming the field): what to say and how to sample
(`SynthesisOptions`, the library's options), how Stage-0/1 run (`EngineOptions`), where a batch
run's output goes (`RunOptions`), and the checkpoint names. `settings.resolve` fills them in one
pass (flag > env > profile > default). No torch here."""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, fields
from functools import cache
from typing import get_args, get_type_hints

from mimo_tts.codec.config import STREAM_MODES
from mimo_tts.errors import InputError, OptionTypeError, UsageError, short_repr
from mimo_tts.lm.config import LM_QUANTS, MAX_GROUPS, SamplerConfig
from mimo_tts.lm.engine import DEFAULT_ENGINE
from mimo_tts.lm.engine import ENGINES as ENGINE_SPECS
from mimo_tts.lm.tasks import TASKS, TTS_EN_TEMPLATES, TTS_ZH_TEMPLATES
from mimo_tts.lm.vllm import VLLM_BOUNDS, setting_problem
from mimo_tts.synthesis.audio import (
    FORMATS,
    SAMPLE_RATE,
    PromptAudio,
    check_format_rate,
    prompt_audio_of,
)
from mimo_tts.synthesis.markup import DEFAULT_SENTENCE_SILENCE, MAX_SENTENCE_SILENCE
from mimo_tts.synthesis.tempo import SPEEDS
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


def check(ok: bool, message: str) -> None:
    """A usage rule: `message` as a UsageError (exit 2) unless `ok`."""
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
    # Stage-1 pushes when streaming: the first once the decoder's look-ahead (10 groups) and
    # this many more have arrived, so it gives this many groups of audio at once; then
    # doubling up to stream_max_chunk_groups (None: the mode's default, see streaming.chunk_cap).
    stream_chunk_groups: int = 1
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
    # Speaking rate, pitch kept: each piece's audio time-stretched after Stage-1
    # (`synthesis/tempo.py`), so its codes are speed 1's; pauses keep their length.
    speed: float = 1.0
    # Seconds of silence between a text's pieces (`[pause:]` and SSML `<break>` in the text
    # ask their own; `synthesis/markup.py`), counted in samples: 0.32 s = 7680, 8 frames.
    sentence_silence: float = DEFAULT_SENTENCE_SILENCE

    def __post_init__(self):
        object.__setattr__(self, "prompt_audio", prompt_audio_of(self.prompt_audio))
        check_types(self)
        if self.voice is not None:
            check_name(self.voice)
            check(self.prompt_audio is None,
                   "--voice and --prompt-audio both give the voice prompt; give one")
        check(self.max_chars >= 0, "--max-chars must be >= 0 (0 disables splitting)")
        check(SPEEDS[0] <= self.speed <= SPEEDS[1],
              f"--speed must be in [{SPEEDS[0]:g}, {SPEEDS[1]:g}]")
        check(0 <= self.sentence_silence <= MAX_SENTENCE_SILENCE,
              f"--sentence-silence must be in [0, {MAX_SENTENCE_SILENCE:g}] seconds")
        check(0 <= self.seed <= MAX_SEED, "--seed must be in [0, 2**64 - 1]")
        check(self.max_new_groups is None or self.max_new_groups >= 1,
               "--max-new-groups must be >= 1")
        check(self.stream_chunk_groups >= 1, "stream_chunk_groups must be >= 1")
        check(self.stream_max_chunk_groups is None
               or self.stream_max_chunk_groups >= self.stream_chunk_groups,
               "stream_max_chunk_groups must be >= stream_chunk_groups")
        check(self.stream_mode in STREAM_MODES,
               f"--stream-mode must be one of {', '.join(STREAM_MODES)}")
        for name in ("temperature", "audio_temperature"):
            value = getattr(self, name)
            check(value is None or 0 <= value <= MAX_TEMPERATURE,
                   f"{name} must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy)")
        for name in ("top_p", "audio_top_p"):
            value = getattr(self, name)
            check(value is None or 0 < value <= 1, f"{name} must be in (0, 1]")
        for name in ("top_k", "audio_top_k"):
            check(getattr(self, name) is None or getattr(self, name) >= 0, f"{name} must be >= 0")
        count = min(len(TTS_EN_TEMPLATES), len(TTS_ZH_TEMPLATES))
        check(self.template is None or 0 <= self.template < count,
               f"--template must be in [0, {count - 1}]")
        spec = TASKS.get(self.task)
        check(spec is not None, f"unknown --task {self.task!r}; choose one of {', '.join(TASKS)}")
        check(not (self.prompt_audio and spec.prompt_audio == "none"),
               f"--prompt-audio: task {spec.name} takes no voice prompt; use tts_sft_with_audio")
        check(not (self.voice and spec.prompt_audio == "none"),
               f"--voice: task {spec.name} takes no voice prompt; use tts_sft_with_audio")
        check(not (self.instruct and spec.instruct == "none"),
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
    # default, except when streaming with both stages on the CPU (`loader.thread_budgets`): on
    # up to 8 cores the stages take turns with every thread, on more Stage-1 gets an eighth.
    lm_threads: int | None = None
    tokenizer_threads: int | None = None
    # Skip the memory preflight (synthesis/preflight.py) that refuses, with exit 4, a run whose
    # estimate exceeds the available memory.
    no_memory_check: bool = False
    lm_quant: str | None = None  # opt-in quantized LM on CPU (mimo_tts/lm/int8.py)
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
            check(value is None or 1 <= value <= MAX_THREADS,
                   f"--{name.replace('_', '-')} must be in [1, {MAX_THREADS}]")
        check(self.engine in ENGINES, f"--engine must be one of {', '.join(ENGINES)}")
        check(self.lm_quant is None or self.lm_quant in LM_QUANTS,
               f"--lm-quant must be one of {', '.join(LM_QUANTS)}")
        for spec in ENGINE_SPECS.values():  # options of one engine need that engine
            given = [name for name in spec.options if getattr(self, name) is not None]
            check(self.engine == spec.name or not given,
                   f"--{given[0].replace('_', '-') if given else ''} applies to --engine "
                   f"{spec.name} only")
        for name in VLLM_BOUNDS:  # the engine's own bounds, checked before it starts
            problem = setting_problem(name, getattr(self, name))
            check(problem is None, f"--{name.replace('_', '-')} {problem}")


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
            check(bool(names) and all(n in CAPTION_FORMATS for n in names)
                   and len(set(names)) == len(names),
                   f"--captions takes {', '.join(CAPTION_FORMATS)} or both, comma-separated; "
                   f"got {self.caption_formats!r}")
            object.__setattr__(self, "caption_formats", ",".join(names))
        check(self.format in FORMATS, f"--format must be one of {', '.join(FORMATS)}")
        check(8000 <= self.sample_rate <= MAX_SAMPLE_RATE,
               f"--sample-rate must be in [8000, {MAX_SAMPLE_RATE}]")
        check(self.batch_size >= 1, "--batch-size must be >= 1")
        check_format_rate(self.format, self.sample_rate)

    def check_combinations(self) -> RunOptions:
        """Flags that exclude each other (checked by `resolve` once every value is valid)."""
        check(not (self.raw and self.output not in (None, "-")),
               "--raw writes PCM to stdout; it cannot be combined with -o FILE")
        check(not (self.stream and self.batch_size > 1),
               "--stream generates one prompt at a time; drop --batch-size")
        check(not (self.raw and self.sample_rate != SAMPLE_RATE),
               "--raw streams 24 kHz PCM; --sample-rate cannot be used with it")
        check(not (self.caption_formats and self.to_stdout),
               "--captions writes files beside each output; it cannot be used with stdout "
               "(-o - or --raw)")
        check(not (self.raw and self.format != "wav"),
               f"--raw streams 16-bit PCM without a header; --format {self.format} cannot be "
               f"used with it (use -o - --format {self.format} for a {self.format} file on "
               "stdout)")
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
