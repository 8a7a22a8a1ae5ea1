"""Opt-in int8 weight-only quantization of the LM's large matrices, for CPU decoding.

Each row of a matrix gets one float32 scale (max |w| / 127) and int8 values; the product is
scale * (q . x) in float, rounded to the model dtype. Quantized: the backbone's fused q/k/v,
o_proj, fused gate/up and down_proj, lm_head, and the same four matrices of the patch
decoder (together about all the bytes a decode step reads); the patch encoder, the channel
heads, embeddings, norms and biases keep the model dtype. An int8 weight is a plain int8
tensor carrying its scales as `.scale`; `model.linear` (eager) dequantizes it, the CPU
kernel (mimo_tts/lm/cpu_kernel.py) multiplies by it directly, reading half the bytes of
bfloat16. Never the default: `load_lm(..., quant="int8")`, `--lm-quant int8`;
scripts/bench_lm.py --drift reports what it costs in accuracy.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

CHUNK = 4096  # rows quantized at a time: bounds the float32 copy (lm_head: 2.5 GB whole)


def quantize_rows(weight: Tensor) -> Tensor:
    """weight [out, in] -> int8 [out, in] with `.scale` float32 [out] (symmetric, per row)."""
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], CHUNK):
        w = weight.detach()[start : start + CHUNK].float()
        s = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q[start : start + CHUNK] = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
        scale[start : start + CHUNK] = s
    q.scale = scale
    return q


def dequantize(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """An int8 weight with `.scale` -> [out, in] in `dtype`."""
    return (weight.float() * weight.scale[:, None]).to(dtype)


def _split(q: Tensor, parts: tuple[nn.Linear, ...]) -> None:
    """Point the checkpoint-named parts at rows of the int8 matrix (the dtype copy is freed)."""
    start = 0
    for part in parts:
        end = start + part.weight.shape[0]
        part.weight = nn.Parameter(q[start:end], requires_grad=False)
        start = end


def matrices(model) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of every matrix `quantize_lm` quantizes, as the blocks read them."""
    out: list[tuple[nn.Module, str]] = []
    for stack in (model.model, model.local_transformer):
        for layer in stack.layers:
            attn, mlp = layer.self_attn, layer.mlp
            out += [(attn, "qkv_weight"), (attn.o_proj, "weight"), (mlp, "gate_up_weight"),
                    (mlp.down_proj, "weight")]
    return out + [(model.lm_head, "weight")]


def quantize_lm(model) -> None:
    """Quantize the model's large matrices to int8 in place, weight-only (see the module
    docstring; which `--lm-quant` values can run where is `lm.config.quant_refusal`'s)."""
    with torch.no_grad():
        for module, name in matrices(model):
            q = quantize_rows(getattr(module, name))
            if isinstance(getattr(module, name), nn.Parameter):
                scale, q = q.scale, nn.Parameter(q, requires_grad=False)
                q.scale = scale  # a new tensor object: its scale set again
            setattr(module, name, q)
        for stack in (model.model, model.local_transformer):
            for layer in stack.layers:
                attn, mlp = layer.self_attn, layer.mlp
                _split(attn.qkv_weight, (attn.q_proj, attn.k_proj, attn.v_proj))
                _split(mlp.gate_up_weight, (mlp.gate_proj, mlp.up_proj))
