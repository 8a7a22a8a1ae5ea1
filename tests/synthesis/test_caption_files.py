"""Issue 32 item 19: a cue's text cannot break its caption file. WebVTT cue text escapes `&`,
`<` and `>` (the WebVTT spec: `<` opens a tag, `&` a character reference, and `-->` may not
occur in a cue's text); SubRip, which has no escapes, gets `-->` broken so that no reader
takes a text line for a timing line; a line break in a cue's text would end the cue."""

from __future__ import annotations

import html
import re

import pytest

from mimo_tts.synthesis.captions import caption_text, cue_text, cues
from mimo_tts.synthesis.markup import default_pauses

HOSTILE = ["Tom & Jerry <b>bold</b> 1 < 2 > 0", "00:00:01.000 --> 00:00:09.000",
           "a ---> b -> c <-- d", "&amp; is already an entity", "two\nlines\r\nhere"]
TIMING = {"vtt": re.compile(r"^\d\d:\d\d:\d\d\.\d{3} --> \d\d:\d\d:\d\d\.\d{3}$"),
          "srt": re.compile(r"^\d\d:\d\d:\d\d,\d{3} --> \d\d:\d\d:\d\d,\d{3}$")}


def _records():
    return [c.record() for c in cues(HOSTILE, [24000] * len(HOSTILE), 24000,
                                    default_pauses(len(HOSTILE), 7680))]


def _parse(text: str, fmt: str) -> list[str]:
    """The cue texts a reader finds: after each timing line, the lines up to a blank one."""
    lines = text.split("\n")
    found, at = [], 0
    while at < len(lines):
        if "-->" in lines[at]:
            assert TIMING[fmt].match(lines[at]), lines[at]  # only real timing lines hold -->
            body = []
            at += 1
            while at < len(lines) and lines[at]:
                body.append(lines[at])
                at += 1
            found.append("\n".join(body))
        at += 1
    return found


def test_webvtt_cue_text_is_escaped_per_the_spec():
    text = caption_text(_records(), "vtt")
    assert text.startswith("WEBVTT\n\n")
    found = _parse(text, "vtt")
    assert len(found) == len(HOSTILE)  # before: 6 timing lines, and a cue cut in two
    for body, original in zip(found, HOSTILE, strict=True):
        assert "<" not in body and "-->" not in body
        assert not re.search(r"&(?!amp;|lt;|gt;)", body)  # every & starts a reference
        assert html.unescape(body) == " ".join(original.split())
    assert found[0] == "Tom &amp; Jerry &lt;b&gt;bold&lt;/b&gt; 1 &lt; 2 &gt; 0"


def test_srt_text_has_no_line_a_reader_takes_for_timing():
    found = _parse(caption_text(_records(), "srt"), "srt")
    assert len(found) == len(HOSTILE)
    assert found[1] == "00:00:01.000 -- > 00:00:09.000"
    assert found[2] == "a --- > b -> c <-- d"
    assert found[0] == HOSTILE[0] and found[3] == HOSTILE[3]  # nothing else changed
    assert found[4] == "two lines here"


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_plain_text_is_unchanged(fmt):
    assert cue_text("The boats came in at dawn, didn't they?", fmt) == (
        "The boats came in at dawn, didn't they?")


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_plain_cues_write_the_files_the_batch_writer_wrote(fmt):
    """A drop-in for `batch.files.caption_text`: the same bytes where no text needs escaping."""
    from mimo_tts.batch.files import caption_text as batch_caption_text

    plain = [c.record() for c in cues(["One sentence.", "Two, three!", "字。"], [960, 1920, 2880],
                                      24000, default_pauses(3, 7680))]
    assert caption_text(plain, fmt) == batch_caption_text(plain, fmt)
