"""A fused CPU kernel for one decode position of the patch decoder, all layers in one call.

The patch decoder runs 16 small layers 11 times per group; in eager PyTorch each of those
layer steps is some 40 operator calls whose fixed costs (dispatch, oneDNN set-up, a thread
fork/join per matmul) add up to about a fifth of the step, and its 2-16 MB matrix-vector
products run well below the memory bandwidth. This kernel does a whole position in one call
with one thread team: matrix-vector products that stream each weight once for all rows
(AVX512-BF16 dot products where the CPU has them), RMSNorm, RoPE, the KV-cache write and
attention, SwiGLU and the residuals. It rounds to bfloat16 wherever the PyTorch modules
produce a bfloat16 tensor, so it tracks the eager path (float32 models match the reference
fixtures); accumulation order differs from oneDNN's, so bfloat16 outputs may differ from the
eager ones in the last bit.

The C source (cpu_kernel.c, beside this file) is compiled once per machine with the system C
compiler into the user cache directory (about 3 s, once) and loaded with ctypes. By default it
runs only where it beats eager PyTorch (bfloat16 on AVX512-BF16 CPUs);
`load_lm(..., cpu_kernel="on"/"off")` or MIMO_TTS_CPU_KERNEL=1/0 overrides that. Without a
compiler the eager modules run. Shapes in the C source: n rows, D dim, F ffn dim, S cache length.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from importlib.resources import files
from pathlib import Path

import torch
from torch import Tensor

from mimo_tts.errors import UsageError

SOURCE = files("mimo_tts.lm") / "cpu_kernel.c"

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LAYER_FIELDS = ("in_norm", "qkv_w", "qkv_b", "o_w", "post_norm", "gate_up_w", "down_w")
MAX_HEAD_DIM = 256  # the kernel's per-head scratch arrays


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in LAYER_FIELDS]


class _Step(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in
                ("layers", "dim", "heads", "head_dim", "ffn", "rows", "slot", "threads")] + [
        ("eps", ctypes.c_float), ("layer", ctypes.POINTER(_Layer)),
        ("final_norm", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
        ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("cache_rows", ctypes.c_long), ("cache_len", ctypes.c_long),
        ("x", ctypes.c_void_p), ("out", ctypes.c_void_p), ("work", ctypes.c_void_p),
    ]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mimo-tts" / "kernels"


def _cpu_flags() -> str:
    """The CPU's feature flags: -march=native code is only reused on the same kind of CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.node())
    except OSError:
        return platform.node()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel (built on first use, cached per source and machine), or None."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        source_text = SOURCE.read_text(encoding="utf-8")
    except OSError:  # an install without the C file: the eager modules run
        return None
    key = hashlib.sha256((source_text + " ".join(FLAGS) + _cpu_flags()).encode()).hexdigest()
    target = _cache_dir() / f"lm_step_{key[:16]}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory() as tmp:
                source = Path(tmp) / "lm_step.c"
                source.write_text(source_text)
                built = Path(tmp) / target.name
                subprocess.run(["cc", *FLAGS, str(source), "-o", str(built), "-lm"],
                               check=True, capture_output=True, timeout=120)
                os.replace(built, target)  # atomic: concurrent builders never see half a file
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError):
        return None
    for name in ("step_bf16", "step_f32"):
        getattr(lib, name).argtypes = [ctypes.POINTER(_Step)]
        getattr(lib, name).restype = ctypes.c_int
    lib.amx_enable()  # AMX tiles for several rows, where the CPU and kernel allow them
    return lib


def features() -> dict[str, bool]:
    """What the compiled kernel uses on this machine (all False when it cannot be built)."""
    lib = library()
    bits = 0 if lib is None else lib.features()
    return {"built": lib is not None, "avx512_bf16": bool(bits & 1), "amx": bool(bits & 2)}


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class LocalStepKernel:
    """One decode position of a fused Qwen2 stack (the patch decoder) through the C kernel.

    Holds references to the weights it points at, so they outlive it; a `.to()` (any
    `_apply`) of the stack drops the kernel and the eager modules run from then on.
    """

    def __init__(self, stack, lib: ctypes.CDLL):
        cfg = stack.cfg
        self.stack, self.cfg = stack, cfg
        self.dtype = stack.norm.weight.dtype
        self.fn = lib.step_bf16 if self.dtype == torch.bfloat16 else lib.step_f32
        self.tensors = self._tensors()
        layers = (_Layer * cfg.layers)()
        for layer, parts in zip(layers, self.tensors[:-1], strict=True):
            for name, tensor in zip(LAYER_FIELDS, parts, strict=True):
                setattr(layer, name, _ptr(tensor))
        self.layers = layers

    def _tensors(self) -> list[tuple[Tensor, ...]]:
        out = []
        for layer in self.stack.layers:
            attn, mlp = layer.self_attn, layer.mlp
            out.append((layer.input_layernorm.weight, attn.qkv_weight, attn.qkv_bias,
                        attn.o_proj.weight, layer.post_attention_layernorm.weight,
                        mlp.gate_up_weight, mlp.down_proj.weight))
        return out + [(self.stack.norm.weight,)]

    def accepts(self, x: Tensor, positions: Tensor, cache, slot, span, mask) -> bool:
        return (cache is not None and mask is None and isinstance(slot, int)
                and span == slot + 1 and x.dim() == 3 and x.shape[1] == 1
                and x.shape[0] <= cache.k.shape[1] and positions.numel() == 1
                and x.dtype == self.dtype == cache.k.dtype and x.device.type == "cpu"
                and not torch.is_grad_enabled())

    def __call__(self, x: Tensor, positions: Tensor, cache, slot: int) -> Tensor:
        """x [n, 1, D] at one position, written at cache `slot` -> normed hidden [n, 1, D]."""
        cfg, n = self.cfg, x.shape[0]
        threads = torch.get_num_threads()
        x = x.contiguous()
        out = torch.empty_like(x)
        dim, ffn, length = cfg.dim, cfg.ffn_dim, cache.length
        # float32 scratch, then three buffers of the model dtype (see step_* in cpu_kernel.c)
        floats = n * (5 * dim + 2 * ffn) + threads * length + n * (2 * max(dim, ffn) + dim)
        work = torch.empty(floats, dtype=torch.float32)
        position = int(positions.reshape(-1)[0])
        rope = self.stack.rope_cos[position], self.stack.rope_sin[position]
        step = _Step(cfg.layers, dim, cfg.heads, cfg.head_dim, ffn, n, slot, threads,
                     cfg.eps, self.layers, _ptr(self.stack.norm.weight), _ptr(rope[0]),
                     _ptr(rope[1]), _ptr(cache.k), _ptr(cache.v), cache.k.shape[1], length,
                     _ptr(x), _ptr(out), _ptr(work))
        self.fn(ctypes.byref(step))
        return out


ENV = "MIMO_TTS_CPU_KERNEL"  # "auto" (default), "1" (wherever it can run) or "0" (never)
MODES = ("auto", "on", "off")


def mode_from_env() -> str:
    """The kernel mode MIMO_TTS_CPU_KERNEL asks for: auto, on or off."""
    value = os.environ.get(ENV, "auto").strip().lower()
    spellings = {"on": ("1", "on", "true", "yes"), "off": ("0", "off", "false", "no"),
                 "auto": ("", "auto")}
    for mode, words in spellings.items():
        if value in words:
            return mode
    raise UsageError(f"{ENV}={os.environ[ENV]!r}: use auto, 1 (on) or 0 (off)")


def local_step_kernel(stack, mode: str = "auto") -> LocalStepKernel | None:
    """The kernel for a fused stack, or None for the eager modules.

    "on": wherever it can run (CPU, bf16/f32, fused, equal q/kv heads); "auto": only where it
    measured faster than eager PyTorch, i.e. bfloat16 weights on a CPU with AVX512-BF16 dot
    products (its float32 and scalar bfloat16 loops are slower than oneDNN's); "off": never.
    """
    if mode not in MODES:
        raise UsageError(f"cpu kernel mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off":
        return None
    cfg = stack.cfg
    weight = stack.norm.weight
    fused = all(layer.self_attn.qkv_weight is not None and layer.mlp.gate_up_weight is not None
                for layer in stack.layers)
    if (weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32)
            or not fused or cfg.kv_heads != cfg.heads or cfg.head_dim > MAX_HEAD_DIM
            or cfg.head_dim % 2 or stack.rope_cos.dtype != weight.dtype):
        return None
    lib = library()
    if lib is None or (mode == "auto" and not (weight.dtype == torch.bfloat16
                                               and features()["avx512_bf16"])):
        return None
    return LocalStepKernel(stack, lib)
