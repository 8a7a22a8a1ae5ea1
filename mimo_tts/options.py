"""Run options of `mimo-tts synth`: one frozen dataclass, TOML profiles, validation in one place.

Precedence for every field is flag > profile > default, tested with `is not None` (an explicit
0 or false wins). Device and checkpoint fields also have environment variables, so they are
resolved downstream (`devices.resolve_placement`, `models.pick_names`) where the env step sits
between the flag and the profile. No torch here.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

from mimo_tts.errors import UsageError
from mimo_tts.io import FORMATS, SAMPLE_RATE
from mimo_tts.lm.config import MAX_GROUPS

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
# Resolved downstream with their env vars (devices.py, models.py), so the profile is not merged
# into these fields here: flag > env > profile > default needs the env step in between.
STREAM_MODES = ("official", "incremental")
ENGINES = ("native", "vllm")
# Options of the vLLM engine only (`--engine vllm`); an error with the native engine.
VLLM_FIELDS = ("gpu_memory_utilization", "max_num_seqs", "tensor_parallel_size", "max_model_len",
               "kv_cache_mib")
DEFERRED_FIELDS = ("lm_device", "tokenizer_device", "dtype", "tokenizer_dtype", "cuda_graph",
                   "model", "tokenizer")


@dataclass(frozen=True)
class SynthOptions:
    """Every run option of `mimo-tts synth`; TOML profile keys equal these field names."""

    task: str = "tts_sft"
    instruct: str | None = None
    prompt_audio: str | None = None
    template: int | None = None
    model: str | None = None
    tokenizer: str | None = None
    allow_download: bool = False
    lm_device: str | None = None
    tokenizer_device: str | None = None
    dtype: str | None = None
    tokenizer_dtype: str | None = None
    cuda_graph: bool | None = None
    # Skip the memory preflight (mimo_tts.memory) that refuses, with exit 4, a run whose
    # estimate exceeds the available memory.
    no_memory_check: bool = False
    # CPU threads per stage (torch intra-op threads, set per thread): None leaves torch's
    # default, except that --stream with both stages on the CPU splits the cores between them.
    lm_threads: int | None = None
    tokenizer_threads: int | None = None
    seed: int = 0
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    audio_temperature: float | None = None
    audio_top_k: int | None = None
    audio_top_p: float | None = None
    max_new_groups: int | None = None
    batch_size: int = 1
    max_chars: int = 300
    output_dir: str = "output_audio"
    output: str | None = None
    format: str = "wav"
    sample_rate: int = SAMPLE_RATE
    save_codes: bool = False
    overwrite: bool = False
    stream: bool = False
    raw: bool = False
    # Stage-1 pushes with --stream: the first after this many groups (0.8 s of audio), then
    # doubling up to stream_max_chunk_groups (None: 10 in incremental mode, 30 in official
    # mode, vllm-omni's chunk; see mimo_tts.stream.DEFAULT_MAX_CHUNK).
    stream_chunk_groups: int = 5
    stream_max_chunk_groups: int | None = None
    # Streaming decoder: "incremental" decodes every frame once with bounded state, closest to
    # the official one-shot decode (mimo_tts.codec.incremental); "official" re-decodes
    # overlapping windows (the official `streaming_decode`, spec §7.2).
    stream_mode: str = "incremental"
    # Stage-0 engine: "native" (mimo_tts.lm) or "vllm" (mimo_tts.lm.vllm, optional install). The
    # vLLM settings stay None unless given (None: VLLMOptions' defaults, see engine.vllm_options).
    engine: str = "native"
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    tensor_parallel_size: int | None = None
    max_model_len: int | None = None  # groups, prompt included
    kv_cache_mib: int | None = None  # profile only; default 64 MiB on CPU, else the utilisation

    def validate(self) -> SynthOptions:
        """Check values and combinations in one place (UsageError, exit 2)."""
        _check(self.format in FORMATS, f"--format must be one of {', '.join(FORMATS)}")
        _check(self.sample_rate >= 8000, "--sample-rate must be at least 8000")
        _check(self.batch_size >= 1, "--batch-size must be >= 1")
        _check(self.max_chars >= 0, "--max-chars must be >= 0 (0 disables splitting)")
        _check(self.seed >= 0, "--seed must be >= 0")
        _check(self.max_new_groups is None or self.max_new_groups >= 1,
               "--max-new-groups must be >= 1")
        _check(self.stream_chunk_groups >= 1, "stream_chunk_groups must be >= 1")
        _check(self.stream_max_chunk_groups is None
               or self.stream_max_chunk_groups >= self.stream_chunk_groups,
               "stream_max_chunk_groups must be >= stream_chunk_groups")
        _check(self.stream_mode in STREAM_MODES,
               f"--stream-mode must be one of {', '.join(STREAM_MODES)}")
        for name in ("temperature", "audio_temperature"):
            _check(getattr(self, name) is None or getattr(self, name) >= 0, f"{name} must be >= 0")
        for name in ("top_p", "audio_top_p"):
            value = getattr(self, name)
            _check(value is None or 0 < value <= 1, f"{name} must be in (0, 1]")
        for name in ("top_k", "audio_top_k"):
            _check(getattr(self, name) is None or getattr(self, name) >= 0, f"{name} must be >= 0")
        for name in ("lm_threads", "tokenizer_threads"):
            value = getattr(self, name)
            _check(value is None or value >= 1, f"--{name.replace('_', '-')} must be >= 1")
        _check(not (self.raw and self.output not in (None, "-")),
               "--raw writes PCM to stdout; it cannot be combined with -o FILE")
        _check(self.template is None or self.template >= 0, "--template must be >= 0")
        self._validate_engine()
        return self

    def _validate_engine(self) -> None:
        _check(self.engine in ENGINES, f"--engine must be one of {', '.join(ENGINES)}")
        given = [name for name in VLLM_FIELDS if getattr(self, name) is not None]
        _check(self.engine == "vllm" or not given,
               f"--{given[0].replace('_', '-') if given else ''} applies to --engine vllm only")
        value = self.gpu_memory_utilization
        _check(value is None or 0 < value <= 1, "--gpu-memory-utilization must be in (0, 1]")
        for name in ("max_num_seqs", "tensor_parallel_size", "kv_cache_mib"):
            value = getattr(self, name)
            _check(value is None or value >= 1, f"--{name.replace('_', '-')} must be >= 1")
        _check(self.max_model_len is None or 2 <= self.max_model_len <= MAX_GROUPS,
               f"--max-model-len must be in [2, {MAX_GROUPS}] groups")

    @property
    def to_stdout(self) -> bool:
        return self.raw or self.output == "-"


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


def load_profile(name: str | None) -> dict:
    """A TOML profile (a path, or a name in the repo's `configs/`); keys must be option fields."""
    if not name:
        return {}
    path = Path(name).expanduser()
    if not path.is_file() and (CONFIG_DIR / f"{name}.toml").is_file():
        path = CONFIG_DIR / f"{name}.toml"
    if not path.is_file():
        raise UsageError(f"config profile not found: {name}")
    try:
        profile = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"invalid TOML in {path}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"cannot read config profile {path}: {exc.strerror or exc}") from None
    known = {f.name for f in fields(SynthOptions)}
    unknown = sorted(set(profile) - known)
    if unknown:
        raise UsageError(f"{path}: unknown key(s) {', '.join(unknown)}")
    return profile


def build_options(flags: Mapping[str, object], profile: Mapping[str, object]) -> SynthOptions:
    """flag > profile > default per field, tested with `is not None` (explicit 0/false wins).

    Device and checkpoint fields stay None here: `devices.resolve_placement` and
    `models.pick_names` apply env and profile themselves.
    """
    values = {}
    for spec in fields(SynthOptions):
        flag = flags.get(spec.name)
        if flag is not None:
            values[spec.name] = flag
        elif spec.name not in DEFERRED_FIELDS and profile.get(spec.name) is not None:
            values[spec.name] = profile[spec.name]
    try:
        return SynthOptions(**values).validate()
    except TypeError as exc:
        raise UsageError(f"bad option value: {exc}") from None


def option_flags(flags: Mapping[str, object]) -> dict:
    """The subset of a command's parameters that are SynthOptions fields."""
    names = {f.name for f in fields(SynthOptions)}
    return {k: v for k, v in flags.items() if k in names}


def replace_options(options: SynthOptions, **changes) -> SynthOptions:
    return replace(options, **changes).validate()
