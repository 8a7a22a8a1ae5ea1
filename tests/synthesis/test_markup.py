"""Pauses and voices in a text (`synthesis/markup.py`): what a text asks, to the sample."""

from __future__ import annotations

import pytest

from mimo_tts.errors import UsageError
from mimo_tts.synthesis.markup import MarkupError, Script, default_pauses, script
from mimo_tts.synthesis.options import SynthesisOptions

PLAIN = SynthesisOptions()


def test_plain_text_is_todays_pieces_and_pauses():
    text = "One sentence here. " * 30
    found = script(text.strip(), PLAIN)
    assert len(found.texts) > 1 and found.voices == (None,) * len(found.texts)
    assert found.pauses == default_pauses(len(found.texts), 7680)  # 0.32 s, 8 frames
    assert found.plain(7680)


def test_brackets_that_are_no_tags_stay_text():
    assert script("He said [laughs] and [pause] went.", PLAIN).texts == (
        "He said [laughs] and [pause] went.",)


@pytest.mark.parametrize(("tag", "samples"), [("[pause:1.5]", 36000), ("[pause:500ms]", 12000),
                                              ("[pause: 2s]", 48000), ("[PAUSE:0]", 0)])
def test_a_pause_tag_replaces_the_sentence_silence_there(tag, samples):
    found = script(f"First part. {tag} Second part.", PLAIN)
    assert found.texts == ("First part.", "Second part.")
    assert found.pauses == (0, samples, 0)


def test_pauses_in_a_row_add_up_and_the_ends_keep_theirs():
    found = script("[pause:1] Hello. [pause:0.25][pause:0.25] World. [pause:2]", PLAIN)
    assert found.pauses == (24000, 12000, 48000)


def test_sentence_silence_sets_the_pause_between_pieces():
    found = script("One. Two.", SynthesisOptions(captions=True, sentence_silence=0.5))
    assert found.texts == ("One.", "Two.") and found.pauses == (0, 12000, 0)


def test_ssml_breaks_by_time_and_strength():
    doc = ('<speak>Hello &amp; welcome.<break time="500ms"/>Second.<break strength="strong"/>'
           'Third.<break/>Fourth.<break time="1.5s"/></speak>')
    found = script(doc, PLAIN)
    assert found.texts == ("Hello & welcome.", "Second.", "Third.", "Fourth.")
    assert found.pauses == (0, 12000, 24000, 12000, 36000)


@pytest.mark.parametrize(("text", "named"), [
    ("<speak>Hi <emphasis>there</emphasis></speak>", "<emphasis>"),
    ("<speak>Hi <p>there</p></speak>", "<p>"),
    ('<speak>Hi <break strength="loud"/></speak>', "loud"),
    ("<speak>Hi <break time=\"abc\"/></speak>", "abc"),
    ("<speak>Hi", "not well-formed"),
    ("Hi [pause:abc] there", "[pause:abc]"),
    ("Hi [pause:61] there", "[pause:61]"),
    ("Hi [voice:bad/name] there", "[voice:bad/name]"),
    ("[pause:1]", "nothing to say"),
])
def test_anything_else_is_a_one_line_usage_error_naming_it(text, named):
    with pytest.raises(MarkupError) as caught:
        script(text, PLAIN)
    assert isinstance(caught.value, UsageError) and caught.value.exit_code == 2
    assert named in str(caught.value) and "\n" not in str(caught.value)


def test_voice_tags_give_each_piece_its_voice():
    found = script("[voice:narrator] She said: [voice:anna] Hello there. How are you? "
                   "[voice:default] Fine.", SynthesisOptions(captions=True))
    assert found.texts == ("She said:", "Hello there.", "How are you?", "Fine.")
    assert found.voices == ("narrator", "anna", "anna", "default")
    assert found.pauses == (0, 7680, 7680, 7680, 0)
    assert found.named_voices == ("narrator", "anna", "default")
    ssml = script('<speak><voice name="anna">Hi.</voice> Back.</speak>', PLAIN)
    assert ssml.voices == ("anna", None) and isinstance(ssml, Script)


# --- the library face ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tts(tiny_cache):
    import mimo_tts
    from mimo_tts.presets import ensure_tiny_preset
    from mimo_tts.runtime.paths import CACHE_ENV

    lm, tok = ensure_tiny_preset({CACHE_ENV: str(tiny_cache)})
    return mimo_tts.load(str(lm), str(tok), lm_device="cpu", tokenizer_device="cpu")


SHORT = {"seed": 3, "captions": True, "max_new_groups": 5}


def test_library_pauses_are_exact_in_synthesize_and_stream(tts):
    """`synthesize` and `stream` of a text with [pause:] and sentence_silence: the silence
    before, between and after the pieces is the asked samples; the cues start after it; the
    stream's samples are the whole call's."""
    import numpy as np

    plain = tts.synthesize("One here. Two here.", **SHORT)
    for text, extra, pauses in (
            ("[pause:0.1] One here. [pause:1.5] Two here. [pause:0.5]", {}, (2400, 36000, 12000)),
            ("One here. Two here.", {"sentence_silence": 0.05}, (0, 1200, 0)),
            ('<speak>One here.<break strength="x-strong"/>Two here.</speak>', {}, (0, 48000, 0))):
        audio = tts.synthesize(text, **SHORT, **extra)
        lengths = [c.end_sample - c.start_sample for c in audio.cues]
        assert lengths == [c.end_sample - c.start_sample for c in plain.cues]  # same pieces
        assert audio.cues[0].start_sample == pauses[0]
        assert audio.cues[1].start_sample - audio.cues[0].end_sample == pauses[1]
        assert len(audio.samples) == sum(lengths) + sum(pauses)
        for start, end in ((0, pauses[0]), (audio.cues[0].end_sample, audio.cues[1].start_sample),
                           (audio.cues[1].end_sample, len(audio.samples))):
            assert end - start in pauses and not audio.samples[start:end].any()
        streamed = np.concatenate([c.samples for c in tts.stream(text, **SHORT, **extra)])
        assert len(streamed) == len(audio.samples)
        assert not streamed[:pauses[0]].any() and not streamed[len(streamed) - pauses[2]:].any()
    default = tts.synthesize("One here. Two here.", **SHORT, sentence_silence=0.32)
    assert np.array_equal(default.samples, plain.samples)  # the default: today's audio


def test_library_voice_tags_speak_each_span_as_its_voice_alone(tts, monkeypatch):
    """`synthesize` of `[voice:natural] ... [voice:default] ...`: one `Audio` whose spans are
    each that text synthesised alone in its voice (the same codes, the same prompt), cues
    naming the voice; an unknown voice raises (a one-line usage error naming it) before
    the model generates anything."""
    import numpy as np
    import torch

    from mimo_tts.errors import EXIT_USAGE, MimoTTSError
    from mimo_tts.synthesis.options import SynthesisOptions
    from mimo_tts.synthesis.worker import SpeechJob

    def codes(text, **given):  # each piece's codes: the building blocks `synthesize` runs
        o = SynthesisOptions(**SHORT, **given)
        jobs = [SpeechJob(p, o.generation_options(o.seed), o.seed, decode="none")
                for p in tts.prompts(text, o, o.seed)]
        list(tts.worker(1).run(jobs))
        return [job.piece.codes for job in jobs]

    text = "[voice:natural] Speak softly now. [voice:default] Two here."
    audio = tts.synthesize(text, **SHORT)
    assert [c.voice for c in audio.cues] == ["natural", "default"]
    assert [c.text for c in audio.cues] == ["Speak softly now.", "Two here."]
    spans = [(c.start_sample, c.end_sample) for c in audio.cues]
    assert len(audio.samples) == spans[-1][1]
    tagged = codes(text)
    for (start, end), mine, record, (words, task) in zip(
            spans, tagged, audio.provenance["pieces"],
            (("Speak softly now.", "tts_sft_with_natural_instruction"), ("Two here.", "tts_sft")),
            strict=True):
        (alone,) = codes(words, task=task)
        assert torch.equal(mine, alone)
        said = tts.synthesize(words, task=task, **SHORT)
        assert record["rendered_prompt"] == said.provenance["pieces"][0]["rendered_prompt"]
        # decoded in one Stage-1 batch with the other span: equal up to float rounding
        assert np.allclose(audio.samples[start:end], said.samples, atol=1e-5)
    assert not torch.equal(tagged[0], codes("Speak softly now.")[0])  # its own voice's task

    calls = []
    worker = tts.worker

    def counted(*args, **kwargs):  # the real speech worker, counted
        calls.append(1)
        return worker(*args, **kwargs)

    monkeypatch.setattr(tts, "worker", counted)
    for tagged in ("[voice:default] Hi. [voice:nobody] There.",
                   '<speak>Hi. <voice name="nobody">There.</voice></speak>'):
        with pytest.raises(MimoTTSError) as raised:
            tts.synthesize(tagged, **SHORT)
        assert raised.value.exit_code == EXIT_USAGE and "'nobody'" in str(raised.value)
        assert len(str(raised.value).splitlines()) == 1
        with pytest.raises(MimoTTSError):
            next(iter(tts.stream(tagged, **SHORT)))
    assert calls == []
