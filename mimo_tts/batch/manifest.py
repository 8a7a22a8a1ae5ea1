"""What is done in an output folder: the manifest (`results.jsonl`, one line per item and
format, a cut line dropped), the sidecars and their results, complete audio (its size or header
against the sidecar), and the locks that keep one run (or one shard) per folder."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

from mimo_tts.batch.files import audio_suffix, iter_jsonl
from mimo_tts.errors import OutputError
from mimo_tts.runtime.paths import atomic_write, open_no_follow

LOCK_NAME = ".mimo-tts.lock"

MANIFEST_NAME = "results.jsonl"

SHARED_LOCK_WAIT_S = 2.0  # a shard waits this long for another shard's temp-file clean-up


def manifest_name(shard=None) -> str:
    """`results.jsonl`, or `results.shard-K-of-N.jsonl` for shard K of N."""
    return MANIFEST_NAME if shard is None else f"results.{shard.tag}.jsonl"


def lock_name(shard=None) -> str:
    return LOCK_NAME if shard is None else f".mimo-tts.{shard.tag}.lock"


class Manifest:
    """`results.jsonl`: one line per item and format (the last line wins), crash tolerant.

    A new item is appended; a re-recorded one rewrites the file atomically, so the file always
    holds one line per item and format. An identical record is not written again (bad lines
    re-reported by a resumed run cost nothing). A manifest path that is a directory, a link or
    a device is an OutputError: it is never read through or appended to.
    """

    def __init__(self, path: Path):
        self.path = path
        if path.is_symlink() or (path.exists() and not path.is_file()):
            kind = "a symbolic link" if path.is_symlink() else "not a regular file"
            raise OutputError(f"{path} is {kind}; remove it or use another --output-dir")
        self.records: dict[tuple[str, str], dict] = {}
        lines = 0
        try:
            for record in iter_jsonl(path):
                lines += 1
                if "id" in record:
                    self.records[_manifest_key(record)] = record
            needs_compaction = self._needs_compaction(lines)
        except OSError as exc:
            raise OutputError(f"cannot read {path}: {exc.strerror or exc}") from None
        if needs_compaction:
            self.compact()

    def _needs_compaction(self, parsed: int) -> bool:
        if not self.path.is_file():
            return False
        data = self.path.read_bytes()
        complete = data.endswith(b"\n") or not data
        return not complete or data.count(b"\n") != parsed or parsed != len(self.records)

    def compact(self) -> None:
        """Rewrite the file with exactly one line per item and format (atomically)."""
        payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.records.values())
        atomic_write(self.path, lambda f: f.write(payload.encode("utf-8")))

    def get(self, item_id: str, fmt: str | None = None) -> dict | None:
        return self.records.get((item_id, audio_suffix(fmt)))

    def add(self, record: dict) -> None:
        """Record an item: append a line, or rewrite the file when it is already present."""
        key = _manifest_key(record)
        previous = self.records.get(key)
        if previous == record:
            return
        self.records[key] = record
        if previous is not None:
            self.compact()
            return
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        try:
            with open_no_follow(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT) as handle:
                handle.write(line)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            del self.records[key]
            raise OutputError(f"cannot write {self.path}: {exc.strerror or exc}") from None
        except OutputError:
            del self.records[key]
            raise


def _manifest_key(record: dict) -> tuple[str, str]:
    """Lines are per item and audio file: wav and flac of one id each keep their own line."""
    return str(record["id"]), audio_suffix(record.get("format"))


def done_record(audio: Path, sidecar: Path, key: str) -> dict | None:
    """The result of a finished item with this input key, or None.

    The sidecar (holding the key, the result and the audio file's size) is written before the
    audio, so an audio file of that size whose sidecar carries the same key is complete, even
    if the run was then killed before anything else was recorded. A file cut short (a full
    disk, a copy stopped half-way) is not done.
    """
    data = read_sidecar(sidecar)
    result = data.get("result") if data else None
    if not isinstance(result, dict) or result.get("key") != key or result.get("status") != "ok":
        return None
    return result if audio_problem(audio, data) is None else None


def read_sidecar(sidecar: Path) -> dict | None:
    """A sidecar's JSON object, or None (absent, a link, unreadable, not an object)."""
    if sidecar.is_symlink():
        return None
    try:
        data = json.loads(sidecar.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def sidecar_result(sidecar: Path) -> dict | None:
    result = (read_sidecar(sidecar) or {}).get("result")
    return result if isinstance(result, dict) else None


def audio_problem(audio: Path, sidecar: dict) -> str | None:
    """Why an audio file is not the whole output its sidecar describes, or None: gone, or a
    size other than the recorded one (sidecars from before sizes were recorded: empty, or a
    WAV whose RIFF header states another length)."""
    try:
        info = audio.stat()
    except OSError:
        return "audio file gone"
    if not stat.S_ISREG(info.st_mode):
        return "audio file is not a regular file"
    expected = (sidecar.get("audio") or {}).get("bytes") if isinstance(sidecar.get("audio"),
                                                                     dict) else None
    if isinstance(expected, int) and not isinstance(expected, bool):
        return None if info.st_size == expected else \
            f"audio file cut ({info.st_size} of {expected} bytes)"
    if info.st_size == 0:
        return "audio file empty"
    if audio.suffix.lower() == ".wav":
        riff = _riff_size(audio)
        if riff is not None and riff != info.st_size:
            return f"audio file cut ({info.st_size} of {riff} bytes)"
    return None


def _riff_size(audio: Path) -> int | None:
    """The file size a WAV's RIFF header states (its chunk size + 8), or None."""
    try:
        with open(audio, "rb") as handle:
            head = handle.read(12)
    except OSError:
        return None
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    return int.from_bytes(head[4:8], "little") + 8


def flock(handle, exclusive: bool, wait: float = 0.0) -> bool:
    """Take (or convert to) an exclusive or shared `flock` without blocking, retrying for
    `wait` seconds; False when another process holds it."""
    import fcntl

    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(handle.fileno(), (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
                        | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
