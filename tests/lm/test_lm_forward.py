"""Teacher-forced prefill against the reference (fixtures README §5.3; tolerances §6)."""

from __future__ import annotations

import pytest
import torch

from mimo_tts.lm.generate import decode_patch, split_prompt
from mimo_tts.lm.model import KVCache
from mimo_tts.lm.sampling import GREEDY
from mimo_tts.lm.step import EagerStep

TOL = 1e-4
PREFILL = [
    ("lm_forward", "prefill_tts_en"),
    ("lm_forward", "prefill_tts_zh"),
    ("lm_forward", "prefill_tts_instruct"),
    ("voice_prompt", "prefill_tts_voice"),
]


def test_every_prefill_case_is_covered(cases):
    found = {(g, c["name"]) for g, grp in cases["groups"].items() for c in grp["cases"]
             if c["task"] == "lm_forward"}
    assert found == set(PREFILL)


@torch.inference_mode()
def _prefill(lm, ids, empty):
    text, codes = split_prompt(lm, ids, empty)
    embeds = lm.embed_groups(text[None], codes[None], empty)  # [1, G, H]
    groups = embeds.shape[1]
    cache = KVCache(lm.cfg.backbone, 1, groups, dtype=embeds.dtype, device=embeds.device)
    hidden = lm.backbone(embeds, torch.arange(groups)[None], cache, 0)
    return embeds[0], hidden[0]


@pytest.mark.parametrize(("group", "name"), PREFILL)
def test_prefill_matches_reference(lm, special, case_tensors, group, name):
    t = case_tensors(group)
    embeds, hidden = _prefill(lm, t[f"{name}.input_ids"], special.empty)
    torch.testing.assert_close(embeds, t[f"{name}.input_embeds"], atol=TOL, rtol=0)
    torch.testing.assert_close(hidden, t[f"{name}.last_hidden_all"], atol=TOL, rtol=0)
    with torch.inference_mode():
        logits = lm.text_logits(hidden[-1:])[0]
        local = lm.hidden_states_downcast(hidden[-1])
    torch.testing.assert_close(logits, t[f"{name}.text_logits_last"], atol=TOL, rtol=0)
    torch.testing.assert_close(local, t[f"{name}.local_hidden_last"], atol=TOL, rtol=0)


@pytest.mark.parametrize(("group", "name"), PREFILL)
def test_patch_decoder_matches_reference(lm, case_tensors, group, name):
    t = case_tensors(group)
    cfg = lm.cfg
    cache = KVCache(cfg.patch_decoder, 1, cfg.local_steps, dtype=torch.float32, device="cpu")
    record = [[] for _ in range(cfg.audio_channels)]
    with torch.inference_mode():
        codes = decode_patch(lm, t[f"{name}.local_hidden_last"][None], GREEDY, None,
                             EagerStep(lm, None, cache), record)
    assert codes.shape == (1, cfg.group_size, cfg.audio_channels)
    assert torch.equal(codes[0], t[f"{name}.local_greedy_tokens"].long())
    for c in range(cfg.audio_channels):
        logits = torch.cat(record[c])  # [F, V_c], frames in order
        torch.testing.assert_close(logits, t[f"{name}.local_logits_ch{c}"], atol=TOL, rtol=0)
    # The empty id is never produced (it is masked before the argmax).
    assert (codes[0] < torch.tensor(cfg.speech_empty_ids)).all()


def test_fresh_local_cache_per_group_gives_same_codes(lm, case_tensors):
    """Reusing one preallocated local cache across groups must not leak state."""
    t = case_tensors("lm_forward")
    cfg = lm.cfg
    cache = KVCache(cfg.patch_decoder, 1, cfg.local_steps, dtype=torch.float32, device="cpu")
    with torch.inference_mode():
        for name in ("prefill_tts_en", "prefill_tts_zh", "prefill_tts_en"):
            codes = decode_patch(lm, t[f"{name}.local_hidden_last"][None], GREEDY, None,
                                 EagerStep(lm, None, cache))
            assert torch.equal(codes[0], t[f"{name}.local_greedy_tokens"].long())


def test_bad_prompt_shapes_and_ids_are_input_errors(lm, special, case_tensors):
    from mimo_tts.errors import InputError

    ids = case_tensors("lm_forward")["prefill_tts_en.input_ids"]
    with pytest.raises(InputError, match="prompt ids must be"):
        split_prompt(lm, ids[:, :-1], special.empty)
    with pytest.raises(InputError, match="prompt ids must be"):
        split_prompt(lm, ids[:8], special.empty)
    bad = ids.clone()
    bad[0, 0] = lm.cfg.vocab_size
    with pytest.raises(InputError, match="text id out of range"):
        split_prompt(lm, bad, special.empty)
    bad = ids.clone()
    bad[0, :4] = special.empty
    bad[1, :4] = lm.cfg.speech_vocab_sizes[0]
    with pytest.raises(InputError, match="audio code out of range"):
        split_prompt(lm, bad, special.empty)
