"""float32 linears of the codec through a bf16x3 AMX GEMM of our own (gemm.c beside this file).

Each float32 operand is split into two bfloat16 halves and multiplied three times in AMX tiles
with float32 accumulation (~16 mantissa bits per operand, outputs within ~1e-5 relative of the
float32 product); bias and residual are added in float32. On AMX CPUs that is several times
the float32 FMA peak. Weights are split and packed once (`PackedGemm`); activations per call.
"""

from __future__ import annotations

import ctypes
import functools
from importlib.resources import files

import torch
from torch import Tensor

from mimo_tts.native import build

SOURCE = files("mimo_tts.codec") / "gemm.c"

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


@functools.cache
def _build() -> tuple[ctypes.CDLL | None, str]:
    """(the compiled GEMM with AMX granted, "") or (None, why not)."""
    lib, why = build(SOURCE, "codec_gemm")
    if lib is None:
        return None, why
    lib.packed_bytes.argtypes = [_L, _L]
    lib.packed_bytes.restype = _L
    lib.pack_weight.argtypes = [_P, _L, _L, _I, _P]
    lib.split_rows.argtypes = [_P, _L, _L, _L, _I, _P, _P]
    lib.gemm.argtypes = [_P, _P, _P, _L, _L, _L, _P, _P, _P, _I]
    if not lib.amx_enable():
        return None, "no AMX tiles on this CPU (or the kernel refused them)"
    return lib, ""


def library() -> ctypes.CDLL | None:
    """The GEMM where it can run (AMX compiled in and granted), else None (`_build` says why)."""
    return _build()[0]


def _up(v: int) -> int:
    return -(-v // 32) * 32


class PackedGemm:
    """A float32 [N, K] weight (and bias) split and packed once; call with x [..., K]."""

    def __init__(self, lib: ctypes.CDLL, weight: Tensor, bias: Tensor | None):
        self.lib = lib
        self.out_features, self.in_features = weight.shape
        w = weight.detach().contiguous()
        self.packed = torch.empty(lib.packed_bytes(*w.shape) // 2, dtype=torch.bfloat16)
        lib.pack_weight(w.data_ptr(), *w.shape, torch.get_num_threads(), self.packed.data_ptr())
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """x @ weight.T + bias (+ residual), float32, same leading shape as x."""
        k, n = self.in_features, self.out_features
        flat = x.reshape(-1, k)
        if flat.stride(1) != 1:
            flat = flat.contiguous()
        m = flat.shape[0]
        y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
        if m == 0:
            return y
        threads = torch.get_num_threads()
        halves = torch.empty(2, _up(m), _up(k), dtype=torch.bfloat16)
        self.lib.split_rows(flat.data_ptr(), m, k, flat.stride(0), threads,
                            halves[0].data_ptr(), halves[1].data_ptr())
        res = None
        if residual is not None:
            res = residual.reshape(m, n).contiguous().data_ptr()
        bias = None if self.bias is None else self.bias.data_ptr()
        self.lib.gemm(halves[0].data_ptr(), halves[1].data_ptr(), self.packed.data_ptr(),
                      m, n, k, bias, res, y.data_ptr(), threads)
        return y
