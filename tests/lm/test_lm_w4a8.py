"""The opt-in w4a8 profile (`--lm-quant w4a8`, mimo_tts/lm/cpu_kernel.py `pack_w4a8`): 4-bit
weights in groups of 32 columns with float16 scales, packed in 16-row blocks, times each row's
activations quantized to signed bytes in the kernel. A group's sums are exact integers and
the groups add in one order, so a row's bytes are the same alone or in a batch of any width,
on any thread count and on every instruction-set path (the refusals and a whole model's
generation: test_lm_w8a8.py, for both profiles)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from mimo_tts.lm import cpu_kernel
from mimo_tts.lm.load import load_lm
from mimo_tts.lm.native import NativeEngine

from .conftest import assert_rows_alike_everywhere, on_every_path, operands

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
GROUP = cpu_kernel.W4_GROUP


def _values_and_scales(packed):
    """The packed weight's integer values [out, in] (float64) and group scales [out, in / 32]
    (float64), read from its bytes, not through the kernel."""
    blocks, lines, _ = packed.shape
    byte = packed.view(blocks, lines, 16, 4).to(torch.int64)
    values = torch.stack((byte & 15, byte >> 4), dim=3) - 8  # [block, line, row, half, 4]
    values = values.permute(0, 2, 1, 3, 4).reshape(blocks * 16, lines * 8).double()
    scales = packed.scale.transpose(1, 2).reshape(blocks * 16, -1).double()
    return values, scales


def _integer_reference(x, packed, bias):
    """The w4a8 product as the kernel defines it: each row of x quantized to signed bytes
    (max |x| / 127), each group's sum of bytes by 4-bit values exact, the groups' terms added
    in order in float32 (one rounding each, as the fma), the row scale and bias applied once,
    rounded to bfloat16."""
    values, scales = _values_and_scales(packed)
    out, width = values.shape
    xf = x.float()
    scale = xf.abs().amax(1) / 127
    scale = torch.where(scale > 0, scale, 1.0)  # a row of zeros: any scale, the kernel's is 1
    a = torch.round(xf * (1 / scale)[:, None]).clamp(-127, 127).double()
    sums = torch.einsum("ngk,ogk->nog", a.view(-1, width // GROUP, GROUP),
                        values.view(out, width // GROUP, GROUP))  # exact in float64
    f = torch.zeros(x.shape[0], out, dtype=torch.float32)
    for g in range(width // GROUP):
        f = (sums[:, :, g] * scales[None, :, g] + f.double()).float()
    return (f.double() * scale.double()[:, None] + bias.double()).float().bfloat16()


def _reference_pack(weight):
    """The packing as its definition reads, in PyTorch: lines [out / 16, in / 8, 64], scales
    [out / 16, in / 32, 16] (float16)."""
    rows, cols = weight.shape
    grouped = weight.float().view(rows, cols // GROUP, GROUP)
    scale = (grouped.abs().amax(dim=2) / 7).half()  # float32 division, then nearest even
    wide = scale.float()[:, :, None]
    q = torch.where(wide > 0, torch.round(grouped / wide), 0.0).clamp(-8, 7)
    u = (q + 8).to(torch.uint8).view(rows // 16, 16, cols // 8, 2, 4)
    lines = (u[:, :, :, 0] | (u[:, :, :, 1] << 4)).permute(0, 2, 1, 3)
    return (lines.reshape(rows // 16, cols // 8, 64),
            scale.view(rows // 16, 16, cols // GROUP).transpose(1, 2))


def test_the_kernel_packs_as_the_definition_reads_over_every_magnitude():
    """Group maxima from 1e-12 to 1e5 (float16 scales denormal, normal, near the top, and
    rounding to 0 or infinity): the kernel's lines and scales equal the reference's bytes."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 32 * GROUP, generator=gen)
    exponent = torch.empty(64, 32).uniform_(-14, 5.5, generator=gen)
    weight = (weight.view(64, 32, GROUP) * (10 ** exponent)[:, :, None]).view(64, -1)
    weight[0, :GROUP] = 0.0
    weight = weight.bfloat16()
    lines, scales = _reference_pack(weight)
    assert (scales == 0).any() and scales.isinf().any() and (scales.abs() < 2 ** -14).any()
    packed = cpu_kernel.pack_w4a8(cpu_kernel.library(), weight)
    assert torch.equal(packed.scale.view(torch.int16), scales.contiguous().view(torch.int16))
    assert torch.equal(packed, lines)


def test_packing_keeps_the_4bit_values_and_their_group_scales():
    _, weight, _ = operands()
    packed = cpu_kernel.pack_w4a8(cpu_kernel.library(), weight)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 40, 64)
    assert packed.scale.dtype == torch.float16 and packed.scale.shape == (6, 10, 16)
    assert cpu_kernel.packed_shape(packed) == (96, 320)
    values, scales = _values_and_scales(packed)
    assert values.abs().max() <= 8
    per_group = values.view(96, 10, GROUP).abs().amax(2)
    assert (per_group == 7).all()  # max |w| / 7 (float16): the largest of a group is +-7
    want = (weight.float().view(96, 10, GROUP).abs().amax(2) / 7).half().double()
    assert torch.equal(scales, want)
    dense = cpu_kernel.unpack_w4a8(packed)
    assert torch.equal(dense.double(), values * scales.repeat_interleave(GROUP, dim=1))
    half_step = scales.repeat_interleave(GROUP, dim=1) / 2
    assert ((dense.double() - weight.double()).abs() <= half_step * 1.001 + 1e-6).all()
    assert cpu_kernel.w4a8_bytes(96, 320) == packed.numel() + packed.scale.numel() * 2


@pytest.mark.parametrize("bias", [True, False])
def test_products_equal_the_integer_arithmetic_on_every_path(isa_path, bias):
    x, weight, b = operands()
    b = b if bias else None
    packed = cpu_kernel.pack_w4a8(cpu_kernel.library(), weight)
    want = _integer_reference(x, packed, torch.zeros(96) if b is None else b)
    got = cpu_kernel.packed_linear(x, packed, b)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
    # 15 levels a group: on Gaussian weights the error is some 10% of a product's size
    exact = F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert (got.float() - exact).pow(2).mean() < 0.15 ** 2 * exact.pow(2).mean()


def test_a_row_is_the_same_bytes_at_every_width_thread_count_and_path():
    """Widths 1-17 and 40 (tiles of 1-8 vectors, chunks of groups past 8) on a matrix of 33
    groups (the chunks' edge), 1-3 threads, each path."""
    x, weight, b = operands(rows=40, width=33 * GROUP)
    packed = cpu_kernel.pack_w4a8(cpu_kernel.library(), weight)
    alone = assert_rows_alike_everywhere(x, packed, b)
    torch.testing.assert_close(alone.float(), _integer_reference(x, packed, b).float(),
                               rtol=2 ** -7, atol=1e-6)


def test_edge_rows_quantize_alike_on_every_path():
    """Rows one-signed, of signed zeros, tiny or huge, and a weight with an all-zero group
    and a tiny one (its float16 scale denormal or zero): every path gives the same bytes and
    the integer reference's."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4 * GROUP, generator=gen)
    x[1] = -x[1].abs()
    x[2] = x[2].abs()
    x[3, ::2], x[3, 1::2] = 0.0, -0.0  # zeros of both signs: the bias alone
    x[4] *= 1e-30
    x[5] *= 1e30
    x = x.bfloat16()
    weight = torch.randn(32, 4 * GROUP, generator=gen)
    weight[0, :GROUP] = 0.0
    weight[1, GROUP:2 * GROUP] *= 1e-6  # scale ~4e-7: a float16 denormal
    weight[2, 2 * GROUP:3 * GROUP] *= 1e-12  # below float16's least: scale 0, values 0
    weight = weight.bfloat16()
    packed = cpu_kernel.pack_w4a8(cpu_kernel.library(), weight)
    values, scales = _values_and_scales(packed)
    assert scales[0, 0] == 0 and scales[2, 2] == 0 and not values[2, 2 * GROUP:3 * GROUP].any()
    assert 0 < scales[1, 1] < 2 ** -14
    bias = torch.zeros(32)
    results = on_every_path(lambda: cpu_kernel.packed_linear(x, packed))
    for got in results:
        assert torch.equal(got, results[0])
    torch.testing.assert_close(results[0].float(), _integer_reference(x, packed, bias).float(),
                               rtol=2 ** -7, atol=1e-6)
    assert torch.equal(results[0][3], bias.bfloat16())


def test_a_row_of_zeros_gives_the_bias():
    _, weight, b = operands()
    packed = cpu_kernel.pack_w4a8(cpu_kernel.library(), weight)
    assert torch.equal(cpu_kernel.packed_linear(torch.zeros(2, 320).bfloat16(), packed, b),
                       b.expand(2, 96))


def test_outside_the_kernel_a_packed_weight_multiplies_as_its_dense_form():
    x, weight, b = operands(rows=3)
    packed = cpu_kernel.pack_w4a8(cpu_kernel.library(), weight)
    dense = cpu_kernel.unpack_w4a8(packed, torch.float32)
    got = cpu_kernel.packed_linear(x.float(), packed, b.float())  # float32: not the kernel's
    torch.testing.assert_close(got, F.linear(x.float(), dense, b.float()))


@pytest.fixture(scope="module")
def w4a8_lm(lm_dir):
    return load_lm(lm_dir, dtype=torch.bfloat16, quant="w4a8")


def test_load_packs_the_streamed_matrices_as_4bit_groups(w4a8_lm):
    packed = [getattr(o, n) for o, n, _ in w4a8_lm.streamed_matrices()
              if getattr(o, n).dim() == 3]
    assert packed and all(w.dtype == torch.uint8 and w.scale.dtype == torch.float16
                          and w.scale.numel() * 4 == w.numel() // 8 * 2 for w in packed)
    assert w4a8_lm.quant == "w4a8"
    assert w4a8_lm.packed_bytes == sum(cpu_kernel.w4a8_bytes(*cpu_kernel.packed_shape(w))
                                       for w in packed)
    described = NativeEngine(w4a8_lm, None).describe()
    assert described["lm_quant"] == "w4a8"
    assert "of 4-bit groups (w4a8)" in described["lm_weights"]
    step = cpu_kernel.LocalStepKernel(w4a8_lm.local_transformer, cpu_kernel.library())
    assert step.packed == 3


def test_a_matrix_not_in_whole_groups_is_refused_with_the_way_out(lm_dir):
    model = load_lm(lm_dir, dtype=torch.bfloat16, cpu_kernel="off")
    model.cpu_kernel = "auto"
    assert cpu_kernel.packed_quant_refusal(model, "w4a8") == ""
    owner, name, _ = model.streamed_matrices()[0]
    setattr(owner, name, torch.nn.Parameter(torch.zeros(16, 48, dtype=torch.bfloat16),
                                            requires_grad=False))
    why = cpu_kernel.packed_quant_refusal(model, "w4a8")
    assert "48 columns" in why and "w8a8" in why
    assert cpu_kernel.packed_quant_refusal(model, "w8a8") == ""


def test_the_cli_runs_w4a8_and_keeps_it_apart_from_w8a8_results(mimo, tmp_path):
    """`synth --lm-quant w4a8` records the profile in the sidecar and in the resume key: the
    w8a8 run of the same text in the same folder neither skips as done nor replaces the w4a8
    file (exit 5 without --overwrite); a float32 model is refused before loading."""
    run = ("synth", "--model", "tiny", "--max-new-groups", "4", "-t", "Hello there.",
           "--output-dir", "out", "--dtype", "bfloat16")
    done = mimo(*run, "--lm-quant", "w4a8")
    assert done.returncode == 0, done.stderr
    sidecar = next((tmp_path / "out" / "tts_sft").glob("*.json"))
    wav = sidecar.with_suffix(".wav").read_bytes()
    text = sidecar.read_text()
    assert '"lm_quant": "w4a8"' in text and "4-bit groups (w4a8)" in text
    again = mimo(*run, "--lm-quant", "w8a8")
    assert again.returncode == 5 and b"exists from other inputs" in again.stderr
    assert sidecar.with_suffix(".wav").read_bytes() == wav
    refused = mimo(*run[:-2], "--lm-quant", "w4a8")
    assert refused.returncode == 2 and b"needs bfloat16" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
