"""The tokenizer's attention on the CPU through a fused kernel of our own (attention.c beside
this file).

PyTorch's CPU flash attention takes a 512-key sequence as one block, so a causal stack pays for
the whole square, and its float32 and bfloat16 inner loops run well below the machine's FMA
rate. The kernel computes only the keys a query sees (`Keys`: causal, a key-padding length, a
sliding window), packs each head's keys once, and keeps a query's scores, softmax and weighted
values in float32 registers and one row of scratch. bfloat16 on a CPU with the bfloat16 dot
instruction (AVX512-BF16) multiplies in pairs of bfloat16, with the softmax weights rounded to
bfloat16 for the values as PyTorch's bfloat16 attention rounds them. A query's output depends
only on its own row and key range: never on the rows beside it, the batch, the thread or the
thread count.

Whether it runs is measured once per machine and dtype against PyTorch's attention
(`faster`, kept like the other product choices: `runtime.measured`), under the run's codec
kernel mode (MIMO_TTS_CODEC_KERNEL: auto, on, off).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from importlib.resources import files

import torch
import torch.nn.functional as F
from torch import Tensor

from mimo_tts.runtime.devices import CODEC_KERNEL_ENV, Choice
from mimo_tts.runtime.kernels import bind, settled
from mimo_tts.runtime.measured import Decision, alternating_best, decide

SOURCE = files("mimo_tts.codec") / "attention.c"
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
LANES = 16  # the kernel's head dimension must be a multiple of this
# Below this many queries a head's packing costs more than its products save.
MIN_QUERIES = 16
# The shape `measure` times: one decoder layer's causal attention, 8 of its 20 heads.
PROBE = (1, 8, 512, 64)

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


@functools.cache
def _build() -> tuple[ctypes.CDLL | None, str]:
    """(the compiled kernel, "") or (None, why not)."""
    return bind(SOURCE, "codec_attention", {
        "attend": ((_P, _P, _P, _P, _I, _L, _L, _L, _L, _L, _P, _P, _P, _P, _P, _L, _L, _L,
                    ctypes.c_float, _I), _I)})


def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built (`_build` says why)."""
    return _build()[0]


@dataclass(frozen=True)
class Keys:
    """The keys each query sees, in closed form: query i (at key position offset + i) sees
    key j when lo(i) <= j <= hi(i), lo = offset + i - left (left >= 0; else 0), hi = offset +
    i + right (right >= 0; else the last key), and j < lengths[b] where lengths are given.

    `mask` and `causal` say the same to PyTorch's attention (where the kernel does not run):
    a bool mask [B|1, 1, Lq|1, Lk] or None, and whether keys are top-left causal."""

    mask: Tensor | None = None
    causal: bool = False
    lengths: Tensor | None = None
    offset: int = 0
    left: int = -1
    right: int = -1


def _takes(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """CPU tensors of one of the kernel's dtypes, rows of D (a multiple of LANES) contiguous."""
    return (q.device.type == "cpu" and q.dtype in DTYPES and q.dtype == k.dtype == v.dtype
            and q.shape[-1] % LANES == 0 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            and library() is not None)


def runs(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the kernel should take attention over q [B, H, Lq, D], k, v [B, H, Lk, D] in a
    layer that chose it: it can (`_takes`), and there are queries enough (MIN_QUERIES)."""
    return q.shape[2] >= MIN_QUERIES and _takes(q, k, v)


def _strides(t: Tensor):
    """{batch, position, head} element strides of a [B, H, L, D] view (D contiguous)."""
    return (ctypes.c_long * 3)(t.stride(0), t.stride(2), t.stride(1))


def attend(q: Tensor, k: Tensor, v: Tensor, keys: Keys) -> Tensor:
    """softmax(q k^T / sqrt(D)) v over the keys `keys` allows: q [B, H, Lq, D], k, v
    [B, H, Lk, D] (any strides with D contiguous, one dtype) -> [B, H, Lq, D], a view of a
    [B, Lq, H, D] tensor (so merging the heads is free); any number of queries (`runs` adds
    MIN_QUERIES for the layers)."""
    if not _takes(q, k, v):
        raise ValueError("attend needs CPU tensors of one dtype (float32 or bfloat16), rows "
                         f"of a multiple of {LANES} contiguous elements")
    b, heads, size, dim = q.shape
    out = q.new_empty(b, size, heads, dim)
    view = out.transpose(1, 2)
    lengths = None
    if keys.lengths is not None:
        lengths = (ctypes.c_long * b)(*keys.lengths.reshape(-1).expand(b).tolist())
    status = library().attend(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), DTYPES[q.dtype], b, heads,
        size, k.shape[2], dim, _strides(q), _strides(k), _strides(v), _strides(view), lengths,
        keys.offset, keys.left, keys.right, dim ** -0.5, torch.get_num_threads())
    if status:
        raise MemoryError(f"attention kernel: no scratch memory (status {status})")
    return view


@functools.cache
def faster(dtype: torch.dtype) -> Decision:
    """Whether the kernel beats PyTorch's attention in `dtype` on this machine (`measure`,
    measured once per machine and kept: `runtime.measured`)."""
    name = str(dtype).removeprefix("torch.")
    return decide("codec_attention", f"{name} causal {list(PROBE)}",
                  lambda: measure(dtype))


def measure(dtype: torch.dtype) -> tuple[bool, float, float]:
    """(faster, kernel GFLOP/s, PyTorch GFLOP/s) on one causal layer of PROBE's shape, best of
    5 alternating rounds after a warm-up call each; FLOP counts the causal half both ways."""
    b, heads, size, dim = PROBE
    with torch.device("cpu"):
        gen = torch.Generator().manual_seed(0)
        qkv = torch.randn(b, size, 3, heads, dim, generator=gen).to(dtype)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    causal = Keys(causal=True, right=0)
    ours, theirs = alternating_best(
        lambda: attend(q, k, v, causal),
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    flops = 2 * 2 * b * heads * dim * size * (size + 1) / 2
    return ours < theirs, round(flops / ours / 1e9), round(flops / theirs / 1e9)


def choose(dtype: torch.dtype, mode: str = "auto") -> Choice:
    """Whether the tokenizer's CPU attention in `dtype` runs through the kernel, and why (not),
    in `mode` (the run's codec kernel mode): "on" wherever it builds, "auto" where it measured
    faster than PyTorch's attention (`faster`), "off" never."""
    def unavailable() -> str:
        return (f"not for {str(dtype).removeprefix('torch.')}" if dtype not in DTYPES
                else _build()[1])

    forced = settled(mode, "codec kernel", CODEC_KERNEL_ENV, unavailable, "fused attention")
    if forced is not None:
        return forced
    decision = faster(dtype)
    return Choice(decision.faster, f"auto: fused vs PyTorch attention: "
                                   f"{decision.words('GFLOP/s')}")
