"""Input items: reading `--text` / `.txt` / `.jsonl` / stdin, safe ids, text cleaning, splitting.

A bad line never stops a batch: it becomes an `Item` carrying its `InputError` (with the file
and line number), reported as that item's failure while the other items run. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from mimo_tts.errors import InputError

JSONL_FIELDS = {"id", "text", "instruct", "prompt_audio", "seed"}
_RESERVED = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(10)),
             *(f"lpt{i}" for i in range(10))}
_UNSAFE = re.compile(r"[^\w.\-]+")
_SENTENCE_END = re.compile(r"(?<=[.!?;。！？；…])\s*")
MAX_ID_CHARS = 80


@dataclass
class Item:
    """One thing to synthesise; `error` set means the item is bad and is reported, not run."""

    id: str
    text: str
    source: str
    instruct: str | None = None
    prompt_audio: str | None = None
    seed: int | None = None
    source_id: str | None = None
    error: InputError | None = None
    extra: dict = field(default_factory=dict)


# --- ids and text -------------------------------------------------------------------------------


def sanitize_id(raw: str) -> str:
    """A safe file stem: no separators, no `..`, no reserved device names, bounded length."""
    text = unicodedata.normalize("NFC", str(raw)).strip()
    text = _UNSAFE.sub("_", text).strip("._-")
    text = re.sub(r"\.{2,}", ".", text)[:MAX_ID_CHARS].rstrip("._-")
    if not text:
        return "item"
    if text.split(".")[0].lower() in _RESERVED:
        text = "_" + text
    return text


def text_id(text: str) -> str:
    """A stable id for an item without one: a slug of the text plus a short content hash."""
    digest = hashlib.sha1(text.encode("utf-8")).hexdigest()[:8]
    slug = sanitize_id(" ".join(text.split()[:6]))[:32].rstrip("._-")
    return f"{slug}-{digest}" if slug != "item" else f"item-{digest}"


def clean_text(text: str, where: str) -> str:
    """Collapse whitespace; refuse empty text and control characters (naming the position)."""
    if not isinstance(text, str):
        raise InputError(f"{where}: text must be a string, got {type(text).__name__}")
    text = unicodedata.normalize("NFC", text)
    for pos, char in enumerate(text):
        if unicodedata.category(char) == "Cc" and char not in "\t\n\r":
            raise InputError(f"{where}: text has control character U+{ord(char):04X} at {pos}")
    text = " ".join(text.split())
    if not text:
        raise InputError(f"{where}: empty text")
    return text


def split_text(text: str, max_chars: int) -> list[str]:
    """Split long text on sentence boundaries into pieces of at most `max_chars` characters."""
    if max_chars <= 0 or len(text) <= max_chars:
        return [text]
    pieces: list[str] = []
    current = ""
    for sentence in filter(None, _SENTENCE_END.split(text)):
        for part in _hard_split(sentence, max_chars):
            joined = f"{current} {part}".strip() if current else part
            if len(joined) <= max_chars:
                current = joined
            else:
                pieces.append(current)
                current = part
    if current:
        pieces.append(current)
    return pieces


def _hard_split(sentence: str, max_chars: int) -> list[str]:
    """A sentence longer than the limit is cut at spaces or commas, else at the limit."""
    parts = []
    while len(sentence) > max_chars:
        window = sentence[:max_chars]
        cut = max(window.rfind(" "), window.rfind(","), window.rfind("，"))
        cut = cut + 1 if cut > 0 else max_chars
        parts.append(sentence[:cut].strip())
        sentence = sentence[cut:].strip()
    return [p for p in [*parts, sentence] if p]


# --- reading items ------------------------------------------------------------------------------


def read_items(texts: Iterable[str], inputs: Iterable[str], stdin=None) -> list[Item]:
    """Items from `--text` values and `--input` files (`.txt`/`.jsonl`; `-` reads stdin)."""
    items: list[Item] = []
    for n, text in enumerate(texts, 1):
        if text == "-":
            text = _stdin_text(stdin)
        items.append(_make_item(None, text, f"--text #{n}", {}))
    for name in inputs:
        items.extend(_read_input(name, stdin))
    return _dedupe(items)


def _stdin_text(stdin) -> str:
    stream = stdin or sys.stdin
    if stream.isatty():
        raise InputError("'-' reads from stdin, but stdin is a terminal; pipe text in")
    return stream.read()


def _read_input(name: str, stdin) -> list[Item]:
    if name == "-":
        lines = _decode_lines(_stdin_bytes(stdin))
        first = next((ln for ln in lines if ln.strip()), "")
        as_jsonl = first.lstrip().startswith("{")
        return _parse_lines(lines, "stdin", as_jsonl)
    path = Path(name)
    if not path.is_file():
        raise InputError(f"input file not found: {path}")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read input file {path}: {exc.strerror}") from None
    return _parse_lines(_decode_lines(data), path.name, path.suffix == ".jsonl")


def _stdin_bytes(stdin) -> bytes:
    stream = stdin or sys.stdin
    if stream.isatty():
        raise InputError("--input - reads items from stdin, but stdin is a terminal")
    buffer = getattr(stream, "buffer", None)
    return buffer.read() if buffer is not None else stream.read().encode("utf-8")


def _decode_lines(data: bytes) -> list[str]:
    """UTF-8 lines; invalid bytes become a per-line error marker (reported with the line)."""
    lines = []
    for raw in data.splitlines():
        try:
            lines.append(raw.decode("utf-8").removeprefix("\ufeff"))
        except UnicodeDecodeError as exc:
            lines.append(_BadLine(f"invalid UTF-8 at byte {exc.start}"))
    return lines


class _BadLine(str):
    """A line that could not be decoded; carries the reason."""


def _parse_lines(lines: list[str], where: str, as_jsonl: bool) -> list[Item]:
    items = []
    for number, line in enumerate(lines, 1):
        label = f"{where}:{number}"
        if isinstance(line, _BadLine):
            items.append(_bad_item(f"line-{number:05d}", label, f"{label}: {line}"))
        elif line.strip():
            items.append(_jsonl_item(line, label, number) if as_jsonl
                         else _make_item(None, line, label, {}))
    return items


def _jsonl_item(line: str, label: str, number: int) -> Item:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return _bad_item(f"line-{number:05d}", label, f"{label}: malformed JSON ({exc.msg})")
    if not isinstance(record, dict):
        return _bad_item(f"line-{number:05d}", label, f"{label}: expected a JSON object")
    unknown = sorted(set(record) - JSONL_FIELDS)
    if unknown:
        return _bad_item(str(record.get("id") or f"line-{number:05d}"), label,
                         f"{label}: unknown field(s) {', '.join(unknown)} "
                         f"(allowed: {', '.join(sorted(JSONL_FIELDS))})")
    return _make_item(record.get("id"), record.get("text", ""), label, record)


def _make_item(raw_id, text, label: str, record: dict) -> Item:
    try:
        text = clean_text(text, label)
        seed = record.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise InputError(f"{label}: seed must be an integer >= 0, got {seed!r}")
        for key in ("instruct", "prompt_audio"):
            if record.get(key) is not None and not isinstance(record[key], str):
                raise InputError(f"{label}: {key} must be a string")
        instruct = record.get("instruct")
        instruct = clean_text(instruct, f"{label} instruct") if instruct else None
    except InputError as exc:
        return _bad_item(str(raw_id) if raw_id is not None else text_id(str(text)), label, exc)
    item_id = sanitize_id(str(raw_id)) if raw_id is not None else text_id(text)
    return Item(id=item_id, text=text, source=label, instruct=instruct,
                prompt_audio=record.get("prompt_audio"), seed=seed,
                source_id=str(raw_id) if raw_id is not None else None)


def _bad_item(raw_id: str, label: str, error) -> Item:
    error = error if isinstance(error, InputError) else InputError(str(error))
    return Item(id=sanitize_id(raw_id), text="", source=label, error=error)


def _dedupe(items: list[Item]) -> list[Item]:
    """Explicit duplicate ids are an error on the later item; derived ids get a suffix.

    A failed item is renamed after its line, so it never shares a manifest line or an
    output name with a good item.
    """
    seen: dict[str, str] = {}
    for item in items:
        if item.id in seen:
            if item.error is None and item.source_id is None:
                item.id = _free_id(item.id, seen)
            else:
                if item.error is None:
                    item.error = InputError(f"{item.source}: duplicate id {item.source_id!r} "
                                            f"(first at {seen[item.id]})")
                item.id = _free_id(f"{item.id}-{_line_tag(item.source)}", seen)
        seen.setdefault(item.id, item.source)
    return items


def _free_id(base: str, seen: dict) -> str:
    n, candidate = 2, base
    while candidate in seen:
        candidate, n = f"{base}-{n}", n + 1
    return candidate


def _line_tag(source: str) -> str:
    return "line-" + sanitize_id(source.rsplit(":", 1)[-1])
