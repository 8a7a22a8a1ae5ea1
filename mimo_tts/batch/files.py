"""A batch run's files beside its audio, and stdout: sidecar and codes paths, codes files,
caption files, raw PCM and whole files on stdout.

Nothing here imports torch at module level, so the CLI can import it cheaply. Files are written
through `runtime.paths.atomic_write` (a temp file renamed into place: an output is complete or
absent, even after `kill -9`); the audio itself through `synthesis.audio.write_audio`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from mimo_tts.errors import InputError, OutputError
from mimo_tts.runtime.paths import atomic_write
from mimo_tts.synthesis.audio import FORMATS, MAX_PAUSE_FRAMES, SAMPLE_RATE
from mimo_tts.synthesis.captions import caption_text
from mimo_tts.synthesis.markup import MAX_PAUSE


def audio_suffix(fmt: str | None) -> str:
    """An output's file ending in a folder: its format's extension, and `.f32.wav` for
    `wav-float`, so a float and a PCM16 WAV of one item keep their own files (and sidecars,
    `x.f32.json`). Lines from before formats were recorded are wav."""
    return ".f32.wav" if fmt == "wav-float" else FORMATS.get(fmt or "wav", FORMATS["wav"])[2]


def companion_paths(audio: Path, named: bool = False) -> tuple[Path, Path]:
    """The sidecar and codes files of an audio file: `x.json` beside `x.wav`, `x.flac.json`
    beside `x.flac` (each format has its own, so formats in one folder never share one). A file
    the user `named` (`-o x.flac`) has `x.json` whatever its format, as `-o x.wav` has."""
    return (audio.with_name(_base(audio, named) + ".json"),
            audio.with_name(_base(audio, named) + ".codes.safetensors"))


def _base(audio: Path, named: bool) -> str:
    return audio.stem if named or audio.suffix.lower() in ("", ".wav") else audio.name


# --- codes files --------------------------------------------------------------------------------


def save_codes(path: str | Path, pieces: list, metadata: dict) -> Path:
    """Stage-0 codes (one [8, T] int32 tensor per text piece) as safetensors + JSON metadata."""
    import torch

    from mimo_tts.synthesis.voices import stable_safetensors
    tensors = {f"codes.{i}": p.to(torch.int32).cpu().contiguous() for i, p in enumerate(pieces)}
    meta = {"format": "mimo-tts-codes", "pieces": str(len(pieces)),
            "metadata": json.dumps(metadata, ensure_ascii=False)}
    data = stable_safetensors(tensors, meta)  # equal codes, equal bytes
    return atomic_write(path, lambda f: f.write(data))


MAX_PAUSE_SAMPLES = round(MAX_PAUSE * SAMPLE_RATE)  # one [pause:] or <break>: 60 s


def load_codes(path: str | Path) -> tuple[list, dict]:
    """Read codes saved by `save_codes` (or a bare `codes` tensor in any safetensors file).

    Every piece must be an integer [8, T] tensor (T >= 1), `pause_frames` in the metadata an
    integer in [0, 250] and `pause_samples` (written when the text asked its own pauses, or
    --sentence-silence was not the default: silence before each piece and after the last, in
    samples) one integer per piece and one more; anything else is an InputError naming the
    file, so the other files of a `decode` run still go on.
    """
    from safetensors import SafetensorError, safe_open

    from mimo_tts.synthesis.stage1 import codes_tensor

    path = Path(path)
    if not path.is_file():
        raise InputError(f"codes file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            keys = sorted((k for k in handle.keys() if k.split(".")[0] == "codes"),
                          key=lambda k: int(k.split(".")[1]) if "." in k else 0)
            pieces = [handle.get_tensor(k) for k in keys]
        metadata = json.loads(meta.get("metadata", "{}"))
    except (SafetensorError, OSError, ValueError) as exc:
        raise InputError(f"unreadable codes file {path}: {exc}") from None
    if not pieces:
        raise InputError(f"{path}: no 'codes' tensor found")
    pieces = [codes_tensor(p, f"{path}: {key}") for key, p in zip(keys, pieces, strict=True)]
    metadata = metadata if isinstance(metadata, dict) else {}
    pause = metadata.get("pause_frames", 0)
    if isinstance(pause, bool) or not isinstance(pause, int) or \
            not 0 <= pause <= MAX_PAUSE_FRAMES:
        raise InputError(f"{path}: metadata pause_frames must be an integer in "
                         f"[0, {MAX_PAUSE_FRAMES}], got {str(pause)[:20]!r}")
    samples = metadata.get("pause_samples")
    if samples is not None and not (
            isinstance(samples, list) and len(samples) == len(pieces) + 1
            and all(isinstance(n, int) and not isinstance(n, bool)
                    and 0 <= n <= MAX_PAUSE_SAMPLES for n in samples)):
        raise InputError(f"{path}: metadata pause_samples must be {len(pieces) + 1} integers "
                         f"in [0, {MAX_PAUSE_SAMPLES}] (silence before each piece and after "
                         f"the last), got {str(samples)[:40]!r}")
    return pieces, metadata


# --- stdout -----------------------------------------------------------------------------------


def _broken_pipe() -> OutputError:
    """The reader closed stdout: silence later writes (and the exit-time flush) to it."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return OutputError("stdout was closed by the reader (broken pipe)")


def stdout_stream():
    """sys.stdout, or an OutputError when the command was started with it closed (`>&-`:
    Python then has no stdout at all)."""
    if sys.stdout is None:
        raise OutputError("cannot write to stdout: it is closed (started with >&-); "
                          "redirect it to a file or /dev/null instead")
    return sys.stdout


def write_stdout_bytes(data: bytes, stream=None) -> None:
    """Bytes on stdout, all of them, flushed: a short write is retried until the reader has
    everything or has gone away (then an OutputError: the data did not arrive)."""
    stream = stream or stdout_stream().buffer
    view = memoryview(data)
    try:
        while view:
            written = stream.write(view)
            if not written:
                raise OutputError("cannot write to stdout: the write made no progress")
            view = view[written:]
        stream.flush()
    except BrokenPipeError:
        raise _broken_pipe() from None
    except OSError as exc:
        raise OutputError(f"cannot write to stdout: {exc.strerror or exc}") from None


def write_stdout_line(text: str) -> None:
    """One line of data on stdout (a path, a JSON record); a closed pipe is an OutputError."""
    stream = stdout_stream()
    try:
        try:
            stream.write(text + "\n")
        except UnicodeEncodeError:  # a path of bytes that are not UTF-8 (or not the locale's)
            stream.write(text.encode(stream.encoding or "utf-8", "backslashreplace").decode(
                stream.encoding or "utf-8") + "\n")
        stream.flush()
    except BrokenPipeError:
        raise _broken_pipe() from None
    except OSError as exc:
        raise OutputError(f"cannot write to stdout: {exc.strerror or exc}") from None


def iter_jsonl(path: Path) -> Iterator[dict]:
    """Records of a JSON-lines file, skipping lines a killed writer left incomplete."""
    with contextlib.suppress(FileNotFoundError), open(path, "rb") as handle:
        yield from jsonl_records(handle)


def jsonl_records(handle) -> Iterator[dict]:
    """The JSON objects of an open binary file's lines; lines that do not parse are skipped."""
    for raw in handle:
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(record, dict):
            yield record


# --- captions -----------------------------------------------------------------------------------


def caption_path(audio: Path, fmt: str, named: bool = False) -> Path:
    """`x.srt` beside `x.wav`, `x.flac.vtt` beside `x.flac` (as `companion_paths`)."""
    return audio.with_name(f"{_base(audio, named)}.{fmt}")


def write_captions(audio: Path, cues: list[dict], formats: list[str],
                   named: bool = False) -> list[Path]:
    """Each caption file beside `audio`, written atomically."""
    paths = []
    for fmt in formats:
        payload = caption_text(cues, fmt).encode("utf-8")
        paths.append(atomic_write(caption_path(audio, fmt, named),
                                  lambda f, p=payload: f.write(p)))
    return paths
