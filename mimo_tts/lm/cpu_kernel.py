"""The fused CPU kernel: Stage-0's decode-step products, and the patch decoder's whole
one-position step, in C (`CpuKernelStep`, one implementation of mimo_tts.lm.step.DecodeStep).

Packed weights: where the kernel will multiply bfloat16 weights, `load_lm` packs every matrix
a step streams (`prepare`, `pack_model`) into 16-row blocks with column pairs interleaved
(`model.unpack_rows` says the layout), in place of the loaded one, on one anonymous mapping
madvise'd for huge pages. A thread's share of a product is then one linear region, one 512-bit
load is a column pair of 16 rows, and a tile of R blocks by up to 8 rows keeps its sums in
registers, so each weight line is read once per step for every row (`pk_*` in the C source:
AVX512-BF16 `vdpbf16ps`, AVX2 with bfloat16 widened to float32, plain C, AMX tiles on the
packed blocks). Each output sums its column pairs in one fixed order, whatever the rows,
tiles or threads: a row's bytes are the same alone, in a batch and on any thread count.

Three entry points of cpu_kernel.c (beside this file):
- `gemv_*_call`: one product of a weight by some rows (1-16, or any number for packed
  weights: a prefill's), streaming the weight once for all rows (AMX tiles for every row count
  where the CPU grants them, so a row sums alike alone or in a batch), the bias added and the
  result rounded to the model dtype. The backbone's fused q/k/v, o_proj, gate/up and
  down_proj, lm_head, the patch encoder and the channel heads multiply through it; norms and
  the rest stay PyTorch.
- `attend_one_bf16`: the backbone's bfloat16 attention from one query position (`Attention`),
  each (row, kv head) one thread's pass over the keys it sees, where it measured faster than
  PyTorch's (`attention_faster`: some 10x here, whose fixed costs dominate one query).
- `step_*`: the patch decoder (16 small layers, 11 positions per group), every layer of one
  position in one call with one thread team (each thread with its own copy of the residual
  stream, so the threads meet only where a product's outputs are read): in eager PyTorch each
  layer step is some 40 operator calls whose fixed costs add up to a fifth of the step.
Both round to bfloat16 wherever the PyTorch modules produce a bfloat16 tensor, so they track
the eager path (float32 models match the reference fixtures); accumulation order differs
from oneDNN's, so bfloat16 outputs may differ from the eager ones in the last bit.

The C source is compiled once per machine with the system C compiler (`-march=native`, about
3 s) into the user cache directory and loaded with ctypes: no PyTorch headers or build
toolchain (torch.utils.cpp_extension) at run time, and one small file to read. Loading asks
Linux for AMX tile state for the whole process. By default (`auto`) the kernel runs only
where it beats eager PyTorch (bfloat16 on AVX512-BF16 CPUs, and on AVX2 CPUs where its
products measured faster); `load_lm(..., cpu_kernel=
"on"/"off")` overrides that (the CLI and the library pass `Placement.cpu_kernel`, which
MIMO_TTS_CPU_KERNEL=1/0 sets), and `choose(model)` says whether it runs and why (not).
Shapes in the C source: n rows, D dim, F ffn dim, S cache length.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import re
import time
from collections.abc import Sequence
from importlib.resources import files

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mimo_tts.errors import UsageError
from mimo_tts.lm.config import W4_GROUP, quant_refusal
from mimo_tts.lm.model import (
    PACK_ROWS,
    KVCache,
    Matmul,
    MiMoAudioLM,
    fuse_parts,
    linear,
    unpack_rows,
    upcast_linear,
)
from mimo_tts.lm.step import EagerStep
from mimo_tts.runtime import pages
from mimo_tts.runtime.devices import Choice, check_kernel_mode
from mimo_tts.runtime.fixed_order import attend_one
from mimo_tts.runtime.kernels import build
from mimo_tts.runtime.measured import Decision, alternating_best, decide

SOURCE = files("mimo_tts.lm") / "cpu_kernel.c"

LAYER_FIELDS = ("in_norm", "qkv_w", "qkv_b", "o_w", "post_norm", "gate_up_w", "down_w",
                "qkv_s", "o_s", "gate_up_s", "down_s")
MAX_ROWS = 16  # rows a product takes through the kernel; more go to PyTorch's GEMM
DTYPES = (torch.bfloat16, torch.float32)


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in LAYER_FIELDS]


class _Step(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in
                ("layers", "dim", "heads", "head_dim", "ffn", "rows", "slot", "threads",
                 "packed")] + [
        ("eps", ctypes.c_float), ("layer", ctypes.POINTER(_Layer)),
        ("final_norm", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
        ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("cache_rows", ctypes.c_long), ("cache_len", ctypes.c_long),
        ("x", ctypes.c_void_p), ("out", ctypes.c_void_p), ("work", ctypes.c_void_p),
    ]


class _AttendOne(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("q", "k", "v", "mask", "out", "work")] + [
        (name, ctypes.c_long) for name in ("qb", "qh", "kb", "kh", "ks", "vb", "vh", "vs", "mb")
    ] + [(name, ctypes.c_int) for name in ("batch", "heads", "kv_heads", "dim", "keys",
                                           "threads")] + [("scale", ctypes.c_float)]


class _Gemv(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("w", "b", "x", "scale", "y", "work")] + [
        ("inputs", ctypes.c_long), ("outputs", ctypes.c_long),
        ("rows", ctypes.c_int), ("threads", ctypes.c_int), ("packed", ctypes.c_int),
    ]


@functools.cache
def _build() -> tuple[ctypes.CDLL | None, str]:
    """(the compiled kernel, "") or (None, why not); built on first use (`kernels.build`)."""
    lib, why = build(SOURCE, "lm_step")
    if lib is None:
        return None, why
    for name in ("step_bf16", "step_f32", "step_work_floats"):
        getattr(lib, name).argtypes = [ctypes.POINTER(_Step)]
    for name in ("gemv_bf16_call", "gemv_f32_call", "gemv_work_floats"):
        getattr(lib, name).argtypes = [ctypes.POINTER(_Gemv)]
    lib.step_work_floats.restype = lib.gemv_work_floats.restype = ctypes.c_long
    for name in ("attend_one_bf16", "attend_one_floats"):
        getattr(lib, name).argtypes = [ctypes.POINTER(_AttendOne)]
    lib.attend_one_floats.restype = ctypes.c_long
    lib.pack_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                              ctypes.c_long, ctypes.c_int]
    lib.pack_w8.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long,
                            ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_int]
    lib.pack_w4.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long,
                            ctypes.c_long, ctypes.c_long, ctypes.c_int]
    # AMX tiles for every row count where the CPU grants them: a row's sums then do not
    # depend on how many rows share a product (the dot products sum in another order), so a
    # job in a batch equals its single run. From 2 rows the tiles are also the faster path;
    # one row costs some 5% more than the dot products (measured on an AMX Xeon).
    if lib.amx_enable() and _tiles_agree(lib):
        lib.set_amx_min_rows(1)
    return lib, ""


def _tiles_agree(lib: ctypes.CDLL) -> bool:
    """Whether the AMX tiles' products on packed weights agree with the dot products' (both
    rounded once to bfloat16) on a small matrix, for 1 and 17 rows: a check at first use,
    before any model relies on the tiles (where they disagree, the dot products run)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 512, generator=gen).bfloat16()
    x = torch.randn(17, 512, generator=gen).bfloat16()
    packed = pack(lib, weight)
    results = []
    for rows in (1, 17):  # 1: the tiles; 17: never
        lib.set_amx_min_rows(rows)
        results.append(_gemv(lib, x, packed, None, 1).float())
    lib.set_amx_min_rows(MAX_ROWS + 1)
    scale = results[1].abs().amax().item()
    return bool((results[0] - results[1]).abs().amax().item() <= 2 ** -7 * scale)


def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built (`_build` says why)."""
    return _build()[0]


ISAS = ("plain C", "AVX2", "AVX512-BF16")  # set_isa's levels, by number


def features() -> dict[str, bool | int | str]:
    """What the compiled kernel uses on this machine (all False when it cannot be built);
    amx_min_rows: the fewest rows a product runs on AMX tiles (1 where granted, 17: never);
    packed_isa: the path of packed products below AMX (`set_isa`)."""
    lib = library()
    bits = 0 if lib is None else lib.features()
    return {"built": lib is not None, "avx512_bf16": bool(bits & 1), "amx": bool(bits & 2),
            "avx2": bool(bits & 4),
            "amx_min_rows": lib.amx_min_rows() if lib is not None else MAX_ROWS + 1,
            "packed_isa": ISAS[lib.isa_in_use()] if lib is not None else ""}


def set_isa(level: int) -> None:
    """The widest path packed products take below AMX: 2 AVX512-BF16, 1 AVX2 (bfloat16
    widened to float32), 0 plain C, where compiled in (tests run the paths of other CPUs)."""
    lib = library()
    if lib is not None:
        lib.set_isa_cap(level)


def set_amx_min_rows(rows: int) -> None:
    """Products of >= `rows` rows (1-16) use AMX tiles where granted; 17 never (tests force
    the AVX512-BF16 path of CPUs without AMX with it). Only 1 or 17 keep a row's result
    independent of the row count."""
    lib = library()
    if lib is not None:
        lib.set_amx_min_rows(rows)


@functools.cache
def products_faster() -> Decision:
    """Whether the kernel's one-row bfloat16 products (packed weights) run the backbone on
    this machine (`measure_products`, measured once per machine and kept: `runtime.measured`)."""
    return decide("lm_kernel_products", "bfloat16 [1, 4096] x packed [8192, 4096]",
                  measure_products)


def measure_products() -> tuple[bool, float, float]:
    """Whether the kernel's one-row bfloat16 product on packed weights streams a weight faster
    than PyTorch's here: (faster, kernel GB/s, PyTorch GB/s), best of 3 alternating rounds
    over two 64 MiB matrices (together past the last-level cache; both on ordinary pages)."""
    lib = library()
    mats = [torch.full((8192, 4096), 0.01, dtype=torch.bfloat16) for _ in range(2)]
    packed = [pack(lib, m) for m in mats]
    x = torch.full((1, 4096), 0.5, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    best = {"kernel": float("inf"), "torch": float("inf")}
    for _ in range(3):
        for name, i in (("kernel", 0), ("torch", 1), ("torch", 0), ("kernel", 1)):
            start = time.perf_counter()
            if name == "kernel":
                _gemv(lib, x, packed[i], None, threads)
            else:
                torch.mv(mats[i], x[0])
            best[name] = min(best[name], time.perf_counter() - start)
    nbytes = mats[0].numel() * 2
    return (best["kernel"] < best["torch"], round(nbytes / best["kernel"] / 1e9, 1),
            round(nbytes / best["torch"] / 1e9, 1))


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _gemv(lib: ctypes.CDLL, x: Tensor, weight: Tensor, bias: Tensor | None,
          threads: int) -> Tensor:
    """x [rows, in] (contiguous) . weight[out, in]^T + bias -> [rows, out] in x's dtype;
    an int8 weight brings its row scales (mimo_tts/lm/int8.py); a packed one (3-D) is
    [out / 16, in / 2, 32] bfloat16 (`pack`), [out / 16, in / 4, 64] int8 with its rowdata
    as `.scale` (`pack_w8a8`) or [out / 16, in / 8, 64] uint8 with its group scales as
    `.scale` (`pack_w4a8`); for the last two x's rows are quantized to bytes in the kernel."""
    packed = packed_kind(weight)
    rows = x.shape[0]
    out, inputs = packed_shape(weight) if packed else weight.shape
    y = torch.empty(rows, out, dtype=x.dtype)
    call = _Gemv(_ptr(weight), _ptr(bias), _ptr(x), _ptr(getattr(weight, "scale", None)),
                 _ptr(y), None, inputs, out, rows, threads, packed)
    bf16 = x.dtype == torch.bfloat16
    if bf16:
        work = torch.empty(lib.gemv_work_floats(ctypes.byref(call)), dtype=torch.float32)
        call.work = work.data_ptr()
    (lib.gemv_bf16_call if bf16 else lib.gemv_f32_call)(ctypes.byref(call))
    return y


HUGE_PAGE = 2 << 20


def huge_bytes(nbytes: int) -> Tensor:
    """`nbytes` uninitialised uint8 on their own anonymous mapping, aligned to 2 MiB and
    madvise'd MADV_HUGEPAGE, so Linux backs them with huge pages where it can (THP "madvise"
    mode): a weight streamed from them reads faster than from 4 KiB pages. Pages are taken
    as they are first written. The tensor keeps the mapping alive. Below one huge page, or
    where the platform has no such call: torch.empty."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(advice)
    view = ctypes.c_char.from_buffer(buf)
    offset = -ctypes.addressof(view) % HUGE_PAGE
    del view  # releases its export of the buffer; the tensor holds its own
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)


def packable(weight: Tensor | None) -> bool:
    """A bfloat16 CPU matrix of whole 16-row blocks and column pairs (every matrix a decode
    step streams, at the published sizes and the fixtures')."""
    return (weight is not None and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.dtype == torch.bfloat16 and weight.shape[0] % PACK_ROWS == 0
            and weight.shape[1] % 2 == 0 and weight.shape[1] > 0)


PACKED_KINDS = {torch.bfloat16: 1, torch.int8: 2, torch.uint8: 3}


def packed_kind(weight: Tensor) -> int:
    """The kernel's code for a weight's layout: 0 plain, 1 packed bfloat16 (`pack`), 2 packed
    int8 (`pack_w8a8`), 3 packed 4-bit (`pack_w4a8`)."""
    return 0 if weight.dim() != 3 else PACKED_KINDS[weight.dtype]


def packed_shape(weight: Tensor) -> tuple[int, int]:
    """(out, in) of a packed weight: bfloat16 [out / 16, in / 2, 32], int8 [out / 16, in / 4,
    64] or 4-bit [out / 16, in / 8, 64] (two columns a byte)."""
    per_byte = 2 if weight.dtype == torch.uint8 else 1
    return (weight.shape[0] * PACK_ROWS,
            weight.shape[1] * weight.shape[2] * per_byte // PACK_ROWS)


def packable_w8a8(weight: Tensor | None) -> bool:
    """A bfloat16 CPU matrix of whole 16-row blocks and column quads (`pack_w8a8`)."""
    return packable(weight) and weight.shape[1] % 4 == 0


def pack_w8a8(lib: ctypes.CDLL, weight: Tensor, out: Tensor | None = None) -> Tensor:
    """weight [out, in] bfloat16 -> int8 [out / 16, in / 4, 64] packed for the kernel's w8a8
    products (cpu_kernel.c says the layout), quantized and written there (`pack_w8`, on every
    thread) into `out` (bytes) or a new tensor, carrying its rowdata as `.scale`: float32
    [2 * out], the row scales (as `int8.quantize_rows`: symmetric, max |w| / 127) then the
    rows' sums of the int8 values as int32 bits."""
    rows, cols = weight.shape
    shape = (rows // PACK_ROWS, cols // 4, 4 * PACK_ROWS)
    out = (torch.empty(shape, dtype=torch.int8) if out is None
           else out.view(torch.int8).view(shape))
    rowdata = torch.empty(2 * rows, dtype=torch.float32)
    source = weight.detach().contiguous()
    lib.pack_w8(source.data_ptr(), out.data_ptr(), rowdata.data_ptr(), cols, rows, 0,
                shape[0], torch.get_num_threads())
    out.scale = rowdata
    return out


def packable_w4a8(weight: Tensor | None) -> bool:
    """A bfloat16 CPU matrix of whole 16-row blocks and 32-column groups (`pack_w4a8`)."""
    return packable(weight) and weight.shape[1] % W4_GROUP == 0


def w4a8_bytes(rows: int, cols: int) -> int:
    """Bytes of a `pack_w4a8` matrix: half a byte an element, then its float16 scales."""
    return rows * cols // 2 + rows * cols // W4_GROUP * 2


def pack_w4a8(lib: ctypes.CDLL, weight: Tensor, out: Tensor | None = None) -> Tensor:
    """weight [out, in] bfloat16 -> uint8 [out / 16, in / 8, 64] packed for the kernel's w4a8
    products (cpu_kernel.c says the layout and the rounding; written there, `pack_w4`, on
    every thread) into `out` (`w4a8_bytes` bytes: the 4-bit lines, then the float16 group
    scales [out / 16, in / 32, 16], carried as `.scale`) or a new tensor. Each group of 32
    columns of a row: symmetric, scale max |w| / 7 rounded to float16, values
    round(w / scale) in -8..7 stored plus 8."""
    rows, cols = weight.shape
    buf = (torch.empty(w4a8_bytes(rows, cols), dtype=torch.uint8) if out is None
           else out.view(torch.uint8))
    packed, scales = _w4a8_views(buf, rows, cols)
    _pack_w4(lib, weight, packed, scales)
    packed.scale = scales
    return packed


def _w4a8_views(buf: Tensor, rows: int, cols: int) -> tuple[Tensor, Tensor]:
    """The 4-bit lines [rows / 16, cols / 8, 64] and the float16 group scales [rows / 16,
    cols / 32, 16] of a `pack_w4a8` matrix in its bytes `buf`."""
    blocks, half = rows // PACK_ROWS, rows * cols // 2
    return (buf[:half].view(blocks, cols // 8, 64),
            buf[half:w4a8_bytes(rows, cols)].view(torch.float16).view(
                blocks, cols // W4_GROUP, PACK_ROWS))


def _pack_w4(lib: ctypes.CDLL, weight: Tensor, packed: Tensor, scales: Tensor) -> None:
    """`weight`'s blocks as 4-bit groups into `packed` and `scales` (as `_w4a8_views` gives
    them, or their blocks of one part of a matrix: a block packs alone)."""
    source = weight.detach().contiguous()
    lib.pack_w4(source.data_ptr(), packed.data_ptr(), scales.data_ptr(), weight.shape[1], 0,
                weight.shape[0] // PACK_ROWS, torch.get_num_threads())


def unpack_w4a8(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """A `pack_w4a8` weight as [out, in] in `dtype`: its 4-bit values times the group
    scales."""
    blocks, lines, _ = packed.shape
    byte = packed.view(blocks, lines, PACK_ROWS, 4).to(torch.int16)
    halves = torch.stack((byte & 15, byte >> 4), dim=3) - 8  # [block, line, row, 2, 4]
    values = halves.permute(0, 2, 1, 3, 4).reshape(blocks * PACK_ROWS, lines * 8)
    scale = packed.scale.transpose(1, 2).reshape(blocks * PACK_ROWS, -1).float()
    return (values.float() * scale.repeat_interleave(W4_GROUP, dim=1)).to(dtype)


def unpack_packed(packed: Tensor, dtype: torch.dtype) -> Tensor:
    """Any packed weight as [out, in] in `dtype` (for a product outside the kernel)."""
    if packed.dtype == torch.int8:
        return unpack_w8a8(packed, dtype)
    if packed.dtype == torch.uint8:
        return unpack_w4a8(packed, dtype)
    return unpack_rows(packed).to(dtype)


def unpack_w8a8(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """A `pack_w8a8` weight as [out, in] in `dtype`: its int8 values times the row scales."""
    blocks, quads, _ = packed.shape
    values = packed.reshape(blocks, quads, PACK_ROWS, 4).transpose(1, 2).reshape(
        blocks * PACK_ROWS, 4 * quads)
    return (values.float() * packed.scale[:blocks * PACK_ROWS, None]).to(dtype)


def pack(lib: ctypes.CDLL, weight: Tensor, out: Tensor | None = None) -> Tensor:
    """weight [out, in] bfloat16 -> packed [out / 16, in / 2, 32] (`model.unpack_rows` says the
    layout), into `out` (bytes, e.g. a slice of `huge_bytes`) or a new tensor; written by the
    kernel's threads."""
    rows, cols = weight.shape
    shape = (rows // PACK_ROWS, cols // 2, 2 * PACK_ROWS)
    out = (torch.empty(shape, dtype=weight.dtype) if out is None
           else out.view(weight.dtype).view(shape))
    source = weight.detach().contiguous()
    lib.pack_bf16(source.data_ptr(), out.data_ptr(), cols // 2, 0, shape[0],
                  torch.get_num_threads())
    return out


QUANT_PACKERS = {None: (packable, pack), "w8a8": (packable_w8a8, pack_w8a8),
                 "w4a8": (packable_w4a8, pack_w4a8)}


def _packed_bytes(weight: Tensor, quant: str | None) -> int:
    rows, cols = weight.shape
    if quant == "w4a8":
        return w4a8_bytes(rows, cols)
    return rows * cols * (1 if quant == "w8a8" else 2)


def pack_model(model: MiMoAudioLM, quant: str | None = None) -> int:
    """Pack every matrix a decode step streams (`MiMoAudioLM.streamed_matrices`) in place, one
    at a time: the packed copy (huge pages) replaces the original and its checkpoint-named
    parts become row views of it, so there are never two resident copies beyond the matrix
    in hand. -> bytes packed. Only bfloat16 matrices of whole blocks (`packable`); int8 ones
    (--lm-quant int8) stay as they are. `quant` "w8a8": packed as int8 (`pack_w8a8`), half
    the bytes; "w4a8": as 4-bit groups (`pack_w4a8`), some 0.28x the bytes."""
    lib = library()
    fits, packer = QUANT_PACKERS[quant]
    for owner, name, parts in model.streamed_matrices():  # left in parts the kernel can't take
        if getattr(owner, name) is None and not all(
                lib is not None and fits(p.weight) for p in parts):
            fuse_parts(owner, parts)
    todo = [(owner, name, parts) for owner, name, parts in model.streamed_matrices()
            if lib is not None and (getattr(owner, name) is None or fits(getattr(owner, name)))]
    nbytes = [_packed_bytes(_shape_of(o, n, p), quant) for o, n, p in todo]
    sizes = [-(-b // mmap.PAGESIZE) * mmap.PAGESIZE for b in nbytes]  # whole pages each
    arena, offset = huge_bytes(sum(sizes)), 0  # one mapping, filled as packed
    with torch.no_grad():
        for (owner, name, parts), size, used in zip(todo, sizes, nbytes, strict=True):
            weight = getattr(owner, name)
            if weight is None:  # q/k/v or gate/up still in their mapped parts (`load_lm`)
                weight = _pack_parts(lib, parts, arena[offset:offset + size], quant)
                setattr(owner, name, weight)
                _view_parts(weight, parts)
                offset += size
                continue
            packed = packer(lib, weight, arena[offset:offset + used])
            offset += size
            if isinstance(weight, nn.Parameter):
                scale = getattr(packed, "scale", None)
                packed = nn.Parameter(packed, requires_grad=False)
                if scale is not None:
                    packed.scale = scale
            setattr(owner, name, packed)
            _view_parts(packed, parts)
            pages.drop(weight)  # the file's copy, now packed
            del weight
    return sum(nbytes)


def _shape_of(owner: nn.Module, name: str, parts: Sequence[nn.Module]) -> Tensor:
    """The matrix `pack_model` packs, or (still in its parts) a meta tensor of its shape."""
    weight = getattr(owner, name)
    if weight is not None:
        return weight
    rows = sum(p.weight.shape[0] for p in parts)
    return torch.empty((rows, parts[0].weight.shape[1]), dtype=parts[0].weight.dtype,
                       device="meta")


def _pack_parts(lib: ctypes.CDLL, parts: Sequence[nn.Module], out: Tensor,
                quant: str | None = None) -> Tensor:
    """A fused bfloat16 matrix packed straight from its parts' weights (mapped), as `pack`,
    `pack_w8a8` or `pack_w4a8` (`quant`) would pack their stack, part after part into `out`:
    a block of 16 rows packs alone, and each row's (or row group's) scales are its own, so
    these are the bytes of packing the stack. Each part's file pages are given back once
    packed."""
    if quant == "w4a8":  # all the 4-bit lines, then all the scales: each part into its blocks
        rows = sum(p.weight.shape[0] for p in parts)
        whole, scales = _w4a8_views(out.view(torch.uint8), rows, parts[0].weight.shape[1])
        whole.scale = scales
    rowdata, start = [], 0
    for part in parts:
        if quant == "w4a8":
            blocks = slice(start, start + part.weight.shape[0] // PACK_ROWS)
            _pack_w4(lib, part.weight, whole[blocks], whole.scale[blocks])
            start = blocks.stop
        else:  # the parts' blocks one after another, as their stack's
            size = _packed_bytes(part.weight, quant)
            packed = QUANT_PACKERS[quant][1](lib, part.weight, out[start:start + size])
            rowdata += [packed.scale.view(2, -1)] if quant == "w8a8" else []  # scales, sums
            start += size
        pages.drop(part.weight)
    if quant == "w4a8":
        return whole
    whole = out[:start].view(packed.dtype).view(-1, *packed.shape[1:])
    if rowdata:
        whole.scale = torch.cat(rowdata, dim=1).reshape(-1)  # every scale, then every sum
    return whole


def _view_parts(packed: Tensor, parts: Sequence[nn.Module]) -> None:
    """Point the checkpoint-named parts of a fused matrix at their blocks of the packed one
    (their rows are whole blocks), so none keeps the unpacked matrix alive."""
    start = 0
    for part in parts:
        blocks = part.weight.shape[0] // PACK_ROWS
        part.weight = nn.Parameter(packed[start:start + blocks], requires_grad=False)
        start += blocks


def may_pack(device: str | torch.device, dtype: torch.dtype, quant: str | None,
             mode: str) -> bool:
    """What `prepare` needs that is known before the weights load: the CPU, bfloat16 weights,
    no int8 weight-only matrices (`--lm-quant int8`), the kernel not "off". Where it holds,
    `load_lm` leaves q/k/v and gate/up in their mapped parts for `pack_model`; where
    `prepare` then packs nothing after all (the kernel not built, its products measured
    slower), `fuse_rest` concatenates them as the loader would have: one copy more, never
    another model."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and quant != "int8" and check_mode(mode) != "off")


def prepare(model: MiMoAudioLM) -> None:
    """At load, after the mode is set: pack the streamed matrices (`pack_model`) where the
    kernel will multiply by them, i.e. `choose` makes it active on bfloat16 weights and its
    products either are asked for ("on") or measured faster than PyTorch's (`products_faster`);
    `packing(model)` reports what was packed."""
    quant = getattr(model, "quant", None)
    if quant in ("w8a8", "w4a8"):
        why = packed_quant_refusal(model, quant)
        if why:
            raise UsageError(f"--lm-quant {quant}: {why}")
        model.packed_bytes = pack_model(model, quant)
    elif (model.lm_head.weight.dtype == torch.bfloat16 and choose(model).active
            and (model.cpu_kernel == "on" or products_faster().faster)):
        model.packed_bytes = pack_model(model)


def packed_quant_refusal(model: MiMoAudioLM, quant: str = "w8a8") -> str:
    """Why the w8a8 or w4a8 profile cannot run on `model` as placed ("" where it can): it
    needs the kernel (built, not "off"), bfloat16 weights on the CPU, and for w4a8 every
    streamed matrix in whole 32-column groups."""
    weight = model.lm_head.weight
    why = quant_refusal(quant, weight.device.type, str(weight.dtype).removeprefix("torch."),
                        model.cpu_kernel)
    if why:
        return why
    if quant == "w4a8":
        for owner, name, parts in model.streamed_matrices():
            matrix = _shape_of(owner, name, parts)  # q/k/v, gate/up maybe still in parts
            if matrix.dim() == 2 and matrix.shape[1] % W4_GROUP:
                return (f"a matrix of {matrix.shape[1]} columns is not in whole groups of "
                        f"{W4_GROUP} (use w8a8)")
    lib, why = _build()
    return "" if lib is not None else f"the CPU kernel cannot be built: {why}"


def packing(model: MiMoAudioLM) -> str:
    """The sidecar's line on the packed weights: how much, and how much on huge pages."""
    weights = packed_weights(model)
    huge = min(huge_page_bytes(weights), model.packed_bytes)  # a merged mapping counts more
    kind = {torch.int8: " of int8 (w8a8)", torch.uint8: " of 4-bit groups (w4a8)"}.get(
        weights[0].dtype, "") if weights else ""
    return (f"{model.packed_bytes / 2**30:.2f} GiB{kind} packed in 16-row blocks "
            f"({len(weights)} matrices), {huge / 2**30:.2f} GiB of it on huge pages")


def huge_page_bytes(tensors: Sequence[Tensor]) -> int:
    """Bytes of these tensors' memory that Linux backs with huge pages now: AnonHugePages of
    the mappings holding them (/proc/self/smaps; 0 where unknown). Linux merges adjacent
    anonymous mappings, so this may include memory beside them."""
    starts = sorted({t.untyped_storage().data_ptr() for t in tensors})
    total, current = 0, None
    try:
        with open("/proc/self/smaps", encoding="ascii", errors="replace") as smaps:
            for line in smaps:
                head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
                if head:
                    lo, hi = int(head[1], 16), int(head[2], 16)
                    current = any(lo <= s < hi for s in starts)
                elif current and line.startswith("AnonHugePages:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


def packed_weights(model: MiMoAudioLM) -> list[Tensor]:
    """The model's packed matrices (after `pack_model`), each once."""
    return [getattr(owner, name) for owner, name, _ in model.streamed_matrices()
            if getattr(owner, name).dim() == 3]


def packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., in] @ W.T (+ bias) for a packed W [out / 16, in / 2, 32], any number of rows:
    the kernel's products where it runs (bfloat16 on CPU), else W unpacked for F.linear (a
    model converted or moved after packing: correct, slow)."""
    out, inputs = packed_shape(weight)
    rows = x.numel() // inputs
    lib = library()
    if (lib is not None and rows > 0 and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.dtype == torch.bfloat16 and weight.dtype in PACKED_KINDS
            and weight.is_contiguous()
            and (bias is None or (bias.is_contiguous() and bias.dtype == x.dtype))):
        flat = x.reshape(rows, inputs).contiguous()
        return _gemv(lib, flat, weight, bias, torch.get_num_threads()).view(*x.shape[:-1], out)
    dense = unpack_packed(weight, x.dtype)
    return F.linear(x, dense, None if bias is None else bias.to(x.dtype))


class Products:
    """`matmul` (mimo_tts.lm.model.Matmul) through the kernel: packed weights for any number
    of rows; else 1-16 rows of a contiguous CPU weight: int8 ones (with scales) always, those
    of the kernel's dtypes when `dense`; anything else goes to `linear`."""

    def __init__(self, lib: ctypes.CDLL, dense: bool = True):
        self.lib, self.dense = lib, dense

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if weight.dim() == 3:
            return packed_linear(x, weight, bias)
        rows = x.numel() // weight.shape[1] if weight.shape[1] else 0
        int8 = weight.dtype == torch.int8 and hasattr(weight, "scale")
        if not (0 < rows <= MAX_ROWS and x.device.type == "cpu" and x.dtype in DTYPES
                and ((self.dense and x.dtype == weight.dtype) or int8)
                and weight.is_contiguous()
                and (bias is None or bias.is_contiguous())):
            return linear(x, weight, bias)
        flat = x.reshape(rows, weight.shape[1]).contiguous()
        y = _gemv(self.lib, flat, weight, bias, torch.get_num_threads())
        return y.view(*x.shape[:-1], weight.shape[0])


MAX_GROUP = 64  # query heads per kv head the kernel's attention holds


class Attention:
    """`attend` (mimo_tts.lm.model.Attend) through the kernel: one bfloat16 query position
    per row on the CPU, heads a multiple of 16 wide, keys and values with contiguous rows (the
    cache's); anything else goes to `attend_one`. PyTorch's attention takes 0.24 ms for one
    row of 64 keys and 7.6 ms for eight rows of 256 (32 heads over 8 kv heads of 128, two
    threads, AMD EPYC with AVX512-BF16), most of it not arithmetic; here each (row, kv
    head) is one pass over its keys."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        if not _attends(q, k, v, mask):
            return attend_one(q, k, v, mask)
        b, heads, _, dim = q.shape
        out = torch.empty(b, heads, 1, dim, dtype=q.dtype)
        call = _AttendOne(q.data_ptr(), k.data_ptr(), v.data_ptr(),
                          None if mask is None else mask.data_ptr(), out.data_ptr(), None,
                          q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                          v.stride(0), v.stride(1), v.stride(2),
                          0 if mask is None or mask.shape[0] == 1 else mask.stride(0),
                          b, heads, k.shape[1], dim, k.shape[2], torch.get_num_threads(),
                          float(dim) ** -0.5)
        work = torch.empty(call.threads * self.lib.attend_one_floats(ctypes.byref(call)),
                           dtype=torch.float32)
        call.work = work.data_ptr()
        if self.lib.attend_one_bf16(ctypes.byref(call)):
            raise RuntimeError("the kernel refused operands `_attends` let through")
        return out


def _attends(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> bool:
    """Whether the kernel's attention takes these operands (`Attention`)."""
    b, heads, length, dim = q.shape
    if not (q.device.type == k.device.type == v.device.type == "cpu" and length == 1
            and q.dtype == k.dtype == v.dtype == torch.bfloat16 and dim % 16 == 0
            and k.shape == v.shape and k.shape[0] == b and k.shape[3] == dim
            and heads % k.shape[1] == 0 and heads // k.shape[1] <= MAX_GROUP
            and q.stride(3) == k.stride(3) == v.stride(3) == 1):
        return False
    return mask is None or (mask.dtype == torch.bool and mask.device.type == "cpu"
                            and mask.dim() == 4 and mask.shape[0] in (1, b)
                            and mask.shape[1] == mask.shape[2] == 1
                            and mask.shape[3] == k.shape[2] and mask.stride(3) == 1)


@functools.cache
def attention_faster() -> Decision:
    """Whether the kernel's attention of one query (`Attention`) is faster than PyTorch's
    here (`measure_attention`, measured once per machine and kept: `runtime.measured`)."""
    return decide("lm_attention", "bfloat16 [1, 32, 1, 128] over [1, 8, 256, 128]",
                  measure_attention)


def measure_attention() -> tuple[bool, float, float]:
    """(faster, the kernel's calls a second, PyTorch's): best of 5 alternating rounds of 20
    calls of one row's 32 query heads over 8 kv heads of 256 keys of 128."""
    lib = library()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 1, 128, generator=gen).bfloat16()
    k, v = (torch.randn(1, 8, 256, 128, generator=gen).bfloat16() for _ in range(2))
    ours = Attention(lib)
    mine, theirs = alternating_best(lambda: [ours(q, k, v) for _ in range(20)],
                                    lambda: [attend_one(q, k, v) for _ in range(20)])
    return mine < theirs, round(20 / mine), round(20 / theirs)


class LocalStepKernel:
    """One decode position of a fused Qwen2 stack (the patch decoder) through the C kernel.

    Holds the tensors it points at (so they outlive it); build one per generation, after the
    model has its final device and dtype.
    """

    def __init__(self, stack, lib: ctypes.CDLL):
        cfg = stack.cfg
        self.stack, self.cfg, self.lib = stack, cfg, lib
        self.dtype = stack.norm.weight.dtype
        self.fn = lib.step_bf16 if self.dtype == torch.bfloat16 else lib.step_f32
        self.tensors = self._tensors()
        matrices = ("qkv_w", "o_w", "gate_up_w", "down_w")
        dims = {parts[LAYER_FIELDS.index(m)].dim() for parts in self.tensors[:-1]
                for m in matrices}
        if len(dims) > 1:
            raise RuntimeError("the patch decoder's matrices are partly packed")
        self.packed = packed_kind(stack.layers[0].mlp.down_proj.weight)
        layers = (_Layer * cfg.layers)()
        for layer, parts in zip(layers, self.tensors[:-1], strict=True):
            for name, tensor in zip(LAYER_FIELDS, parts, strict=True):
                setattr(layer, name, _ptr(tensor))
        self.layers = layers

    def _tensors(self) -> list[tuple[Tensor, ...]]:
        out = []
        for layer in self.stack.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights = (attn.qkv_weight, attn.o_proj.weight, mlp.gate_up_weight,
                       mlp.down_proj.weight)
            out.append((layer.input_layernorm.weight, attn.qkv_weight, attn.qkv_bias,
                        attn.o_proj.weight, layer.post_attention_layernorm.weight,
                        mlp.gate_up_weight, mlp.down_proj.weight,
                        *(getattr(w, "scale", None) for w in weights)))
        return out + [(self.stack.norm.weight,)]

    def __call__(self, x: Tensor, position: int, cache: KVCache, slot: int) -> Tensor:
        """x [n, 1, D] (n <= the cache's rows) at one position, written at cache `slot` ->
        normed hidden [n, 1, D]."""
        cfg, n = self.cfg, x.shape[0]
        x = x.contiguous()
        out = torch.empty_like(x)
        rope = self.stack.rope_cos[position], self.stack.rope_sin[position]
        step = _Step(cfg.layers, cfg.dim, cfg.heads, cfg.head_dim, cfg.ffn_dim, n, slot,
                     torch.get_num_threads(), self.packed, cfg.eps, self.layers,
                     _ptr(self.stack.norm.weight), _ptr(rope[0]), _ptr(rope[1]),
                     _ptr(cache.k), _ptr(cache.v), cache.k.shape[1], cache.length,
                     _ptr(x), _ptr(out), None)
        work = torch.empty(self.lib.step_work_floats(ctypes.byref(step)), dtype=torch.float32)
        step.work = work.data_ptr()
        self.fn(ctypes.byref(step))
        return out


class CpuKernelStep(EagerStep):
    """The decode step with the patch decoder's positions in one kernel call each and the
    products of 1-16 rows in the kernel: int8 ones always, the others where `choose` found
    them faster than PyTorch's (or mode "on"); the backbone's one-query attention in the
    kernel where it measured faster (or mode "on"); built by `generate.decode_step`."""

    def __init__(self, model: MiMoAudioLM, cache: KVCache | None, local_cache: KVCache,
                 valid: Tensor | None = None):
        lib = library()
        if lib is None:
            raise RuntimeError(f"the CPU kernel cannot run: {_build()[1]}")
        dense = model.cpu_kernel == "on" or products_faster().faster
        attend = (Attention(lib) if model.cpu_kernel == "on" or attention_faster().faster
                  else attend_one)
        super().__init__(model, cache, local_cache, valid, Products(lib, dense), attend)
        self.local = LocalStepKernel(model.local_transformer, lib)

    def local_logits(self, x: Tensor, step: int, channels: Sequence[int]) -> list[Tensor]:
        hidden = self.local(x, step, self.local_cache, step)[:, 0]
        return self.model.local_transformer_lm_heads.logits(channels, hidden, self.matmul)


@functools.cache
def upcast_faster() -> Decision:
    """Whether a prefill multiplies through `model.upcast_linear` on this machine
    (`measure_upcast`, measured once per machine and kept: `runtime.measured`)."""
    return decide("prefill_upcast", "bfloat16 [64, 4096] x [1024, 4096]", measure_upcast)


def measure_upcast() -> tuple[bool, float, float]:
    """Whether `model.upcast_linear` multiplies a prefill's rows faster than PyTorch's bfloat16
    GEMM here: (faster by 1.5x or more, its GFLOP/s, PyTorch's), best of 5 alternating rounds
    of 64 rows by a 1024 x 4096 matrix (an AVX2-only EPYC: 77 against 17 GFLOP/s; AMX or
    AVX512-BF16 CPUs: PyTorch's is faster)."""
    weight = torch.full((1024, 4096), 0.01, dtype=torch.bfloat16)
    x = torch.full((64, 4096), 0.5, dtype=torch.bfloat16)
    best = {"upcast": float("inf"), "torch": float("inf")}
    for _ in range(5):
        for name, product in (("upcast", upcast_linear), ("torch", torch.nn.functional.linear)):
            start = time.perf_counter()
            product(x, weight)
            best[name] = min(best[name], time.perf_counter() - start)
    flops = 2 * x.shape[0] * weight.numel() / 1e9
    return (best["upcast"] * 1.5 <= best["torch"], round(flops / best["upcast"], 1),
            round(flops / best["torch"], 1))


def prefill_products(model: MiMoAudioLM) -> tuple[Matmul, Choice]:
    """How a prefill multiplies: packed weights (`prepare`) through the kernel, whatever the
    rows (`linear` sends them there); otherwise its many rows never go to the kernel, which
    takes <= 16: `upcast_linear` for bfloat16 weights on a CPU where it measured faster, else
    `linear`; "off" (the kernel mode) keeps PyTorch's products everywhere."""
    weight = model.lm_head.weight
    if model.cpu_kernel == "off" or weight.device.type != "cpu":
        return linear, Choice(False, "PyTorch's products")
    if getattr(model, "packed_bytes", 0):  # packed where "on" asked or the products won
        why = "asked for" if model.cpu_kernel == "on" else products_faster().words("GB/s")
        return linear, Choice(True, f"the kernel's products on the packed weights, {why}")
    if weight.dtype not in (torch.bfloat16, torch.int8) or model.model.norm.weight.dtype != \
            torch.bfloat16:
        return linear, Choice(False, "PyTorch's products (not bfloat16)")
    decision = upcast_faster()
    words = decision.words("GFLOP/s")
    if decision.faster:
        return upcast_linear, Choice(True, f"float32 blocks of the bfloat16 weights, {words}")
    return linear, Choice(False, f"PyTorch's bfloat16 GEMM, {words}")


def check_mode(mode: str) -> str:
    return check_kernel_mode(mode, "cpu kernel")


def choose(model: MiMoAudioLM) -> Choice:
    """The kernel decision for `model` as it is now, under its `cpu_kernel` mode.

    "on": wherever it can run (CPU, bf16/f32, the patch decoder with equal q/kv heads and a
    head size the kernel holds); "auto": only where it is faster than eager PyTorch, i.e.
    bfloat16 weights on a CPU with AVX512-BF16 dot products, or with AVX2 where its products
    measured faster than PyTorch's (`products_faster`; PyTorch's bfloat16 runs slowly there:
    on an AVX2-only EPYC its one-row product reads ~14 GB/s); never on float32 weights or the
    plain C loops, which are slower than oneDNN's; "off": never.
    """
    mode = check_mode(model.cpu_kernel)
    if mode == "off":
        return Choice(False, "off (asked for)")
    stack = model.local_transformer
    cfg, weight = stack.cfg, stack.norm.weight
    if weight.device.type != "cpu":
        return Choice(False, f"the LM is on {weight.device}, not the CPU")
    if weight.dtype not in DTYPES or stack.rope_cos.dtype != weight.dtype:
        return Choice(False, f"{weight.dtype} weights: the kernel has bfloat16 and float32")
    lib, why = _build()
    if lib is None:
        return Choice(False, why)
    if cfg.kv_heads != cfg.heads:
        return Choice(False, f"patch decoder has {cfg.kv_heads} kv heads for {cfg.heads} heads")
    if cfg.head_dim > lib.max_head_dim() or cfg.head_dim % 2:
        return Choice(False, f"patch decoder head size {cfg.head_dim}: the kernel holds even "
                             f"sizes up to {lib.max_head_dim()}")
    isa = features()
    if mode == "auto" and weight.dtype != torch.bfloat16:
        return Choice(False, f"auto: {str(weight.dtype).removeprefix('torch.')} weights run "
                             "faster in eager PyTorch")
    path = isa["packed_isa"]  # the widest path compiled in, or the one `set_isa` left
    if mode == "auto" and path == "plain C":
        return Choice(False, "auto: this CPU has neither AVX512-BF16 nor AVX2")
    if mode == "auto" and path == "AVX2" and not products_faster().faster:
        return Choice(False, "auto: AVX2 only, where the kernel's products measured slower "
                             f"than PyTorch's: {products_faster().words('GB/s')}")
    how = {"AVX512-BF16": "AVX512-BF16 dot products",
           "AVX2": "AVX2, bfloat16 widened to float32"}.get(path, "scalar loops")
    if isa["amx"] and isa["amx_min_rows"] <= MAX_ROWS:
        how += ", AMX tiles" if isa["amx_min_rows"] == 1 else (
            f", AMX tiles from {isa['amx_min_rows']} rows")
    if mode == "on":
        return Choice(True, f"on: {how}; every product of <= {MAX_ROWS} rows")
    decision, attention = products_faster(), attention_faster()
    where = "in the kernel" if decision.faster else "in PyTorch (its GEMV was faster here)"
    attends = "in the kernel" if attention.faster else "in PyTorch (faster here)"
    return Choice(True, f"auto: {how}; patch decoder steps in the kernel, backbone products "
                        f"{where}: {decision.words('GB/s')}; backbone attention {attends}: "
                        f"{attention.words('calls/s')}")
