"""The output directory of a run: `<output-dir>/<task>/` with its lock, manifest and file names.

One run at a time may write a task directory: `OutputDir.open` takes an exclusive `flock` on
`.mimo-tts.lock` (released by the kernel even after `kill -9`), then removes temp files a
killed run left behind. `results.jsonl` holds one line per item; a line cut by a killed
writer is dropped by the next open.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from mimo_tts.errors import OutputError
from mimo_tts.io import FORMATS, atomic_write, clean_temp_files, iter_jsonl

LOCK_NAME = ".mimo-tts.lock"
MANIFEST_NAME = "results.jsonl"


class Manifest:
    """`results.jsonl`: one line per item (the last line for an id wins), crash tolerant.

    A new id is appended; a re-recorded id rewrites the file atomically, so the file always
    holds one line per id. An identical record is not written again (bad lines re-reported
    by a resumed run cost nothing).
    """

    def __init__(self, path: Path):
        self.path = path
        self.records: dict[str, dict] = {}
        lines = 0
        for record in iter_jsonl(path):
            lines += 1
            if "id" in record:
                self.records[str(record["id"])] = record
        if self._needs_compaction(lines):
            self.compact()

    def _needs_compaction(self, parsed: int) -> bool:
        if not self.path.is_file():
            return False
        data = self.path.read_bytes()
        complete = data.endswith(b"\n") or not data
        return not complete or data.count(b"\n") != parsed or parsed != len(self.records)

    def compact(self) -> None:
        """Rewrite the file with exactly one line per id (atomically)."""
        payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.records.values())
        atomic_write(self.path, lambda f: f.write(payload.encode("utf-8")))

    def get(self, item_id: str) -> dict | None:
        return self.records.get(item_id)

    def add(self, record: dict) -> None:
        """Record an item: append a line, or rewrite the file when the id is already present."""
        previous = self.records.get(record["id"])
        if previous == record:
            return
        self.records[record["id"]] = record
        if previous is not None:
            self.compact()
            return
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        try:
            with open(self.path, "ab") as handle:
                handle.write(line)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            del self.records[record["id"]]
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
            self._lock = open(self.dir / LOCK_NAME, "a+")  # noqa: SIM115 (held open)
        except OSError as exc:
            raise OutputError(f"cannot create output directory {self.dir}: "
                              f"{exc.strerror or exc}") from None
        self._acquire()
        try:
            clean_temp_files(self.dir)
            self.manifest = Manifest(self.dir / MANIFEST_NAME)
        except BaseException:
            self.close()
            raise
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
        with contextlib.suppress(OSError):  # e.g. a full disk: the lock is held all the same
            self._lock.seek(0)
            self._lock.truncate()
            self._lock.write(str(os.getpid()))
            self._lock.flush()

    def close(self) -> None:
        """Release the lock."""
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
