"""Pauses and voices inside a text: `[pause:1.5]`, `[voice:anna]`, and a small SSML subset.

A text is a `Script`: its pieces (each generated on its own, as `captions.text_pieces` cuts
them), the voice of each (None: the run's) and the silence around them, counted in samples at
24 kHz: before each piece and after the last. Between two pieces the silence is
`--sentence-silence` unless the text asks for its own there (`[pause:]`, `<break>`; several in
a row add up); a pause before the first words or after the last is kept as asked.

Plain text stays plain: only `[pause:SECONDS]` (also `500ms`, `2s`) and `[voice:NAME]` are
read in it; any other bracket is spoken as written. A text that starts with `<speak` is an SSML
document; the subset read is `<speak>`, `<break time="500ms"/>` (or `1.5s`),
`<break strength="none|x-weak|weak|medium|strong|x-strong"/>` and `<voice name="NAME">...
</voice>`; any other tag is a `MarkupError` naming it (exit 2). No torch here.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from functools import lru_cache

from mimo_tts.errors import UsageError
from mimo_tts.synthesis.audio import SAMPLE_RATE
from mimo_tts.synthesis.captions import caption_pieces
from mimo_tts.synthesis.text import split_text, trim
from mimo_tts.synthesis.voices import BUILT_IN, check_name

DEFAULT_SENTENCE_SILENCE = 0.32  # seconds between pieces: 7680 samples, 8 code frames
MAX_SENTENCE_SILENCE = 10.0
MAX_PAUSE = 60.0  # seconds: the longest one `[pause:]` or `<break>` may ask
# <break strength=...>: seconds of silence (SSML's own names; `medium` is a bare <break/>).
STRENGTHS = {"none": 0.0, "x-weak": 0.1, "weak": 0.25, "medium": 0.5, "strong": 1.0,
             "x-strong": 2.0}
SSML_TAGS = ("speak", "break", "voice")
STORE_HINT = "mimo-tts voices add {name} FILE stores one"  # check_voices' hint: the registry

_TAG = re.compile(r"\[\s*(pause|voice)\s*:([^\]\[]*)\]", re.IGNORECASE)
_TIME = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s)?\s*", re.IGNORECASE)


class MarkupError(UsageError):
    """A pause or voice tag, or an SSML document, that cannot be read (exit 2)."""


@dataclass(frozen=True)
class Script:
    """A text's pieces as generated: each one's text and voice, and the silence around them."""

    texts: tuple[str, ...]
    voices: tuple[str | None, ...]  # None: the run's voice
    pauses: tuple[int, ...]  # samples before each piece, then after the last: len(texts) + 1

    @property
    def named_voices(self) -> tuple[str, ...]:
        """The voices the text names, in order of first use."""
        return tuple(dict.fromkeys(v for v in self.voices if v is not None))

    def plain(self, silence: int) -> bool:
        """Whether this is what a text without tags gives: no voice named, `silence` samples
        between pieces and none around them."""
        return (not self.named_voices and self.pauses[0] == 0 and self.pauses[-1] == 0
                and all(p == silence for p in self.pauses[1:-1]))


def silence_samples(seconds: float, sample_rate: int = SAMPLE_RATE) -> int:
    """Seconds of silence as samples (0.32 s at 24 kHz: 7680, today's 8 frames)."""
    return round(seconds * sample_rate)


def script(text: str, o) -> Script:
    """The `Script` of a (clean) text under `SynthesisOptions` `o`: its pieces, voices and
    pauses. A bad tag is a `MarkupError` naming it."""
    return _script(text, o.max_chars, o.captions, silence_samples(o.sentence_silence))


def has_markup(text: str) -> bool:
    """Whether `text` holds a tag this module reads (an SSML document or a bracket tag)."""
    return _is_ssml(text) or _TAG.search(text) is not None


def default_pauses(count: int, silence: int) -> tuple[int, ...]:
    """The pauses of `count` pieces of plain text: none around them, `silence` between."""
    return (0, *([silence] * max(count - 1, 0)), 0)


def check_voices(named, known, hint: str) -> None:
    """The voices `[voice:]` tags name (`Script.named_voices`) each built-in or in `known()`
    (the stored or served names, read once when a tag names another), else a one-line
    `MarkupError` naming it and `hint` (where voices come from; `{name}`: the one named)."""
    names = None
    for name in named:
        if name in BUILT_IN:
            continue
        names = list(known()) if names is None else names
        if name not in names:
            raise MarkupError(f"[voice:{name}]: unknown voice {name!r}; choose one of "
                              f"{', '.join(dict.fromkeys([*BUILT_IN, *names]))} "
                              f"({hint.format(name=name)})")


@lru_cache(maxsize=256)
def _script(text: str, max_chars: int, captions: bool, silence: int) -> Script:
    def cut(span: str) -> list[str]:
        return caption_pieces(span, max_chars) if captions else split_text(span, max_chars)

    if not has_markup(text):
        pieces = cut(text)
        return Script(tuple(pieces), (None,) * len(pieces), default_pauses(len(pieces), silence))
    tokens = _ssml_tokens(text) if _is_ssml(text) else _bracket_tokens(text)
    texts: list[str] = []
    voices: list[str | None] = []
    pauses: list[int] = []
    asked: int | None = None  # explicit silence since the last words
    voice: str | None = None
    for kind, value in tokens:
        if kind == "pause":
            asked = (asked or 0) + value
            if asked > silence_samples(MAX_PAUSE):
                raise MarkupError(f"pauses in a row add up to more than {MAX_PAUSE:g} s")
        elif kind == "voice":
            voice = value
        else:
            span = trim(" ".join(value.split()))
            for piece in (cut(span) if span else []):
                pauses.append(asked if asked is not None else (silence if texts else 0))
                texts.append(piece)
                voices.append(voice)
                asked = None
    if not texts:
        raise MarkupError("the text holds pauses or voice tags but nothing to say")
    return Script(tuple(texts), tuple(voices), (*pauses, asked or 0))


# --- plain text: [pause:1.5] and [voice:name] ---------------------------------------------------


def _bracket_tokens(text: str) -> list[tuple[str, object]]:
    tokens: list[tuple[str, object]] = []
    at = 0
    for m in _TAG.finditer(text):
        tokens.append(("text", text[at:m.start()]))
        kind, value = m[1].lower(), m[2]
        tokens.append((kind, _pause(value, m[0]) if kind == "pause" else _voice(value, m[0])))
        at = m.end()
    tokens.append(("text", text[at:]))
    return tokens


def _pause(value: str, tag: str, default_unit: str = "s") -> int:
    m = _TIME.fullmatch(value)
    if not m:
        raise MarkupError(f"{tag}: a pause is seconds (1.5), or with a unit (500ms, 2s)")
    seconds = float(m[1]) / (1000 if (m[2] or default_unit).lower() == "ms" else 1)
    if seconds > MAX_PAUSE:
        raise MarkupError(f"{tag}: a pause is at most {MAX_PAUSE:g} s")
    return silence_samples(seconds)


def _voice(value: str, tag: str) -> str:
    name = value.strip()
    if name in BUILT_IN:
        return name
    try:
        return check_name(name)
    except UsageError as exc:
        raise MarkupError(f"{tag}: {exc}") from None


# --- SSML: <speak>, <break>, <voice> -----------------------------------------------------------


def _is_ssml(text: str) -> bool:
    head = text.lstrip()
    if head.startswith("<?xml"):
        head = head[head.find("?>") + 2:].lstrip() if "?>" in head else head
    return head.startswith("<speak")


def _ssml_tokens(text: str) -> list[tuple[str, object]]:
    try:
        root = ET.fromstring(text.strip())
    except ET.ParseError as exc:
        raise MarkupError(f"the <speak> document is not well-formed XML ({exc})") from None
    if _name(root) != "speak":
        raise MarkupError(f"SSML: the document's root is <{_name(root)}>, not <speak>")
    tokens: list[tuple[str, object]] = []
    _walk(root, tokens, None)
    return tokens


def _walk(element, tokens: list, voice: str | None) -> None:
    tokens.extend(_bracket_tokens(element.text or ""))
    for child in element:
        tag = _name(child)
        if tag == "break":
            tokens.append(("pause", _break(child)))
        elif tag == "voice":
            name = child.get("name")
            if name is None:
                raise MarkupError("SSML <voice> needs a name=\"...\" attribute")
            tokens.append(("voice", _voice(name, f"<voice name=\"{name}\">")))
            _walk(child, tokens, name)
            tokens.append(("voice", voice))
        else:
            raise MarkupError(f"SSML tag <{tag}> is not supported (supported: "
                              f"{', '.join(f'<{t}>' for t in SSML_TAGS)})")
        tokens.extend(_bracket_tokens(child.tail or ""))


def _break(element) -> int:
    if list(element) or (element.text or "").strip():
        raise MarkupError("SSML <break/> holds nothing")
    time, strength = element.get("time"), element.get("strength")
    if time is not None:
        return _pause(time, f"<break time=\"{time}\"/>", default_unit="ms")
    strength = "medium" if strength is None else strength
    if strength not in STRENGTHS:
        raise MarkupError(f"<break strength=\"{strength}\"/>: strength is one of "
                          f"{', '.join(STRENGTHS)}")
    return silence_samples(STRENGTHS[strength])


def _name(element) -> str:
    tag = element.tag if isinstance(element.tag, str) else "?"
    return tag.rsplit("}", 1)[-1]
