"""Captions with exact times: one cue per synthesised piece.

With captions asked, a text is cut into one piece per sentence (a sentence past `CUE_CHARS` is
cut at clause punctuation, then at whitespace, never inside a grapheme cluster), and each piece
is generated on its own. The
pieces' audio is joined with `PAUSE_FRAMES` of silence between them (`audio.join_pieces`), so
a cue's start and end are known to the sample: piece i starts after the samples of the pieces
before it and their pauses. MiMo-Audio's TTS output carries no text aligned with its audio, so
there are no word times: nothing here is an estimate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mimo_tts.synthesis.audio import PAUSE_FRAMES
from mimo_tts.synthesis.text import grapheme_boundary, sentences, split_text, trim

CUE_CHARS = 84  # two subtitle lines of 42 characters, the usual readable cue
# A clause ends at `,;:` (or a dash) before whitespace, or at CJK clause punctuation.
_CLAUSE_END = re.compile(r"(?:[,;:]|\s[—–-])(?=\s)|[，；：、]")


def text_pieces(text: str, o) -> list[str]:
    """A text's pieces under `SynthesisOptions` `o`: one per sentence with captions, else
    split on sentence ends past `o.max_chars`."""
    return caption_pieces(text, o.max_chars) if o.captions else split_text(text, o.max_chars)


def caption_pieces(text: str, max_chars: int = 0) -> list[str]:
    """The pieces of a captioned text: its sentences, each cut at clause punctuation while
    longer than `CUE_CHARS` (or `max_chars` when smaller and not 0)."""
    limit = min(CUE_CHARS, max_chars) if max_chars > 0 else CUE_CHARS
    return [part for sentence in sentences(text) for part in _clauses(sentence, limit)]


def _clauses(sentence: str, limit: int) -> list[str]:
    if len(sentence) <= limit:
        return [sentence]
    cuts = [m.end() for m in _CLAUSE_END.finditer(sentence)
            if grapheme_boundary(sentence, m.end())]  # never inside a cluster
    parts, start, last = [], 0, 0
    for cut in [*cuts, len(sentence)]:
        if cut - start > limit and last > start:  # close the cue at the clause before
            parts.append(sentence[start:last])
            start = last
        last = cut
    parts.append(sentence[start:])
    out = []
    for part in map(trim, parts):
        if part:  # a clause still too long is cut at whitespace (`split_text`'s rule)
            out.extend(split_text(part, limit) if len(part) > limit else [part])
    return out


@dataclass(frozen=True)
class Cue:
    """One caption: a piece's text and its span in the joined samples, [start, end)."""

    index: int  # 1, 2, ...
    text: str
    start_sample: int
    end_sample: int
    sample_rate: int

    @property
    def start(self) -> float:
        return self.start_sample / self.sample_rate

    @property
    def end(self) -> float:
        return self.end_sample / self.sample_rate

    def record(self) -> dict:
        """The cue as JSON (sidecars, the server)."""
        return {"index": self.index, "text": self.text, "start": round(self.start, 6),
                "end": round(self.end, 6), "start_sample": self.start_sample,
                "end_sample": self.end_sample}


def piece_samples(piece, samples_per_frame: int) -> int:
    """A piece's decoded length: its audio's, else its frames' (Stage-1 gives 960 per frame)."""
    if piece.audio is not None:
        return int(piece.audio.shape[-1])
    return int(piece.codes.shape[-1]) * samples_per_frame


def cues(texts: list[str], lengths: list[int], sample_rate: int, samples_per_frame: int,
         pause_frames: int = PAUSE_FRAMES) -> list[Cue]:
    """The cues of pieces of `lengths` samples joined with `pause_frames` frames between."""
    if len(texts) != len(lengths):
        raise ValueError(f"{len(texts)} cue texts for {len(lengths)} pieces")
    out, at = [], 0
    for i, (text, length) in enumerate(zip(texts, lengths, strict=True)):
        if i:
            at += pause_frames * samples_per_frame
        out.append(Cue(i + 1, text, at, at + length, sample_rate))
        at += length
    return out


def at_rate(found: list[Cue], rate: int) -> list[Cue]:
    """Cues in the samples of their audio resampled to `rate`: each bound scaled and rounded
    up, as `audio.resample` sizes its output, so the last cue still ends at the audio's end."""
    if not found or found[0].sample_rate == rate:
        return found
    source = found[0].sample_rate

    def scale(sample: int) -> int:
        return -(-sample * rate // source)

    return [Cue(c.index, c.text, scale(c.start_sample), scale(c.end_sample), rate)
            for c in found]


# --- caption files -----------------------------------------------------------------------------


def caption_text(cues: list[dict], fmt: str) -> str:
    """SubRip (`srt`) or WebVTT (`vtt`) text of cue records (`Cue.record`), each cue's text
    escaped for its format (`cue_text`)."""
    mark = "," if fmt == "srt" else "."
    blocks = [f"{c['index']}\n{_stamp(c['start'], mark)} --> {_stamp(c['end'], mark)}\n"
              f"{cue_text(c['text'], fmt)}\n" for c in cues]
    text = "\n".join(blocks)
    return f"WEBVTT\n\n{text}" if fmt == "vtt" else text


_SRT_ARROW = re.compile(r"--+>")


def cue_text(text: str, fmt: str) -> str:
    """A cue's text as its file needs it: on one line (a line break could end the cue); in
    WebVTT `&`, `<` and `>` as character references (the WebVTT spec: `<` opens a tag, `&` a
    reference, and `-->` may not occur in cue text); in SubRip, which has no escapes, `-->`
    broken as `-- >` so no reader takes the line for a timing line."""
    text = " ".join(text.split())
    if fmt == "vtt":
        return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _SRT_ARROW.sub(lambda m: m[0][:-1] + " >", text)


def _stamp(seconds: float, mark: str) -> str:
    ms = round(seconds * 1000)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{mark}{ms:03d}"
