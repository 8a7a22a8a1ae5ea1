"""The fused CPU patch-decoder kernel (mimo_tts/lm/cpu_kernel.py): the reference fixtures in
float32, the eager modules in both dtypes, and its fall-backs."""

from __future__ import annotations

import shutil

import pytest
import torch

from mimo_tts.errors import UsageError
from mimo_tts.lm import cpu_kernel
from mimo_tts.lm.generate import decode_patch, generate
from mimo_tts.lm.load import load_lm
from mimo_tts.lm.model import KVCache
from mimo_tts.lm.sampling import GREEDY

TOL = 1e-4
CASES = [("lm_forward", "prefill_tts_en"), ("lm_forward", "prefill_tts_instruct"),
         ("voice_prompt", "prefill_tts_voice")]
needs_kernel = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def _steps(model, xs: torch.Tensor) -> torch.Tensor:
    """Eleven patch-decoder positions of xs [11, n, 1, D] -> hidden [11, n, D] in float32."""
    cache = KVCache(model.cfg.patch_decoder, xs.shape[1], model.cfg.local_steps,
                    dtype=xs.dtype, device="cpu")
    with torch.inference_mode():
        return torch.stack([model.local_step(x, t, cache) for t, x in enumerate(xs)]).float()


@pytest.fixture(scope="module")
def kernel_lm(lm_dir):
    return load_lm(lm_dir, cpu_kernel="on")


@needs_kernel
def test_kernel_is_built_and_used_where_it_is_faster(lm_dir, kernel_lm, monkeypatch):
    """auto: bfloat16 on AVX512-BF16 CPUs only; on: wherever it runs; off/env: never."""
    assert cpu_kernel.features()["built"]
    assert kernel_lm.local_transformer.kernel is not None
    assert kernel_lm.model.kernel is None and kernel_lm.input_local_transformer.kernel is None
    assert load_lm(lm_dir).local_transformer.kernel is None  # float32: eager is faster
    bf16 = load_lm(lm_dir, dtype=torch.bfloat16).local_transformer.kernel
    assert (bf16 is not None) == cpu_kernel.features()["avx512_bf16"]
    assert load_lm(lm_dir, dtype=torch.bfloat16, cpu_kernel="off").local_transformer.kernel is None
    monkeypatch.setenv(cpu_kernel.ENV, "0")
    assert load_lm(lm_dir, dtype=torch.bfloat16).local_transformer.kernel is None
    monkeypatch.setenv(cpu_kernel.ENV, "1")
    assert load_lm(lm_dir).local_transformer.kernel is not None
    monkeypatch.setenv(cpu_kernel.ENV, "fast")
    with pytest.raises(UsageError, match=cpu_kernel.ENV):
        load_lm(lm_dir)


@needs_kernel
@pytest.mark.parametrize(("group", "name"), CASES)
def test_kernel_patch_decoder_matches_reference(kernel_lm, case_tensors, group, name):
    t = case_tensors(group)
    lm, cfg = kernel_lm, kernel_lm.cfg
    cache = KVCache(cfg.patch_decoder, 1, cfg.local_steps, dtype=torch.float32, device="cpu")
    record = [[] for _ in range(cfg.audio_channels)]
    with torch.inference_mode():
        codes = decode_patch(lm, t[f"{name}.local_hidden_last"][None], GREEDY, None, cache,
                             record)
    assert torch.equal(codes[0], t[f"{name}.local_greedy_tokens"].long())
    for c in range(cfg.audio_channels):
        torch.testing.assert_close(torch.cat(record[c]), t[f"{name}.local_logits_ch{c}"],
                                   atol=TOL, rtol=0)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_kernel_equals_eager_float32(lm_dir, rows):
    kernel, eager = load_lm(lm_dir, cpu_kernel="on"), load_lm(lm_dir, cpu_kernel="off")
    assert eager.local_transformer.kernel is None
    xs = torch.randn(11, rows, 1, kernel.cfg.local_dim, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_steps(kernel, xs), _steps(eager, xs), atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5])
def test_kernel_bfloat16_tracks_float32_like_eager(lm_dir, rows):
    """bfloat16 rounding makes both paths drift from float32; the kernel's drift (rows > 1
    run on AMX tiles where the CPU has them) must be no worse than the eager modules'."""
    reference = load_lm(lm_dir, cpu_kernel="off")
    kernel = load_lm(lm_dir, dtype=torch.bfloat16, cpu_kernel="on")
    eager = load_lm(lm_dir, dtype=torch.bfloat16, cpu_kernel="off")
    assert kernel.local_transformer.kernel is not None
    xs = torch.randn(11, rows, 1, kernel.cfg.local_dim, generator=torch.Generator().manual_seed(2))
    want = _steps(reference, xs)
    scale = want.abs().amax()
    err_kernel = ((_steps(kernel, xs.bfloat16()) - want).abs().amax() / scale).item()
    err_eager = ((_steps(eager, xs.bfloat16()) - want).abs().amax() / scale).item()
    assert err_kernel < 0.05 and err_kernel <= 1.5 * err_eager + 1e-3


@needs_kernel
def test_kernel_batch_rows_are_independent(lm_dir):
    """Each row's result is the same alone or in a batch (bfloat16, 4 rows vs 1)."""
    model = load_lm(lm_dir, dtype=torch.bfloat16, cpu_kernel="on")
    xs = torch.randn(11, 4, 1, model.cfg.local_dim,
                     generator=torch.Generator().manual_seed(3)).bfloat16()
    together = _steps(model, xs)
    for row in range(4):
        assert torch.equal(_steps(model, xs[:, row : row + 1])[:, 0], together[:, row])


@needs_kernel
def test_replaced_weights_fall_back_to_eager(lm_dir, special, case_tensors, greedy_options):
    """After `.to()` the kernel's pointers are stale: the eager modules must run instead."""
    model = load_lm(lm_dir, dtype=torch.bfloat16, cpu_kernel="on")
    assert model.local_transformer.kernel is not None
    model = model.float()
    assert model.local_transformer.kernel is None
    reference = load_lm(lm_dir, cpu_kernel="off")
    prompt = case_tensors("lm_generate")["gen_tts_en_forced.input_ids"]
    xs = torch.randn(11, 1, 1, model.cfg.local_dim, generator=torch.Generator().manual_seed(4))
    # bf16 weights made float32: close to, not equal to, the float32 checkpoint
    assert (_steps(model, xs) - _steps(reference, xs)).abs().amax() < 0.1
    assert generate(model, [prompt], greedy_options(max_new_groups=2), special)


def test_kernel_is_skipped_where_it_cannot_run(kernel_lm):
    kernel = kernel_lm.local_transformer.kernel
    if kernel is None:
        pytest.skip("no kernel on this machine")
    lm, cfg = kernel_lm, kernel_lm.cfg
    cache = KVCache(cfg.patch_decoder, 2, cfg.local_steps, dtype=torch.float32, device="cpu")
    x = torch.zeros(2, 1, cfg.local_dim)
    position = lm.local_positions[0]
    assert not kernel.accepts(x, position, cache, 0, 1, None)  # autograd on: eager
    with torch.inference_mode():
        _accepts_only_one_decode_position(kernel, x, position, cache, cfg)


def _accepts_only_one_decode_position(kernel, x, position, cache, cfg):
    assert kernel.accepts(x, position, cache, 0, 1, None)
    assert not kernel.accepts(x, position, cache, 0, 1, torch.ones(2, 1, 1, 1, dtype=torch.bool))
    assert not kernel.accepts(x, position, None, 0, 1, None)  # no cache: a prefill
    assert not kernel.accepts(torch.zeros(2, 3, cfg.local_dim), position, cache, 0, 3, None)
    assert not kernel.accepts(torch.zeros(3, 1, cfg.local_dim), position, cache, 0, 1, None)
    assert not kernel.accepts(x.bfloat16(), position, cache, 0, 1, None)
    assert not kernel.accepts(x, position, cache, torch.tensor([0]), 1, None)
