"""Transformer pieces shared by the encoder, decoder and vocoder (spec §3.2).

Each layer is pre-LN: self_attn_layer_norm -> MHA -> residual, final_layer_norm -> fc1 -> GELU(erf)
-> fc2 -> residual. q/v/out projections have a bias, k does not. RoPE is NeoX rotate-half.

Shapes: B batch, L positions (mel/latent frames), H heads, D head dim. Sequences of a batch are
right-padded; `lengths` [B] gives each valid length. Every attention kind below keeps padded keys
invisible to valid queries, so a padded batch gives each sequence exactly what it gets alone.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Query block of the windowed (local) attention: small enough that the masked key span
# (block + left + right) stays close to the block, large enough to keep matmuls efficient.
LOCAL_BLOCK = 128


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
    """LayerNorm computed in float32 and cast back (house style: norms in float32)."""
    w = norm.weight.float() if norm.weight is not None else None
    b = norm.bias.float() if norm.bias is not None else None
    return F.layer_norm(x.float(), norm.normalized_shape, w, b, norm.eps).to(x.dtype)


def valid_mask(lengths: Tensor, size: int) -> Tensor:
    """[B, size] bool: True on the first lengths[b] positions."""
    return torch.arange(size, device=lengths.device)[None, :] < lengths[:, None]


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
    mean = (xf * mask).sum(dim=(1, 2), keepdim=True) / count
    var = (((xf - mean) * mask) ** 2).sum(dim=(1, 2), keepdim=True) / count
    y = (xf - mean) * torch.rsqrt(var + norm.eps)
    y = y * norm.weight.float()[None, :, None] + norm.bias.float()[None, :, None]
    return (y * mask).to(x.dtype)


class Rotary(nn.Module):
    """NeoX RoPE tables, built on CPU in float32 and cached per device (no state-dict entries).

    Tables only grow, and every table ever handed out stays referenced, so a CUDA graph that
    captured a slice of one never reads freed memory.
    """

    def __init__(self, head_dim: int, theta: float, initial: int = 4096):
        super().__init__()
        self.head_dim, self.theta, self.initial = head_dim, float(theta), initial
        self._tables: dict[tuple, tuple[Tensor, Tensor]] = {}
        self._retired: list[tuple[Tensor, Tensor]] = []
        self._lock = threading.Lock()

    def _build(self, size: int) -> tuple[Tensor, Tensor]:
        with torch.device("cpu"):
            exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
            inv_freq = 1.0 / (self.theta**exponent)
            freqs = torch.outer(torch.arange(size, dtype=torch.float32), inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)  # [size, D]
            return emb.cos(), emb.sin()

    def tables(self, size: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [size, D] for positions 0..size-1 on `device` in `dtype`."""
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
    """x [B, H, L, D] rotated by position: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def local_attention(q: Tensor, k: Tensor, v: Tensor, left: int, right: int,
                    lengths: Tensor | None) -> Tensor:
    """Exact banded attention: query i sees keys [i-left, i+right] that are valid.

    Blockwise: each block of LOCAL_BLOCK queries attends to its own key span of
    LOCAL_BLOCK + left + right keys, so the cost is linear in L and no [L, L] mask exists.
    q, k, v [B, H, L, D] -> [B, H, L, D].
    """
    b, h, size, d = q.shape
    block = min(LOCAL_BLOCK, size)
    nb = -(-size // block)
    span = block + left + right
    pad_q = nb * block - size
    q = F.pad(q, (0, 0, 0, pad_q)).view(b, h, nb, block, d)
    k = F.pad(k, (0, 0, left, pad_q + right)).unfold(2, span, block)  # [B, H, nb, D, span]
    v = F.pad(v, (0, 0, left, pad_q + right)).unfold(2, span, block)
    mask = _local_mask(b, nb, block, left, right, size, lengths, q.device)  # [B, nb, block, span]
    q = q.transpose(1, 2).reshape(b * nb, h, block, d)
    k = k.permute(0, 2, 1, 4, 3).reshape(b * nb, h, span, d)
    v = v.permute(0, 2, 1, 4, 3).reshape(b * nb, h, span, d)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.reshape(b * nb, 1, block, span))
    out = out.view(b, nb, h, block, d).transpose(1, 2).reshape(b, h, nb * block, d)
    return out[:, :, :size]


def _local_mask(b: int, nb: int, block: int, left: int, right: int, size: int,
                lengths: Tensor | None, device: torch.device) -> Tensor:
    """[B, nb, block, span] bool mask of the blockwise band, padded keys hidden.

    A query always sees its own key, so rows of padding never become all -inf (no NaN).
    """
    i = torch.arange(block, device=device)[:, None]
    j = torch.arange(block + left + right, device=device)[None, :]
    band = (j >= i) & (j <= i + left + right)  # [block, span]
    key_pos = torch.arange(nb, device=device)[:, None, None] * block - left + j  # [nb, 1, span]
    limit = lengths.view(-1, 1, 1, 1) if lengths is not None else torch.full(
        (1, 1, 1, 1), size, device=device)
    valid = (key_pos >= 0) & (key_pos < limit)  # [B|1, nb, 1, span]
    mask = band & (valid | (j == i + left))
    return mask.expand(b, nb, block, block + left + right)


class Attention(nn.Module):
    """Multi-head self-attention with k_proj lacking a bias (spec §3.2)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=True)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=True)
        self.out_proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], spec: AttnSpec,
                lengths: Tensor | None = None) -> Tensor:
        b, size, dim = x.shape
        shape = (b, size, self.heads, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)  # [B, H, L, D]
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if spec.windowed:
            left = spec.left if spec.left >= 0 else size
            right = 0 if spec.causal else (spec.right if spec.right >= 0 else size)
            out = local_attention(q, k, v, left, right, lengths)
        elif spec.causal:
            # Keys after a valid query are never seen, so right padding needs no mask.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif lengths is not None:
            keys = valid_mask(lengths, size)[:, None, None, :]  # [B, 1, 1, L]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keys)
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, size, dim))


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
                lengths: Tensor | None = None) -> Tensor:
        """x [B, L, dim] -> [B, L, dim]."""
        x = x + self.self_attn(layer_norm_fp32(self.self_attn_layer_norm, x), rope, spec, lengths)
        x = x + self.fc2(F.gelu(self.fc1(layer_norm_fp32(self.final_layer_norm, x))))
        if x.dtype in (torch.float16, torch.bfloat16):
            # Spec §3.2: half precision clamps overflow to +-(finfo.max - 1000); clamp is a no-op
            # on finite values, so doing it unconditionally avoids a host sync.
            limit = torch.finfo(x.dtype).max - 1000
            x = x.clamp(min=-limit, max=limit)
        return x


def run_layers(
    layers: nn.ModuleList, rotary: Rotary, x: Tensor, spec: AttnSpec,
    lengths: Tensor | None = None, keep: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Run a stack with per-sequence positions 0..L-1; also return the output of layer `keep`."""
    rope = rotary.tables(x.shape[1], x.device, x.dtype)
    kept = None
    for index, layer in enumerate(layers):
        x = layer(x, rope, spec, lengths)
        if index == keep:
            kept = x
    return x, kept
