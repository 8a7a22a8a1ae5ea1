"""The voice registry: voice prompts encoded once and kept by name.

A voice is two files in the store folder (`MIMO_TTS_VOICES_DIR`, else
`$XDG_DATA_HOME/mimo-tts/voices`, else `~/.local/share/mimo-tts/voices`):
`<name>.safetensors` (the prompt codes [K, T] int64, exactly what `Stage1.prompt_codes` gives
for the source file) and `<name>.json` (its record: the source file's sha256 and duration, the
audio tokenizer that encoded it, the codes' sha256, created-at, an optional transcript).

Writes take an exclusive `flock` on the store's lock file; reads a shared one, so two processes
never see half a voice. Each file is written through `atomic_write`, the codes before the
record: a record present means the voice is complete, and its `codes_sha256` must match the
codes file (else the voice is reported corrupt). Removing drops the record first.
"""

from __future__ import annotations

import contextlib
import datetime
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
RESERVED = frozenset({"default", "natural"})  # the server's built-in voices
RECORD_FORMAT = 1
LOCK_NAME = ".voices.lock"


def voices_dir(env: Mapping[str, str] | None = None) -> Path:
    """The store folder: MIMO_TTS_VOICES_DIR, else the XDG data home's `mimo-tts/voices`."""
    env = os.environ if env is None else env
    if env.get(VOICES_DIR_ENV):
        return Path(env[VOICES_DIR_ENV]).expanduser()
    base = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "mimo-tts" / "voices"


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
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            handle = open_no_follow(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise OutputError(f"voice store {self.root}: {exc.strerror or exc}") from None
        with handle:  # closing releases the lock
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield

    def add(self, name: str, codes, record: dict, overwrite: bool = False) -> dict:
        """Store `codes` [K, T] under `name` with `record` (source, tokenizer, transcript);
        an existing voice is kept unless `overwrite`. Returns the full record."""
        from safetensors.torch import save

        codes_path, record_path = self.paths(name)
        payload = save({"codes": codes.detach().cpu().long().contiguous()},
                       metadata={"name": name, "format": str(RECORD_FORMAT)})
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
        """Every voice's record, by name; a corrupt one is listed with its `error`."""
        out = []
        with self._lock(exclusive=False):
            for name in self._names():
                try:
                    out.append(self._record(name))
                except InputError as exc:
                    out.append({"name": name, "error": str(exc)})
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
            try:
                payload = codes_path.read_bytes()
            except OSError as exc:
                raise InputError(f"voice {name!r} is corrupt: its codes {codes_path} cannot be "
                                 f"read ({exc.strerror or exc}); add it again") from None
        if hashlib.sha256(payload).hexdigest() != record.get("codes", {}).get("sha256"):
            raise InputError(f"voice {name!r} is corrupt: {codes_path} does not match its "
                             "record; add it again")
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
                or not isinstance(record.get("tokenizer"), dict)):
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
