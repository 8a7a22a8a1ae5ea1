"""The codec's float32 CPU linears packed once at load, and how (`choose`, per machine).

Two engines, both REPLACING the float32 weights (memory stays that of the weights):

- "bf16x3": a GEMM of our own (gemm.c beside this file). Each float32 operand is split into
  two bfloat16 halves and multiplied three times in AMX tiles with float32 accumulation (~16
  mantissa bits per operand, outputs within ~1e-5 relative of the float32 product); bias and
  residual are added in float32. On an AMX Xeon that ran about twice as fast as PyTorch's
  float32 product. Weights are split and packed once (`PackedGemm`), activations per call.
- "onednn": the same float32 products as the plain path, with the weights reordered once into
  oneDNN's blocked layout (`layers.PackedLinear`) instead of inside every call. Without AMX
  (an AMD EPYC, say) that is 1.04-1.26x at the codec's shapes and up to 2.6x for a few rows.

`choose` takes the first that runs and measured faster here; beside an LM whose weights the
machine cannot also hold packed, the encoder's layers stay mapped (`Packing.encoder`).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from importlib.resources import files

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mimo_tts.runtime import pages
from mimo_tts.runtime.devices import CODEC_KERNEL_ENV, check_kernel_mode
from mimo_tts.runtime.kernels import bind
from mimo_tts.runtime.measured import Decision, alternating_best, decide

SOURCE = files("mimo_tts.codec") / "gemm.c"

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


@functools.cache
def _build() -> tuple[ctypes.CDLL | None, str]:
    """(the compiled GEMM with AMX granted, "") or (None, why not)."""
    lib, why = bind(SOURCE, "codec_gemm", {
        "packed_bytes": ((_L, _L), _L),
        "pack_weight": ((_P, _L, _L, _I, _P), None),
        "split_rows": ((_P, _L, _L, _L, _I, _P, _P), None),
        "gemm": ((_P, _P, _P, _L, _L, _L, _P, _P, _P, _I), _I)})
    if lib is None:
        return None, why
    if not lib.amx_enable():
        return None, "no AMX tiles on this CPU (or the kernel refused them)"
    return lib, ""


def library() -> ctypes.CDLL | None:
    """The GEMM where it can run (AMX compiled in and granted), else None (`_build` says why)."""
    return _build()[0]


def _up(v: int) -> int:
    return -(-v // 32) * 32


class PackedGemm:
    """The float32 weights (and biases) of `modules` (nn.Linear, one product when several,
    e.g. q/k/v) split and packed once; the modules' weights are REPLACED by meta-device
    placeholders of the same shape, so memory stays that of the float32 weights. `unpack`
    puts float32 weights back (hi + lo: within ~8e-6 relative of the originals)."""

    def __init__(self, lib: ctypes.CDLL, modules: list[nn.Linear]):
        self.lib, self.modules = lib, modules
        weights = [m.weight.detach() for m in modules]
        weight = torch.cat(weights) if len(weights) > 1 else weights[0].contiguous()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.empty(lib.packed_bytes(*weight.shape) // 2, dtype=torch.bfloat16,
                                  device="cpu")
        lib.pack_weight(weight.data_ptr(), *weight.shape, torch.get_num_threads(),
                        self.packed.data_ptr())
        self.bias = joined_bias(modules)
        if self.bias is not None:
            self.bias = self.bias.float()
        del weight
        self.placeholders = replace_weights(modules, weights)
        del weights

    def current(self, weights: list, x: Tensor, residual: Tensor | None = None) -> bool:
        """Whether the modules still hold the placeholders and x (and residual) are float32
        on the CPU."""
        return holds(self.placeholders, weights, x, residual)

    def __call__(self, x: Tensor, gelu: bool = False, residual: Tensor | None = None) -> Tensor:
        """x @ weight.T + bias, then GELU(erf) or `+ residual`; float32, x's leading shape."""
        k, n = self.in_features, self.out_features
        flat = x.reshape(-1, k)
        if flat.stride(1) != 1:
            flat = flat.contiguous()
        m = flat.shape[0]
        y = torch.empty(*x.shape[:-1], n, dtype=torch.float32, device="cpu")
        if m == 0:
            return y
        threads = torch.get_num_threads()
        halves = torch.empty(2, _up(m), _up(k), dtype=torch.bfloat16, device="cpu")
        self.lib.split_rows(flat.data_ptr(), m, k, flat.stride(0), threads,
                            halves[0].data_ptr(), halves[1].data_ptr())
        res = None if residual is None else residual.reshape(m, n).contiguous()
        if self.lib.gemm(halves[0].data_ptr(), halves[1].data_ptr(), self.packed.data_ptr(),
                         m, n, k, _ptr(self.bias), _ptr(res), y.data_ptr(), threads):
            raise MemoryError(f"GEMM partial sums of [{m}, {n}] float32")
        return torch._C._nn.gelu_(y) if gelu else y

    def weights(self) -> list[Tensor]:
        """The modules' float32 weights from the packed halves (hi + lo, exact sums)."""
        bias, self.bias = self.bias, None
        try:  # row i of eye . W^T is column i of W^T
            weight = self(torch.eye(self.in_features, device="cpu")).t()
        finally:
            self.bias = bias
        return [w.contiguous() for w in weight.split([m.weight.shape[0] for m in self.modules])]

    def unpack(self) -> None:
        """Give the modules plain float32 weights again (`weights`)."""
        for m, w in zip(self.modules, self.weights(), strict=True):
            m.weight = nn.Parameter(w, requires_grad=False)


def joined_bias(modules: list[nn.Linear]) -> Tensor | None:
    """The biases of `modules` joined as one product's (zeros where a module has none, e.g.
    k_proj), or None when none has one."""
    if all(m.bias is None for m in modules):
        return None
    return torch.cat([m.bias.detach() if m.bias is not None else
                      m.weight.new_zeros(m.weight.shape[0]) for m in modules])


def replace_weights(modules: list[nn.Linear], weights: list[Tensor]) -> list[nn.Parameter]:
    """After `weights` (the modules' weights) were packed: give back their mapped file pages
    and put meta-device placeholders of the same shapes and dtype in the modules; the
    placeholders."""
    for w in weights:
        pages.drop(w)
    for m in modules:
        m.weight = nn.Parameter(torch.empty(m.weight.shape, dtype=m.weight.dtype, device="meta"),
                                requires_grad=False)
    return [m.weight for m in modules]


def holds(placeholders: list, weights: list, x: Tensor, residual: Tensor | None,
          dtype: torch.dtype = torch.float32) -> bool:
    """Whether the modules still hold `placeholders` (`weights`, as read from them now) and x
    (and residual) are `dtype` on the CPU: a packed product still applies."""
    return x.device.type == "cpu" and x.dtype == dtype and \
        (residual is None or residual.dtype == dtype) and \
        len(weights) == len(placeholders) and \
        all(w is p for w, p in zip(weights, placeholders, strict=True))


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@functools.cache
def faster() -> Decision:
    """Whether the codec's float32 linears run through the GEMM on this machine (`measure`,
    measured once per machine and kept: `runtime.measured`)."""
    return decide("codec_gemm", "float32 [512, 1280] x [1280, 2560]", measure)


def measure() -> tuple[bool, float, float]:
    """Whether the GEMM beats torch's float32 F.linear here: (faster, GEMM GFLOP/s, torch
    GFLOP/s), best of 5 alternating rounds after a warm-up call each, on a [512, 1280] x
    [1280, 2560] product (the codec's fc1 shape, halved)."""
    with torch.device("cpu"):  # also where the caller's default device is another one
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(512, 1280, generator=gen)
        proj = nn.Linear(1280, 2560).requires_grad_(False)
        weight, bias = proj.weight.clone(), proj.bias
        packed = PackedGemm(library(), [proj])
    ours, theirs = alternating_best(lambda: packed(x), lambda: F.linear(x, weight, bias))
    flops = 2 * 512 * 1280 * 2560
    return ours < theirs, round(flops / ours / 1e9), round(flops / theirs / 1e9)


@functools.cache
def onednn_packs(dtype: torch.dtype = torch.float32) -> str:
    """"" where oneDNN reorders linear weights of `dtype` once and runs products on them in this
    torch and on this CPU, else why not: one tiny product, once per process and dtype. bfloat16
    needs AVX512 (BW, VL, DQ), AVX-NE-CONVERT or AMX; oneDNN refuses it elsewhere (an AVX2-only
    EPYC, say), where PyTorch's own bfloat16 kernels run instead."""
    name = str(dtype).removeprefix("torch.")
    try:
        if not torch.backends.mkldnn.is_available():
            return "no oneDNN in this torch"
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 16, dtype=dtype), weight, None,
                                           "none", [], "")
    except (AttributeError, RuntimeError) as exc:
        return f"no oneDNN {name} linear in this torch on this CPU ({type(exc).__name__})"
    return ""


@functools.cache
def onednn_faster() -> Decision:
    """Whether the codec's float32 linears run faster with their weights in oneDNN's blocked
    layout than plain on this machine (`measure_onednn`, measured once per machine, kept)."""
    return decide("codec_packed_float32", "float32 [512, 1280] x [1280, 2560] and [44, 1280] x "
                  "[1280, 2560] reordered", measure_onednn)


def measure_onednn() -> tuple[bool, float, float]:
    """Whether a reordered float32 weight beats the plain one in oneDNN's own product (what
    the unpacked codec runs): (faster, packed GFLOP/s, plain GFLOP/s), best of 5 alternating
    rounds after a warm-up, over the codec's fc1 shape halved and a streamed push of 44 rows."""
    with torch.device("cpu"):
        gen = torch.Generator().manual_seed(0)
        xs = [torch.randn(rows, 1280, generator=gen) for rows in (512, 44)]
        weight = torch.randn(2560, 1280, generator=gen) / 1280**0.5
        bias = torch.randn(2560, generator=gen)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 512)

    def run(w: Tensor) -> None:
        for x in xs:
            torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")

    ours, theirs = alternating_best(lambda: run(packed), lambda: run(weight))
    flops = 2 * (512 + 44) * 1280 * 2560
    return ours < theirs, round(flops / ours / 1e9), round(flops / theirs / 1e9)


ENGINES = {"bf16x3": "bf16x3 AMX products", "onednn": "oneDNN's blocked float32 layout"}


@dataclass(frozen=True)
class Packing:
    """How the codec's float32 CPU linears run: `engine` "bf16x3" (`PackedGemm`), "onednn"
    (`layers.PackedLinear`) or None (plain float32 weights, as mapped); whether the encoder's
    layers are packed too (else only the decoder's and vocoder's); why, in words."""

    engine: str | None
    encoder: bool
    reason: str

    @property
    def active(self) -> bool:
        return self.engine is not None

    @property
    def words(self) -> str:
        """"bf16x3 AMX products", ..., or "plain float32" (the -v log)."""
        return ENGINES.get(self.engine, "plain float32")


PLAIN = Packing(None, False, "not asked")


def choose(beside: int = 0, weights: int = 0, mode: str = "auto") -> Packing:
    """How the codec's float32 CPU linears run in `mode` (the run's `Placement.codec_kernel`,
    which MIMO_TTS_CODEC_KERNEL sets): "off" plain; "on" the GEMM where AMX runs it, else
    oneDNN's layout; "auto" the first of the two that measured faster here than the plain
    product (`faster`, `onednn_faster`), else plain.

    Packed, the tokenizer's weights become anonymous memory, which the kernel can no longer
    drop and re-read like the checkpoint's file pages. The decoder's (and vocoder's) are read
    by every run anyway, so packing them costs nothing beside the LM; the encoder's are read
    only for a voice prompt. With `beside` bytes of LM weights on the CPU (file pages the LM
    reads every step) auto packs the encoder too only when both and PACK_HEADROOM fit in the
    machine's memory (`machine.cpu_total`): on a 24 GiB machine with the full-size LM the
    whole tokenizer packed squeezed the page cache and Stage-0 re-read its weights from disk
    (1.48 s a group, not 1.19).
    """
    if check_kernel_mode(mode, "codec kernel") == "off":
        return Packing(None, False, f"off ({CODEC_KERNEL_ENV}=0)")
    encoder, scope = True, ""
    if beside and mode != "on":
        from mimo_tts.runtime.machine import PACK_HEADROOM, cpu_total, gib, packed_fits

        if not packed_fits(beside, weights):
            encoder = False
            scope = (f"; encoder left mapped: {gib(weights)} of packed tokenizer weights "
                     f"beside {gib(beside)} of LM weights would leave under "
                     f"{gib(PACK_HEADROOM)} of {gib(cpu_total())}")
    no_gemm = _build()[1]
    if not no_gemm:
        if mode == "on":
            return Packing("bf16x3", encoder, f"on ({CODEC_KERNEL_ENV}=1): {ENGINES['bf16x3']}")
        decision = faster()
        if decision.faster:
            return Packing("bf16x3", encoder, "auto: bf16x3 AMX vs float32: "
                                              f"{decision.words('GFLOP/s')}{scope}")
    no_onednn = onednn_packs()
    if no_onednn:
        return Packing(None, False, no_gemm or no_onednn)
    if mode == "on":
        return Packing("onednn", encoder, f"on ({CODEC_KERNEL_ENV}=1): {ENGINES['onednn']} "
                                          f"({no_gemm or 'the GEMM measured slower'})")
    decision = onednn_faster()
    why = f"auto: oneDNN's blocked vs plain float32: {decision.words('GFLOP/s')}"
    if not decision.faster:
        return Packing(None, False, why)
    return Packing("onednn", encoder, f"{why}{scope}")
