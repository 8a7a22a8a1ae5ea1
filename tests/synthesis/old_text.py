"""The sentence splitter as it was before it was made linear (quadratic in the worst case): the
oracle `test_text_linear.py` compares the new splitter with, on random texts."""

from __future__ import annotations

import re


def split_text(text: str, max_chars: int) -> list[str]:
    """Split long text at sentence ends into pieces of at most `max_chars` characters.

    Every piece is a slice of `text` (whitespace at a cut is dropped, nothing is added or
    changed), so joining the pieces with the whitespace between them gives the text back. A
    sentence ends at `.!?;…` followed by whitespace (not "3.5", "www.example.com" or an
    abbreviation such as "p.m." or "Mr."), or at `。！？；`; closing quotes stay with it. A
    sentence longer than the limit is cut at whitespace, then at a comma, else at the limit.
    """
    if max_chars <= 0 or len(text) <= max_chars:
        return [text]
    spans: list[tuple[int, int]] = []
    for start, end in _sentences(text):
        spans.extend(_hard_spans(text, start, end, max_chars))
    pieces: list[tuple[int, int]] = []
    for start, end in spans:
        if pieces and end - pieces[-1][0] <= max_chars:
            pieces[-1] = (pieces[-1][0], end)
        else:
            pieces.append((start, end))
    return [text[a:b] for a, b in pieces]


_ASCII_END = re.compile(r"[.!?;…]+[\"'”’)\]]*(?=\s)")


_CJK_END = re.compile(r"[。！？；]+[”’」』）)]*")


# Lower-cased words that end in "." without ending a sentence (initials are caught apart).
ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st mt vs etc e.g i.e a.m p.m no nos inc ltd co corp fig figs approx "
    "dept est vol ch sec cf al jan feb mar apr jun jul aug sep sept oct nov dec u.s u.k".split())


def _sentence_ends(text: str) -> list[int]:
    ends = [m.end() for m in _CJK_END.finditer(text)]
    for match in _ASCII_END.finditer(text):
        word = text[:match.start()].rsplit(None, 1)[-1] if text[:match.start()].strip() else ""
        word = word.lstrip("(\"'“‘").lower()
        if text[match.start()] == "." and (word in ABBREVIATIONS or (len(word) == 1
                                                                      and word.isalpha())):
            continue
        ends.append(match.end())
    return sorted(set(ends))


def sentences(text: str) -> list[str]:
    """The sentences of `text` (as `split_text` finds their ends), each a slice of it."""
    return [text[a:b] for a, b in _sentences(text)]


def _sentences(text: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence, whitespace around it excluded."""
    out, start = [], 0
    for end in [*_sentence_ends(text), len(text)]:
        span = _trim(text, start, end)
        if span is not None:
            out.append(span)
        start = end
    return out


def _trim(text: str, start: int, end: int) -> tuple[int, int] | None:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (start, end) if end > start else None


def _hard_spans(text: str, start: int, end: int, max_chars: int) -> list[tuple[int, int]]:
    """A sentence longer than the limit, cut at whitespace, commas, or the limit itself."""
    spans = []
    while end - start > max_chars:
        window = text[start:start + max_chars + 1]  # a cut may fall just past the limit
        cut = max(window.rfind(" "), window.rfind("\t"))
        if cut <= 0:
            cut = max(max(window.rfind(", "), window.rfind("，"), window.rfind("、")) + 1, 0)
        cut = start + (cut if 0 < cut <= max_chars else max_chars)
        span = _trim(text, start, cut)
        if span is not None:
            spans.append(span)
        start = cut
        while start < end and text[start].isspace():
            start += 1
    if end > start:
        spans.append((start, end))
    return spans


_CLAUSE_END = re.compile(r"(?:[,;:]|\s[—–-])(?=\s)|[，；：、]")
CUE_CHARS = 84


def caption_pieces(text: str, max_chars: int = 0) -> list[str]:
    limit = min(CUE_CHARS, max_chars) if max_chars > 0 else CUE_CHARS
    return [part for sentence in sentences(text) for part in _clauses(sentence, limit)]


def _clauses(sentence: str, limit: int) -> list[str]:
    if len(sentence) <= limit:
        return [sentence]
    cuts = [m.end() for m in _CLAUSE_END.finditer(sentence)]
    parts, start, last = [], 0, 0
    for cut in [*cuts, len(sentence)]:
        if cut - start > limit and last > start:
            parts.append(sentence[start:last])
            start = last
        last = cut
    parts.append(sentence[start:])
    out = []
    for part in (p.strip() for p in parts):
        if part:
            out.extend(split_text(part, limit) if len(part) > limit else [part])
    return out
