"""Input items: reading `--text` / `.txt` / `.jsonl` / stdin, safe ids, text cleaning, splitting.

A bad line never stops a batch: it becomes an `Item` carrying its `InputError` (with the file
and line number), reported as that item's failure while the other items run. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from mimo_tts.errors import InputError, short_repr
from mimo_tts.lm.tasks import TASKS
from mimo_tts.synthesis.options import DEFAULT_TASK, MAX_SEED
from mimo_tts.synthesis.text import clean_text

JSONL_FIELDS = {"id", "text", "instruct", "prompt_audio", "seed", "task"}
_RESERVED = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(10)),
             *(f"lpt{i}" for i in range(10))}
_UNSAFE = re.compile(r"[^\w.\-]+")
MAX_ID_BYTES = 120  # UTF-8 bytes of a file stem: with suffixes and temp prefixes < NAME_MAX 255


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
    legacy_id: str | None = None  # the text-only id earlier versions gave it, when other
    task: str | None = None  # its line's task; None: the run's (--task)


@dataclass(frozen=True)
class Naming:
    """The run's values for what an item does not set itself (`--seed`, `--instruct`,
    `--prompt-audio`, `--voice`): they change its audio, so they are part of a derived id."""

    seed: int = 0
    instruct: str | None = None
    prompt_audio: str | None = None
    task: str = DEFAULT_TASK  # not in the id: each task has its own folder
    voice: str | None = None  # a stored voice, by name (an item's own prompt_audio wins)
    captions: bool = False  # a piece per sentence: other audio
    # Output settings that change the audio but not the codes (`--speed`, `--sentence-silence`)
    # as "name=value", only those not at their default: another file, not a collision.
    variant: tuple[str, ...] = ()


# --- ids and text -------------------------------------------------------------------------------


def sanitize_id(raw: str) -> str:
    """A safe file stem: no separators, no `..`, no reserved device names, bounded length."""
    text = unicodedata.normalize("NFC", str(raw)).strip()
    text = _UNSAFE.sub("_", text).strip("._-")  # surrogates are not \w: they go too
    text = re.sub(r"\.{2,}", ".", text)
    text = text.encode("utf-8")[:MAX_ID_BYTES].decode("utf-8", errors="ignore").rstrip("._-")
    if not text:
        return "item"
    if text.split(".")[0].lower() in _RESERVED:
        text = "_" + text
    return text


def has_surrogates(text: str) -> bool:
    """Whether `text` holds lone surrogates: argv or file-name bytes that are not UTF-8, or a
    broken JSON escape; such text cannot be written as UTF-8."""
    return any("\ud800" <= c <= "\udfff" for c in text)


def printable(text: str) -> str:
    """`text` with its lone surrogates as `\\udcff` escapes: safe in a manifest or sidecar."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8") if has_surrogates(text) \
        else text


def text_id(text: str, seed: int = 0, instruct: str | None = None,
            prompt_audio: str | None = None, voice: str | None = None,
            captions: bool = False, variant: tuple[str, ...] = ()) -> str:
    """A stable id for an item without one: a slug of the text plus a short hash of the text
    and of what else changes its audio (a seed other than 0, an instruction, a voice prompt's
    path as written, a stored voice's name, captions' piece per sentence, the `variant` of
    `Naming`), so another seed, style, voice, cut, speed or pause of one sentence is another
    file. With none of those the hash covers the text alone, as it always did."""
    parts = [text, *([f"seed={seed}"] if seed else []),
             *([f"instruct={instruct}"] if instruct else []),
             *([f"prompt_audio={os.path.normpath(prompt_audio)}"] if prompt_audio else []),
             *([f"voice={voice}"] if voice and not prompt_audio else []),
             *(["captions"] if captions else []), *variant]
    blob = "\0".join(parts)  # clean text holds no NUL: the parts cannot run together
    digest = hashlib.sha1(blob.encode("utf-8", errors="surrogatepass")).hexdigest()[:8]
    slug = sanitize_id(" ".join(text.split()[:6]))[:32].rstrip("._-")
    return f"{slug}-{digest}" if slug != "item" else f"item-{digest}"


# --- reading items ------------------------------------------------------------------------------


def read_items(texts: Iterable[str], inputs: Iterable[str], stdin=None,
               naming: Naming = Naming()) -> list[Item]:
    """Items from `--text` values and `--input` files (`.txt`/`.jsonl`; `-` reads stdin);
    an item without an id is named by its text and what `naming` or its line add
    (`text_id`)."""
    items: list[Item] = []
    for n, text in enumerate(texts, 1):
        if text == "-":  # clean_text refuses the bytes that are not UTF-8
            text = _stdin_bytes(stdin, "'-' reads from stdin, but stdin is a terminal; pipe "
                                "text in").decode("utf-8", errors="surrogateescape")
        items.append(_make_item(None, text, f"--text #{n}", {}))
    for name in inputs:
        items.extend(_read_input(name, stdin))
    for item in items:
        if item.error is None and item.source_id is None:
            item.legacy_id = item.id
            item.id = text_id(item.text, item.seed if item.seed is not None else naming.seed,
                              item.instruct or naming.instruct,
                              item.prompt_audio or naming.prompt_audio, naming.voice,
                              naming.captions, naming.variant)
            item.legacy_id = None if item.legacy_id == item.id else item.legacy_id
    return _dedupe(items, naming)


def piped(stdin=None) -> bool:
    """Whether stdin brings text: open and not a terminal (a pipe, a file, a here-string), as
    `echo text | mimo-tts synth` gives it."""
    stream = stdin if stdin is not None else sys.stdin
    try:
        return stream is not None and not stream.closed and not stream.isatty()
    except (OSError, ValueError):  # a closed or unreadable descriptor: nothing is piped
        return False


def _read_input(name: str, stdin) -> list[Item]:
    if name == "-":
        lines = _decode_lines(_stdin_bytes(
            stdin, "--input - reads items from stdin, but stdin is a terminal"))
        return _parse_lines(lines, "stdin", _looks_like_jsonl(lines))
    path = Path(name)
    if not path.exists():  # FIFOs, /dev/fd/N and /dev/stdin are read like files
        raise InputError(f"input file not found: {path}")
    if path.is_dir():
        raise InputError(f"input {path} is a directory, not a .txt or .jsonl file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read input file {path}: {exc.strerror or exc}") from None
    return _parse_lines(_decode_lines(data), printable(path.name),
                        path.suffix.lower() == ".jsonl")


def _looks_like_jsonl(lines: list[str]) -> bool:
    """stdin holds JSON lines when its first non-blank line is a JSON object (not just "{")."""
    first = next((ln for ln in lines if ln.strip()), "")
    try:
        return isinstance(json.loads(first), dict)
    except (ValueError, TypeError):
        return False


def _stdin_bytes(stdin, on_terminal: str) -> bytes:
    stream = stdin if stdin is not None else sys.stdin
    try:
        if stream is None or stream.closed:
            raise InputError("stdin is closed; pipe the items in or use --text / --input FILE")
        if stream.isatty():
            raise InputError(on_terminal)
        buffer = getattr(stream, "buffer", None)
        return buffer.read() if buffer is not None else stream.read().encode("utf-8")
    except (OSError, ValueError) as exc:  # a closed or unreadable descriptor
        raise InputError(f"cannot read stdin: {exc}") from None


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
        if raw_id is not None and (isinstance(raw_id, bool) or not isinstance(raw_id, str | int)):
            bad, raw_id = raw_id, f"line-{label.rsplit(':', 1)[-1]}"
            raise InputError(f"{label}: id must be a string or an integer, got "
                             f"{type(bad).__name__}")
        text = clean_text(text, label)
        seed = record.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                                 or not 0 <= seed <= MAX_SEED):
            raise InputError(f"{label}: seed must be an integer in [0, 2**64 - 1], "
                             f"got {short_repr(seed)}")
        for key in ("instruct", "prompt_audio", "task"):
            if record.get(key) is not None and not isinstance(record[key], str):
                raise InputError(f"{label}: {key} must be a string")
        if record.get("task") is not None and record["task"] not in TASKS:
            raise InputError(f"{label}: unknown task {short_repr(record['task'])}; choose one "
                             f"of {', '.join(TASKS)}")
        instruct = record.get("instruct")
        instruct = clean_text(instruct, f"{label} instruct") if instruct else None
        if record.get("prompt_audio") and has_surrogates(record["prompt_audio"]):
            # a sidecar records the path, and JSON text is Unicode
            raise InputError(f"{label} prompt_audio: the path is not valid Unicode (a lone "
                             "surrogate)")
    except InputError as exc:
        return _bad_item(str(raw_id) if raw_id is not None else text_id(str(text)), label, exc)
    item_id = sanitize_id(str(raw_id)) if raw_id is not None else text_id(text)
    return Item(id=item_id, text=text, source=label, instruct=instruct,
                prompt_audio=record.get("prompt_audio"), seed=seed, task=record.get("task"),
                source_id=printable(str(raw_id)) if raw_id is not None else None)


def _bad_item(raw_id: str, label: str, error) -> Item:
    error = error if isinstance(error, InputError) else InputError(str(error))
    return Item(id=sanitize_id(raw_id), text="", source=label, error=error)


def _dedupe(items: list[Item], naming: Naming) -> list[Item]:
    """Explicit duplicate ids are an error on the later item; derived ids get a suffix. Ids
    are unique within a task's folder (an item's own task, else `naming.task`).

    A failed item is renamed after its line, so it never shares a manifest line or an
    output name with a good item. Two different ids that sanitise to one file name are a
    collision, and the message says so.
    """
    folders: dict[str, dict[str, tuple[str, str | None]]] = {}  # task -> file stem -> ...
    for item in items:
        seen = folders.setdefault(item.task or naming.task, {})  # (source, raw id)
        if item.id in seen:
            if item.error is None and item.source_id is None:
                item.id, item.legacy_id = _free_id(item.id, seen), None
            else:
                first, first_raw = seen[item.id]
                if item.error is None and first_raw not in (None, item.source_id):
                    item.error = InputError(
                        f"{item.source}: id {item.source_id!r} becomes the file name "
                        f"{item.id!r}, which id {first_raw!r} (at {first}) already uses")
                elif item.error is None:
                    item.error = InputError(f"{item.source}: duplicate id {item.source_id!r} "
                                            f"(first at {first})")
                line = sanitize_id(item.source.rsplit(":", 1)[-1])
                item.id = _free_id(f"{item.id}-line-{line}", seen)
        seen.setdefault(item.id, (item.source, item.source_id))
    return items


def _free_id(base: str, seen: dict) -> str:
    n, candidate = 2, base
    while candidate in seen:
        candidate, n = f"{base}-{n}", n + 1
    return candidate
