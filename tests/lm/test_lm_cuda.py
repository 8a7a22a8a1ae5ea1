"""GPU-only checks: the LM on a CUDA device matches the reference, eagerly and with the
decode step captured in CUDA graphs, and runs in bf16."""

from __future__ import annotations

import warnings

import pytest
import torch

from mimo_tts.lm.generate import generate
from mimo_tts.lm.load import load_lm

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_forced_generation_on_cuda_matches_reference(lm_dir, special, cases, case_tensors,
                                                     forcing, greedy_options):
    model = load_lm(lm_dir, device="cuda", dtype=torch.float32)
    assert model.model.rope_cos.device.type == "cuda"
    t = case_tensors("lm_generate")
    names = ["gen_tts_en_forced", "gen_tts_instruct_forced"]
    scripts = [next(c for c in cases["groups"]["lm_generate"]["cases"] if c["name"] == n)
               ["params"]["forced_script_ids"] for n in names]
    options = greedy_options(text_logits_processor=forcing(scripts), keep_logits=True)
    results = generate(model, [t[f"{n}.input_ids"] for n in names], options, special)
    for name, result in zip(names, results, strict=True):
        assert torch.equal(result.new_ids, t[f"{name}.new_ids"].long())
        torch.testing.assert_close(result.step_logits, t[f"{name}.step_text_logits"],
                                   atol=1e-4, rtol=0)


def test_bfloat16_on_cuda_runs(lm_dir, special, case_tensors, forcing, greedy_options):
    model = load_lm(lm_dir, device="cuda", dtype=torch.bfloat16)
    t = case_tensors("lm_generate")
    options = greedy_options(text_logits_processor=forcing([[special.empty] * 3]),
                             max_new_groups=3, keep_logits=True)
    result = generate(model, [t["gen_tts_en_forced.input_ids"]], options, special)[0]
    assert result.new_ids.shape == (9, 12) and torch.isfinite(result.step_logits).all()
    assert (result.step_logits[0] - t["gen_tts_en_forced.step_text_logits"][0]).abs().max() < 0.25


def _scripts(cases, names):
    return [next(c for c in cases["groups"]["lm_generate"]["cases"] if c["name"] == n)
            ["params"]["forced_script_ids"] for n in names]


@pytest.mark.parametrize("decode_step", ["graph", "auto"])
def test_cuda_graph_padded_batch_matches_reference(lm_dir, special, cases, case_tensors,
                                                   forcing, greedy_options, decode_step):
    """Captured backbone and patch-decoder steps, three prompt lengths (two rows padded)."""
    model = load_lm(lm_dir, device="cuda", dtype=torch.float32)
    names = ["gen_tts_en_forced", "gen_tts_zh_forced_interleaved", "gen_tts_instruct_forced"]
    t = case_tensors("lm_generate")
    options = greedy_options(text_logits_processor=forcing(_scripts(cases, names)),
                             keep_logits=True, decode_step=decode_step)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "auto" warns if a capture fails
        results = generate(model, [t[f"{n}.input_ids"] for n in names], options, special)
    for name, result in zip(names, results, strict=True):
        assert torch.equal(result.new_ids, t[f"{name}.new_ids"].long())
        torch.testing.assert_close(result.step_logits, t[f"{name}.step_text_logits"],
                                   atol=1e-4, rtol=0)


def test_cuda_graph_equals_eager_free_greedy(lm_dir, case_tensors, modes_agree):
    """A 54-group prompt and 20 free greedy groups: the backbone step moves from the
    64-group span bucket (and its graph) to the 128-group one."""
    model = load_lm(lm_dir, device="cuda", dtype=torch.float32)
    prompt = case_tensors("lm_generate")["gen_tts_en_forced.input_ids"]  # 54 groups
    modes_agree(model, prompt, ("eager", "graph"), groups=20, atol=1e-4)

