"""Opt-in int8 weight-only LM (mimo_tts/lm/int8.py): the quantizer, the kernel's int8
products against the dequantized matrices, and whole generations through both paths."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from mimo_tts.errors import UsageError
from mimo_tts.lm import cpu_kernel
from mimo_tts.lm.generate import generate
from mimo_tts.lm.int8 import dequantize, quantize_rows
from mimo_tts.lm.load import load_lm

needs_kernel = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def test_rows_round_trip_within_half_a_step():
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(0))
    w[3] = 0.0  # an all-zero row keeps a positive scale
    q = quantize_rows(w)
    assert q.dtype == torch.int8 and q.scale.shape == (40,) and (q.scale > 0).all()
    assert ((dequantize(q, torch.float32) - w).abs() <= q.scale[:, None] / 2 + 1e-7).all()
    assert q.abs().max() == 127


def test_int8_is_opt_in_and_cpu_only(lm, lm_dir):
    assert lm.quant is None and lm.lm_head.weight.dtype == torch.float32
    with pytest.raises(UsageError, match="one of int8"):
        load_lm(lm_dir, quant="int4")
    with pytest.raises(UsageError, match="CPU only"):
        load_lm(lm_dir, device="cuda", quant="int8")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("shape", [(80, 96), (83, 101)])  # 4-row blocks; odd rows and columns
def test_int8_products_equal_the_dequantized_matrix(dtype, rows, shape):
    out, size = shape
    gen = torch.Generator().manual_seed(rows)
    q = quantize_rows(torch.randn(out, size, generator=gen))
    x = torch.randn(rows, size, generator=gen).to(dtype)
    bias = torch.randn(out, generator=gen).to(dtype)
    got = cpu_kernel.Products(cpu_kernel.library())(x, q, bias)
    assert got.dtype == dtype
    want = F.linear(x.float(), dequantize(q, torch.float32), bias.float())
    tol = 1e-4 if dtype == torch.float32 else 2 ** -7 * want.abs().amax().item()
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=0)


@needs_kernel
def test_int8_generation_kernel_equals_eager(lm_dir, special, case_tensors, greedy_options):
    """float32 activations: the kernel's int8 step and the eager (dequantized) step agree;
    both stay close to the unquantized model."""
    model = load_lm(lm_dir, cpu_kernel="on", quant="int8")
    assert model.model.layers[0].self_attn.qkv_weight.dtype == torch.int8
    assert model.local_transformer.layers[0].mlp.down_proj.weight.dtype == torch.int8
    prompt = case_tensors("lm_generate")["gen_tts_en_free_greedy.input_ids"]
    runs = [generate(model, [prompt], greedy_options(max_new_groups=4, keep_logits=True,
                                                     decode_step=mode), special)[0]
            for mode in ("auto", "eager")]
    torch.testing.assert_close(runs[0].step_logits, runs[1].step_logits, atol=1e-4, rtol=0)
    plain = generate(load_lm(lm_dir), [prompt], greedy_options(max_new_groups=1,
                                                               keep_logits=True), special)[0]
    scale = plain.step_logits.abs().amax()
    assert (runs[0].step_logits[0] - plain.step_logits[0]).abs().amax() < 0.05 * scale
