"""MiMo-Audio LM: Qwen2 backbone, patch encoder and patch decoder (spec §4.1-4.4, §4.9).

Module attribute names equal the checkpoint tensor names, so loading is a strict
load_state_dict. After loading, `fuse_weights()` concatenates q/k/v, gate/up and the channel
heads into single matrices and turns the checkpoint-named parameters into views of them: one
matrix-vector pass per block instead of two or three, no extra memory; the blocks compute
only through the fused matrices. Every product by a weight goes through a `matmul` function
the caller may pass (`linear` by default; mimo_tts/lm/cpu_kernel.py passes its own).
Shapes: B batch, G groups, L new positions, S cached positions, K codebooks (audio channels),
F = group_size frames per group, H hidden.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mimo_tts.lm.config import MAX_GROUPS, LMConfig, TransformerConfig
from mimo_tts.runtime import pages
from mimo_tts.runtime.fixed_order import attend_one, product, silu


class RMSNorm(nn.Module):
    """Qwen2 RMSNorm, computed in float32 and cast back."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(head_dim: int, theta: float, length: int) -> tuple[Tensor, Tensor]:
    """NeoX RoPE cos/sin [length, head_dim] in float32 on CPU (cat(freqs, freqs))."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE: x [B, heads, L, D], cos/sin broadcastable [*, 1, L, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# Up to this many rows, CPU matmuls go through matrix-vector style kernels (see `linear`).
SMALL_ROWS = 8


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., in] @ weight[out, in].T (+ bias); few-row CPU calls read the weight once, fast.

    A decode step multiplies 1-8 rows by each weight. On CPU, F.linear sends that to a GEMM
    that streams bf16 weights well below the memory bandwidth; `mv`/`mm` with the weight as
    the left operand reach it ("Stage-0" in docs/performance.md, scripts/bench_lm.py).
    An int8 weight (mimo_tts/lm/int8.py) is dequantized to x's dtype first; a packed one
    (3-D, `unpack_rows`) goes to the CPU kernel (mimo_tts/lm/cpu_kernel.py), which reads it.
    """
    if weight.dim() == 3:
        from mimo_tts.lm.cpu_kernel import packed_linear

        return packed_linear(x, weight, bias)
    if weight.dtype == torch.int8:
        from mimo_tts.lm.int8 import dequantize

        weight = dequantize(weight, x.dtype)
    rows = x.numel() // weight.shape[1]
    if x.device.type != "cpu" or rows > SMALL_ROWS or rows == 0:
        return product(x, weight, bias)  # float32 CPU: oneDNN, whose sums ignore the threads
    flat = x.reshape(rows, weight.shape[1])
    if rows == 1:
        out = torch.mv(weight, flat[0]) if bias is None else torch.addmv(bias, weight, flat[0])
    elif bias is None:
        out = torch.mm(weight, flat.T).T  # [rows, out]
    else:
        out = torch.addmm(bias.unsqueeze(1), weight, flat.T).T
    return out.reshape(*x.shape[:-1], weight.shape[0])


# Rows per block of a packed weight (`unpack_rows`).
PACK_ROWS = 16


def unpack_rows(packed: Tensor) -> Tensor:
    """A packed weight [out / 16, in / 2, 32] as a new [out, in] tensor. Packed (by the CPU
    kernel, mimo_tts/lm/cpu_kernel.py, at load), block b holds for each column pair p the
    pairs (w[16b + l, 2p], w[16b + l, 2p + 1]) of its 16 rows l, one after another."""
    blocks, pairs, _ = packed.shape
    return packed.reshape(blocks, pairs, PACK_ROWS, 2).transpose(1, 2).reshape(
        blocks * PACK_ROWS, 2 * pairs)


# Weight rows converted to float32 at a time by `upcast_linear`: bounds the copy (8 MiB of a
# 4096-wide matrix) so it stays in cache while the rows use it.
UPCAST_BLOCK = 512


_SCRATCH = threading.local()


def _upcast_scratch(width: int) -> Tensor:
    """This thread's float32 block [UPCAST_BLOCK, width] for `upcast_linear`, kept between
    calls: a fresh one a block costs page faults, which reclaim page cache when the mapped
    weights fill memory (measured: 9 GFLOP/s instead of 60 in a full-size run).

    Always a normal tensor, made outside inference mode: one made under `torch.inference_mode`
    (a generation) could not be written by a later call outside it (a library user's next
    model), and a normal tensor may be written in both."""
    blocks = getattr(_SCRATCH, "blocks", None)
    if blocks is None:
        blocks = _SCRATCH.blocks = {}
    if width not in blocks:
        with torch.inference_mode(False):
            blocks[width] = torch.empty(UPCAST_BLOCK, width, dtype=torch.float32)
    return blocks[width]


def upcast_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`linear` for many rows of bfloat16 (a prefill) on a CPU whose bfloat16 GEMM is slow (no
    AVX512-BF16 or AMX: PyTorch's reaches ~8 GFLOP/s there, float32 ~70): the weight goes
    to float32 a block of rows at a time and the rows are multiplied in float32, rounded to
    bfloat16 once, as the bfloat16 GEMM rounds its float32 sums. Few rows (decode steps) and
    other dtypes go to `linear`; an int8 weight is dequantized to bfloat16 first, as there."""
    rows = x.numel() // weight.shape[1]
    if (x.device.type != "cpu" or x.dtype != torch.bfloat16 or rows <= SMALL_ROWS
            or weight.dtype not in (torch.bfloat16, torch.int8) or weight.dim() == 3):
        return linear(x, weight, bias)
    flat = x.reshape(rows, weight.shape[1]).float()
    out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
    scale = getattr(weight, "scale", None)
    scratch = _upcast_scratch(weight.shape[1])
    for start in range(0, weight.shape[0], UPCAST_BLOCK):
        part = weight[start:start + UPCAST_BLOCK]
        block = scratch[:part.shape[0]]
        block.copy_(part)  # into the same float32 pages every block
        if weight.dtype == torch.int8:  # as `int8.dequantize`: scaled, rounded to bfloat16
            block.mul_(scale[start:start + UPCAST_BLOCK, None])
            block.copy_(block.to(x.dtype))
        out[:, start:start + UPCAST_BLOCK] = product(flat, block)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


# matmul(x [..., in], weight [out, in], bias [out] | None) -> [..., out]: how a stack multiplies
# by its weights (`linear`, or the CPU kernel's products, mimo_tts/lm/cpu_kernel.py).
Matmul = Callable[[Tensor, Tensor, Tensor | None], Tensor]
# attend(q [B, h, 1, D], k, v [B, kv, S, D], mask [B|1, 1, 1, S] | None) -> [B, h, 1, D]: how a
# stack attends from one query position (`attend_one`, or the CPU kernel's).
Attend = Callable[..., Tensor]
# The keys a step attends to: the first `span` cache slots of every row (under its mask), or
# row i's first span[i] slots (a continuous batch: each row alone, no mask, as its single run).
Span = int | Sequence[int]


class Linear(nn.Linear):
    """nn.Linear (same parameters) computed by `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def fuse_linears(parts: Sequence[nn.Linear], weight: Tensor | None = None,
                 bias: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Stack the parts' weights (and biases) by rows into one tensor; each part's parameters
    become views of it, so checkpoint names and state_dict() stay as they were. `weight` and
    `bias` are the stacks already read by the loader (the parts are still meta then)."""
    has_bias = parts[0].bias is not None
    if weight is None:
        weight = torch.cat([p.weight.detach() for p in parts])
        bias = torch.cat([p.bias.detach() for p in parts]) if has_bias else None
    row_views(parts, "weight", weight)
    if has_bias:
        row_views(parts, "bias", bias)
    return weight, bias


def fuse_parts(owner: nn.Module, parts: Sequence[nn.Linear]) -> None:
    """Concatenate a group the loader left in its mapped parts (`owner.fuse()`), then give
    the parts' file pages back: the mapping would otherwise keep them resident beside the
    concatenated copy."""
    mapped = [part.weight for part in parts]
    owner.fuse()
    for weight in mapped:
        pages.drop(weight)


def row_views(parts: Sequence[nn.Linear], attr: str, stacked: Tensor) -> None:
    """Each part's `attr` ("weight" or "bias") becomes its rows of `stacked`, in order."""
    start = 0
    for part in parts:
        end = start + part.weight.shape[0]
        setattr(part, attr, nn.Parameter(stacked[start:end], requires_grad=False))
        start = end


class KVCache:
    """Keys/values of one stack: [layers, B, H_kv, S, D], S slots allocated so far.

    A prefill allocates what the prompt and the first new groups need; `reserve` grows S (one
    copy, amortised by doubling up to the generation's limit), so a short run never holds a
    cache sized for the longest possible one. Shapes never change between `reserve` calls, so a
    decode step can be captured in a CUDA graph once the cache is reserved in full; a call on
    fewer rows than allocated uses the first rows (the patch decoder's audio subset).
    """

    def __init__(self, cfg: TransformerConfig, batch: int, length: int, *, dtype, device):
        shape = (cfg.layers, batch, cfg.kv_heads, length, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def length(self) -> int:
        return self.k.shape[3]

    def reserve(self, length: int, limit: int | None = None) -> None:
        """Make at least `length` slots (doubling, but never past `limit`); keeps the contents."""
        if length <= self.length:
            return
        target = max(length, 2 * self.length)
        if limit is not None:
            target = max(length, min(target, limit))
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:3], target, old.shape[4])
            new[:, :, :, : old.shape[3]] = old
            setattr(self, name, new)
            del old

    def update(self, layer: int, slot: int | Tensor, span: int, k: Tensor, v: Tensor):
        """Write k/v [n, H_kv, L, D] at slot..slot+L; return the first `span` cached positions.

        `slot` may be a device tensor [n] of one position per row (L = 1): row i writes at
        slot[i] (rows of a continuous batch are at different lengths; a captured step's input).
        """
        n, length = k.shape[0], k.shape[2]
        keys, values = self.k[layer, :n], self.v[layer, :n]
        if isinstance(slot, Tensor):
            rows = torch.arange(n, device=slot.device)
            keys[rows, :, slot] = k[:, :, 0]
            values[rows, :, slot] = v[:, :, 0]
        else:
            keys[:, :, slot : slot + length] = k
            values[:, :, slot : slot + length] = v
        return keys[:, :, :span], values[:, :, :span]


class Attention(nn.Module):
    """GQA self-attention with q/k/v bias and no o_proj bias (Qwen2)."""

    def __init__(self, cfg: TransformerConfig, layer: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.causal, self.layer = cfg.causal, layer
        self.q_proj = Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=True)
        self.k_proj = Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=True)
        self.v_proj = Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=True)
        self.o_proj = Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)
        # [q + k + v, dim] and its bias once fused; not in the checkpoint.
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)

    PARTS = ("q_proj", "k_proj", "v_proj")

    def fuse(self, weight: Tensor | None = None, bias: Tensor | None = None) -> None:
        self.qkv_weight, self.qkv_bias = fuse_linears(
            [getattr(self, name) for name in self.PARTS], weight, bias)

    def fuse_bias(self, bias: Tensor) -> None:
        """Only the biases (the loader's stack): the weights stay in q/k/v until packed."""
        row_views([getattr(self, name) for name in self.PARTS], "bias", bias)
        self.qkv_bias = bias

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None,
                slot: int | Tensor, span: Span, mask: Tensor | None, matmul: Matmul,
                attend: Attend = attend_one) -> Tensor:
        b, length, _ = x.shape
        heads, kv = self.heads, self.kv_heads
        qkv = matmul(x, self.qkv_weight, self.qkv_bias)
        qkv = qkv.view(b, length, heads + 2 * kv, self.head_dim)
        qk = apply_rope(qkv[:, :, : heads + kv].transpose(1, 2), cos, sin)  # [B, h+kv, L, D]
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, :, heads + kv :].transpose(1, 2)
        spans = None if isinstance(span, int) else list(span)
        if cache is not None:
            k, v = cache.update(self.layer, slot, span if spans is None else max(spans), k, v)
        if spans is not None:  # one row at a time over its own keys, as its single run does
            out = torch.cat([attend(q[r:r + 1], k[r:r + 1, :, :n], v[r:r + 1, :, :n])
                             for r, n in enumerate(spans)])
        elif length == 1:
            out = attend(q, k, v, mask)
        else:
            # is_causal aligns top-left: only valid when the queries start at key 0 (prefill).
            causal = self.causal and mask is None and length > 1
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=heads != kv
            )
        return matmul(out.transpose(1, 2).reshape(b, length, -1), self.o_proj.weight, None)


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = Linear(dim, ffn_dim, bias=False)
        self.up_proj = Linear(dim, ffn_dim, bias=False)
        self.down_proj = Linear(ffn_dim, dim, bias=False)
        self.register_buffer("gate_up_weight", None, persistent=False)  # [2 * ffn, dim]

    PARTS = ("gate_proj", "up_proj")

    def fuse(self, weight: Tensor | None = None, bias: Tensor | None = None) -> None:
        self.gate_up_weight, _ = fuse_linears([self.gate_proj, self.up_proj], weight)

    def forward(self, x: Tensor, matmul: Matmul) -> Tensor:
        gate, up = matmul(x, self.gate_up_weight, None).chunk(2, dim=-1)
        return matmul(silu(gate) * up, self.down_proj.weight, None)


class DecoderLayer(nn.Module):
    """Pre-norm Qwen2 block: x + attention(norm(x)), then + MLP(norm(.))."""

    def __init__(self, cfg: TransformerConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.eps)
        self.mlp = MLP(cfg.dim, cfg.ffn_dim)

    def forward(self, x, cos, sin, cache, slot, span, mask, matmul: Matmul,
                attend: Attend = attend_one) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, slot, span, mask,
                               matmul, attend)
        return x + self.mlp(self.post_attention_layernorm(x), matmul)


class Transformer(nn.Module):
    """A Qwen2 stack ending in its `norm`; `embed_tokens` only for the backbone."""

    def __init__(self, cfg: TransformerConfig, rope_length: int, vocab_size: int | None = None):
        super().__init__()
        self.cfg, self.rope_length = cfg, rope_length
        if vocab_size is not None:
            self.embed_tokens = nn.Embedding(vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        # Derived tables: not in the checkpoint; rebuilt on a real device by build_rope().
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def build_rope(self, device, dtype) -> None:
        """Compute the RoPE tables on CPU in float32, then move and cast them (HF casts too)."""
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.rope_theta, self.rope_length)
        self.rope_cos = cos.to(device=device, dtype=dtype)
        self.rope_sin = sin.to(device=device, dtype=dtype)

    def fuse(self) -> None:
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def forward(self, x: Tensor, positions: Tensor, cache: KVCache | None = None,
                slot: int | Tensor = 0, span: Span | None = None,
                mask: Tensor | None = None, matmul: Matmul = linear,
                attend: Attend = attend_one) -> Tensor:
        """x [B, L, dim], positions [B or 1, L] -> normed hidden [B, L, dim].

        A tensor `slot` (one cache position per row, L = 1, on x's device) needs an explicit
        span: one for all rows (with a mask), or one per row (`Span`).
        """
        span = slot + x.shape[1] if span is None else span
        cos = self.rope_cos[positions].unsqueeze(1)  # [B, 1, L, D]
        sin = self.rope_sin[positions].unsqueeze(1)
        for layer in self.layers:
            x = layer(x, cos, sin, cache, slot, span, mask, matmul, attend)
        return self.norm(x)


class ChannelHeads(nn.ModuleList):
    """`local_transformer_lm_heads`: one bias-free head per audio channel. Fused, the heads
    of consecutive channels (those sampled at one patch-decoder step) are one matmul."""

    def __init__(self, dim: int, sizes: Sequence[int]):
        super().__init__(Linear(dim, n, bias=False) for n in sizes)
        self.sizes = tuple(sizes)
        self.offsets = [sum(self.sizes[:c]) for c in range(len(self.sizes) + 1)]
        self.register_buffer("fused", None, persistent=False)  # [sum(sizes), dim]

    def fuse(self, weight: Tensor | None = None, bias: Tensor | None = None) -> None:
        self.fused, _ = fuse_linears(list(self), weight)

    def logits(self, channels: Sequence[int], hidden: Tensor,
               matmul: Matmul = linear) -> list[Tensor]:
        """hidden [n, dim] -> raw float32 logits [n, V_c] for each channel, in order."""
        out: list[Tensor] = []
        for first, last in _runs(channels):
            rows = self.fused[self.offsets[first] : self.offsets[last + 1]]
            out += matmul(hidden, rows, None).float().split(self.sizes[first : last + 1], dim=-1)
        return out


def _runs(channels: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive runs (first, last) of a channel list: [0, 1, 2, 5] -> [(0, 2), (5, 5)]."""
    runs: list[tuple[int, int]] = []
    for c in channels:
        if runs and runs[-1][1] == c - 1:
            runs[-1] = (runs[-1][0], c)
        else:
            runs.append((c, c))
    return runs


class MiMoAudioLM(nn.Module):
    """The whole Stage-0 model; sampling and the generation loop live in generate.py."""

    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Transformer(cfg.backbone, MAX_GROUPS, cfg.vocab_size)
        self.lm_head = Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.speech_embeddings = nn.ModuleList(
            nn.Embedding(n, cfg.input_local_dim) for n in cfg.speech_vocab_sizes
        )
        self.input_local_transformer = Transformer(cfg.patch_encoder, cfg.group_size)
        self.local_transformer = Transformer(cfg.patch_decoder, cfg.local_steps)
        self.local_transformer_lm_heads = ChannelHeads(cfg.local_dim, cfg.speech_vocab_sizes)
        self.speech_group_downcast = Linear(
            cfg.group_size * cfg.input_local_dim, cfg.hidden, bias=False
        )
        self.hidden_states_downcast = Linear(cfg.hidden, cfg.local_dim, bias=False)
        if cfg.input_local_dim != cfg.local_dim:
            self.speech_embeddings_to_local = Linear(
                cfg.input_local_dim, cfg.local_dim, bias=False
            )
        else:
            self.speech_embeddings_to_local = None
        self.register_buffer("empty_ids", torch.empty(0, dtype=torch.long), persistent=False)
        self.local_positions: list[Tensor] = []
        # Mode of the fused CPU kernel ("auto", "on", "off"; set by load_lm): the decode step
        # asks mimo_tts.lm.cpu_kernel.choose(model) whether, and why (not), it runs.
        self.cpu_kernel = "off"
        self.quant: str | None = None  # "int8", "w8a8" or "w4a8" (`load_lm(quant=...)`)
        # Bytes of streamed matrices the CPU kernel packed at load (cpu_kernel.pack_model).
        self.packed_bytes = 0

    def build_buffers(self, device) -> None:
        """(Re)build derived, non-checkpoint tensors on a real device after loading."""
        dtype = self.lm_head.weight.dtype
        for stack in (self.model, self.input_local_transformer, self.local_transformer):
            stack.build_rope(device, dtype)
        self.empty_ids = torch.tensor(self.cfg.speech_empty_ids, dtype=torch.long, device=device)
        # Per-step position index [1, 1] of the patch decoder, made once, reused every group.
        self.local_positions = [
            torch.tensor([[t]], device=device) for t in range(self.cfg.local_steps)
        ]

    def fusion_groups(self) -> dict[tuple[str, ...], tuple[nn.Module, tuple[str, ...] | None]]:
        """Every fused matrix: its parts' weight names -> (owner, its parts' bias names)."""
        groups = {}
        for name, module in self.named_modules():
            if isinstance(module, ChannelHeads):
                parts = [str(c) for c in range(len(module))]
            elif isinstance(module, (Attention, MLP)):
                parts = list(module.PARTS)
            else:
                continue
            biased = getattr(module, parts[0]).bias is not None
            names = [f"{name}.{part}" for part in parts]
            groups[tuple(f"{n}.weight" for n in names)] = (
                module, tuple(f"{n}.bias" for n in names) if biased else None)
        return groups

    def streamed_matrices(self) -> list[tuple[nn.Module, str, tuple[nn.Module, ...]]]:
        """(owner, attribute, the Linear parts that are row views of it) of every matrix a
        decode step streams: the three stacks' fused q/k/v, o_proj, fused gate/up and
        down_proj, lm_head and the downcasts (the channel heads, read by row ranges, stay)."""
        out: list[tuple[nn.Module, str, tuple[nn.Module, ...]]] = []
        for stack in (self.model, self.input_local_transformer, self.local_transformer):
            for layer in stack.layers:
                attn, mlp = layer.self_attn, layer.mlp
                out += [(attn, "qkv_weight", tuple(getattr(attn, n) for n in attn.PARTS)),
                        (attn.o_proj, "weight", ()),
                        (mlp, "gate_up_weight", tuple(getattr(mlp, n) for n in mlp.PARTS)),
                        (mlp.down_proj, "weight", ())]
        extra = (self.lm_head, self.speech_group_downcast, self.hidden_states_downcast,
                 self.speech_embeddings_to_local)
        return out + [(m, "weight", ()) for m in extra if m is not None]

    def fuse_weights(self, stacks: dict[tuple[str, ...], Tensor] | None = None) -> None:
        """Fuse q/k/v, gate/up and the channel heads in place, on the weights' final device.

        The checkpoint-named parameters become views of the fused tensors. `stacks` are the
        fused tensors the loader read (by `fusion_groups` names: no copy, no second resident
        copy); without them the parts are concatenated. A later `.to()` converts both
        (correct, but then no longer shared), so fuse after placing the model.

        A streamed group whose weights `stacks` lacks (`packed_from_parts`) keeps them in its
        parts, fusing only its biases: the CPU kernel packs the parts into one matrix
        (`cpu_kernel.pack_model`), and `fuse_rest` concatenates what it did not pack.
        """
        for weights, (module, biases) in self.fusion_groups().items():
            bias = None if biases is None or stacks is None else stacks[biases]
            if stacks is None:
                module.fuse()
            elif weights in stacks:
                module.fuse(stacks[weights], bias)
            elif bias is not None:
                module.fuse_bias(bias)

    def packed_from_parts(self) -> set[tuple[str, ...]]:
        """The weight groups a step streams (q/k/v, gate/up: `streamed_matrices`) by their
        `fusion_groups` names: where the CPU kernel will pack them, the loader leaves them in
        their mapped parts rather than stacking a copy that packing would copy again."""
        streamed = {id(owner) for owner, _, parts in self.streamed_matrices() if parts}
        return {weights for weights, (module, _) in self.fusion_groups().items()
                if id(module) in streamed}

    def fuse_rest(self) -> None:
        """Concatenate the groups still in their parts (`fuse_weights`): nothing packed them."""
        for owner, name, parts in self.streamed_matrices():
            if parts and getattr(owner, name) is None:
                fuse_parts(owner, parts)

    # -- patch encoder (§4.3) -------------------------------------------------------------
    def encode_patches(self, codes: Tensor, matmul: Matmul = linear) -> Tensor:
        """Audio groups' codes [N, F, K] -> backbone input [N, H]."""
        n, frames, _ = codes.shape
        speech = None
        for c, table in enumerate(self.speech_embeddings):
            ids = codes[..., c]
            # Frames holding a channel's empty id contribute nothing for that channel.
            keep = (ids != self.empty_ids[c]).unsqueeze(-1).to(table.weight.dtype)
            speech = table(ids) * keep if speech is None else speech + table(ids) * keep
        positions = torch.arange(frames, device=codes.device).unsqueeze(0)  # [1, F]
        speech = self.input_local_transformer(speech, positions, matmul=matmul)  # [N, F, E]
        return matmul(speech.reshape(n, frames * speech.shape[-1]),
                      self.speech_group_downcast.weight, None)

    def embed_groups(self, text_ids: Tensor, codes: Tensor, empty_token: int,
                     matmul: Matmul = linear) -> Tensor:
        """Input embedding: text_ids [B, G], codes [B, G, F, K] -> [B, G, H].

        Text groups get their token embedding; `<|empty|>` groups get only the patch-encoded
        speech (the speech part is zero elsewhere, so it is computed for audio groups only).
        """
        is_speech = text_ids == empty_token
        embeds = self.model.embed_tokens(text_ids) * (~is_speech).unsqueeze(-1).to(
            self.lm_head.weight.dtype
        )
        if bool(is_speech.any()):
            embeds[is_speech] = self.encode_patches(codes[is_speech], matmul)
        return embeds

    # -- backbone and heads ---------------------------------------------------------------
    def backbone(self, embeds: Tensor, positions: Tensor, cache: KVCache,
                 slot: int | Tensor, span: Span | None = None,
                 mask: Tensor | None = None, matmul: Matmul = linear,
                 attend: Attend = attend_one) -> Tensor:
        """embeds [B, L, H] at per-row positions [B, L] -> normed hidden [B, L, H]."""
        return self.model(embeds, positions, cache, slot, span, mask, matmul, attend)

    def text_logits(self, hidden: Tensor, matmul: Matmul = linear) -> Tensor:
        """hidden [B, H] -> text logits [B, V] in float32."""
        return matmul(hidden, self.lm_head.weight, None).float()

    # -- patch decoder (§4.4) -------------------------------------------------------------
    def local_step(self, x: Tensor, step: int, cache: KVCache,
                   matmul: Matmul = linear) -> Tensor:
        """One patch-decoder position: x [n, 1, local_dim] -> normed hidden [n, local_dim]."""
        positions = self.local_positions[step]
        return self.local_transformer(x, positions, cache, slot=step, matmul=matmul)[:, 0]

    def channel_logits(self, channel: int, hidden: Tensor) -> Tensor:
        """hidden [n, local_dim] -> raw logits [n, V_c] of one audio channel, float32."""
        return self.local_transformer_lm_heads[channel](hidden).float()

    def embed_codes(self, channels: list[int], codes: list[Tensor]) -> Tensor:
        """Next patch-decoder input: sum of the new codes' embeddings -> [n, 1, local_dim]."""
        total = None
        for c, ids in zip(channels, codes, strict=True):
            emb = self.speech_embeddings[c](ids)
            if self.speech_embeddings_to_local is not None:
                emb = self.speech_embeddings_to_local(emb)
            total = emb if total is None else total + emb
        return total.unsqueeze(1)
