"""The opt-in w8a8 profile (`--lm-quant w8a8`, mimo_tts/lm/cpu_kernel.py `pack_w8a8`): int8
weights packed in 16-row blocks times each row's activations quantized to bytes in the kernel.
Its products equal the exact integer arithmetic they stand for, so a row's bytes are the same
alone or in a batch of any width, on any thread count and on every instruction-set path; a
whole w8a8 model stays near float32 and never runs unasked."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from mimo_tts.errors import UsageError
from mimo_tts.lm import cpu_kernel, int8
from mimo_tts.lm.generate import generate
from mimo_tts.lm.load import load_lm
from mimo_tts.lm.native import NativeEngine

from .conftest import assert_rows_alike_everywhere, on_every_path, operands

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def _integer_reference(x, packed, bias):
    """The w8a8 product as the kernel defines it, in float64 integer sums: each row of x
    quantized to bytes over a range holding 0, the weight's int8 values by them, the row
    and weight scales applied once (float32), the bias added, rounded to bfloat16."""
    out = packed.shape[0] * 16
    xf = x.float()
    lo = torch.clamp(xf.amin(1), max=0.0)
    hi = torch.clamp(xf.amax(1), min=0.0)
    scale = (hi - lo) / 255
    scale = torch.where(scale > 0, scale, 1.0)  # a row of zeros: any scale, the kernel's is 1
    inv = 1 / scale
    zero = torch.round(-lo * inv).clamp(0, 255)
    a = (torch.round(xf * inv[:, None]) + zero[:, None]).clamp(0, 255).double()
    w = torch.round(cpu_kernel.unpack_w8a8(packed) / packed.scale[:out, None]).double()
    sums = a @ w.T - zero[:, None].double() * w.sum(1)[None]
    return (sums.float() * (scale[:, None] * packed.scale[None, :out]) + bias.float()).bfloat16()


def test_the_kernel_packs_as_quantize_rows_defines_over_every_magnitude():
    """Rows of magnitudes from 1e-40 to 1e30, a zero row and one at 1e-45 (the scale's floor):
    the kernel's bytes, scales and sums equal `int8.quantize_rows`' laid out in blocks."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 200, generator=gen)
    weight *= (10 ** torch.empty(64, 1).uniform_(-40, 30, generator=gen))
    weight[0] = 0.0
    weight[1] = 1e-45
    weight = weight.bfloat16()
    q = int8.quantize_rows(weight)
    lines = q.view(4, 16, 50, 4).permute(0, 2, 1, 3).reshape(4, 50, 64)
    packed = cpu_kernel.pack_w8a8(cpu_kernel.library(), weight)
    assert torch.equal(packed, lines)
    assert torch.equal(packed.scale[:64], q.scale)
    assert torch.equal(packed.scale[64:].view(torch.int32), q.sum(dim=1, dtype=torch.int32))


def test_packing_keeps_the_int8_rows_their_scales_and_sums():
    _, weight, _ = operands()
    packed = cpu_kernel.pack_w8a8(cpu_kernel.library(), weight)
    assert packed.dtype == torch.int8 and packed.shape == (6, 80, 64)
    assert cpu_kernel.packed_shape(packed) == (96, 320)
    scale, sums = packed.scale[:96], packed.scale[96:].view(torch.int32)
    values = torch.round(cpu_kernel.unpack_w8a8(packed) / scale[:, None])
    assert values.abs().max() == 127 and torch.equal(sums, values.sum(1).int())
    assert ((cpu_kernel.unpack_w8a8(packed) - weight.float()).abs()
            <= scale[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("bias", [True, False])
def test_products_equal_the_integer_arithmetic_on_every_path(isa_path, bias):
    x, weight, b = operands()
    b = b if bias else None
    packed = cpu_kernel.pack_w8a8(cpu_kernel.library(), weight)
    want = _integer_reference(x, packed, torch.zeros(96) if b is None else b)
    got = cpu_kernel.packed_linear(x, packed, b)
    # the kernel fuses the scale and the bias into one rounding (fma): one bfloat16 step
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
    exact = F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert (got.float() - exact).abs().amax() < 0.03 * exact.abs().amax()


def test_a_row_is_the_same_bytes_at_every_width_thread_count_and_path():
    x, weight, b = operands(rows=40)
    packed = cpu_kernel.pack_w8a8(cpu_kernel.library(), weight)
    alone = assert_rows_alike_everywhere(x, packed, b)
    torch.testing.assert_close(alone.float(), _integer_reference(x, packed, b).float(),
                               rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("width", [324, 1028])
def test_rows_quantize_to_the_same_bytes_on_every_path_tails_and_edges_included(width):
    """Widths that leave a tail after the 16-wide loops, and rows whose range is one-sided,
    signed zeros, tiny or huge: every path gives the integer reference's bytes."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, width, generator=gen)
    x[1] = -x[1].abs()  # all negative: the range's top is 0
    x[2] = x[2].abs()  # all positive: its bottom is 0
    x[3, ::2], x[3, 1::2] = 0.0, -0.0  # zeros of both signs: the bias alone
    x[4] *= 1e-30
    x[5] *= 1e30
    x[5, -1] = -3e38  # the extreme sits in the tail
    x = x.bfloat16()
    weight = torch.randn(32, width, generator=gen).bfloat16()
    packed = cpu_kernel.pack_w8a8(cpu_kernel.library(), weight)
    bias = torch.zeros(32)
    want = _integer_reference(x, packed, bias)
    results = on_every_path(lambda: cpu_kernel.packed_linear(x, packed))
    for got in results:
        assert torch.equal(got, results[0])
    torch.testing.assert_close(results[0].float(), want.float(), rtol=2 ** -7, atol=1e-6)
    assert torch.equal(results[0][3], bias.bfloat16())


def test_without_a_bias_each_result_is_the_exact_product_rounded_denormals_kept(isa_path):
    """Without a bias a result is one rounding of an exact product (the fma's), then
    bfloat16's: the integer reference gives those bytes exactly. A weight and rows scaled by
    1e-20 make the combined scales denormal, and many results: they round as f2bf and PyTorch round
    them, never flushed to zero (as the vector conversion instruction would)."""
    x, weight, _ = operands(rows=9)
    x[4:] *= 1e-20
    weight *= 1e-20
    packed = cpu_kernel.pack_w8a8(cpu_kernel.library(), weight)
    want = _integer_reference(x, packed, torch.zeros(96))
    denormal = (want.float().abs() < 2 ** -126) & (want != 0)
    assert denormal[4:].sum() > 300 and not denormal[:4].any()
    for n in (1, 4, 9):
        got = cpu_kernel.packed_linear(x[-n:], packed)
        assert torch.equal(got.view(torch.int16), want[-n:].view(torch.int16)), n


def test_a_row_of_zeros_gives_the_bias():
    _, weight, b = operands()
    packed = cpu_kernel.pack_w8a8(cpu_kernel.library(), weight)
    assert torch.equal(cpu_kernel.packed_linear(torch.zeros(2, 320).bfloat16(), packed, b),
                       b.expand(2, 96))


@pytest.fixture(scope="module")
def w8a8_lm(lm_dir):
    return load_lm(lm_dir, dtype=torch.bfloat16, quant="w8a8")


def test_load_packs_the_streamed_matrices_as_int8(w8a8_lm):
    packed = [getattr(o, n) for o, n, _ in w8a8_lm.streamed_matrices()
              if getattr(o, n).dim() == 3]
    assert packed and all(w.dtype == torch.int8 and w.scale.numel() == 2 * w.shape[0] * 16
                          for w in packed)
    assert w8a8_lm.quant == "w8a8"
    assert w8a8_lm.packed_bytes == sum(w.numel() for w in packed)
    described = NativeEngine(w8a8_lm, None).describe()
    assert described["lm_quant"] == "w8a8" and "of int8 (w8a8)" in described["lm_weights"]
    step = cpu_kernel.LocalStepKernel(w8a8_lm.local_transformer, cpu_kernel.library())
    assert step.packed == 2


# The kernel's two quantized profiles alike (their own tests of products and packing apart).
KERNEL_QUANTS = ("w8a8", "w4a8")


@pytest.mark.parametrize("quant", KERNEL_QUANTS)
def test_kernel_quants_are_opt_in_and_refused_where_they_cannot_run(lm, lm_dir, quant):
    assert lm.quant is None
    with pytest.raises(UsageError, match="needs bfloat16"):
        load_lm(lm_dir, quant=quant)
    with pytest.raises(UsageError, match="CPU only"):
        load_lm(lm_dir, device="cuda", dtype=torch.bfloat16, quant=quant)
    with pytest.raises(UsageError, match="kernel, which is off"):
        load_lm(lm_dir, dtype=torch.bfloat16, quant=quant, cpu_kernel="off")


# The first group's logits against float32's on tiny-a: (RMS error over the logits' RMS at
# most, cosine at least). w8a8 measured 0.06 and 0.998; w4a8 (2 groups a row, random
# weights) 0.53 and 0.85: a wrong nibble, row or scale gives noise, cosine near 0.
LOGIT_BOUNDS = {"w8a8": (0.1, 0.99), "w4a8": (0.75, 0.75)}


@pytest.mark.parametrize("quant", KERNEL_QUANTS)
def test_kernel_quant_generation_tracks_float32_and_batches_equal_single_runs(
        lm_dir, quant, special, case_tensors, greedy_options):
    """The first group's logits follow float32's (the drift a user accepts, reported at full
    width by scripts/lm_quant_drift.py); a batch of two prompts gives each the bytes of its
    own run, through the kernel step and the eager one alike (the products are exact integer
    sums, so the paths cannot differ)."""
    model = load_lm(lm_dir, dtype=torch.bfloat16, quant=quant)
    prompt = case_tensors("lm_generate")["gen_tts_en_free_greedy.input_ids"]
    other = prompt[:, : prompt.shape[1] - 8]
    options = greedy_options(max_new_groups=3, keep_logits=True)
    exact = generate(load_lm(lm_dir), [prompt], options, special)[0]
    runs = {mode: generate(model, [prompt, other],
                           greedy_options(max_new_groups=3, keep_logits=True, decode_step=mode),
                           special) for mode in ("auto", "eager")}
    single = [generate(model, [p], options, special)[0] for p in (prompt, other)]
    for mode, batch in runs.items():
        for got, want in zip(batch, single, strict=True):
            assert torch.equal(got.new_ids, want.new_ids), mode
    got, want = single[0].step_logits[0].float(), exact.step_logits[0].float()
    rms, cosine = LOGIT_BOUNDS[quant]
    assert (got - want).pow(2).mean() < rms ** 2 * want.pow(2).mean()
    assert F.cosine_similarity(got, want, dim=0) > cosine


def test_the_cli_runs_w8a8_and_keeps_it_apart_from_unquantized_results(mimo, tmp_path):
    """`synth --lm-quant w8a8` records the profile in the sidecar and in the resume key: the
    unquantized run of the same text in the same folder neither skips as done nor replaces
    the w8a8 file (exit 5 without --overwrite); a float32 model, or the kernel switched off, is
    refused before loading."""
    run = ("synth", "--model", "tiny", "--max-new-groups", "4", "-t", "Hello there.",
           "--output-dir", "out")
    done = mimo(*run, "--dtype", "bfloat16", "--lm-quant", "w8a8")
    assert done.returncode == 0, done.stderr
    sidecar = next((tmp_path / "out" / "tts_sft").glob("*.json"))
    wav = sidecar.with_suffix(".wav").read_bytes()
    assert '"lm_quant": "w8a8"' in sidecar.read_text()
    again = mimo(*run, "--dtype", "bfloat16")
    assert again.returncode == 5 and b"exists from other inputs" in again.stderr
    assert sidecar.with_suffix(".wav").read_bytes() == wav
    refused = mimo(*run, "--lm-quant", "w8a8")
    assert refused.returncode == 2 and b"needs bfloat16" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    # The kernel switched off is refused by the run's settings too: with -v a load would log,
    # so the one line says nothing was loaded first.
    off = mimo(*run, "--dtype", "bfloat16", "--lm-quant", "w8a8", "-v",
               env={"MIMO_TTS_CPU_KERNEL": "0"})
    assert off.returncode == 2 and b"CPU kernel, which is off" in off.stderr
    assert len(off.stderr.strip().splitlines()) == 1
