"""Text rules: control characters refused, long text split at sentence ends (ASCII and CJK
punctuation, abbreviations kept), never inside a grapheme cluster, in linear time.

A text is at most `MAX_TEXT_CHARS` characters (`clean_text` refuses a longer one): splitting is
linear in the text's length and its memory is the pieces themselves, so the limit bounds what
one item may cost before the model sees it, not the splitter.
"""

from __future__ import annotations

import re
import unicodedata

from mimo_tts.errors import InputError

MAX_TEXT_CHARS = 1_000_000  # one text (an item, a request): about 20 hours of speech


def clean_text(text: str, where: str) -> str:
    """Collapse whitespace; refuse empty text, text past `MAX_TEXT_CHARS` and control
    characters (naming the position)."""
    if not isinstance(text, str):
        raise InputError(f"{where}: text must be a string, got {type(text).__name__}")
    if len(text) > MAX_TEXT_CHARS:
        raise InputError(f"{where}: text is {len(text):,} characters; the limit is "
                         f"{MAX_TEXT_CHARS:,}: split it into several items")
    for pos, char in enumerate(text):
        if unicodedata.category(char) == "Cs":  # \ud800 in JSON, or argv bytes not UTF-8
            raise InputError(f"{where}: text is not valid Unicode (lone surrogate "
                             f"U+{ord(char):04X} at {pos}: invalid UTF-8 or a broken escape)")
    text = unicodedata.normalize("NFC", text)
    for pos, char in enumerate(text):
        if unicodedata.category(char) == "Cc" and char not in "\t\n\r":
            raise InputError(f"{where}: text has control character U+{ord(char):04X} at {pos}")
    text = " ".join(text.split())
    if not text:
        raise InputError(f"{where}: empty text")
    return text


def split_text(text: str, max_chars: int) -> list[str]:
    """Split long text at sentence ends into pieces of at most `max_chars` characters.

    Every piece is a slice of `text` (whitespace at a cut is dropped, nothing is added or
    changed), so joining the pieces with the whitespace between them gives the text back. A
    sentence ends at `.!?;…` followed by whitespace (not "3.5", "www.example.com" or an
    abbreviation such as "p.m." or "Mr."), or at `。！？；`; closing quotes stay with it. A
    sentence longer than the limit is cut at whitespace, then at a comma, else at the limit.
    No cut falls inside a grapheme cluster (`grapheme_boundary`): a cluster longer than the
    limit is a piece of its own.
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


def sentences(text: str) -> list[str]:
    """The sentences of `text` (as `split_text` finds their ends), each a slice of it."""
    return [text[a:b] for a, b in _sentences(text)]


def trim(text: str) -> str:
    """`text` without the whitespace at its ends, except whitespace that is part of a grapheme
    cluster (a space carrying a combining mark)."""
    span = _trim(text, 0, len(text))
    return text[span[0]:span[1]] if span else ""


# --- sentence ends ---------------------------------------------------------------------------

# A sentence ends after a run of `.!?;…` and any closing quotes, when whitespace follows. Each
# run is found once and decided once: a run not followed by whitespace cannot end a sentence
# from any of its positions, so nothing is scanned twice (the single regex it replaces tried
# every position of a long run of dots again).
_ASCII_RUN = re.compile(r"[.!?;…]+")
_CLOSERS = re.compile(r"[\"'”’)\]]*")
_CJK_END = re.compile(r"[。！？；]+[”’」』）)]*")

# Lower-cased words that end in "." without ending a sentence (initials are caught apart).
ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st mt vs etc e.g i.e a.m p.m no nos inc ltd co corp fig figs approx "
    "dept est vol ch sec cf al jan feb mar apr jun jul aug sep sept oct nov dec u.s u.k".split())


def _sentence_ends(text: str) -> list[int]:
    ends = [m.end() for m in _CJK_END.finditer(text)]
    for run in _ASCII_RUN.finditer(text):
        end = _CLOSERS.match(text, run.end()).end()
        if end >= len(text) or not text[end].isspace():
            continue
        if text[run.start()] == "." and _abbreviation(_word_before(text, run.start())):
            continue
        ends.append(end)
    return sorted({end for end in ends if grapheme_boundary(text, end)})


def _word_before(text: str, at: int) -> str:
    """The last whitespace-separated word of `text[:at]` ("" when there is none)."""
    end = at
    while end > 0 and text[end - 1].isspace():
        end -= 1
    start = end
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    return text[start:end]


def _abbreviation(word: str) -> bool:
    word = word.lstrip("(\"'“‘").lower()
    return word in ABBREVIATIONS or (len(word) == 1 and word.isalpha())


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
    """[start, end) without whitespace at its ends (whitespace inside a cluster stays)."""
    while start < end and text[start].isspace() and grapheme_boundary(text, start + 1):
        start += 1
    while end > start and text[end - 1].isspace() and grapheme_boundary(text, end - 1):
        end -= 1
    return (start, end) if end > start else None


def _hard_spans(text: str, start: int, end: int, max_chars: int) -> list[tuple[int, int]]:
    """A sentence longer than the limit, cut at whitespace, commas, or the limit itself."""
    spans = []
    while end - start > max_chars:
        window = text[start:start + max_chars + 1]  # a cut may fall just past the limit
        cut = _space_cut(text, start, window)
        if cut <= 0:
            cut = _comma_cut(text, start, window, max_chars)
        cut = start + cut if 0 < cut <= max_chars else _limit_cut(text, start, max_chars)
        span = _trim(text, start, cut)
        if span is not None:
            spans.append(span)
        start = cut
        while start < end and text[start].isspace() and grapheme_boundary(text, start + 1):
            start += 1
    if end > start:
        spans.append((start, end))
    return spans


def _space_cut(text: str, start: int, window: str) -> int:
    """The last space or tab of the window that stands alone as a cluster (-1: none)."""
    high = len(window)
    while True:
        cut = max(window.rfind(" ", 0, high), window.rfind("\t", 0, high))
        if cut <= 0 or (grapheme_boundary(text, start + cut, start)
                        and grapheme_boundary(text, start + cut + 1, start)):
            return cut
        high = cut


def _comma_cut(text: str, start: int, window: str, max_chars: int) -> int:
    """Just after the last comma of the window that a cut may follow (0: none)."""
    high = len(window)
    while True:
        cut = max(max(window.rfind(", ", 0, high), window.rfind("，", 0, high),
                      window.rfind("、", 0, high)) + 1, 0)
        if cut <= 0 or cut > max_chars or grapheme_boundary(text, start + cut, start):
            return cut
        high = cut - 1


def _limit_cut(text: str, start: int, max_chars: int) -> int:
    """The last cluster boundary within the limit; past it when one cluster is longer."""
    for cut in range(start + max_chars, start, -1):
        if grapheme_boundary(text, cut, start):
            return cut
    cut = start + max_chars + 1
    while not grapheme_boundary(text, cut, start):
        cut += 1
    return cut


# --- grapheme clusters (Unicode's extended grapheme clusters, UAX #29) ---------------------------

# The standard library has no segmentation; the rules below are UAX #29's, each at least as
# strict as the standard's (where they differ, they keep more together: no break after a ZWJ,
# any letter after a virama), so a cut they allow is a cut between clusters.
ZWJ = "\u200d"
_PREPEND = frozenset(chr(c) for c in (*range(0x0600, 0x0606), 0x06DD, 0x070F, 0x0890, 0x0891,
                                      0x08E2, 0x0D4E, 0x110BD, 0x110CD, 0x111C2, 0x111C3,
                                      0x1193F, 0x11941, 0x11A3A, *range(0x11A84, 0x11A8A),
                                      0x11D46))
_EXTRA_EXTEND = frozenset("\u200c\u200d\u0e33\u0eb3\uff9e\uff9f")  # beside Mn, Me and Mc
_VIRAMAS = frozenset("\u094d\u09cd\u0acd\u0b4d\u0c4d\u0d4d")  # Indic conjunct linkers (GB9c)


def grapheme_boundary(text: str, i: int, floor: int = 0) -> bool:
    """Whether a cut between `text[i - 1]` and `text[i]` falls between grapheme clusters.

    `floor` is a position known to be a boundary at or before `i` (a piece's start): regional
    indicators are paired from it, so a call never looks further back than `i - floor`."""
    if i <= floor or i >= len(text):
        return True
    before, after = text[i - 1], text[i]
    if before == "\r" and after == "\n":  # GB3
        return False
    if _control(before) or _control(after):  # GB4, GB5
        return True
    if _hangul_pair(before, after):  # GB6-GB8
        return False
    if _extends(after) or before in _PREPEND or before == ZWJ:  # GB9, GB9a, GB9b, GB11
        return False
    if _regional(before) and _regional(after):  # GB12, GB13: flags are pairs
        run = i - 1
        while run > floor and _regional(text[run - 1]):
            run -= 1
        return (i - run) % 2 == 0
    if unicodedata.category(after) == "Lo":  # GB9c: a consonant joined by a virama
        at, linked = i, False
        while at > floor and (_extends(text[at - 1]) or text[at - 1] == ZWJ):
            linked = linked or text[at - 1] in _VIRAMAS
            at -= 1
        if linked:  # (the standard also wants a consonant before the virama)
            return False
    return True


def _control(char: str) -> bool:
    category = unicodedata.category(char)
    if category in ("Cc", "Zl", "Zp"):
        return True
    return (category == "Cf" and char not in _EXTRA_EXTEND and char not in _PREPEND
            and not "\U000e0020" <= char <= "\U000e007f")


def _extends(char: str) -> bool:
    """Extend, ZWJ or SpacingMark: never a break before it (GB9, GB9a)."""
    return (unicodedata.category(char) in ("Mn", "Me", "Mc") or char in _EXTRA_EXTEND
            or "\U0001f3fb" <= char <= "\U0001f3ff"  # emoji skin tones
            or "\U000e0020" <= char <= "\U000e007f")  # emoji tag sequences


def _regional(char: str) -> bool:
    return "\U0001f1e6" <= char <= "\U0001f1ff"


def _hangul(char: str) -> str | None:
    code = ord(char)
    if 0x1100 <= code <= 0x115F or 0xA960 <= code <= 0xA97C:
        return "L"
    if 0x1160 <= code <= 0x11A7 or 0xD7B0 <= code <= 0xD7C6:
        return "V"
    if 0x11A8 <= code <= 0x11FF or 0xD7CB <= code <= 0xD7FB:
        return "T"
    if 0xAC00 <= code <= 0xD7A3:
        return "LV" if (code - 0xAC00) % 28 == 0 else "LVT"
    return None


def _hangul_pair(before: str, after: str) -> bool:
    a, b = _hangul(before), _hangul(after)
    if a is None or b is None:
        return False
    return (a == "L" and b in ("L", "V", "LV", "LVT") or a in ("LV", "V") and b in ("V", "T")
            or a in ("LVT", "T") and b == "T")


def ended_sentences(text: str) -> tuple[list[str], str]:
    """A text still being written: its sentences whose end is there (an ASCII end mark and the
    whitespace after it, or a CJK one), and the rest, which more text may still extend."""
    ends = _sentence_ends(text)
    if not ends:
        return [], text
    return sentences(text[:ends[-1]]), text[ends[-1]:]
