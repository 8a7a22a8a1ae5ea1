"""The library's voices (`tts.add_voice`, `synthesize(voice=...)`) and captions (`Audio.cues`)."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from mimo_tts.lm.batching import generate_all
from mimo_tts.presets import ensure_tiny_preset
from mimo_tts.runtime.paths import CACHE_ENV
from mimo_tts.synthesis.captions import caption_pieces

FIVE = ("The first sentence is short. A second one follows it. Then a third, with a comma. "
        "The fourth asks why? And the fifth ends it!")


@pytest.fixture(scope="module")
def tts(tiny_cache):
    import mimo_tts

    lm, tok = ensure_tiny_preset({CACHE_ENV: str(tiny_cache)})
    return mimo_tts.load(str(lm), str(tok), lm_device="cpu", tokenizer_device="cpu")


def test_a_stored_voice_speaks_as_its_file(tts, tmp_path):
    import mimo_tts

    tts.voices = mimo_tts.VoiceStore(tmp_path / "voices")
    rng = np.random.default_rng(1)
    sf.write(str(tmp_path / "me.wav"), (0.1 * rng.standard_normal(12000)).astype("float32"),
             24000)
    record = tts.add_voice("me", tmp_path / "me.wav", transcript="noise")
    assert [r["name"] for r in tts.list_voices()] == ["me"] and record["transcript"] == "noise"
    by_name = tts.synthesize("Say it.", voice="me", seed=2)
    by_file = tts.synthesize("Say it.", prompt_audio=str(tmp_path / "me.wav"), seed=2)
    assert np.array_equal(by_name.samples, by_file.samples)
    assert by_name.provenance["task"] == "tts_sft_with_audio"
    tts.remove_voice("me")
    with pytest.raises(mimo_tts.InputError, match="unknown voice 'me'"):
        tts.synthesize("Say it.", voice="me")


def test_caption_pieces_are_sentences_and_clauses():
    assert len(caption_pieces(FIVE)) == 5
    long = ("This sentence runs on for quite a while, long past a readable cue, and so it is "
            "cut at its commas; each part stays short.")
    parts = caption_pieces(long)
    assert len(parts) > 1 and all(len(p) <= 84 for p in parts)
    assert " ".join(parts) == long


def test_cues_are_the_pieces_samples_in_the_joined_audio(tts):
    audio = tts.synthesize(FIVE, captions=True, seed=1)
    cues = audio.cues
    assert [c.text for c in cues] == caption_pieces(FIVE) and len(cues) == 5
    assert all(a.end_sample < b.start_sample for a, b in zip(cues, cues[1:], strict=False))
    assert cues[-1].end_sample == len(audio.samples)  # within one frame: exactly the end
    # Each cue's span is that piece's decoded samples; the gaps are the pauses' zeros.
    o = tts._options("synthesize", None, captions=True, seed=1)
    gens = generate_all(tts.engine, [p.input_ids for p in tts.prompts(FIVE, o, 1)],
                        o.generation_options(1), rows=1)
    pieces = [tts.piece(p, g, 1) for p, g in zip(tts.prompts(FIVE, o, 1), gens, strict=True)]
    decoded = tts.stage1.decode([p.codes for p in pieces])
    for cue, piece in zip(cues, decoded, strict=True):
        assert np.array_equal(audio.samples[cue.start_sample:cue.end_sample], piece.numpy())
    for a, b in zip(cues, cues[1:], strict=False):
        assert b.start_sample - a.end_sample == 8 * 960
        assert not audio.samples[a.end_sample:b.start_sample].any()
    plain = tts.synthesize(FIVE, seed=1)
    assert plain.cues == () and len(plain.provenance["pieces"]) == 1
