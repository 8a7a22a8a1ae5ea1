"""CPU products and attention whose sums do not depend on the thread count.

The same seed gives the same audio on any `--lm-threads`/`--tokenizer-threads` only where
every sum is taken in an order the thread split cannot change. Measured on this torch build
(MKL + oneDNN) at 1, 2 and 3 threads: MKL's float32 GEMM splits some shapes' sums across
threads (rows 5-11 of a [4096, 4096] product differ, and prefill shapes now and then), and
PyTorch's float32 attention of one query splits its keys; oneDNN's float32 and bfloat16 matmuls,
MKL's GEMV, bfloat16 attention, norms, softmax and reductions to several values split outputs
only. So float32 products of several rows go to oneDNN here, float32 attention of one query
is two small matrix products (each kv head's queries at once), and float32 SiLU is spelled
out. torch is imported lazily.
"""

from __future__ import annotations

import functools


@functools.cache
def onednn() -> bool:
    """Whether this torch has oneDNN's linear op (`torch.ops.mkldnn._linear_pointwise`)."""
    import torch

    try:
        return torch.backends.mkldnn.is_available() and \
            torch.ops.mkldnn._linear_pointwise is not None
    except (AttributeError, RuntimeError):
        return False


def product(x, weight, bias=None):
    """x [..., in] @ weight[out, in].T (+ bias): oneDNN for float32 on the CPU (sums split by
    outputs, never by the thread count), F.linear otherwise."""
    import torch
    import torch.nn.functional as F

    if x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and onednn() \
            and not weight.requires_grad:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def attend_one(q, k, v, mask=None):
    """Attention of one query position: q [B, h, 1, D] over k, v [B, kv, S, D] (kv divides h;
    q head i reads kv head i // (h / kv)), mask [B|1, 1, 1, S] bool or None -> [B, h, 1, D].

    float32 on the CPU: each kv head's queries as one small matrix (sums split by heads, never
    by keys); other dtypes, devices and query lengths: PyTorch's attention.
    """
    import torch
    import torch.nn.functional as F

    if q.dtype != torch.float32 or q.device.type != "cpu" or q.shape[2] != 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              enable_gqa=q.shape[1] != k.shape[1])
    b, heads, _, dim = q.shape
    grouped = q.reshape(b, k.shape[1], heads // k.shape[1], dim)  # [B, kv, h / kv, D]
    scores = torch.matmul(grouped, k.transpose(-1, -2)) * dim**-0.5  # [B, kv, h / kv, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v).reshape(b, heads, 1, dim)


def silu(x):
    """SiLU; float32 on the CPU as x / (1 + e^-x): PyTorch's float32 `silu` rounds its vector
    and scalar loops differently, and where a thread's share ends decides which loop an element
    takes (its `exp`, division and addition agree in both)."""
    import torch
    import torch.nn.functional as F

    if x.dtype == torch.float32 and x.device.type == "cpu":
        return x / (1 + torch.exp(-x))
    return F.silu(x)
