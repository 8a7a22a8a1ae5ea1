"""Device policy: where each stage runs, in what dtype, whether decode uses CUDA graphs, and
the modes of the C kernels (the LM's CPU kernel, the codec's float32 GEMM).

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
DTYPE_ENV = "MIMO_TTS_DTYPE"
TOKENIZER_DTYPE_ENV = "MIMO_TTS_TOKENIZER_DTYPE"
# "auto" (default), "1" (wherever it can run) or "0" (never): lm.cpu_kernel; codec.gemm and
# codec.attention.
CPU_KERNEL_ENV = "MIMO_TTS_CPU_KERNEL"
CODEC_KERNEL_ENV = "MIMO_TTS_CODEC_KERNEL"
# `name=1|0,...`: product choices taken as given instead of measured (runtime.measured).
PRODUCT_CHOICES_ENV = "MIMO_TTS_PRODUCT_CHOICES"
PRODUCT_CHOICES = ("lm_kernel_products", "lm_attention", "prefill_upcast", "codec_gemm",
                   "codec_packed_float32", "codec_attention")
KERNEL_MODES = ("auto", "on", "off")

_DEVICE_RE = re.compile(r"^(cpu|cuda|mps)(?::(.*))?$")
_FALSE = {"0", "false", "no", "off"}
_TRUE = {"1", "true", "yes", "on"}
_KERNEL_WORDS = {"on": _TRUE, "off": _FALSE, "auto": {"", "auto"}}
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# CPU flags (Linux /proc/cpuinfo) with native bfloat16 matmuls: oneDNN and our C kernel use them.
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class Probe:
    """What the machine offers; injectable so the policy can be tested without hardware."""

    cuda_count: int
    cuda_current: int
    mps: bool
    cpu_bf16: tuple[str, ...] = ()  # the CPU's native bfloat16 flags (CPU_BF16_FLAGS found)
    cuda_bf16: bool = True  # whether the current CUDA device computes bfloat16 natively

    @staticmethod
    def detect() -> Probe:
        """Ask torch, unless the machine plainly has no accelerator (then torch stays unimported).

        Importing torch costs seconds; `mimo-tts devices` and `--dry-run` must not pay it on a
        CPU-only machine (issue 5, start-up).
        """
        cpu = cpu_bf16_flags()
        if "torch" not in sys.modules and not accelerator_possible():
            return Probe(cuda_count=0, cuda_current=0, mps=False, cpu_bf16=cpu)
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        current = torch.cuda.current_device() if count else 0
        mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
        bf16 = bool(count) and torch.cuda.is_bf16_supported(including_emulation=False)
        return Probe(cuda_count=count, cuda_current=current, mps=mps, cpu_bf16=cpu,
                     cuda_bf16=bf16)


def cpuinfo_line(name: str, cpuinfo: str = "/proc/cpuinfo") -> str:
    """The value of the first `name` line of /proc/cpuinfo (empty off Linux); no torch."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith(name):
                    return line.split(":", 1)[-1].strip()
    except OSError:
        pass
    return ""


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, ...]:
    """The CPU's feature flags, in /proc/cpuinfo's order (empty off Linux); no torch."""
    return tuple(cpuinfo_line("flags", cpuinfo).split())


def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, ...]:
    """The native-bfloat16 flags of this CPU (empty off Linux or without them); no torch."""
    present = set(cpu_flags(cpuinfo))
    return tuple(f for f in CPU_BF16_FLAGS if f in present)


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
    """A resolved value and why: where it came from ("flag", "env NAME", "config", "default"),
    or, for a kernel decision (`value` True or False), why it runs or not, in words."""

    value: object
    source: str

    @property
    def active(self) -> bool:
        """A kernel decision: whether the kernel runs."""
        return bool(self.value)

    @property
    def reason(self) -> str:
        """A kernel decision: why it runs or not (the `source`)."""
        return self.source


DEFAULT_KERNEL = Choice("auto", "default")


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
    if kind in ("cpu", "mps") and index not in (None, "0"):
        raise DeviceError(f"invalid device {_describe(value, source)}: {kind} takes no index")
    if kind == "cpu":
        return "cpu"
    probe = probe or Probe.detect()
    if kind == "mps":
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


def resolve_kernel(env_name: str, env: Mapping[str, str] | None = None) -> Choice:
    """A C kernel's mode from its environment variable: auto (unset), on (1) or off (0)."""
    env = os.environ if env is None else env
    raw = env.get(env_name)
    value = (raw if raw is not None else "auto").strip().lower()
    for mode, words in _KERNEL_WORDS.items():
        if value in words:
            return Choice(mode, f"env {env_name}" if raw else "default")
    raise UsageError(f"{env_name}={raw!r}: use auto, 1 (on) or 0 (off)")


def check_kernel_mode(mode: str, what: str) -> str:
    """`mode` where it is one of KERNEL_MODES, else a UsageError naming `what` (the kernel)."""
    if mode not in KERNEL_MODES:
        raise UsageError(f"{what} mode must be one of {', '.join(KERNEL_MODES)}, got {mode!r}")
    return mode


def dtype_name(value: object, what: str, source: str) -> str:
    """Canonical dtype name (float32, bfloat16, float16) from a name or a short form."""
    name = str(value).strip().lower()
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise UsageError(f"invalid {what} dtype {_describe(str(value), source)}: use auto, "
                         f"{', '.join(DTYPES)}")
    return name


def auto_dtype(checkpoint: str | None, device: str, probe: Probe | None = None,
               stage: str = "LM") -> Choice:
    """The checkpoint's own dtype where the device computes it well, else the nearest.

    A float32 checkpoint (the tiny ones) stays float32, so fixture comparisons stay exact. A
    bfloat16 checkpoint (the published LM) runs in bfloat16 on GPUs with bf16 support and on
    every CPU for the LM: a decode step streams the weights, and half the bytes of float32 is
    faster even without bfloat16 dot products, while the prefill's many rows go through float32
    blocks where PyTorch's bfloat16 GEMM is slow (`lm.cpu_kernel.prefill_products`); the 7B LM
    in float32 would not fit a 24 GB machine either. A bfloat16 tokenizer runs in float32 on
    CPUs without AVX512-BF16 or AMX (its products have no such path), in float16 on older GPUs.
    """
    if checkpoint is None:
        return Choice("float32", "default (checkpoint dtype unknown)")
    name = DTYPE_ALIASES.get(str(checkpoint).lower(), str(checkpoint).lower())
    if name not in DTYPES or name == "float32":
        return Choice("float32", f"checkpoint (torch_dtype {checkpoint})")
    probe = probe or Probe.detect()
    if device == "cpu":
        if probe.cpu_bf16:
            return Choice("bfloat16", f"checkpoint (torch_dtype {name}; the CPU has "
                                      f"{'/'.join(probe.cpu_bf16)})")
        if stage == "LM" and name == "bfloat16":
            return Choice("bfloat16", f"checkpoint (torch_dtype {name}; the CPU has no "
                                      "AVX512-BF16/AMX: prefill in float32 blocks)")
        return Choice("float32", f"device (torch_dtype {name}, but the CPU has no "
                                 "AVX512-BF16/AMX: float32)")
    if device.startswith("cuda") and name == "bfloat16" and not probe.cuda_bf16:
        return Choice("float16", "device (torch_dtype bfloat16, but the GPU has no bf16: float16)")
    return Choice(name, f"checkpoint (torch_dtype {name})")


def pick_dtype(flag: str | None, config: str | None, device: str, stage: str,
                  checkpoint: str | None = None, env: Mapping[str, str] | None = None,
                  probe: Probe | None = None) -> Choice:
    """flag > env > profile > auto; "auto" (the default) is `auto_dtype` of the checkpoint."""
    env = os.environ if env is None else env
    env_name = DTYPE_ENV if stage == "LM" else TOKENIZER_DTYPE_ENV
    picked = _pick(flag, env_name, env, config)
    if picked is None or str(picked[0]).strip().lower() == "auto":
        auto = auto_dtype(checkpoint, device, probe, stage)
        if picked is None:
            return auto
        return Choice(auto.value, f"{picked[1]} auto: {auto.source}")
    value, source = picked
    return Choice(dtype_name(value, stage, source), source)


@dataclass(frozen=True)
class Placement:
    """Where and how both stages run, with the source of every value."""

    lm_device: Choice
    tokenizer_device: Choice
    lm_dtype: Choice
    tokenizer_dtype: Choice
    cuda_graph: Choice
    cpu_kernel: Choice = DEFAULT_KERNEL  # the LM's fused CPU kernel (lm.cpu_kernel)
    codec_kernel: Choice = DEFAULT_KERNEL  # the codec's GEMM and attention (codec.gemm, .attention)

    def describe(self) -> dict[str, dict[str, object]]:
        return {
            name: {"value": choice.value, "source": choice.source}
            for name, choice in vars(self).items()
        }


def product_choices(env: Mapping[str, str] | None = None) -> dict[str, bool]:
    """The product choices MIMO_TTS_PRODUCT_CHOICES sets (`name=1|0`, comma-separated)."""
    text = (os.environ if env is None else env).get(PRODUCT_CHOICES_ENV, "").strip()
    found = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        name, value = name.strip(), value.strip().lower()
        if name not in PRODUCT_CHOICES or value not in _TRUE | _FALSE:
            raise UsageError(f"{PRODUCT_CHOICES_ENV}: {part!r} is not NAME=1|0 with NAME one "
                             f"of {', '.join(PRODUCT_CHOICES)}")
        found[name] = value in _TRUE
    return found


def resolve_placement(
    lm_device: str | None = None,
    tokenizer_device: str | None = None,
    dtype: str | None = None,
    tokenizer_dtype: str | None = None,
    cuda_graph: bool | None = None,
    profile: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    probe: Probe | None = None,
    checkpoint_dtypes: tuple[str | None, str | None] = (None, None),
) -> Placement:
    """Resolve every placement choice at once from flags, env, a profile and defaults.

    `checkpoint_dtypes` are the LM's and the tokenizer's `torch_dtype` (config.json), which the
    automatic dtype follows.
    """
    profile = profile or {}
    product_choices(env)  # a bad value is refused before anything runs
    lm = resolve_lm_device(lm_device, profile.get("lm_device"), env, probe)
    tok = resolve_tokenizer_device(tokenizer_device, profile.get("tokenizer_device"), env, probe)
    lm_ckpt, tok_ckpt = checkpoint_dtypes
    return Placement(
        lm_device=lm,
        tokenizer_device=tok,
        lm_dtype=pick_dtype(dtype, profile.get("dtype"), lm.value, "LM", lm_ckpt, env, probe),
        tokenizer_dtype=pick_dtype(tokenizer_dtype, profile.get("tokenizer_dtype"), tok.value,
                                      "tokenizer", tok_ckpt, env, probe),
        cuda_graph=resolve_cuda_graph(tok.value, cuda_graph, profile.get("cuda_graph"), env),
        cpu_kernel=resolve_kernel(CPU_KERNEL_ENV, env),
        codec_kernel=resolve_kernel(CODEC_KERNEL_ENV, env),
    )


def torch_dtype(name, what: str = "torch"):
    """The torch dtype of a name or short form (float32, bf16, ...), or of a torch dtype;
    another is a UsageError naming `what` ("tokenizer", ...)."""
    import torch

    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    return getattr(torch, dtype_name(name, what, "argument"))
