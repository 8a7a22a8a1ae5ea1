"""The voice registry: voice prompts encoded once and kept by name.

A voice is two files in the store folder (`MIMO_TTS_VOICES_DIR`, else
`$XDG_DATA_HOME/mimo-tts/voices`, else `~/.local/share/mimo-tts/voices`):
`<name>.safetensors` (the prompt codes [K, T] int64, exactly what `Stage1.prompt_codes` gives
for the source file) and `<name>.json` (its record: the source file's sha256 and duration, the
audio tokenizer that encoded it, the codes' sha256, created-at, an optional transcript).

Writes take an exclusive `flock` on the store's lock file; reads a shared one, so two processes
never see half a voice. Each file is written through `atomic_write`, the codes before the
record: a record present means the voice is complete, and its `codes_sha256` must match the
codes file (else the voice is reported corrupt, by `list` too). Removing drops the record first.
Reading never creates anything: a store folder that does not exist is empty, and a read-only
one (no lock file, none can be made) is read without the lock, as nothing can write there.
The codes file's bytes depend on the codes and the name only (`stable_safetensors`), so adding
the same recording again gives the same file, and the same resume keys for what it voiced.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from mimo_tts.errors import InputError, OutputError, UsageError
from mimo_tts.runtime.paths import atomic_write, clean_temp_files, open_no_follow, write_json
from mimo_tts.runtime.safetensors import weight_files

VOICES_DIR_ENV = "MIMO_TTS_VOICES_DIR"
MAX_NAME = 64
# A letter or digit first, then letters, digits, "_", "-", ".": no separators, no dot files.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# The built-in voices every face offers: name -> (the task it speaks in, its note).
BUILT_IN = {"default": ("tts_sft", "the model's own voice"),
            "natural": ("tts_sft_with_natural_instruction",
                        "natural-language instruction: the text says how to speak")}
RESERVED = frozenset(BUILT_IN)  # no stored voice takes these names
RECORD_FORMAT = 1
LOCK_NAME = ".voices.lock"


def voices_dir(env: Mapping[str, str] | None = None) -> Path:
    """The store folder: MIMO_TTS_VOICES_DIR, else the XDG data home's `mimo-tts/voices`."""
    env = os.environ if env is None else env
    if env.get(VOICES_DIR_ENV):
        return Path(env[VOICES_DIR_ENV]).expanduser()
    base = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "mimo-tts" / "voices"


def served_voices(startup: Mapping[str, object], store: VoiceStore) -> list[tuple[str, str]]:
    """The voices a server offers, in order, each with its kind: the built-in ones, the
    start-up ones (`--voice NAME=FILE`) and the registry's: the one list of the page, the
    start-up line, `/v1/audio/voices` and Wyoming's `info`."""
    return ([(n, "builtin") for n in BUILT_IN] + [(n, "startup") for n in startup]
            + [(n, "registry") for n in store.names() if n not in startup])


def check_startup_voices(startup: Mapping[str, object], store: VoiceStore) -> None:
    """A start-up voice may not share its name with a stored one: refused (exit 2), as a
    built-in name is, rather than one silently hiding the other."""
    taken = sorted(set(startup) & set(store.names()))
    if taken:
        raise UsageError(f"--voice {taken[0]}: the voice registry holds a voice of that name; "
                         f"pick another name, or remove it (mimo-tts voices rm {taken[0]})")


def check_name(name) -> str:
    """A voice name: 1-64 of letters, digits, `_-.`, starting with a letter or digit."""
    if not isinstance(name, str) or not name:
        raise UsageError("a voice name must be a non-empty string")
    if len(name) > MAX_NAME or not NAME_PATTERN.fullmatch(name) or name.endswith("."):
        raise UsageError(f"invalid voice name {name[:80]!r}: use at most {MAX_NAME} letters, "
                         "digits, '_', '-' or '.', starting with a letter or digit")
    if name.lower() in RESERVED:
        raise UsageError(f"voice name {name!r} is reserved (the server's built-in voice)")
    return name


@lru_cache(maxsize=8)
def tokenizer_id(path: str) -> str:
    """A fingerprint of an audio tokenizer checkpoint: its config.json and each weight file's
    name, size and safetensors header (the tensors' names, shapes, dtypes and offsets) plus
    the first MiB of its data, so another checkpoint of the same architecture differs."""
    digest = hashlib.sha256()
    root = Path(path)
    digest.update((root / "config.json").read_bytes())
    for file in weight_files(root):
        digest.update(file.name.encode())
        digest.update(str(file.stat().st_size).encode())
        with open(file, "rb") as handle:
            digest.update(handle.read((1 << 20) + (1 << 16)))
    return digest.hexdigest()[:32]


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


_DTYPES = {"int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
           "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
           "bool": "BOOL"}


def stable_safetensors(tensors: dict, metadata: dict[str, str]) -> bytes:
    """A safetensors file whose bytes depend on its tensors and metadata only.

    `safetensors.torch.save` writes the metadata in its hash map's order, which changes from
    process to process, so the same codes gave other bytes (and another sha256) on each run.
    Here the header is JSON with sorted keys, the tensors are laid out by name, and the header
    is padded with spaces to 8 bytes, as the format describes; any safetensors reader reads it.
    """
    import torch

    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    blobs, at = [], 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        dtype = _DTYPES[str(tensor.dtype).removeprefix("torch.")]
        blob = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": list(tensor.shape),
                        "data_offsets": [at, at + len(blob)]}
        blobs.append(blob)
        at += len(blob)
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    text += " " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text.encode("ascii") + b"".join(blobs)


def _file_above(root: Path) -> Path | None:
    """A file (not a folder) where one of `root`'s parent folders should be."""
    return next((p for p in root.parents if p.exists() and not p.is_dir()), None)


def folder_problem(root: Path, exc: OSError | None) -> str:
    """What is wrong with a store folder, in words (not `[Errno 17] File exists`)."""
    if os.path.islink(root) and not root.exists():
        return "it is a symbolic link to nothing; make it a folder"
    if root.exists() and not root.is_dir():
        return "it is a file, not a folder; move it away or set MIMO_TTS_VOICES_DIR to a folder"
    if (above := _file_above(root)) is not None:
        return f"{above} is a file, not a folder; set MIMO_TTS_VOICES_DIR to a folder"
    code = getattr(exc, "errno", None)
    if code in (errno.EACCES, errno.EPERM):
        return "permission denied: this user cannot write there; set MIMO_TTS_VOICES_DIR"
    if code == errno.EROFS:
        return "the file system is read-only: voices can be listed and used, not added"
    if code == errno.ENOSPC:
        return "no space left on the device"
    return (exc.strerror or str(exc)).lower() if exc is not None else "not a usable folder"


@dataclass(frozen=True)
class Voice:
    """A stored voice: its prompt codes [K, T] int64 and its record."""

    name: str
    codes: object  # torch.Tensor [K, T] int64
    record: dict


class VoiceStore:
    """The registry folder: add, list, show (`record`), load and remove voices by name."""

    def __init__(self, root: str | Path | None = None, env: Mapping[str, str] | None = None):
        self.root = Path(root) if root is not None else voices_dir(env)

    def __repr__(self) -> str:
        return f"VoiceStore({str(self.root)!r})"

    def paths(self, name: str) -> tuple[Path, Path]:
        """(codes, record) of a voice."""
        name = check_name(name)
        return self.root / f"{name}.safetensors", self.root / f"{name}.json"

    @contextlib.contextmanager
    def _lock(self, exclusive: bool):
        """The store's lock: exclusive for writes (the folder made first), shared for reads,
        which make nothing: a missing folder is read as empty, a read-only one unlocked."""
        handle = self._open_lock() if exclusive else self._open_lock_to_read()
        if handle is None:
            yield
            return
        with handle:  # closing releases the lock
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield

    def _open_lock(self):
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            return open_no_follow(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise OutputError(f"voice store {self.root}: {folder_problem(self.root, exc)}"
                              ) from None

    def _open_lock_to_read(self):
        if not os.path.lexists(self.root) and not _file_above(self.root):
            return None  # nothing stored yet
        if not self.root.is_dir():
            raise OutputError(f"voice store {self.root}: {folder_problem(self.root, None)}")
        for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
            try:
                return open_no_follow(self.root / LOCK_NAME, flags)
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT):
                    raise OutputError(f"voice store {self.root}: "
                                      f"{folder_problem(self.root, exc)}") from None
        return None  # read-only and never locked: nothing can be writing there

    def add(self, name: str, codes, record: dict, overwrite: bool = False) -> dict:
        """Store `codes` [K, T] under `name` with `record` (source, tokenizer, transcript);
        an existing voice is kept unless `overwrite`. Returns the full record."""
        codes_path, record_path = self.paths(name)
        payload = stable_safetensors({"codes": codes.detach().cpu().long().contiguous()},
                                     {"name": name, "format": str(RECORD_FORMAT)})
        full = {"name": name, "format": RECORD_FORMAT,
                "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                **record, "codes": {"shape": list(codes.shape),
                                    "sha256": hashlib.sha256(payload).hexdigest()}}
        with self._lock(exclusive=True):
            clean_temp_files(self.root)  # holding the lock: any temp file is a dead writer's
            if record_path.exists() and not overwrite:
                raise UsageError(f"voice {name!r} already exists; give --overwrite (overwrite="
                                 "True) to replace it")
            atomic_write(codes_path, lambda f: f.write(payload))
            write_json(record_path, full)
        return full

    def names(self) -> list[str]:
        with self._lock(exclusive=False):
            return self._names()

    def _names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.stem for p in self.root.glob("*.json")
                      if NAME_PATTERN.fullmatch(p.stem) and p.stem.lower() not in RESERVED)

    def list(self) -> list[dict]:
        """Every voice's record, by name; one that cannot be used (a corrupt record, codes
        gone or not matching the record) is listed with its `error`."""
        out = []
        with self._lock(exclusive=False):
            for name in self._names():
                try:
                    record = self._record(name)
                    self._codes(name, record)
                except InputError as exc:
                    out.append({"name": name, "error": str(exc)})
                else:
                    out.append(record)
        return out

    def record(self, name: str) -> dict:
        """A voice's record (InputError for an unknown or corrupt voice)."""
        with self._lock(exclusive=False):
            return self._record(name)

    def load(self, name: str) -> Voice:
        """A voice's codes and record, checked against each other."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        codes_path, _ = self.paths(name)
        with self._lock(exclusive=False):
            record = self._record(name)
            payload = self._codes(name, record)
        try:
            codes = load(payload)["codes"]
        except (SafetensorError, KeyError, ValueError) as exc:
            raise InputError(f"voice {name!r} is corrupt: {codes_path}: {exc}") from None
        if codes.dim() != 2 or codes.is_floating_point():
            raise InputError(f"voice {name!r} is corrupt: codes of shape {list(codes.shape)}")
        return Voice(name, codes.long(), record)

    def remove(self, name: str) -> None:
        """Drop a voice (record first, so a reader never finds a record without codes)."""
        codes_path, record_path = self.paths(name)
        with self._lock(exclusive=True):
            if not record_path.exists():
                raise InputError(self._unknown(name))
            for path in (record_path, codes_path):
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    raise OutputError(f"cannot remove {path}: {exc.strerror or exc}") from None

    def _codes(self, name: str, record: dict) -> bytes:
        """A voice's codes file, checked against its record's sha256."""
        codes_path, _ = self.paths(name)
        try:
            payload = codes_path.read_bytes()
        except FileNotFoundError:
            raise InputError(f"voice {name!r} is broken: its codes file {codes_path} is gone; "
                             "add it again") from None
        except OSError as exc:
            raise InputError(f"voice {name!r} is corrupt: its codes {codes_path} cannot be "
                             f"read ({exc.strerror or exc}); add it again") from None
        if hashlib.sha256(payload).hexdigest() != record["codes"].get("sha256"):
            raise InputError(f"voice {name!r} is corrupt: {codes_path} does not match its "
                             "record; add it again")
        return payload

    def _record(self, name: str) -> dict:
        _, record_path = self.paths(name)
        try:
            text = record_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise InputError(self._unknown(name)) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"voice {name!r} is corrupt: {record_path}: {exc}") from None
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"voice {name!r} is corrupt: {record_path} is not JSON "
                             f"({exc.msg} at line {exc.lineno}); add it again") from None
        if (not isinstance(record, dict) or record.get("name") != name
                or not isinstance(record.get("codes"), dict)
                or not isinstance(record.get("tokenizer"), dict)
                or not isinstance(record.get("source"), dict)
                or not isinstance(record["source"].get("seconds"), int | float)
                or not isinstance(record.get("created_at"), str)):
            raise InputError(f"voice {name!r} is corrupt: {record_path} is not a voice record; "
                             "add it again")
        return record

    def _unknown(self, name: str) -> str:
        known = self._names()
        return (f"unknown voice {name!r} in {self.root}; "
                + (f"known: {', '.join(known)}" if known else "add one with `mimo-tts voices add "
                   "NAME FILE`"))


def source_record(path: str | Path, transcript: str | None = None,
                  shown: str | None = None) -> dict:
    """What a record keeps of the source recording: its path (or `shown` in its place), sha256,
    duration (of the decoded samples: a FLAC's header may not say) and rate."""
    from mimo_tts.synthesis.audio import read_audio

    audio, rate = read_audio(path, shown=shown)  # refuses unusable audio before any encode
    seconds = audio.shape[-1] / rate
    del audio
    return {"source": {"path": shown or str(Path(path).resolve()), "sha256": file_sha256(path),
                       "seconds": round(seconds, 4), "sample_rate": rate},
            "transcript": transcript}


def tokenizer_record(ref) -> dict:
    """What a voice records of the audio tokenizer that encoded it (a `ModelRef`)."""
    return {"id": tokenizer_id(str(ref.path)), "path": str(ref.path), "name": ref.name}


def add_voice(store: VoiceStore, stage1, tok_ref, name: str, path, transcript=None,
              overwrite: bool = False, label: str | None = None) -> dict:
    """Encode the recording at `path` once with `stage1` (a `Stage1`, as `--prompt-audio
    path` encodes it) and keep its codes in `store` as `name`; returns the voice's record.
    `label` replaces the source path in the record (an upload's temporary file)."""
    check_name(name)
    path = str(path)
    record = source_record(path, transcript, label)  # unusable: InputError, nothing kept
    codes = stage1.prompt_codes(path)
    return store.add(name, codes, {**record, "tokenizer": tokenizer_record(tok_ref)},
                     overwrite=overwrite)
