"""Inputs and outputs: reading items, sanitising ids and text, atomic audio/JSON writes, sinks.

Nothing here imports torch at module level, so the CLI can import it cheaply. Every write goes
through a temp file in the destination directory followed by `os.replace`, so an output is
either complete or absent, even after `kill -9`; `clean_temp_files` removes what a killed run
left behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import io as _io
import json
import os
import re
import sys
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mimo_tts.errors import InputError, OutputError

SAMPLE_RATE = 24000
TEMP_MARK = ".mimo-tmp-"
JSONL_FIELDS = {"id", "text", "instruct", "prompt_audio", "seed"}
FORMATS = {"wav": ("WAV", "PCM_16", ".wav"), "wav-float": ("WAV", "FLOAT", ".wav"),
           "flac": ("FLAC", "PCM_16", ".flac")}
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
        lines = _decode_lines(_stdin_bytes(stdin), "stdin")
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
    return _parse_lines(_decode_lines(data, str(path)), path.name, path.suffix == ".jsonl")


def _stdin_bytes(stdin) -> bytes:
    stream = stdin or sys.stdin
    if stream.isatty():
        raise InputError("--input - reads items from stdin, but stdin is a terminal")
    buffer = getattr(stream, "buffer", None)
    return buffer.read() if buffer is not None else stream.read().encode("utf-8")


def _decode_lines(data: bytes, where: str) -> list[str]:
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
    except InputError as exc:
        return _bad_item(str(raw_id) if raw_id is not None else text_id(str(text)), label, exc)
    item_id = sanitize_id(str(raw_id)) if raw_id is not None else text_id(text)
    instruct = record.get("instruct")
    return Item(id=item_id, text=text, source=label,
                instruct=clean_text(instruct, label) if instruct else None,
                prompt_audio=record.get("prompt_audio"), seed=seed,
                source_id=str(raw_id) if raw_id is not None else None)


def _bad_item(raw_id: str, label: str, error) -> Item:
    error = error if isinstance(error, InputError) else InputError(str(error))
    return Item(id=sanitize_id(raw_id), text="", source=label, error=error)


def _dedupe(items: list[Item]) -> list[Item]:
    """Explicit duplicate ids are an error on the later item; derived ids get a suffix."""
    seen: dict[str, str] = {}
    for item in items:
        if item.id in seen and item.error is None:
            if item.source_id is not None:
                item.error = InputError(f"{item.source}: duplicate id {item.source_id!r} "
                                        f"(first at {seen[item.id]})")
                continue
            n = 2
            while f"{item.id}-{n}" in seen:
                n += 1
            item.id = f"{item.id}-{n}"
        seen.setdefault(item.id, item.source)
    return items


# --- atomic files -------------------------------------------------------------------------------


def _temp_path(path: Path) -> Path:
    """A hidden `.part` file beside `path`: never matched by `*.wav`-style globs."""
    return path.with_name(f"{TEMP_MARK}{os.getpid()}-{path.name}.part")


def atomic_write(path: str | Path, writer) -> Path:
    """Write through `writer(file)` into a temp file beside `path`, fsync, then rename."""
    path = Path(path)
    temp = _temp_path(path)
    try:
        with open(temp, "wb") as handle:
            writer(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    return path


def write_json(path: str | Path, data: dict) -> Path:
    payload = (json.dumps(data, ensure_ascii=False, indent=2) + "\n").encode("utf-8")
    return atomic_write(path, lambda f: f.write(payload))


def clean_temp_files(directory: str | Path) -> list[Path]:
    """Remove temp files left by killed runs (call while holding the directory lock)."""
    removed = []
    for path in Path(directory).glob(f"{TEMP_MARK}*"):
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
    return removed


# --- audio --------------------------------------------------------------------------------------


def to_numpy(audio):
    """A float32 numpy array of samples from a tensor or array ([S])."""
    import numpy as np

    if hasattr(audio, "detach"):
        audio = audio.detach().float().cpu().numpy()
    return np.asarray(audio, dtype=np.float32).reshape(-1)


def pcm16(audio) -> bytes:
    """Little-endian signed 16-bit PCM, clipped to [-1, 1]."""
    import numpy as np

    samples = np.clip(to_numpy(audio), -1.0, 1.0)
    return np.round(samples * 32767.0).astype("<i2").tobytes()


def resample(audio, from_rate: int, to_rate: int):
    """Resample a [S] waveform (float32) with torchaudio; a no-op at equal rates."""
    if from_rate == to_rate:
        return audio
    import torch
    import torchaudio.functional as F

    tensor = audio if isinstance(audio, torch.Tensor) else torch.as_tensor(to_numpy(audio))
    return F.resample(tensor.float().cpu(), from_rate, to_rate)


def encode_audio(audio, sample_rate: int, fmt: str) -> bytes:
    """Encoded file bytes for `fmt` (`wav` PCM16, `wav-float`, `flac`)."""
    import numpy as np
    import soundfile as sf

    container, subtype, _ = FORMATS[fmt]
    samples = to_numpy(audio)
    if subtype == "PCM_16":
        samples = np.frombuffer(pcm16(samples), dtype="<i2")
    buffer = _io.BytesIO()
    sf.write(buffer, samples, sample_rate, format=container, subtype=subtype)
    return buffer.getvalue()


def write_audio(path: str | Path, audio, sample_rate: int, fmt: str = "wav") -> Path:
    data = encode_audio(audio, sample_rate, fmt)
    return atomic_write(path, lambda f: f.write(data))


def read_audio(path: str | Path, where: str = "prompt audio"):
    """A [C, S] float32 tensor and its sample rate; unusable audio is an InputError."""
    import soundfile as sf
    import torch

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{where} not found: {path}")
    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        raise InputError(f"{where} {path} is unreadable or unsupported: {exc}") from None
    audio = torch.from_numpy(data.T.copy())  # [S, C] -> [C, S]
    if audio.shape[-1] == 0:
        raise InputError(f"{where} {path} has no samples")
    if not torch.isfinite(audio).all():
        raise InputError(f"{where} {path} contains NaN or infinite samples")
    return audio, int(rate)


def save_codes(path: str | Path, pieces: list, metadata: dict) -> Path:
    """Stage-0 codes (one [8, T] int32 tensor per text piece) as safetensors + JSON metadata."""
    import torch
    from safetensors.torch import save

    tensors = {f"codes.{i}": p.to(torch.int32).cpu().contiguous() for i, p in enumerate(pieces)}
    meta = {"format": "mimo-tts-codes", "pieces": str(len(pieces)),
            "metadata": json.dumps(metadata, ensure_ascii=False)}
    data = save(tensors, metadata=meta)
    return atomic_write(path, lambda f: f.write(data))


def load_codes(path: str | Path) -> tuple[list, dict]:
    """Read codes saved by `save_codes` (or a bare `codes` tensor in any safetensors file)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise InputError(f"codes file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            keys = sorted(handle.keys(), key=lambda k: int(k.split(".")[1]) if "." in k else 0)
            pieces = [handle.get_tensor(k).long() for k in keys if k.split(".")[0] == "codes"]
    except (SafetensorError, OSError, ValueError) as exc:
        raise InputError(f"unreadable codes file {path}: {exc}") from None
    if not pieces or any(p.dim() != 2 for p in pieces):
        raise InputError(f"{path}: no [K, T] 'codes' tensor found")
    return pieces, json.loads(meta.get("metadata", "{}"))


# --- stdout sinks -------------------------------------------------------------------------------


class RawPcmSink:
    """Streams PCM16 chunks to a binary stream (stdout) as they are decoded."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout.buffer

    def write(self, chunk) -> None:
        try:
            self.stream.write(pcm16(chunk))
            self.stream.flush()
        except BrokenPipeError:
            raise OutputError("stdout was closed by the reader (broken pipe)") from None


def write_stdout_audio(audio, sample_rate: int, fmt: str, stream=None) -> None:
    """A whole item's encoded audio file on stdout (`-o -`)."""
    stream = stream or sys.stdout.buffer
    try:
        stream.write(encode_audio(audio, sample_rate, fmt))
        stream.flush()
    except BrokenPipeError:
        raise OutputError("stdout was closed by the reader (broken pipe)") from None


def iter_jsonl(path: Path) -> Iterator[dict]:
    """Records of a JSON-lines file, skipping lines a killed writer left incomplete."""
    with contextlib.suppress(FileNotFoundError), open(path, "rb") as handle:
        for raw in handle:
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(record, dict):
                yield record


# --- output directory: lock, manifest, layout ---------------------------------------------------


class Manifest:
    """`results.jsonl`: one line per item (the last line for an id wins), crash tolerant."""

    def __init__(self, path: Path):
        self.path = path
        self.records: dict[str, dict] = {}
        lines = 0
        for record in iter_jsonl(path):
            lines += 1
            if "id" in record:
                self.records[str(record["id"])] = record
        if self._needs_compaction(lines):
            self._rewrite()

    def _needs_compaction(self, parsed: int) -> bool:
        if not self.path.is_file():
            return False
        data = self.path.read_bytes()
        complete = data.endswith(b"\n") or not data
        return not complete or data.count(b"\n") != parsed or parsed != len(self.records)

    def _rewrite(self) -> None:
        payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.records.values())
        atomic_write(self.path, lambda f: f.write(payload.encode("utf-8")))

    def get(self, item_id: str) -> dict | None:
        return self.records.get(item_id)

    def add(self, record: dict) -> None:
        """Record an item: append a line, or rewrite the file when the id is already present."""
        replace = record["id"] in self.records
        self.records[record["id"]] = record
        if replace:
            self._rewrite()
            return
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        try:
            with open(self.path, "ab") as handle:
                handle.write(line)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            raise OutputError(f"cannot write {self.path}: {exc.strerror or exc}") from None


class OutputDir:
    """`<output-dir>/<task>/` with its lock, manifest and per-item file names."""

    def __init__(self, root: str | Path, task: str, fmt: str = "wav"):
        self.dir = Path(root) / task
        self.suffix = FORMATS[fmt][2]
        self._lock = None
        self.manifest: Manifest | None = None

    def open(self) -> OutputDir:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.dir / ".mimo-tts.lock", "a+")  # noqa: SIM115 (held open)
        except OSError as exc:
            raise OutputError(f"cannot create output directory {self.dir}: "
                              f"{exc.strerror or exc}") from None
        self._acquire()
        clean_temp_files(self.dir)
        self.manifest = Manifest(self.dir / "results.jsonl")
        return self

    def _acquire(self) -> None:
        import fcntl

        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.seek(0)
            holder = self._lock.read().strip() or "?"
            self._lock.close()
            self._lock = None
            raise OutputError(f"another mimo-tts run (pid {holder}) is writing to {self.dir}; "
                              "wait for it or use another --output-dir") from None
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(str(os.getpid()))
        self._lock.flush()

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> OutputDir:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def audio_path(self, item_id: str) -> Path:
        return self.dir / f"{item_id}{self.suffix}"

    def sidecar_path(self, item_id: str) -> Path:
        return self.dir / f"{item_id}.json"

    def codes_path(self, item_id: str) -> Path:
        return self.dir / f"{item_id}.codes.safetensors"

    def done_record(self, item_id: str, key: str) -> dict | None:
        """The result of a finished item with this input key, or None.

        The sidecar (holding the key and the result) is written before the audio, so an audio
        file whose sidecar carries the same key is complete, even if the run was then killed
        before its manifest line was written.
        """
        if not self.audio_path(item_id).is_file():
            return None
        try:
            sidecar = json.loads(self.sidecar_path(item_id).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        result = sidecar.get("result") if isinstance(sidecar, dict) else None
        if isinstance(result, dict) and result.get("key") == key and result.get("status") == "ok":
            return result
        return None
