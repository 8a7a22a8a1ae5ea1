"""Output extraction rules (spec §4.8, fixtures README §5.4)."""

from __future__ import annotations

import pytest
import torch

from mimo_tts.errors import AudioCheckError
from mimo_tts.lm.extract import extract

EMPTY_IDS = (1024, 1024) + (128,) * 6


def _groups(special, groups):
    """[(text token, codes [4, 8] or None)] -> new_ids [9, 4N] in the generated layout."""
    blocks = []
    for token, codes in groups:
        if codes is None:
            codes = torch.tensor(EMPTY_IDS).expand(4, -1)
        blocks.append(torch.cat((torch.full((1, 4), token), codes.T), dim=0))
    return torch.cat(blocks, dim=1)


def _audio(seed):
    return torch.stack([torch.randint(0, n, (4,), generator=torch.Generator().manual_seed(seed))
                        for n in EMPTY_IDS], dim=1)  # [4, 8]


def test_audio_after_generated_sostm_until_eostm(text_tokenizer, special):
    a, b, c = _audio(1), _audio(2), _audio(3)
    ids = _groups(special, [(special.empty, a), (special.sostm, None), (special.empty, b),
                            (special.eot, None), (special.empty, c), (special.eostm, None),
                            (special.empty, _audio(4))])
    out = extract(ids, text_tokenizer, EMPTY_IDS, 4)
    # Group 0 precedes the generated <|sostm|>; the <|eot|> group's frames are all empty.
    assert torch.equal(out.codes, torch.cat((b, c)).T)
    assert (out.audio_start, out.audio_end, out.n_frames) == (2, 5, 8)
    assert out.text == "<|sostm|>"


def test_plain_tts_audio_starts_at_the_first_group_and_text_drops_the_last(text_tokenizer,
                                                                           special):
    hi = text_tokenizer.encode("hi")
    ids = _groups(special, [(t, None) for t in hi] + [(special.empty, _audio(5)),
                                                     (special.eostm, None)])
    out = extract(ids, text_tokenizer, EMPTY_IDS, 4)
    assert out.text == "hi" and out.n_frames == 4
    ended = _groups(special, [(t, None) for t in hi] + [(special.im_end, None)])
    assert extract(ended, text_tokenizer, EMPTY_IDS, 4).text == "hi"
    # Without a stop group the last generated token is still dropped (spec §4.8).
    assert extract(ended[:, :-4], text_tokenizer, EMPTY_IDS, 4).text == text_tokenizer.decode(
        hi[:-1]).strip()


def test_no_audio_is_none_not_silence(text_tokenizer, special):
    ids = _groups(special, [(special.end_think, None), (special.eostm, None)])
    out = extract(ids, text_tokenizer, EMPTY_IDS, 4)
    assert out.codes is None and out.n_frames == 0
    assert out.text == "</think>"


def test_codes_at_or_above_the_empty_id_are_rejected(text_tokenizer, special):
    bad = _audio(6)
    bad[2, 3] = EMPTY_IDS[3]  # channel 3 holds its empty id in a kept frame
    ids = _groups(special, [(special.empty, bad), (special.eostm, None)])
    with pytest.raises(AudioCheckError, match="channel 3 frame 2"):
        extract(ids, text_tokenizer, EMPTY_IDS, 4)
