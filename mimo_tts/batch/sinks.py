"""Sinks: where a batch run's results go. The runner hands each one data; sinks write bytes.

- `DirectorySink`: `<output-dir>/<task>/` with its lock, manifest and per-item files (codes,
  then sidecar, then audio, each atomic: audio present => done). One run at a time may write a
  task directory: opening takes an exclusive `flock` on `.mimo-tts.lock` (released by the
  kernel even after `kill -9`), then removes temp files a killed run left behind.
  `results.jsonl` holds one line per item and format; a line cut by a killed writer is dropped
  next time. The locks and the manifests are never opened through a symbolic link.
  Shard K of N (`shards.py`) holds `.mimo-tts.lock` shared and its own
  `.mimo-tts.shard-K-of-N.lock` exclusively, and writes `results.shard-K-of-N.jsonl`: shards
  share a folder without waiting on each other, and an unsharded run is refused beside them.
  Temp files are removed only by a run that finds the folder otherwise idle.
- `FileSink` (`-o FILE`, also `decode`'s files; a same-input re-run is skipped),
  `StdoutSink` (`-o -`), `RawPcmSink` (`--raw`: PCM on stdout, chunks as they are decoded or
  each finished item) and `MemorySink` (results keep their samples).
- `TaskDirectories`: a `DirectorySink` per task, when JSONL lines name tasks of their own.

Every sink has `check(result)` (resume or refuse before work), `on_chunk` (streamed audio, or
None), `write(result, samples, codes, record)` and `finished(result, task)`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from mimo_tts.batch.files import (
    audio_suffix,
    caption_path,
    companion_paths,
    save_codes,
    write_captions,
    write_stdout_bytes,
)
from mimo_tts.batch.manifest import (
    LOCK_NAME,
    SHARED_LOCK_WAIT_S,
    Manifest,
    done_record,
    flock,
    lock_name,
    manifest_name,
    read_sidecar,
    sidecar_result,
)
from mimo_tts.batch.shards import parse_tag
from mimo_tts.errors import OutputError
from mimo_tts.runtime.paths import (
    atomic_write,
    clean_temp_files,
    is_special_file,
    open_no_follow,
    pid_alive,
    remove_quietly,
    write_json,
)
from mimo_tts.synthesis.audio import SAMPLE_RATE, encode_audio, pcm16, write_audio


def _skip(result, path: Path, done: dict) -> None:
    result.status, result.path = "skipped", path
    result.seconds, result.rtf = done.get("seconds", 0.0), done.get("rtf")


class Sink:
    """A sink that writes nothing and refuses nothing (the base of the others)."""

    on_chunk = None  # streamed audio chunks [S_i] float32 24 kHz, or None

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self):
        """Take what the sink writes into (a folder, its locks); `with` opens and closes it."""
        return self

    def close(self) -> None:
        """Let go of what `open` took."""

    def check(self, result) -> None:
        """Before an item runs: mark it skipped, or raise when its target is taken."""

    def write(self, result, samples, codes: dict, record: dict) -> None:
        """One finished item: `samples` [S] at the run rate, `codes` {"pieces", "metadata"},
        `record` the sidecar without its `result` (added last, once paths are known)."""

    def finished(self, result, task: str) -> None:
        """An item ended ok or failed (after `write`, or without it)."""


class MemorySink(Sink):
    """Results keep their samples (`ItemResult.audio`): benchmarks and tests.

    `on_chunk` receives streamed chunks (e.g. `list.append`) when the run streams.
    """

    def __init__(self, on_chunk=None):
        self.on_chunk = on_chunk

    def write(self, result, samples, codes, record) -> None:
        result.audio = samples


class StdoutSink(Sink):
    """`-o -`: each item's encoded audio file on stdout, flushed."""

    def __init__(self, fmt: str = "wav", sample_rate: int = SAMPLE_RATE):
        self.fmt, self.sample_rate = fmt, sample_rate

    def write(self, result, samples, codes, record) -> None:
        write_stdout_bytes(encode_audio(samples, self.sample_rate, self.fmt))


class RawPcmSink(Sink):
    """`--raw`: 16-bit PCM on a binary stream (stdout), flushed at once: chunks as they are
    decoded when the run streams, else each item's whole audio once it is finished."""

    def __init__(self, stream=None, streamed: bool = True):
        self.stream, self.streamed = stream, streamed

    def on_chunk(self, chunk) -> None:
        write_stdout_bytes(pcm16(chunk), self.stream)

    def write(self, result, samples, codes, record) -> None:
        if not self.streamed:
            write_stdout_bytes(pcm16(samples), self.stream)


class FileSink(Sink):
    """`-o FILE`: one item's audio, with its sidecar (and codes) beside it unless `audio_only`.

    A re-run with the same inputs is skipped (the sidecar holds the resume key); any other
    existing file among the item's (audio, sidecar, codes) is kept unless `overwrite`. Missing
    folders are created. Temp files a killed run left beside the target are removed (those of
    dead pids). A target that is not a regular file (`/dev/null`, a FIFO) gets the audio only.
    The user named the file, so its sidecar is `x.json` whatever its format (`named`).
    """

    named = True  # companions by the file's stem (a folder's outputs: by its name, per format)

    def __init__(self, path: str | Path, fmt: str = "wav", sample_rate: int = SAMPLE_RATE,
                 save_codes: bool = False, overwrite: bool = False, audio_only: bool = False,
                 captions: tuple[str, ...] = ()):
        self.path, self.fmt, self.sample_rate = Path(path), fmt, sample_rate
        self.save_codes, self.overwrite, self.audio_only = save_codes, overwrite, audio_only
        self.captions = captions  # the caption formats this run writes (--captions)

    def open(self) -> FileSink:
        if not is_special_file(self.path):
            _make_folder(self.path.parent, "directory")
            own = self.targets(None)[:1 if self.audio_only else 3]  # its audio, sidecar, codes
            clean_temp_files(self.path.parent, tuple(p.name for p in own))
        return self

    def targets(self, result) -> tuple[Path, Path, Path]:
        return (self.path, *companion_paths(self.path, self.named))

    def check(self, result) -> None:
        """Skip an item done with the same inputs; refuse to replace anything else."""
        path, sidecar, codes = self.targets(result)
        if self.overwrite or is_special_file(path):
            return
        if not self.audio_only:
            done = done_record(path, sidecar, result.key)
            if done is not None:
                _skip(result, path, done)
                self._add_captions(result, path, sidecar)
                return
        ours = not self.audio_only and (sidecar_result(sidecar) or {}).get("key") == result.key
        mine = () if self.audio_only or ours else (sidecar, codes) if self.save_codes else (
            sidecar,)
        for taken in () if ours else (path, *mine):  # ours, not done: its audio is cut
            if taken.exists() or taken.is_symlink():
                raise OutputError(f"{taken} exists; use --overwrite to replace it")

    def _add_captions(self, result, path: Path, sidecar: Path) -> None:
        """A done item's captions in a format this run asks for and no earlier run wrote: from
        the cues its sidecar keeps (the same key: the same audio), the sidecar then naming it."""
        record = read_sidecar(sidecar) or {}
        captions = record.get("captions")
        if not self.captions or not isinstance(captions, dict) or "cues" not in captions:
            return
        files = [caption_path(path, f, self.named) for f in self.captions]
        if missing := [f for f, p in zip(self.captions, files, strict=True) if not p.is_file()]:
            write_captions(path, captions["cues"], missing, self.named)
            formats = list(dict.fromkeys([*captions.get("formats", ()), *missing]))
            write_json(sidecar, {**record, "captions": {**captions, "formats": formats}})
        result.captions = [str(p) for p in files]

    def write(self, result, samples, codes, record) -> None:
        """Codes, then the sidecar (with the result), then the audio: audio present => done.

        Audio being replaced is removed first, so a run stopped half-way leaves the item absent
        (redone next time), never old audio beside a new sidecar. A failed item leaves none of
        its files behind.
        """
        path, sidecar, codes_path = self.targets(result)
        if self.audio_only or is_special_file(path):
            result.path = write_audio(path, samples, self.sample_rate, self.fmt)
            return
        if path.is_file() or path.is_symlink():
            remove_quietly(path)
        try:
            if self.save_codes:
                result.codes_path = save_codes(codes_path, codes["pieces"],
                                                   codes["metadata"])
            data = encode_audio(samples, self.sample_rate, self.fmt)
            result.path, result.sidecar = path, sidecar
            captions = record.get("captions") or {}
            caption_files = [caption_path(path, f, self.named) for f in captions.get("formats",
                                                                                  ())]
            result.captions = [str(p) for p in caption_files] or None
            audio = {**record.get("audio", {}), "bytes": len(data)}  # done: this size on disk
            write_json(sidecar, {**record, "audio": audio,
                                 "result": result.record(record["task"])})
            write_captions(path, captions.get("cues", []), captions.get("formats", []),
                           self.named)
            atomic_write(path, lambda f: f.write(data))
        except BaseException:
            remove_quietly(sidecar, result.codes_path,
                           *(Path(p) for p in result.captions or ()))
            result.path = result.sidecar = result.codes_path = result.captions = None
            raise


def _make_folder(folder: Path, what: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create {what} {folder}: {exc.strerror or exc}") from None


class DirectorySink(FileSink):
    """`<output-dir>/<task>/` with its lock, manifest and per-item file names; resumable.

    Each format has its own files (`<id>.wav` + `<id>.json`, `<id>.flac` + `<id>.flac.json`)
    and manifest line. A failed or refused item never replaces the `ok` line of an output that
    is still there. The lock file is opened without following links.
    """

    named = False

    def __init__(self, root: str | Path, task: str, fmt: str = "wav",
                 sample_rate: int = SAMPLE_RATE, save_codes: bool = False,
                 overwrite: bool = False, shard=None, who: str | None = None,
                 captions: tuple[str, ...] = ()):
        super().__init__(Path(root) / task, fmt, sample_rate, save_codes, overwrite,
                         captions=captions)
        self.dir = self.path
        self.who = who  # what opens the folder when it is not a run (`status --merge`)
        self.suffix = audio_suffix(fmt)
        self.shard = shard  # shards.Shard or None
        self._locks: list = []
        self.manifest: Manifest | None = None

    def open(self) -> DirectorySink:
        names = [LOCK_NAME] if self.shard is None else [LOCK_NAME, lock_name(self.shard)]
        _make_folder(self.dir, "output directory")
        try:
            for name in names:
                self._locks.append(open_no_follow(self.dir / name, os.O_RDWR | os.O_CREAT))
        except OSError as exc:
            self.close()
            raise OutputError(f"cannot create output directory {self.dir}: "
                              f"{exc.strerror or exc}") from None
        folder, own = self._locks[0], self._locks[-1]
        try:
            alone = flock(folder, exclusive=True)
            if alone:
                clean_temp_files(self.dir)
            if self.shard is None:
                if not alone and (writing := self._shards_writing()):
                    waits = (f"{self.who} waits until they are done" if self.who else
                             "an unsharded run waits for them (or use another --output-dir)")
                    raise OutputError(f"shard(s) {writing} are writing to {self.dir}; {waits}")
                self._hold(folder, alone, f"is writing to {self.dir}", record=True)
            else:  # shared folder lock (waiting out a clean-up), then this shard's own lock
                self._hold(folder, flock(folder, exclusive=False, wait=SHARED_LOCK_WAIT_S),
                           f"is writing to {self.dir} unsharded")
                self._hold(own, flock(own, exclusive=True),
                           f"is writing shard {self.shard.label} to {self.dir}", record=True)
            self.manifest = Manifest(self.dir / manifest_name(self.shard))
        except BaseException:
            self.close()
            raise
        return self

    def _shards_writing(self) -> str:
        """The shards whose own lock names a live pid, as `1/3 (pid 123), 2/3 (pid 456)`:
        they hold the folder lock shared and never write it, so its pid would be stale."""
        found = []
        for path in sorted(self.dir.glob(".mimo-tts.shard-*-of-*.lock")):
            tag = parse_tag(path.name)
            if tag is None or path.is_symlink():
                continue
            try:
                pid = int(path.read_bytes().strip() or b"0")
            except (OSError, ValueError):
                continue
            if pid > 0 and pid_alive(pid):
                found.append((tag[1], tag[0], f"{tag[0]}/{tag[1]} (pid {pid})"))
        return ", ".join(label for *_, label in sorted(found))

    def _hold(self, lock, held: bool, doing: str, record: bool = False) -> None:
        """Refuse when `lock` is taken; else `record` this pid in it (exclusive locks)."""
        if not held:
            lock.seek(0)
            holder = lock.read().decode("utf-8", "replace").strip() or "?"
            advice = (f"{self.who} waits until it is done" if self.who else
                      "wait for it or use another --output-dir")
            raise OutputError(f"another mimo-tts run (pid {holder}) {doing}; {advice}")
        if record:
            with contextlib.suppress(OSError):  # e.g. a full disk: the lock is held all the same
                lock.seek(0)
                lock.truncate()
                lock.write(str(os.getpid()).encode())
                lock.flush()

    def close(self) -> None:
        """Release the locks."""
        while self._locks:
            self._locks.pop().close()

    def targets(self, result) -> tuple[Path, Path, Path]:
        item_id = result.item.id
        return self.audio_path(item_id), self.sidecar_path(item_id), self.codes_path(item_id)

    def check(self, result) -> None:
        """Skip an item whose audio and sidecar say it is done with the same inputs (also
        under the text-only id earlier versions gave it: the item then keeps that id)."""
        item = result.item
        path = self.audio_path(item.id)
        done = self.done_record(item.id, result.key)
        if done is None and item.legacy_id and not self.overwrite and not path.exists():
            done = self.done_record(item.legacy_id, result.key)
            if done is not None:
                item.id, path = item.legacy_id, self.audio_path(item.legacy_id)
        if done is not None and not self.overwrite:
            _skip(result, path, done)
            self._add_captions(result, path, self.sidecar_path(item.id))
            line = self.manifest.get(item.id, self.fmt) or {}
            if line.get("status") != "ok" or line.get("key") != result.key:
                self.manifest.add({"format": self.fmt, **done})  # killed before its line
        elif (path.exists() or path.is_symlink()) and not self.overwrite and \
                (sidecar_result(self.sidecar_path(item.id)) or {}).get("key") != result.key:
            # (a sidecar with this key beside audio that is not done: its audio was cut, redo it)
            raise OutputError(f"{path} exists from other inputs; use --overwrite to replace it")

    def finished(self, result, task: str) -> None:
        line = self.manifest.get(result.item.id, self.fmt) or {}
        if result.status == "error" and line.get("status") == "ok" and \
                self.audio_path(result.item.id).is_file():
            return  # the output that line describes was kept: the line stays true
        self.manifest.add(result.record(task))

    def audio_path(self, item_id: str) -> Path:
        return self.dir / f"{item_id}{self.suffix}"

    def sidecar_path(self, item_id: str) -> Path:
        return companion_paths(self.audio_path(item_id))[0]

    def codes_path(self, item_id: str) -> Path:
        return companion_paths(self.audio_path(item_id))[1]

    def done_record(self, item_id: str, key: str) -> dict | None:
        """The result of a finished item with this input key, or None (`done_record`)."""
        return done_record(self.audio_path(item_id), self.sidecar_path(item_id), key)


class TaskDirectories(Sink):
    """`<output-dir>/<task>/` for each task of a run whose JSONL lines name their own: one
    `DirectorySink` per task, all opened (locked) together; each item goes to its task's."""

    def __init__(self, root: str | Path, task: str, tasks, **options):
        self.task = task
        self.sinks = {t: DirectorySink(root, t, **options) for t in dict.fromkeys([task, *tasks])}

    def open(self) -> TaskDirectories:
        try:
            for sink in self.sinks.values():
                sink.open()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for sink in self.sinks.values():
            sink.close()

    def of(self, result) -> DirectorySink:
        return self.sinks[result.item.task or self.task]

    def check(self, result) -> None:
        self.of(result).check(result)

    def write(self, result, samples, codes, record) -> None:
        self.of(result).write(result, samples, codes, record)

    def finished(self, result, task: str) -> None:
        self.of(result).finished(result, task)
