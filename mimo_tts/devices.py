"""Device policy: where each stage runs, in what dtype, and whether decode uses CUDA graphs.

This is the only module that reads device environment variables or probes CUDA. It returns
frozen values that record the source of each choice, so a caller can report why a device won.
Precedence everywhere: flag > environment > config profile > default, tested with `is not None`
so that an explicit `0`/`false` wins.
"""

from __future__ import annotations

import glob
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from mimo_tts.errors import DeviceError, UsageError

TOKENIZER_DEVICE_ENV = "MIMO_AUDIO_TOKENIZER_DEVICE"
CUDA_GRAPH_ENV = "MIMO_AUDIO_TOKENIZER_CUDA_GRAPH"
LM_DEVICE_ENV = "MIMO_TTS_LM_DEVICE"

_DEVICE_RE = re.compile(r"^(cpu|cuda|mps)(?::(.*))?$")
_FALSE = {"0", "false", "no", "off"}
_TRUE = {"1", "true", "yes", "on"}
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # memory estimates


@dataclass(frozen=True)
class Probe:
    """What the machine offers; injectable so the policy can be tested without hardware."""

    cuda_count: int
    cuda_current: int
    mps: bool

    @staticmethod
    def detect() -> Probe:
        """Ask torch, unless the machine plainly has no accelerator (then torch stays unimported).

        Importing torch costs seconds; `mimo-tts devices` and `--dry-run` must not pay it on a
        CPU-only machine (issue 5, start-up).
        """
        if "torch" not in sys.modules and not accelerator_possible():
            return Probe(cuda_count=0, cuda_current=0, mps=False)
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        current = torch.cuda.current_device() if count else 0
        mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
        return Probe(cuda_count=count, cuda_current=current, mps=mps)


# Traces a GPU driver leaves on Linux: NVIDIA (/proc, /dev/nvidia*), WSL2 (/dev/dxg) and ROCm
# (/dev/kfd; torch.cuda reports ROCm GPUs too). Any one sends `Probe.detect` to torch.
DRIVER_MARKERS = ("/proc/driver/nvidia", "/dev/nvidia*", "/dev/dxg", "/dev/kfd")
CUDA_LIBRARIES = ("libcuda.so.1", "libcuda.so")


def accelerator_possible(markers=DRIVER_MARKERS, libraries=CUDA_LIBRARIES,
                         platform: str | None = None) -> bool:
    """False only when no GPU can be present: no driver trace, no CUDA driver library, no macOS.

    False positives just cost a torch import. The library check asks the dynamic loader
    (dlopen) rather than `ctypes.util.find_library`, whose gcc fallback alone takes ~0.15 s.
    """
    if (platform or sys.platform) == "darwin":  # MPS
        return True
    if any(glob.glob(marker) for marker in markers):
        return True
    return any(_loadable(name) for name in libraries)


def _loadable(name: str) -> bool:
    import ctypes

    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class Choice:
    """A resolved value and where it came from ("flag", "env NAME", "config", "default")."""

    value: object
    source: str


def _describe(value: str, source: str) -> str:
    return f"{value!r} (from {source})"


def normalize_device(value: str, source: str = "argument", probe: Probe | None = None) -> str:
    """Canonical device string: `cpu`, `mps` or `cuda:N` with N checked against the machine."""
    text = str(value).strip().lower()
    match = _DEVICE_RE.match(text)
    if not match:
        raise DeviceError(
            f"invalid device {_describe(value, source)}: use cpu, cuda, cuda:N or mps"
        )
    kind, index = match.group(1), match.group(2)
    if kind == "cpu":
        if index not in (None, "0"):
            raise DeviceError(f"invalid device {_describe(value, source)}: cpu takes no index")
        return "cpu"
    probe = probe or Probe.detect()
    if kind == "mps":
        if index not in (None, "0"):
            raise DeviceError(f"invalid device {_describe(value, source)}: mps takes no index")
        if not probe.mps:
            raise DeviceError(f"device {_describe(value, source)} is not available on this machine")
        return "mps"
    # isascii(): str.isdigit() accepts characters such as "²" that int() rejects.
    if index is not None and not (index.isascii() and index.isdigit()):
        raise DeviceError(
            f"invalid device {_describe(value, source)}: the CUDA index must be a number >= 0"
        )
    if probe.cuda_count == 0:
        raise DeviceError(
            f"device {_describe(value, source)} asks for CUDA, but CUDA is not available here; "
            "use --tokenizer-device cpu / --lm-device cpu"
        )
    n = probe.cuda_current if index is None else int(index)
    if n >= probe.cuda_count:
        raise DeviceError(
            f"device {_describe(value, source)} does not exist: this machine has "
            f"{probe.cuda_count} CUDA device(s) (cuda:0..cuda:{probe.cuda_count - 1})"
        )
    return f"cuda:{n}"


def default_device(probe: Probe | None = None) -> str:
    probe = probe or Probe.detect()
    return f"cuda:{probe.cuda_current}" if probe.cuda_count else "cpu"


def _pick(flag, env_name: str | None, env: Mapping[str, str], config) -> tuple[object, str] | None:
    if flag is not None:
        return flag, "flag"
    if env_name and env.get(env_name) not in (None, ""):
        return env[env_name], f"env {env_name}"
    if config is not None:
        return config, "config"
    return None


def resolve_device(
    flag: str | None,
    env_name: str | None,
    config: str | None,
    env: Mapping[str, str] | None = None,
    probe: Probe | None = None,
) -> Choice:
    """Resolve one stage's device by precedence and normalise it."""
    env = os.environ if env is None else env
    picked = _pick(flag, env_name, env, config)
    if picked is None:
        return Choice(default_device(probe), "default")
    value, source = picked
    return Choice(normalize_device(str(value), source, probe), source)


def resolve_tokenizer_device(flag=None, config=None, env=None, probe=None) -> Choice:
    """The Stage-1 (code2wav) and prompt-encode device: --tokenizer-device > env > config."""
    return resolve_device(flag, TOKENIZER_DEVICE_ENV, config, env, probe)


def resolve_lm_device(flag=None, config=None, env=None, probe=None) -> Choice:
    """The Stage-0 device: --lm-device > MIMO_TTS_LM_DEVICE > config > default."""
    return resolve_device(flag, LM_DEVICE_ENV, config, env, probe)


def parse_bool(value: object, source: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _FALSE:
        return False
    if text in _TRUE:
        return True
    raise UsageError(
        f"invalid boolean {_describe(str(value), source)}: use 1/true/yes/on or 0/false/no/off"
    )


def resolve_cuda_graph(device: str, flag: bool | None = None, config=None, env=None) -> Choice:
    """CUDA-graph decode: never off CUDA; on CUDA flag > env > config > on."""
    env = os.environ if env is None else env
    picked = _pick(flag, CUDA_GRAPH_ENV, env, config)
    # Validate even when the device makes the answer moot: a typo must not pass silently.
    wanted = parse_bool(*picked) if picked else True
    if not device.startswith("cuda"):
        return Choice(False, f"off: {device} is not a CUDA device")
    return Choice(wanted, picked[1] if picked else "default")


def resolve_dtype(flag: str | None, config: str | None, device: str, stage: str) -> Choice:
    """float32 on CPU by default (exact to the reference); bfloat16 on accelerators."""
    picked = _pick(flag, None, {}, config)
    if picked is None:
        return Choice("float32" if device == "cpu" else "bfloat16", "default")
    value, source = picked
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(
        str(value).lower(), str(value).lower()
    )
    if name not in DTYPES:
        raise UsageError(f"invalid {stage} dtype {_describe(str(value), source)}: use {DTYPES}")
    return Choice(name, source)


@dataclass(frozen=True)
class Placement:
    """Where and how both stages run, with the source of every value."""

    lm_device: Choice
    tokenizer_device: Choice
    lm_dtype: Choice
    tokenizer_dtype: Choice
    cuda_graph: Choice

    def describe(self) -> dict[str, dict[str, object]]:
        return {
            name: {"value": choice.value, "source": choice.source}
            for name, choice in vars(self).items()
        }


def resolve_placement(
    lm_device: str | None = None,
    tokenizer_device: str | None = None,
    dtype: str | None = None,
    tokenizer_dtype: str | None = None,
    cuda_graph: bool | None = None,
    profile: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    probe: Probe | None = None,
) -> Placement:
    """Resolve every placement choice at once from flags, env, a profile and defaults."""
    profile = profile or {}
    lm = resolve_lm_device(lm_device, profile.get("lm_device"), env, probe)
    tok = resolve_tokenizer_device(tokenizer_device, profile.get("tokenizer_device"), env, probe)
    return Placement(
        lm_device=lm,
        tokenizer_device=tok,
        lm_dtype=resolve_dtype(dtype, profile.get("dtype"), lm.value, "LM"),
        tokenizer_dtype=resolve_dtype(
            tokenizer_dtype, profile.get("tokenizer_dtype"), tok.value, "tokenizer"
        ),
        cuda_graph=resolve_cuda_graph(tok.value, cuda_graph, profile.get("cuda_graph"), env),
    )

