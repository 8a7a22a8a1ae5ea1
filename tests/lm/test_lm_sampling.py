"""MiMoSampler order and per-task defaults (spec §4.6)."""

from __future__ import annotations

import math

import pytest
import torch

from mimo_tts.errors import UsageError
from mimo_tts.lm import sampling
from mimo_tts.lm.sampling import (
    GREEDY,
    TASK_SAMPLERS,
    SamplerConfig,
    draw_rows,
    filter_logits,
    sample,
    task_samplers,
)

PROBS = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
LOGITS = PROBS.log()


def _kept(logits):
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_greedy_is_argmax_without_a_generator():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    assert sample(logits, GREEDY, None).tolist() == [1, 0]


def test_top_k_keeps_the_k_best_and_ties_and_clips_to_vocab():
    assert _kept(filter_logits(LOGITS, SamplerConfig(1.0, 2))) == [1, 3]
    assert _kept(filter_logits(LOGITS, SamplerConfig(1.0, 50))) == [0, 1, 2, 3]
    ties = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert _kept(filter_logits(ties, SamplerConfig(1.0, 1))) == [1, 2]


def test_top_p_is_the_hf_nucleus():
    # Ascending cumulative: 0.05, 0.20, 0.50, 1.0; drop cumulative <= 1 - p.
    assert _kept(filter_logits(LOGITS, SamplerConfig(1.0, None, 0.7))) == [1, 3]
    assert _kept(filter_logits(LOGITS, SamplerConfig(1.0, None, 0.81))) == [1, 2, 3]
    assert _kept(filter_logits(LOGITS, SamplerConfig(1.0, None, 0.01))) == [1]  # best kept


def test_temperature_scales_before_top_p():
    # At T = 0.5 the best token alone holds > 0.7 of the mass: 0.5^2 / sum(p^2) = 0.66.
    hot = filter_logits(LOGITS, SamplerConfig(0.5, None, 0.6))
    assert _kept(hot) == [1]
    scaled = filter_logits(LOGITS, SamplerConfig(0.5))
    torch.testing.assert_close(scaled - scaled[0, 1], (LOGITS - LOGITS[0, 1]) / 0.5)


def test_sampling_follows_the_filtered_distribution_and_the_seed():
    cfg = SamplerConfig(1.0, None, 0.7)
    logits = LOGITS.expand(4000, -1)
    draws = sample(logits, cfg, torch.Generator().manual_seed(0))
    again = sample(logits, cfg, torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)
    counts = torch.bincount(draws, minlength=4).tolist()
    assert counts[0] == counts[2] == 0
    share = counts[1] / len(draws)
    assert math.isclose(share, 0.5 / 0.8, abs_tol=0.03)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-40, 2e-38])
def test_a_tiny_temperature_samples_the_best_token(temperature):
    """Issue 13 (found by tests/reliability/test_properties.py): logits / 1e-300 overflowed to
    inf and inf - inf made the softmax NaN (exit 1 from torch.multinomial); now the sampler
    tends to argmax as the temperature tends to 0."""
    logits = torch.tensor([[0.1, 20.0, -1.0, 19.0], [-30.0, -20.0, -50.0, -90.0]])
    for cfg in (SamplerConfig(temperature), SamplerConfig(temperature, 2, 0.5)):
        draws = sample(logits, cfg, torch.Generator().manual_seed(0))
        assert draws.tolist() == [1, 1]


def test_task_defaults_table():
    assert task_samplers("tts") == (SamplerConfig(0.6, None, 1.0), SamplerConfig(0.9, None, 0.95))
    assert task_samplers("default") == (SamplerConfig(0.6, 50, 0.95),
                                        SamplerConfig(0.9, 50, 0.95))
    assert task_samplers("asr")[0].greedy and task_samplers("in_context_learning_s2s")[0].greedy
    assert task_samplers("audio_understanding")[0].temperature == 0.3
    assert task_samplers("text_chat")[0].temperature == 0.4
    assert task_samplers("unknown") == TASK_SAMPLERS["default"]


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_k": -2}, {"top_p": 0.0},
                                {"top_p": 1.5}])
def test_invalid_sampler_values(kw):
    with pytest.raises(UsageError):
        SamplerConfig(**kw)


@pytest.mark.parametrize("vocab", [4, 129, 1025, 151680])
def test_per_row_draws_are_each_rows_multinomial(vocab):
    """draw_rows gives row i exactly torch.multinomial's draw from generator i (what a single
    run samples), and `sample` with per-row samplers keeps greedy rows greedy."""
    probs = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab)).softmax(-1)
    for seed in range(5):
        gens = [torch.Generator().manual_seed(seed * 10 + i) for i in range(6)]
        alone = [torch.Generator().manual_seed(seed * 10 + i) for i in range(6)]
        for _ in range(3):  # consecutive draws stay in step too
            want = [int(torch.multinomial(probs[i:i + 1], 1, generator=g)) for i, g in
                    enumerate(alone)]
            assert draw_rows(probs, gens).tolist() == want
    logits = probs.log()
    cfgs = [SamplerConfig(1.0), GREEDY] * 3
    tokens = sample(logits, cfgs, [torch.Generator().manual_seed(i) for i in range(6)])
    assert tokens[1::2].tolist() == logits[1::2].argmax(-1).tolist()
    with pytest.raises(RuntimeError, match="nan"):
        draw_rows(torch.full((1, vocab), float("nan")), [None])


@pytest.mark.parametrize("threads", [1, 2])
def test_parallel_draws_keep_each_rows_stream(threads):
    """A large vocab's rows draw on a thread pool (inference mode carried to it); each row
    still gets its own generator's multinomial draw, whatever the torch thread count."""
    vocab = sampling.PARALLEL_DRAW_VOCAB * 2
    probs = torch.randn(5, vocab, generator=torch.Generator().manual_seed(3)).softmax(-1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gens = [torch.Generator().manual_seed(40 + i) for i in range(5)]
        alone = [torch.Generator().manual_seed(40 + i) for i in range(5)]
        with torch.inference_mode():
            for _ in range(2):
                want = [int(torch.multinomial(probs[i:i + 1], 1, generator=g))
                        for i, g in enumerate(alone)]
                assert draw_rows(probs, gens).tolist() == want
        assert (sampling._draw_pool(vocab) is None) == (threads == 1)
    finally:
        torch.set_num_threads(before)
