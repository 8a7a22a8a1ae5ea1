"""The vLLM engine against the native engine on the tiny preset, float32 (issue 7).

Greedy runs must be equal id for id (text tokens and every code); sampled runs must repeat
under a seed; and the codes must follow the text token vLLM actually sampled. Whole runs go
through `lm.batching.generate_all` / `stream_steps` over the engine's `run_batch`.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup_vllm_venv.sh)")

from mimo_tts.errors import InputError, UsageError
from mimo_tts.lm.batching import generate_all, stream_steps
from mimo_tts.lm.extract import extract
from mimo_tts.lm.generate import GenerationOptions, generate
from mimo_tts.lm.sampling import GREEDY, TASK_SAMPLERS, SamplerConfig

from .conftest import KV_BYTES  # noqa: E402


@pytest.fixture(scope="module")
def engine(preset_lm_dir):
    from mimo_tts.lm.vllm.engine import VLLMEngine, VLLMOptions

    eng = VLLMEngine(preset_lm_dir, VLLMOptions(dtype="float32", kv_cache_memory_bytes=KV_BYTES,
                                                max_num_seqs=8))
    yield eng
    eng.close()


def _assert_same(native_results, vllm_results):
    for want, got in zip(native_results, vllm_results, strict=True):
        assert got.text_tokens == want.text_tokens
        assert torch.equal(got.new_ids, want.new_ids)


def test_greedy_batch_of_different_lengths_equals_native(engine, native, preset_special, prompts,
                                                         greedy_options, preset_text_tokenizer):
    batch = [prompts[k] for k in ("short", "long", "zh", "instruct")]
    assert len({p.shape[1] for p in batch}) == 4  # four prompt lengths in one batch
    options = greedy_options()
    want = generate(native, batch, options, preset_special)
    got = generate_all(engine, batch, options)
    _assert_same(want, got)
    cfg = native.cfg
    for result in got:  # real speech came out: audio groups, then <|eostm|>
        out = extract(result.new_ids, preset_text_tokenizer, cfg.speech_empty_ids, cfg.group_size)
        assert out.n_frames >= 16 and result.text_tokens[-1] == preset_special.eostm


def test_voice_prompt_task_equals_native(engine, native, preset_special, prompts, greedy_options):
    # The voice prompt's audio groups go through the patch encoder from the request's codes,
    # next to a plain prompt in the same batch.
    batch = [prompts["voice"], prompts["short"]]
    options = greedy_options()
    _assert_same(generate(native, batch, options, preset_special),
                 generate_all(engine, batch, options))


def test_stream_yields_each_rows_groups_in_order_with_their_codes(engine, preset_special, prompts,
                                                                  greedy_options):
    batch = [prompts["short"], prompts["voice"]]
    options = greedy_options()
    steps = list(stream_steps(engine, batch, options))
    results = generate_all(engine, batch, options)
    for row, result in enumerate(results):
        mine = [s for s in steps if s.index == row]
        assert [s.step for s in mine] == list(range(len(result.text_tokens)))
        assert [s.text_token for s in mine] == result.text_tokens
        assert [s.finished for s in mine] == [False] * (len(mine) - 1) + [True]
        for s in mine:
            block = result.new_ids[:, 4 * s.step : 4 * s.step + 4]
            if s.text_token == preset_special.empty:
                assert s.codes.shape == (4, 8) and torch.equal(s.codes, block[1:].T)
            else:
                assert s.codes is None


def test_group_cap_decides_the_last_audio_group(engine, native, preset_special, prompts,
                                                greedy_options):
    # Capped while speaking: the last group is <|empty|> and no forward pass follows it, so
    # its codes are decided when the request finishes.
    options = greedy_options(max_new_groups=5)
    got = generate_all(engine, [prompts["long"]], options)
    assert got[0].text_tokens == [preset_special.empty] * 5
    _assert_same(generate(native, [prompts["long"]], options, preset_special), got)


def test_min_new_groups_hold_off_the_stop_like_native(engine, native, preset_special, prompts,
                                                      greedy_options):
    options = greedy_options(min_new_groups=30, max_new_groups=34)
    got = generate_all(engine, [prompts["short"]], options)
    assert len(got[0].text_tokens) >= 30
    _assert_same(generate(native, [prompts["short"]], options, preset_special), got)


def test_seeded_sampling_repeats_and_seeds_matter(engine, prompts):
    text, audio = TASK_SAMPLERS["tts"]
    batch = [prompts["short"], prompts["voice"]]
    runs = [generate_all(engine, batch, GenerationOptions(
                text_sampler=text, audio_sampler=audio, seed=seed, max_new_groups=12))
            for seed in (7, 7, 8)]
    for first, again in zip(runs[0], runs[1], strict=True):
        assert torch.equal(first.new_ids, again.new_ids)
    assert any(not torch.equal(a.new_ids, b.new_ids) for a, b in zip(runs[0], runs[2],
                                                                       strict=True))


def test_codes_follow_the_sampled_text_token(engine, native, preset_special, prompts,
                                             greedy_options, forcing):
    # Hot text sampling (<|eostm|> not a stop here) draws many tokens that are not the argmax
    # (<|empty|> is, by far, on this checkpoint). Replaying the drawn tokens through the native
    # engine (forced, greedy audio) must give the same codes: audio exactly where <|empty|>
    # was drawn, decided from that draw.
    options = GenerationOptions(text_sampler=SamplerConfig(2.0, 4, 1.0), audio_sampler=GREEDY,
                                seed=3, max_new_groups=40, stop_tokens=("im_end",))
    batch = [prompts["short"], prompts["zh"], prompts["instruct"]]
    got = generate_all(engine, batch, options)
    drawn = [token for r in got for token in r.text_tokens]
    empty = drawn.count(preset_special.empty)
    assert empty >= 5 and len(drawn) - empty >= 5
    scripts = [r.text_tokens for r in got]
    for prompt, script, result in zip(batch, scripts, got, strict=True):
        replay = greedy_options(max_new_groups=len(script), stop_tokens=("im_end",),
                                text_logits_processor=forcing([script]))
        _assert_same(generate(native, [prompt], replay, preset_special), [result])


def test_unsupported_options_and_bad_prompts_are_refused(engine, prompts, greedy_options):
    with pytest.raises(UsageError, match="text_logits_processor"):
        list(stream_steps(engine, [prompts["short"]],
                          greedy_options(text_logits_processor=lambda s, x: x)))
    with pytest.raises(UsageError, match="step logits"):
        generate_all(engine, [prompts["short"]], greedy_options(keep_logits=True))
    with pytest.raises(UsageError, match="temperature"):  # vLLM's range is [0, 2]
        generate_all(engine, [prompts["short"]],
                     GenerationOptions(text_sampler=SamplerConfig(3.0), audio_sampler=GREEDY))
    with pytest.raises(InputError):
        generate_all(engine, [prompts["short"][:, :6]], greedy_options())  # not whole groups
    with pytest.raises(UsageError, match="no prompts"):
        generate_all(engine, [], greedy_options())
    first = stream_steps(engine, [prompts["short"]], greedy_options())
    next(first)
    with pytest.raises(UsageError, match="already running a batch"):
        generate_all(engine, [prompts["short"]], greedy_options())
    first.close()  # an abandoned run aborts its requests and frees the engine
    (capped,) = generate_all(engine, [prompts["short"]], greedy_options(max_new_groups=2))
    assert len(capped.text_tokens) == 2
