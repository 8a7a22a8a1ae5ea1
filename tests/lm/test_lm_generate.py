"""Generation against the reference (fixtures README §5.4), batching, seeds and stop rules."""

from __future__ import annotations

import pytest
import torch

from mimo_tts.errors import InputError, UsageError
from mimo_tts.lm.config import MAX_GROUPS
from mimo_tts.lm.extract import extract
from mimo_tts.lm.generate import GenerationOptions, generate, stream
from mimo_tts.lm.sampling import TASK_SAMPLERS, SamplerConfig
from tests.helpers import find_case

TOL = 1e-4
GENERATE = [
    ("lm_generate", "gen_tts_en_forced"),
    ("lm_generate", "gen_tts_zh_forced_interleaved"),
    ("lm_generate", "gen_tts_instruct_forced"),
    ("lm_generate", "gen_tts_en_free_greedy"),
    ("voice_prompt", "gen_tts_voice_forced"),
    ("voice_prompt", "gen_tts_voice_free_greedy"),
]


def _options(case, special, forcing, greedy_options, **kw):
    params = case["params"]
    assert sorted(set(params["stop_token_ids"])) == sorted(
        {special.eos, special.eostm, special.im_end}
    )
    script = params["forced_script_ids"]
    return greedy_options(
        max_new_groups=params["max_new_groups"],
        text_logits_processor=forcing([script]) if script else None, **kw,
    )


def test_every_generation_case_is_covered(cases):
    found = {(g, c["name"]) for g, grp in cases["groups"].items() for c in grp["cases"]
             if c["task"] == "lm_generate"}
    assert found == set(GENERATE)


@pytest.mark.parametrize(("group", "name"), GENERATE)
def test_generation_matches_reference(lm, text_tokenizer, special, cases, case_tensors,
                                      forcing, greedy_options, group, name):
    case, t = find_case(cases, name), case_tensors(group)
    options = _options(case, special, forcing, greedy_options, keep_logits=True)
    result = generate(lm, [t[f"{name}.input_ids"]], options, special)[0]
    assert result.text_tokens == case["generated_text_tokens"]
    assert torch.equal(result.new_ids, t[f"{name}.new_ids"].long())
    torch.testing.assert_close(result.step_logits, t[f"{name}.step_text_logits"],
                               atol=TOL, rtol=0)
    out = extract(result.new_ids, text_tokenizer, lm.cfg.speech_empty_ids, lm.cfg.group_size)
    assert out.text == case["extracted_text"]
    if case["no_audio"]:
        assert out.codes is None
    else:
        assert torch.equal(out.codes, t[f"{name}.audio_codes"].long())


@pytest.mark.parametrize(("group", "name"), [g for g in GENERATE if "forced" in g[1]])
def test_generated_codes_decode_to_reference_waveform(lm, text_tokenizer, special, cases,
                                                      case_tensors, forcing, greedy_options,
                                                      codec, group, name):
    case, t = find_case(cases, name), case_tensors(group)
    result = generate(lm, [t[f"{name}.input_ids"]],
                      _options(case, special, forcing, greedy_options), special)[0]
    out = extract(result.new_ids, text_tokenizer, lm.cfg.speech_empty_ids, lm.cfg.group_size)
    wave = codec.decode(out.codes)
    assert wave.shape == (960 * out.n_frames,)
    torch.testing.assert_close(wave, t[f"{name}.waveform"], atol=TOL, rtol=0)


def _prompts(case_tensors):
    t = case_tensors("lm_generate")
    # 54, 56 and 147 groups: three different lengths, so two rows are left-padded.
    return [t[f"{n}.input_ids"] for n in
            ("gen_tts_en_forced", "gen_tts_zh_forced_interleaved", "gen_tts_instruct_forced")]


def test_forced_batch_matches_reference_with_per_row_stopping(lm, special, cases, case_tensors,
                                                              forcing, greedy_options):
    names = ["gen_tts_en_forced", "gen_tts_zh_forced_interleaved", "gen_tts_instruct_forced"]
    scripts = [find_case(cases, n)["params"]["forced_script_ids"] for n in names]
    options = greedy_options(text_logits_processor=forcing(scripts), keep_logits=True)
    results = generate(lm, _prompts(case_tensors), options, special)
    t = case_tensors("lm_generate")
    assert [len(r.text_tokens) for r in results] == [7, 9, 8]  # each row stopped on its own
    for name, result in zip(names, results, strict=True):
        assert torch.equal(result.new_ids, t[f"{name}.new_ids"].long())
        torch.testing.assert_close(result.step_logits, t[f"{name}.step_text_logits"],
                                   atol=TOL, rtol=0)


def test_greedy_batch_equals_single_prompts(lm, special, case_tensors, greedy_options):
    options = greedy_options(max_new_groups=5, keep_logits=True)
    prompts = _prompts(case_tensors)
    batch = generate(lm, prompts, options, special)
    for prompt, together in zip(prompts, batch, strict=True):
        alone = generate(lm, [prompt], options, special)[0]
        assert torch.equal(together.new_ids, alone.new_ids)
        torch.testing.assert_close(together.step_logits, alone.step_logits, atol=TOL, rtol=0)


def test_stream_yields_groups_in_order_and_generate_is_built_on_it(lm, special, cases,
                                                                   case_tensors, forcing,
                                                                   greedy_options):
    names = ["gen_tts_en_forced", "gen_tts_zh_forced_interleaved"]
    scripts = [find_case(cases, n)["params"]["forced_script_ids"] for n in names]
    options = greedy_options(text_logits_processor=forcing(scripts))
    prompts = _prompts(case_tensors)[:2]
    steps = list(stream(lm, prompts, options, special))
    t = case_tensors("lm_generate")
    for row, name in enumerate(names):
        mine = [s for s in steps if s.index == row]
        assert [s.step for s in mine] == list(range(len(scripts[row])))
        assert [s.text_token for s in mine] == scripts[row]
        assert [s.finished for s in mine] == [False] * (len(mine) - 1) + [True]
        ids = t[f"{name}.new_ids"].long()
        for s in mine:
            block = ids[:, 4 * s.step: 4 * s.step + 4]
            if s.text_token == special.empty:
                assert s.codes.shape == (4, 8) and torch.equal(s.codes, block[1:].T)
            else:
                assert s.codes is None
    # Groups are yielded as they are produced: step k of every live row before step k + 1.
    assert [s.step for s in steps] == sorted(s.step for s in steps)


def _sampling_options(forcing, seed, steps=4, **kw):
    # Text forced to <|empty|> so that every step runs the sampled patch decoder.
    return GenerationOptions(
        text_sampler=TASK_SAMPLERS["tts"][0], audio_sampler=TASK_SAMPLERS["tts"][1],
        seed=seed, max_new_groups=steps, **kw,
    )


def test_seed_reproducibility_with_sampling(lm, special, case_tensors, forcing):
    prompt = _prompts(case_tensors)[:1]
    hook = forcing([[special.empty] * 4])
    runs = [generate(lm, prompt, _sampling_options(forcing, seed, text_logits_processor=hook),
                     special)[0].new_ids for seed in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    codes = runs[0][1:]
    assert (codes < torch.tensor(lm.cfg.speech_empty_ids)[:, None]).all()
    # Free text sampling at temperature 1 also follows the seed.
    free = GenerationOptions(text_sampler=SamplerConfig(1.0), audio_sampler=SamplerConfig(1.0),
                             max_new_groups=6)
    texts = [generate(lm, prompt, GenerationOptions(**{**free.__dict__, "seed": s}),
                      special)[0].text_tokens for s in (1, 1, 2)]
    assert texts[0] == texts[1] != texts[2]


def _favour(token: int, bonus: float = 1e3):
    def hook(step, logits):
        logits = logits.clone()
        logits[:, token] += bonus
        return logits

    return hook


def test_min_new_groups_suppresses_stop_tokens(lm, special, case_tensors, greedy_options):
    prompt = _prompts(case_tensors)[:1]
    hook = _favour(special.eostm)
    first = generate(lm, prompt, greedy_options(text_logits_processor=hook), special)[0]
    assert first.text_tokens == [special.eostm]  # the stop group is kept
    held = generate(lm, prompt, greedy_options(text_logits_processor=hook, min_new_groups=3),
                    special)[0]
    stops = {special.eos, special.eostm, special.im_end}
    assert len(held.text_tokens) == 4 and held.text_tokens[-1] == special.eostm
    assert not stops & set(held.text_tokens[:3])
    assert held.new_ids.shape == (9, 16)


def test_max_new_groups_and_the_total_cap(lm, special, case_tensors, greedy_options):
    prompt = _prompts(case_tensors)[0]
    two = list(stream(lm, [prompt], greedy_options(max_new_groups=2), special))
    assert [(s.step, s.finished) for s in two] == [(0, False), (1, True)]
    # The total (prompt + new) is capped at MAX_GROUPS: repeat the prompt's text groups.
    groups = MAX_GROUPS - 2
    text = prompt[:, :4].repeat(1, groups)
    capped = generate(lm, [text], greedy_options(max_new_groups=10), special)[0]
    assert len(capped.text_tokens) == 2 and capped.new_ids.shape == (9, 8)
    with pytest.raises(InputError, match="no room"):
        generate(lm, [prompt[:, :4].repeat(1, MAX_GROUPS)], greedy_options(), special)


def test_options_are_validated(special, lm, case_tensors):
    with pytest.raises(UsageError):
        GenerationOptions(max_new_groups=0)
    with pytest.raises(UsageError):
        GenerationOptions(min_new_groups=-1)
    with pytest.raises(UsageError, match="unknown stop token"):
        generate(lm, _prompts(case_tensors)[:1], GenerationOptions(stop_tokens=("nope",)),
                 special)
    tts = GenerationOptions.for_task("tts", seed=3)
    assert tts.text_sampler == SamplerConfig(0.6, None, 1.0) and tts.seed == 3
    assert GenerationOptions.for_task("asr").stop_tokens == ("eos", "im_end")
