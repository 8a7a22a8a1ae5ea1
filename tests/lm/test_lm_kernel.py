"""The fused CPU kernel (mimo_tts/lm/cpu_kernel.py): the reference fixtures in float32, the
eager modules in both dtypes, on AMX tiles and on the AVX512-BF16 path of CPUs without
them, its products, and its decision with the reason it gives."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from mimo_tts.errors import UsageError
from mimo_tts.lm import cpu_kernel
from mimo_tts.lm.generate import decode_patch, generate
from mimo_tts.lm.load import load_lm
from mimo_tts.lm.model import KVCache
from mimo_tts.lm.sampling import GREEDY
from mimo_tts.runtime.devices import CPU_KERNEL_ENV, resolve_placement
from tests.full_size import lm_config_cut, write_random_lm

TOL = 1e-4
CASES = [("lm_forward", "prefill_tts_en"), ("lm_forward", "prefill_tts_instruct"),
         ("voice_prompt", "prefill_tts_voice")]
GENERATE = ("gen_tts_en_forced", "gen_tts_instruct_forced", "gen_tts_en_free_greedy")
needs_kernel = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(params=["amx", "no-amx"])
def amx(request):
    """Run the test with AMX tiles where the CPU has them, and with the AVX512-BF16 dot
    products only (the code path of CPUs without AMX); restored after."""
    before = cpu_kernel.features()["amx_min_rows"]
    if request.param == "no-amx":
        cpu_kernel.set_amx_min_rows(cpu_kernel.MAX_ROWS + 1)
    elif not cpu_kernel.features()["amx"]:
        pytest.skip("no AMX tiles on this CPU")
    else:
        cpu_kernel.set_amx_min_rows(1)
    yield request.param
    cpu_kernel.set_amx_min_rows(before)


def _steps(model, xs: torch.Tensor, kernel: bool) -> torch.Tensor:
    """Eleven patch-decoder positions of xs [11, n, 1, D] -> hidden [11, n, D] in float32,
    through the kernel's one-position step or the eager modules."""
    cache = KVCache(model.cfg.patch_decoder, xs.shape[1], model.cfg.local_steps,
                    dtype=xs.dtype, device="cpu")
    step = cpu_kernel.LocalStepKernel(model.local_transformer, cpu_kernel.library())
    with torch.inference_mode():
        if kernel:
            out = [step(x, t, cache, t)[:, 0] for t, x in enumerate(xs)]
        else:
            out = [model.local_step(x, t, cache) for t, x in enumerate(xs)]
    return torch.stack(out).float()


def _placed() -> str:
    """The CPU kernel mode a run's placement resolves (MIMO_TTS_CPU_KERNEL, else auto)."""
    return resolve_placement(lm_device="cpu", tokenizer_device="cpu").cpu_kernel.value


@pytest.fixture(scope="module")
def kernel_lm(lm_dir):
    return load_lm(lm_dir, cpu_kernel="on")


@needs_kernel
def test_kernel_is_chosen_where_it_is_faster_and_says_why(lm_dir, kernel_lm, monkeypatch):
    """auto: bfloat16 on AVX512-BF16 CPUs, on AVX2 ones where its products measured faster;
    on: wherever it runs; off/env: never."""
    assert cpu_kernel.features()["built"]
    assert cpu_kernel.choose(kernel_lm) == cpu_kernel.Choice(True, cpu_kernel.choose(
        kernel_lm).reason) and cpu_kernel.choose(kernel_lm).reason.startswith("on: ")
    plain = cpu_kernel.choose(load_lm(lm_dir))
    assert plain == cpu_kernel.Choice(False, "auto: float32 weights run faster in eager PyTorch")
    bf16 = cpu_kernel.choose(load_lm(lm_dir, dtype=torch.bfloat16))
    path = cpu_kernel.features()["packed_isa"]
    assert bf16.active == (path == "AVX512-BF16" or (
        path == "AVX2" and cpu_kernel.products_faster().faster))
    assert bf16.reason.startswith("auto: ")
    off = cpu_kernel.choose(load_lm(lm_dir, dtype=torch.bfloat16, cpu_kernel="off"))
    assert off == cpu_kernel.Choice(False, "off (asked for)")
    half = cpu_kernel.choose(load_lm(lm_dir, dtype=torch.float16, cpu_kernel="on"))
    assert not half.active and "torch.float16 weights" in half.reason
    monkeypatch.setenv(CPU_KERNEL_ENV, "0")
    assert not cpu_kernel.choose(load_lm(lm_dir, dtype=torch.bfloat16,
                                         cpu_kernel=_placed())).active
    monkeypatch.setenv(CPU_KERNEL_ENV, "1")
    assert cpu_kernel.choose(load_lm(lm_dir, cpu_kernel=_placed())).active
    assert not cpu_kernel.choose(load_lm(lm_dir)).active  # the LM itself reads no env
    monkeypatch.setenv(CPU_KERNEL_ENV, "fast")
    with pytest.raises(UsageError, match=CPU_KERNEL_ENV):
        _placed()
    with pytest.raises(UsageError, match="cpu kernel mode"):
        load_lm(lm_dir, cpu_kernel="fast")


@needs_kernel
@pytest.mark.parametrize(("group", "name"), CASES)
def test_kernel_patch_decoder_matches_reference(kernel_lm, case_tensors, group, name):
    t = case_tensors(group)
    lm, cfg = kernel_lm, kernel_lm.cfg
    cache = KVCache(cfg.patch_decoder, 1, cfg.local_steps, dtype=torch.float32, device="cpu")
    record = [[] for _ in range(cfg.audio_channels)]
    with torch.inference_mode():
        codes = decode_patch(lm, t[f"{name}.local_hidden_last"][None], GREEDY, None,
                             cpu_kernel.CpuKernelStep(lm, None, cache), record)
    assert torch.equal(codes[0], t[f"{name}.local_greedy_tokens"].long())
    for c in range(cfg.audio_channels):
        torch.testing.assert_close(torch.cat(record[c]), t[f"{name}.local_logits_ch{c}"],
                                   atol=TOL, rtol=0)


@needs_kernel
def test_kernel_generation_matches_reference(kernel_lm, special, cases, case_tensors,
                                             forcing, greedy_options):
    """Whole generations with every decode step in the kernel (backbone products, lm_head,
    patch encoder and decoder), float32: the reference ids and step logits."""
    t = case_tensors("lm_generate")
    for name in GENERATE:
        case = next(c for c in cases["groups"]["lm_generate"]["cases"] if c["name"] == name)
        script = case["params"]["forced_script_ids"]
        options = greedy_options(max_new_groups=case["params"]["max_new_groups"],
                                 keep_logits=True,
                                 text_logits_processor=forcing([script]) if script else None)
        result = generate(kernel_lm, [t[f"{name}.input_ids"]], options, special)[0]
        assert torch.equal(result.new_ids, t[f"{name}.new_ids"].long()), name
        torch.testing.assert_close(result.step_logits, t[f"{name}.step_text_logits"],
                                   atol=TOL, rtol=0)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_kernel_equals_eager_float32(kernel_lm, rows):
    xs = torch.randn(11, rows, 1, kernel_lm.cfg.local_dim,
                     generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_steps(kernel_lm, xs, True), _steps(kernel_lm, xs, False),
                               atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("heads, width", [(2, 32), (4, 40), (8, 32)])
def test_kernel_equals_eager_at_other_head_sizes(lm_dir, tmp_path, heads, width):
    """The patch decoder's scores take a head in lanes of 8 and then its tail: head sizes 16
    (two lanes' worth), 10 (one and a tail of 2) and 4 (the tail alone), on a random
    checkpoint of tiny-a's layout with the patch decoder's heads and width changed."""
    cfg = lm_config_cut(json.loads((lm_dir / "config.json").read_text()),
                        local_attn_heads=heads, local_dim=width, input_local_dim=width,
                        torch_dtype="float32")
    write_random_lm(tmp_path / "lm", cfg)
    model = load_lm(tmp_path / "lm", cpu_kernel="on")
    assert model.cfg.patch_decoder.head_dim == width // heads
    with torch.no_grad():  # random weights: scores near 0 and a faint attention output
        for layer in model.local_transformer.layers:
            layer.self_attn.qkv_weight.mul_(30)
            layer.self_attn.o_proj.weight.mul_(30)
    xs = torch.randn(11, 3, 1, width, generator=torch.Generator().manual_seed(4))
    # a lane or a tail term lost moves the result by ~4e-5; the right sums agree to ~2e-8
    torch.testing.assert_close(_steps(model, xs, True), _steps(model, xs, False),
                               atol=2e-6, rtol=0)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5])
def test_kernel_bfloat16_tracks_float32_like_eager(lm_dir, kernel_lm, rows, amx):
    """bfloat16 rounding makes both paths drift from float32; the kernel's drift must be no
    worse than the eager modules', on AMX tiles and on the dot-product path alike."""
    model = load_lm(lm_dir, dtype=torch.bfloat16, cpu_kernel="on")
    xs = torch.randn(11, rows, 1, model.cfg.local_dim, generator=torch.Generator().manual_seed(2))
    want = _steps(kernel_lm, xs, False)
    scale = want.abs().amax()
    err_kernel = ((_steps(model, xs.bfloat16(), True) - want).abs().amax() / scale).item()
    err_eager = ((_steps(model, xs.bfloat16(), False) - want).abs().amax() / scale).item()
    assert err_kernel < 0.05 and err_kernel <= 1.5 * err_eager + 1e-3


@needs_kernel
def test_kernel_batch_rows_are_independent(lm_dir, amx):
    """Each row's result is the same alone or in a batch (bfloat16, 4 rows vs 1)."""
    model = load_lm(lm_dir, dtype=torch.bfloat16, cpu_kernel="on")
    xs = torch.randn(11, 4, 1, model.cfg.local_dim,
                     generator=torch.Generator().manual_seed(3)).bfloat16()
    together = _steps(model, xs, True)
    for row in range(4):
        assert torch.equal(_steps(model, xs[:, row : row + 1], True)[:, 0], together[:, row])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17])
def test_products_equal_f_linear(dtype, rows, amx):
    """The kernel's matrix products (with and without bias, every row count it takes, and
    17 rows, which go to PyTorch) equal F.linear within one bfloat16 rounding."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1, 96, generator=gen).to(dtype)
    weight = torch.randn(80, 96, generator=gen).to(dtype)
    bias = torch.randn(80, generator=gen).to(dtype)
    products = cpu_kernel.Products(cpu_kernel.library())
    for b in (None, bias):
        got = products(x, weight, b)
        assert got.shape == (rows, 1, 80) and got.dtype == dtype
        want = F.linear(x.float(), weight.float(), None if b is None else b.float())
        tol = 1e-4 if dtype == torch.float32 else 2 ** -7 * want.abs().amax().item()
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=0)


@needs_kernel
def test_converted_model_is_chosen_again(lm_dir, special, case_tensors, greedy_options):
    """The decision is taken per generation on the model as it is: a bfloat16 model made
    float32 runs eagerly under auto (no stale pointers), and generates what the eager step
    gives it."""
    model = load_lm(lm_dir, dtype=torch.bfloat16)
    model = model.float()
    assert cpu_kernel.choose(model) == cpu_kernel.Choice(
        False, "auto: float32 weights run faster in eager PyTorch")
    prompt = case_tensors("lm_generate")["gen_tts_en_forced.input_ids"]
    (got,) = generate(model, [prompt], greedy_options(max_new_groups=2), special)
    (want,) = generate(model, [prompt], greedy_options(max_new_groups=2, decode_step="eager"),
                       special)
    assert got.new_ids.numel() > 0 and torch.equal(got.new_ids, want.new_ids)
