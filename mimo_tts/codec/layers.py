"""Transformer pieces shared by the encoder, decoder and vocoder (spec §3.2).

Each layer is pre-LN: self_attn_layer_norm -> MHA -> residual, final_layer_norm -> fc1 -> GELU(erf)
-> fc2 -> residual. q/v/out projections have a bias, k does not. RoPE is NeoX rotate-half.

Shapes: B batch, L positions (mel/latent frames), H heads, D head dim. Sequences of a batch are
right-padded; `lengths` [B] gives each valid length. Every attention kind below keeps padded keys
invisible to valid queries, so a padded batch gives each sequence exactly what it gets alone.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mimo_tts.codec import attention, gemm
from mimo_tts.codec.attention import Keys
from mimo_tts.runtime import pages
from mimo_tts.runtime.fixed_order import attend_one, product

# Query block of the windowed (local) attention: small enough that the masked key span
# (block + left + right) stays close to the block, large enough to keep matmuls efficient.
LOCAL_BLOCK = 128
# CPU flash attention in bfloat16/float16 runs ~3x slower when the key count is not a multiple
# of this (profiled: 501 keys 19 ms, padded to 512 8 ms); keys are zero-padded and masked.
KV_ALIGN = 16
# Rows the prepacked oneDNN weights are laid out for (a hint: any row count gives exact results).
PACK_ROWS = 512
# Audio the float32 encoder runs on plain weights before it packs them (`PendingPack`). Measured
# at full size on an AMD EPYC (2 cores): packing its 2.5 GB took 3.8 s and saved 7% of 0.36 s
# per second of audio (0.025 s): it pays back after about 150 s encoded, so it starts near that.
ENCODER_PACK_AFTER_S = 120.0
# The same for the float32 decoder in oneDNN's layout. Measured at full size on an AMD EPYC (2
# cores): a one-shot `synth` of 2 s of audio took 2.2 s longer with the decoder packed at load
# (the load 3.0 s longer, the first decode, which no longer faults its weights in, 1.2 s
# shorter), and packed decodes were 4-5% faster (0.014-0.017 s per second of audio): it pays
# back after about 100 s decoded. The AMX GEMM (`gemm.PackedGemm`) gains far more from its
# packing, so its decoder still packs at load.
DECODER_PACK_AFTER_S = 100.0


@dataclass(frozen=True)
class AttnSpec:
    """Which keys a query sees (flash-attn semantics, spec §3.2): -1 means unbounded."""

    left: int = -1
    right: int = -1
    causal: bool = False

    @property
    def windowed(self) -> bool:
        return self.left >= 0 or (self.right >= 0 and not self.causal)


def layer_norm_fp32(norm: nn.LayerNorm, x: Tensor) -> Tensor:
    """LayerNorm computed in float32 and cast back (house style: norms in float32).

    Half-precision input whose weights share its dtype goes straight to the native kernel: on CPU
    and CUDA it computes in float32 and rounds once, like the explicit casts, but without two
    full-size copies (profiled: ~5% of a bfloat16 decode on CPU).
    """
    if x.dtype != torch.float32 and norm.weight is not None and norm.weight.dtype == x.dtype:
        return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    w = norm.weight.float() if norm.weight is not None else None
    b = norm.bias.float() if norm.bias is not None else None
    return F.layer_norm(x.float(), norm.normalized_shape, w, b, norm.eps).to(x.dtype)


def valid_mask(lengths: Tensor, size: int) -> Tensor:
    """[B, size] bool: True on the first lengths[b] positions."""
    return torch.arange(size, device=lengths.device)[None, :] < lengths[:, None]


SUM_CHUNK = 4096  # values one partial sum of `_item_sums` adds up


def _item_sums(x: Tensor) -> Tensor:
    """[B, C, L] -> [B, 1, 1] sums in an order the thread count cannot change: PyTorch splits
    a reduction to a single value across threads (each adds a share, then the shares add), so
    each step here leaves several values per item (split by outputs), chunk by chunk."""
    sums = x.sum(dim=1)  # [B, L]
    while sums.shape[1] > SUM_CHUNK:
        sums = F.pad(sums, (0, -sums.shape[1] % SUM_CHUNK)).view(sums.shape[0], -1, SUM_CHUNK)
        sums = sums.sum(dim=-1)  # [B, ceil(L / SUM_CHUNK)]
    return sums.sum(dim=1).view(-1, 1, 1)


def group_norm_fp32(norm: nn.GroupNorm, x: Tensor, lengths: Tensor | None = None) -> Tensor:
    """GroupNorm(1, C) over [B, C, L] in float32; with lengths, statistics skip the padding."""
    if lengths is None:
        w, b = norm.weight.float(), norm.bias.float()
        return F.group_norm(x.float(), norm.num_groups, w, b, norm.eps).to(x.dtype)
    if norm.num_groups != 1:
        raise ValueError("masked group norm supports num_groups=1 only")
    xf = x.float()
    mask = valid_mask(lengths, x.shape[-1])[:, None, :].to(xf.dtype)  # [B, 1, L]
    count = (lengths.to(xf.dtype) * x.shape[1]).view(-1, 1, 1)
    mean = _item_sums(xf * mask) / count
    var = _item_sums(((xf - mean) * mask) ** 2) / count
    y = (xf - mean) * torch.rsqrt(var + norm.eps)
    y = y * norm.weight.float()[None, :, None] + norm.bias.float()[None, :, None]
    return (y * mask).to(x.dtype)


class Rotary(nn.Module):
    """NeoX RoPE tables, built on CPU in float32 and cached per device (no state-dict entries).

    The sine table carries rotate-half's sign (first half negated), so `apply_rotary` needs one
    copy and one fused multiply-add instead of cat, neg, two multiplies and an add.

    Tables only grow, and every table ever handed out stays referenced, so a CUDA graph that
    captured a slice of one never reads freed memory.
    """

    def __init__(self, head_dim: int, theta: float, initial: int = 4096):
        super().__init__()
        self.head_dim, self.theta, self.initial = head_dim, float(theta), initial
        self._tables: dict[tuple, tuple[Tensor, Tensor]] = {}
        self._retired: list[tuple[Tensor, Tensor]] = []
        self._lock = threading.Lock()

    def _build(self, size: int, start: int = 0, dtype=torch.float32) -> tuple[Tensor, Tensor]:
        # On the CPU whatever the default device (both factories say so: no device context,
        # whose hook every call would pass through on each stream push)
        cpu = torch.device("cpu")
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32,
                                device=cpu) / self.head_dim
        inv_freq = (1.0 / (self.theta**exponent)).to(dtype)
        freqs = torch.outer(torch.arange(start, start + size, dtype=dtype, device=cpu), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [size, D]
        sin = emb.sin()
        sin[:, : self.head_dim // 2].neg_()
        return emb.cos().float(), sin.float()

    def at(self, start: int, size: int, device: torch.device,
           dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, signed sin [size, D] for positions start..start+size-1, angles in float64.

        For streams: nothing is cached, and the rounding does not grow with the position.
        """
        cos, sin = self._build(size, start, torch.float64)
        return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)

    def tables(self, size: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, signed sin [size, D] for positions 0..size-1 on `device` in `dtype`."""
        key = (str(device), dtype)
        with self._lock:
            cached = self._tables.get(key)
            if cached is None or cached[0].shape[0] < size:
                if cached is not None:
                    self._retired.append(cached)
                n = max(size, self.initial, 2 * cached[0].shape[0] if cached else 0)
                cos, sin = self._build(n)
                cached = (cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype))
                self._tables[key] = cached
        return cached[0][:size], cached[1][:size]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, L, D] rotated by position: x*cos + rotate_half(x)*sin (sin pre-signed).

    Any layout works whose last dim is D and whose tables broadcast (e.g. [B, L, 2, H, D]
    with tables [L, 1, 1, D]).
    """
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return torch.addcmul(x * cos, swapped, sin)


def band(spec: AttnSpec, size: int) -> tuple[int, int]:
    """The (left, right) key span of a windowed spec over `size` positions (-1 -> unbounded)."""
    left = spec.left if spec.left >= 0 else size
    right = 0 if spec.causal else (spec.right if spec.right >= 0 else size)
    return left, right


def local_attention(q: Tensor, k: Tensor, v: Tensor, left: int, right: int,
                    mask: Tensor) -> Tensor:
    """Exact banded attention: query i sees keys [i-left, i+right] that are valid.

    Blockwise: each block of LOCAL_BLOCK queries attends to its own key span of
    LOCAL_BLOCK + left + right keys, so the cost is linear in L and no [L, L] mask exists.
    q, k, v [B, H, L, D], mask from `local_mask` -> [B, H, L, D].
    """
    b, h, size, d = q.shape
    block = min(LOCAL_BLOCK, size)
    nb = -(-size // block)
    span = block + left + right
    pad_q = nb * block - size
    q = F.pad(q, (0, 0, 0, pad_q)).view(b, h, nb, block, d)
    k = F.pad(k, (0, 0, left, pad_q + right)).unfold(2, span, block)  # [B, H, nb, D, span]
    v = F.pad(v, (0, 0, left, pad_q + right)).unfold(2, span, block)
    q = q.transpose(1, 2).reshape(b * nb, h, block, d)
    k = k.permute(0, 2, 1, 4, 3).reshape(b * nb, h, span, d)
    v = v.permute(0, 2, 1, 4, 3).reshape(b * nb, h, span, d)
    out = sdpa(q, k, v, mask)
    out = out.view(b, nb, h, block, d).transpose(1, 2).reshape(b, h, nb * block, d)
    return out[:, :, :size]


def local_mask(b: int, size: int, left: int, right: int, lengths: Tensor | None,
               device: torch.device, span: int | None = None) -> Tensor:
    """[B*nb, 1, block, span] bool mask of the blockwise band, padded keys hidden.

    `span` defaults to block + left + right; a longer span adds keys outside the band (hidden).
    Built once per stack (not per layer). A query always sees its own key, so rows of padding
    never become all -inf (no NaN).
    """
    block = min(LOCAL_BLOCK, size)
    nb = -(-size // block)
    span = span or block + left + right
    i = torch.arange(block, device=device)[:, None]
    j = torch.arange(span, device=device)[None, :]
    band_mask = (j >= i) & (j <= i + left + right)  # [block, span]
    key_pos = torch.arange(nb, device=device)[:, None, None] * block - left + j  # [nb, 1, span]
    limit = lengths.view(-1, 1, 1, 1) if lengths is not None else torch.full(
        (1, 1, 1, 1), size, device=device)
    valid = (key_pos >= 0) & (key_pos < limit)  # [B|1, nb, 1, span]
    mask = band_mask & (valid | (j == i + left))
    return mask.expand(b, nb, block, span).reshape(b * nb, 1, block, -1)


@dataclass(frozen=True)
class LocalPlan:
    """Banded attention over a stack whose sequence is padded once (`run_layers`).

    Rows: `left` padding, the `size` frames, then padding up to (blocks-1)*block + span, so that
    every query block's keys are one strided window of the keys (no per-layer pad or copy) and
    span is a multiple of KV_ALIGN where `sdpa` wants it. Padding rows are computed like frames
    but never seen (masked keys) and dropped at the end.
    """

    left: int
    block: int
    blocks: int
    span: int
    mask: Tensor
    size: int  # the frames
    keys: Keys  # the same band in closed form, over the frames alone (the fused kernel's)

    @staticmethod
    def build(spec: AttnSpec, x: Tensor, lengths: Tensor | None) -> LocalPlan:
        size = x.shape[1]
        left, right = band(spec, size)
        block = min(LOCAL_BLOCK, size)
        span = block + left + right
        span += -span % KV_ALIGN if _aligns_keys(x) else 0
        blocks = -(-size // block)
        mask = local_mask(x.shape[0], size, left, right, lengths, x.device, span)
        return LocalPlan(left, block, blocks, span, mask, size,
                         Keys(lengths=lengths, left=left, right=right))

    @property
    def rows(self) -> int:
        return (self.blocks - 1) * self.block + self.span

    def pad(self, x: Tensor) -> Tensor:
        """[B, size, ...] -> [B, rows, ...] with zero padding rows."""
        return F.pad(x, (0, 0) * (x.dim() - 2) + (self.left, self.rows - self.left - x.shape[1]))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, fused: bool = False) -> Tensor:
        """q, k, v [B, H, rows, D] -> attention output [B, rows, H, D] (zero on padding rows
        outside the query blocks; with `fused`, where the kernel takes it, zero on every
        padding row: no query sees them)."""
        b, h, rows, d = q.shape
        frames = slice(self.left, self.left + self.size)
        parts = q[:, :, frames], k[:, :, frames], v[:, :, frames]
        if fused and attention.runs(*parts):
            full = q.new_zeros(b, rows, h, d)
            full[:, frames] = attention.attend(*parts, self.keys).transpose(1, 2)
            return full
        n = self.blocks * self.block
        q = q[:, :, self.left:self.left + n].unflatten(2, (self.blocks, self.block))
        q = q.transpose(1, 2).reshape(b * self.blocks, h, self.block, d)
        k, v = (t.unfold(2, self.span, self.block).permute(0, 2, 1, 4, 3)  # [B, nb, H, span, D]
                .reshape(b * self.blocks, h, self.span, d) for t in (k, v))
        out = sdpa(q, k, v, self.mask)  # [B*nb, H, block, D]
        full = out.new_empty(b, rows, h, d)
        full[:, :self.left].zero_()
        full[:, self.left + n:].zero_()
        full[:, self.left:self.left + n] = out.transpose(1, 2).reshape(b, n, h, d)
        return full


def attention_mask(spec: AttnSpec, b: int, size: int, lengths: Tensor | None,
                   device: torch.device) -> Keys:
    """The `Keys` a stack's layers share: the local band (with its blockwise mask for
    `local_attention`), causal or padded-key attention (no mask at all for PyTorch's where
    none is needed)."""
    if spec.windowed:
        left, right = band(spec, size)
        return Keys(local_mask(b, size, left, right, lengths, device), lengths=lengths,
                    left=left, right=right)
    if spec.causal:
        # Keys after a valid causal query are never seen, so right padding needs no mask.
        return Keys(causal=True, right=0)
    if lengths is None:
        return Keys()
    return Keys(valid_mask(lengths, size)[:, None, None, :], lengths=lengths)  # [B, 1, 1, L]


def _aligns_keys(x: Tensor) -> bool:
    """Whether attention over x pads its keys to KV_ALIGN (CPU, half precision)."""
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | Keys | None = None,
         causal: bool = False, fused: bool = False) -> Tensor:
    """Scaled dot-product attention, q [B, H, Lq, D], k/v [B, H, Lk, D], mask [.., Lq|1, Lk].

    `causal` is top-left aligned (query i sees keys j <= i). A `Keys` mask says which keys in
    closed form (and brings its own mask and causal flag); with `fused` (the layer's
    `Attention.fused`, set by `prepack`) it goes through the fused CPU kernel where that takes
    it (`attention.runs`). On CPU in half precision PyTorch's keys are padded to a multiple of
    KV_ALIGN; padded keys are masked (a causal query never sees them).
    """
    if isinstance(mask, Keys):
        if fused and attention.runs(q, k, v):
            return attention.attend(q, k, v, mask)
        mask, causal = mask.mask, mask.causal
    size, pad = k.shape[2], -k.shape[2] % KV_ALIGN
    if q.shape[2] == 1 and not causal and q.dtype == torch.float32 and q.device.type == "cpu":
        return attend_one(q, k, v, mask)  # PyTorch's splits one query's keys across threads
    if pad and _aligns_keys(q):
        k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        if mask is not None:
            mask = F.pad(mask, (0, pad), value=False)
        elif not causal:
            mask = (torch.arange(size + pad, device=q.device) < size)[None, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None, gelu: bool = False,
                  residual: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias, then GELU(erf) or `+ residual`, in one oneDNN call (CPU).

    The epilogue runs on the float32 accumulator before the output is written, so it saves a
    pass over the output and rounds once. `weight` is plain or from `PackedLinear`.
    """
    if residual is not None:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")
    if gelu:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "gelu", [], "none")
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _fusable(x: Tensor, weight, residual: Tensor | None) -> bool:
    return x.device.type == "cpu" and isinstance(weight, Tensor) and x.dtype == weight.dtype \
        and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and onednn_bf16())) \
        and x.is_contiguous() and (
            residual is None or (residual.is_contiguous() and residual.dtype == x.dtype)) \
        and torch.backends.mkldnn.is_available() and not weight.requires_grad


def onednn_bf16() -> bool:
    """Whether oneDNN runs bfloat16 linears on this CPU (`gemm.onednn_packs`); where it does not,
    PyTorch's own bfloat16 kernels run."""
    return not gemm.onednn_packs(torch.bfloat16)


class PackedLinear:
    """CPU linear weights (float32 or bfloat16; q/k/v as one product) reordered once into
    oneDNN's blocked layout, REPLACING the modules' weights: meta-device placeholders go in
    their place and mapped file pages are given back, so memory stays that of the weights.

    Plain weights make oneDNN reorder them inside every call: on AMX bfloat16 that cost about
    a quarter of each [500, 1280] x [1280, 5120] product (profiled, 1 thread: 10.8 -> 7.7 ms);
    in float32 on an AMD EPYC 4-7% of a decode and encode, and up to 2.6x for a product of a
    few rows. The products are the plain path's (the same bytes from two rows up). A weight
    replaced later (a new Parameter in the module) is detected and used plain; `weights` gives
    the weights back exactly.
    """

    def __init__(self, modules: list[nn.Linear]):
        self.modules = modules
        weights = [m.weight.detach() for m in modules]
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        self.dtype = weight.dtype
        self.bias = gemm.joined_bias(modules)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        del weight
        self.placeholders = gemm.replace_weights(modules, weights)
        del weights

    def current(self, weights: list, x: Tensor, residual: Tensor | None = None) -> bool:
        """Whether the modules still hold the placeholders and x (and residual) are of the
        packed dtype on the CPU."""
        return gemm.holds(self.placeholders, weights, x, residual, self.dtype)

    def __call__(self, x: Tensor, gelu: bool = False, residual: Tensor | None = None) -> Tensor:
        # the plain weights are gone: every call is served, laid out as oneDNN wants it
        return onednn_linear(x.contiguous(), self.weight, self.bias, gelu,
                             None if residual is None else residual.contiguous())

    @property
    def packed(self) -> Tensor:
        """The reordered weight (what holds the memory)."""
        return self.weight

    def weights(self) -> list[Tensor]:
        """The modules' weights, reordered back (the same values)."""
        weight = self.weight.to_dense()
        return [w.contiguous() for w in weight.split([m.weight.shape[0] for m in self.modules])]

    def unpack(self) -> None:
        """Give the modules plain weights again (`weights`)."""
        for m, w in zip(self.modules, self.weights(), strict=True):
            m.weight = nn.Parameter(w, requires_grad=False)


def linear(proj: nn.Module, x: Tensor, gelu: bool = False,
           residual: Tensor | None = None) -> Tensor:
    """proj(x), then GELU or `+ residual`: fused on CPU (packed weights where prepacked)."""
    weight = getattr(proj, "weight", None)
    packed = getattr(proj, "packed", None)
    if packed is not None and packed.current([weight], x, residual):
        return packed(x, gelu, residual)
    if isinstance(weight, Tensor) and weight.is_meta and x.device.type != "meta":
        raise RuntimeError(f"a packed {tuple(weight.shape)} linear cannot take a {x.dtype} "
                           f"input on {x.device}: its weights live in the packed form only")
    fusable = _fusable(x, weight, residual)
    if fusable and (gelu or residual is not None):
        return onednn_linear(x, weight, proj.bias, gelu, residual)
    y = product(x, weight, proj.bias) if isinstance(weight, Tensor) else proj(x)
    if gelu:
        y = F.gelu(y)
    if residual is not None:
        y += residual  # y is the projection's fresh output
    return y


class Attention(nn.Module):
    """Multi-head self-attention with k_proj lacking a bias (spec §3.2)."""

    fused = False  # attention through the fused CPU kernel (`prepack` sets it per layer)

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=True)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=True)
        self.out_proj = nn.Linear(dim, dim, bias=True)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, L, dim] -> q, k, v [B, H, L, D] before RoPE."""
        shape = (x.shape[0], x.shape[1], self.heads, self.head_dim)
        projections = (self.q_proj, self.k_proj, self.v_proj)
        packed = getattr(self, "packed_qkv", None)
        if packed is not None and packed.current([getattr(p, "weight", None)
                                                  for p in projections], x):
            qkv = packed(x).view(x.shape[0], x.shape[1], 3, self.heads, self.head_dim)
            return tuple(qkv[:, :, i].transpose(1, 2) for i in range(3))
        return tuple(linear(proj, x).view(shape).transpose(1, 2) for proj in projections)

    def merge(self, out: Tensor, residual: Tensor | None = None) -> Tensor:
        """Attention output [B, H, L, D] -> out_proj [B, L, dim] (+ residual)."""
        b, _, size, _ = out.shape
        flat = out.transpose(1, 2).reshape(b, size, self.heads * self.head_dim)
        return linear(self.out_proj, flat, residual=residual)

    def project_rotated(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, L, dim] -> q, k (RoPE applied), v [B, H, L, D].

        Packed, q and k come out of one product side by side and rotate in one pass.
        """
        packed = getattr(self, "packed_qkv", None)
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if packed is None or not packed.current([getattr(p, "weight", None)
                                                 for p in projections], x):
            q, k, v = self.project(x)
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v
        qkv = packed(x).view(x.shape[0], x.shape[1], 3, self.heads, self.head_dim)
        size, dim = cos.shape
        qk = apply_rotary(qkv[:, :, :2], cos.view(size, 1, 1, dim), sin.view(size, 1, 1, dim))
        return qk[:, :, 0].transpose(1, 2), qk[:, :, 1].transpose(1, 2), \
            qkv[:, :, 2].transpose(1, 2)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], spec: AttnSpec,
                mask: Tensor | Keys | LocalPlan | None = None,
                residual: Tensor | None = None) -> Tensor:
        """x [B, L, dim] -> out_proj [B, L, dim] (+ residual); a `LocalPlan` as mask means x
        holds the plan's padded rows."""
        q, k, v = self.project_rotated(x, *rope)
        if isinstance(mask, LocalPlan):
            return linear(self.out_proj, mask.attend(q, k, v, self.fused).flatten(2),
                          residual=residual)
        if spec.windowed:
            if isinstance(mask, Keys) and self.fused and attention.runs(q, k, v):
                out = attention.attend(q, k, v, mask)
            else:
                out = local_attention(q, k, v, *band(spec, x.shape[1]),
                                      mask.mask if isinstance(mask, Keys) else mask)
        else:
            out = sdpa(q, k, v, mask, causal=spec.causal, fused=self.fused)
        return self.merge(out, residual)


def clamp_half_(x: Tensor) -> Tensor:
    """Spec §3.2: half precision clamps overflow to +-(finfo.max - 1000), in place.

    The clamp is a no-op on finite values, so running it unconditionally avoids a host sync.
    """
    if x.dtype in (torch.float16, torch.bfloat16):
        limit = torch.finfo(x.dtype).max - 1000
        x.clamp_(min=-limit, max=limit)
    return x


class TransformerLayer(nn.Module):
    """Pre-LN transformer layer with official tensor names (`self_attn`, `fc1`, ...)."""

    def __init__(self, dim: int, heads: int, ffn_dim: int):
        super().__init__()
        self.self_attn = Attention(dim, heads)
        self.self_attn_layer_norm = nn.LayerNorm(dim, eps=1e-5)
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, dim)
        self.final_layer_norm = nn.LayerNorm(dim, eps=1e-5)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], spec: AttnSpec,
                mask: Tensor | Keys | LocalPlan | None = None) -> Tensor:
        """x [B, L, dim] -> [B, L, dim] (a new tensor; x is left untouched)."""
        h = self.self_attn(layer_norm_fp32(self.self_attn_layer_norm, x), rope, spec, mask,
                           residual=x)
        return self.feed_forward(h)

    def feed_forward(self, x: Tensor) -> Tensor:
        """The FFN half with its residual: x [B, L, dim] -> [B, L, dim] (a new tensor)."""
        hidden = linear(self.fc1, layer_norm_fp32(self.final_layer_norm, x), gelu=True)
        return clamp_half_(linear(self.fc2, hidden, residual=x))

    def prepack(self, pack) -> None:
        """Pack q/k/v (one product), out_proj, fc1 and fc2 with `pack(list of nn.Linear)`
        (`PackedLinear` or `gemm.PackedGemm`)."""
        attn = self.self_attn
        attn.packed_qkv = pack([attn.q_proj, attn.k_proj, attn.v_proj])
        for proj in (attn.out_proj, self.fc1, self.fc2):
            proj.packed = pack([proj])


def _run_local(layers: nn.ModuleList, rotary: Rotary, x: Tensor, spec: AttnSpec,
               lengths: Tensor | None, keep: int | None) -> tuple[Tensor, Tensor | None]:
    """`run_layers` for a windowed spec, on the once-padded rows of a `LocalPlan`."""
    plan = LocalPlan.build(spec, x, lengths)
    size, start = x.shape[1], plan.left
    cos, sin = rotary.tables(size, x.device, x.dtype)
    rope = (plan.pad(cos[None])[0], plan.pad(sin[None])[0])  # padding rows: zero tables
    x = plan.pad(x)
    kept = None
    for index, layer in enumerate(layers):
        x = layer(x, rope, spec, plan)
        if index == keep:
            kept = x[:, start:start + size]
    return x[:, start:start + size], kept


def prepack(model: nn.Module, packing: gemm.Packing | None = None,
            codec_kernel: str = "auto") -> None:
    """Prepack the linears of every CPU `TransformerLayer` of `model`, each packed form
    replacing the weights it packs: bfloat16 ones in oneDNN's layout (`PackedLinear`, where
    oneDNN runs bfloat16), float32 ones as `packing` says (default: `gemm.choose` in mode
    `codec_kernel`): through the bf16x3 AMX GEMM (`gemm.PackedGemm`) or in oneDNN's layout
    (`PackedLinear`); the encoder's and the decoder's stacks when `pack_schedule` says (the
    encoder's only where `packing.encoder`). Their attention goes
    through the fused kernel where `attention.choose` in mode `codec_kernel` picks it for their
    dtype (that choice is kept as `model.attention_choice`)."""
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer) and
              isinstance(m.fc1, nn.Linear) and m.fc1.weight.device.type == "cpu"]
    dtypes = {m.fc1.weight.dtype for m in layers}
    chosen = {d: attention.choose(d, codec_kernel) for d in dtypes}
    for m in layers:
        m.self_attn.fused = chosen[m.fc1.weight.dtype].active
    if len(chosen) == 1:  # what a run records (the sidecar, the -v log)
        model.attention_choice = next(iter(chosen.values()))
    if torch.bfloat16 in dtypes and onednn_bf16():
        _pack_layers([m for m in layers if m.fc1.weight.dtype == torch.bfloat16], PackedLinear)
    if torch.float32 not in dtypes:
        return
    if packing is None:
        packing = gemm.choose(mode=codec_kernel)
    if not packing.active:
        return
    if packing.engine == "bf16x3":
        lib = gemm.library()
        pack = lambda modules: gemm.PackedGemm(lib, modules)  # noqa: E731
    else:
        pack = PackedLinear
    floats = [m for m in layers if m.fc1.weight.dtype == torch.float32]
    later = set()
    for part, after_s in pack_schedule(packing).items():
        stack = getattr(model, part, None)  # the encoder or decoder module (a tokenizer)
        if stack is None or after_s == 0:  # 0: at load, with the rest
            continue
        own = {id(m) for m in stack.layers}  # the vocoder's, inside the decoder, pack now
        later |= own
        if after_s is not None:
            stack.pending_pack = PendingPack([m for m in floats if id(m) in own], pack, after_s)
    _pack_layers([m for m in floats if id(m) not in later], pack)


def pack_schedule(packing: gemm.Packing) -> dict[str, float | None]:
    """When `prepack` packs the float32 layers of the encoder's and the decoder's stacks under
    `packing`: 0 at load, else once the stack has run on that many seconds of audio
    (`PendingPack`), None never. The encoder is read only to encode a voice prompt, and packed
    at all only where `packing.encoder`; the decoder in oneDNN's layout after
    `DECODER_PACK_AFTER_S`, for the AMX GEMM at load. The vocoder's layers, small, always pack
    at load."""
    return {"encoder": ENCODER_PACK_AFTER_S if packing.encoder else None,
            "decoder": DECODER_PACK_AFTER_S if packing.engine == "onednn" else 0.0}


def schedule_words(packing: gemm.Packing) -> str:
    """`pack_schedule` in words (the -v log): "encoder plain, decoder after 100 s of audio"."""
    def when(after_s: float | None) -> str:
        if after_s is None:
            return "plain"
        return "at load" if after_s == 0 else f"after {after_s:g} s of audio"

    return ", ".join(f"{part} {when(s)}" for part, s in pack_schedule(packing).items())


def _pack_layers(layers: list[TransformerLayer], pack) -> None:
    for m in layers:
        m.prepack(pack)
        pages.trim()  # this layer's temporaries, before the next one's allocations


class PendingPack:
    """Float32 layers packed once their module has run on `after_s` seconds of audio (the
    encoder's `ENCODER_PACK_AFTER_S`, the decoder's `DECODER_PACK_AFTER_S`): packing is paid
    once, up front, and saves a few percent of every later call, so it is worth it only to a
    process that will run them a lot. Like renting skis until the rent paid equals the price:
    a run that encodes one voice prompt or speaks one sentence never packs (nor holds the
    packed copy); an `encode` of many files or a long `synth` packs after a while and runs
    faster from then on (a server packs the decoder at start-up, `pack_pending`, so that no
    stream stalls for it). Until the layers are packed, calls run one at a time (`use`), so
    none runs them while they are being swapped."""

    def __init__(self, layers: list[TransformerLayer], pack, after_s: float):
        self.layers, self.pack, self.after_s = layers, pack, after_s
        self.seen_s = 0.0
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def use(self, seconds: float):
        """Around a call on `seconds` of audio: pack first if the calls before it reached
        `after_s`; hold the lock for the call while the layers are not packed yet."""
        if not self.layers:  # packed: nothing to wait for
            yield
            return
        with self.lock:
            if self.layers and self.seen_s >= self.after_s:
                self.now()
            self.seen_s += seconds
            yield

    def now(self) -> None:
        """Pack the layers now (once; the caller holds the lock or is alone)."""
        if self.layers:
            _pack_layers(self.layers, self.pack)
        self.layers = []


def pack_pending(module: nn.Module) -> bool:
    """Pack now what `prepack` left for later in `module` (its `PendingPack`), for a process
    that will surely run it a lot, before its first call. -> whether anything was left."""
    pending = getattr(module, "pending_pack", None)
    if pending is None or not pending.layers:
        return False
    with pending.lock:
        pending.now()
    return True


def pending_use(module: nn.Module, seconds: float):
    """The context to run `module` in on `seconds` of audio: its `PendingPack.use` where
    `prepack` left packing for later, else nothing."""
    pending = getattr(module, "pending_pack", None)
    return contextlib.nullcontext() if pending is None else pending.use(seconds)


def _packed_gemms(model: nn.Module):
    """(module, attribute name, packed product) of every linear of `model` packed in place of
    its weights (`gemm.PackedGemm`, `PackedLinear`)."""
    for module in model.modules():
        for name in ("packed", "packed_qkv"):
            packed = getattr(module, name, None)
            if isinstance(packed, gemm.PackedGemm | PackedLinear):
                yield module, name, packed


def unpack(model: nn.Module) -> None:
    """Undo `prepack`'s packing: plain weights again (`unpack` of each)."""
    for module, name, packed in list(_packed_gemms(model)):
        packed.unpack()
        delattr(module, name)
    for module in model.modules():  # and none packed on a first use later
        if hasattr(module, "pending_pack"):
            del module.pending_pack


def weight_tensors(model: nn.Module) -> list[Tensor]:
    """The tensors that hold `model`'s weights in memory: its parameters and buffers (less the
    packed weights' meta placeholders) and the packed weights and biases (oneDNN's
    reordered ones are opaque tensors: `is_mkldnn`, no storage to read)."""
    held = [t for t in model.state_dict().values() if not t.is_meta]
    for _, _, packed in _packed_gemms(model):
        held += [packed.packed] + ([] if packed.bias is None else [packed.bias])
    return held


def plain_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """`model.state_dict()` with plain weights where they are held packed; the model itself is
    left as it is."""
    state = model.state_dict()
    names = {id(m): n for n, m in model.named_modules()}
    for _, _, packed in _packed_gemms(model):
        for m, w in zip(packed.modules, packed.weights(), strict=True):
            state[f"{names[id(m)]}.weight"] = w
    return state


def run_layers(
    layers: nn.ModuleList, rotary: Rotary, x: Tensor, spec: AttnSpec,
    lengths: Tensor | None = None, keep: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Run a stack with per-sequence positions 0..L-1; also return the output of layer `keep`.

    Where `sdpa` would pad the keys of every layer to KV_ALIGN, the sequence is padded once
    instead: the extra rows are masked keys (or come after every causal query), so valid rows
    are exactly what they are unpadded, and they are dropped at the end.
    """
    size = x.shape[1]
    if spec.windowed and size:
        return _run_local(layers, rotary, x, spec, lengths, keep)
    pad = -size % KV_ALIGN if _aligns_keys(x) else 0
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
        if lengths is None and not spec.causal:
            lengths = torch.full((x.shape[0],), size, device=x.device)
    rope = rotary.tables(size + pad, x.device, x.dtype)
    mask = attention_mask(spec, x.shape[0], size + pad, lengths, x.device)
    kept = None
    for index, layer in enumerate(layers):
        x = layer(x, rope, spec, mask)
        if index == keep:
            kept = x[:, :size]
    return x[:, :size], kept
