"""Files, streams and audio: atomic writes, audio checks, joins and encoding, codes files, stdout.

Nothing here imports torch at module level, so the CLI can import it cheaply. Every regular
file is written through a temp file in the destination directory followed by `os.replace`, so
an output is either complete or absent, even after `kill -9`; temp files are created with
O_EXCL | O_NOFOLLOW (never written through a link) and `clean_temp_files` removes what a killed
run left behind. A target that is not a regular file (`/dev/null`, a FIFO) is written
in place: renaming over it would replace the device or pipe.
"""

from __future__ import annotations

import contextlib
import errno
import io as _io
import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

from mimo_tts.errors import AudioCheckError, InputError, NoAudioError, OutputError, UsageError
from mimo_tts.lm.config import AUDIO_CHANNELS

SAMPLE_RATE = 24000
PAUSE_FRAMES = 8  # silence between split text pieces: 8 frames = 0.32 s, whole frames
SILENCE_PEAK = 1e-4  # peak |sample| below this is "all silent"
TEMP_MARK = ".mimo-tmp-"
# format name: (libsndfile container, subtype, file extension)
FORMATS = {"wav": ("WAV", "PCM_16", ".wav"), "wav-float": ("WAV", "FLOAT", ".wav"),
           "flac": ("FLAC", "PCM_16", ".flac"), "mp3": ("MP3", "MPEG_LAYER_III", ".mp3"),
           "opus": ("OGG", "OPUS", ".opus"), "ogg": ("OGG", "VORBIS", ".ogg")}
# The sample rates libsndfile's MP3 and Opus encoders take (any other rate is refused).
FORMAT_RATES = {"mp3": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000),
                "opus": (8000, 12000, 16000, 24000, 48000)}
EXTENSIONS = {".wav": "wav", ".flac": "flac", ".mp3": "mp3", ".opus": "opus", ".ogg": "ogg"}


def output_format(path: str | None, given: str | None) -> str:
    """The format of an output file: `given` (--format) or its extension's, which must agree.

    No extension (`/dev/null`, `-`) means wav unless --format says otherwise; an extension that
    names no format needs --format.
    """
    if given is not None and given not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}")
    suffix = Path(path).suffix.lower() if path and path != "-" else ""
    named = EXTENSIONS.get(suffix)
    if given is None:
        if suffix and named is None:
            raise UsageError(f"cannot tell the audio format from {Path(path).name!r}; name it "
                             f"{', '.join(EXTENSIONS)} or give --format")
        return named or "wav"
    if named is not None and FORMATS[given][2] != suffix:
        raise UsageError(f"--format {given} disagrees with the file name {Path(path).name!r} "
                         f"({named}); drop --format or rename the file")
    return given


def check_format_rate(fmt: str, sample_rate: int) -> None:
    """MP3 and Opus take only some rates: another is a usage error, before any work."""
    rates = FORMAT_RATES.get(fmt)
    if rates is not None and sample_rate not in rates:
        raise UsageError(f"--format {fmt} takes --sample-rate {', '.join(map(str, rates))}, "
                         f"not {sample_rate}")


def companion_paths(audio: Path) -> tuple[Path, Path]:
    """The sidecar and codes files of an audio file: `x.json` beside `x.wav`, `x.flac.json`
    beside `x.flac` (each format has its own, so formats in one folder never share one)."""
    base = audio.stem if audio.suffix.lower() in ("", ".wav") else audio.name
    return audio.with_name(base + ".json"), audio.with_name(base + ".codes.safetensors")
# Lossy formats `mimo-tts serve` offers where this libsndfile has the encoder (`lossy_formats`).
LOSSY_FORMATS = {name: FORMATS[name] for name in ("mp3", "opus")}
STREAM_SIZE = 0xFFFFFFFF  # RIFF and data sizes of a WAV streamed before its length is known


# --- atomic files -------------------------------------------------------------------------------


def _temp_path(path: Path) -> Path:
    """A hidden `.part` file beside `path`: never matched by `*.wav`-style globs."""
    return path.with_name(f"{TEMP_MARK}{os.getpid()}-{path.name}.part")


def is_special_file(path: str | Path) -> bool:
    """True for an existing target that is not a regular file or directory (device, FIFO)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def atomic_write(path: str | Path, writer) -> Path:
    """Write through `writer(file)` into a temp file beside `path`, fsync, then rename."""
    path = Path(path)
    if is_special_file(path):
        return _write_in_place(path, writer)
    temp = _temp_path(path)
    try:
        with _create_temp(temp) as handle:
            writer(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:  # Ctrl-C or a failing writer: no partial file stays behind
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    return path


def _create_temp(temp: Path):
    """A new temp file, never through a link: a file of that name (a reused pid's leftover, or
    a planted symlink) is removed first, and O_EXCL | O_NOFOLLOW refuse one that reappears."""
    with contextlib.suppress(FileNotFoundError):
        temp.unlink()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(temp, flags, 0o666), "wb")


def open_no_follow(path: Path, flags: int):
    """A binary file object on `path` opened with O_NOFOLLOW (O_CREAT: mode 0o666 - umask);
    a symbolic link there is an OutputError, so nothing outside the output folder changes."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OutputError(f"{path} is a symbolic link; remove it (mimo-tts never writes "
                              "through links in its output folder)") from None
        raise
    return os.fdopen(fd, "r+b" if flags & os.O_RDWR else "ab" if flags & os.O_APPEND else "wb")


def _write_in_place(path: Path, writer) -> Path:
    try:
        with open(path, "wb") as handle:
            writer(handle)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def write_json(path: str | Path, data: dict) -> Path:
    payload = (json.dumps(data, ensure_ascii=False, indent=2) + "\n").encode("utf-8")
    return atomic_write(path, lambda f: f.write(payload))


def clean_temp_files(directory: str | Path, names: tuple[str, ...] | None = None) -> list[Path]:
    """Remove temp files left by killed runs: all of them (holding the directory lock), or
    with `names` only those for these target names whose writer's pid is dead (no lock)."""
    removed = []
    for path in Path(directory).glob(f"{TEMP_MARK}*"):
        if names is not None:
            pid, _, rest = path.name[len(TEMP_MARK):].partition("-")
            if rest.removesuffix(".part") not in names or not pid.isdigit() or pid_alive(int(pid)):
                continue
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (ours, or another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def remove_quietly(*paths: Path | None) -> None:
    """Best-effort removal (cleaning up an item's files after it failed half-way)."""
    for path in paths:
        if path is not None and not is_special_file(path):
            with contextlib.suppress(OSError):
                Path(path).unlink()


# --- audio --------------------------------------------------------------------------------------


def to_numpy(audio):
    """A float32 numpy array of samples from a tensor or array ([S])."""
    import numpy as np

    if hasattr(audio, "detach"):
        audio = audio.detach().float().cpu().numpy()
    return np.asarray(audio, dtype=np.float32).reshape(-1)


def check_audio(audio, item_id: str) -> None:
    """Refuse NaN/inf or all-silent audio (exit 6) rather than write a broken file."""
    import torch

    if audio.numel() == 0:
        raise NoAudioError(f"item {item_id!r}: no audio samples")
    if not bool(torch.isfinite(audio).all()):
        raise AudioCheckError(f"item {item_id!r}: decoded audio has NaN or infinite samples")
    if float(audio.abs().max()) < SILENCE_PEAK:
        raise AudioCheckError(f"item {item_id!r}: decoded audio is silent "
                              f"(peak below {SILENCE_PEAK})")


def join_pieces(audios: list, pause_frames: int, samples_per_frame: int):
    """Pieces' audio [S_i] joined with `pause_frames` frames of silence: [S] float32 on CPU."""
    import torch

    pause = torch.zeros(pause_frames * samples_per_frame)
    parts = []
    for i, audio in enumerate(audios):
        if i:
            parts.append(pause)
        parts.append(audio.detach().float().cpu())
    return torch.cat(parts)


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


def lossy_formats() -> list[str]:
    """The `LOSSY_FORMATS` this soundfile/libsndfile build can write."""
    import soundfile as sf

    return [name for name, (container, subtype, _) in LOSSY_FORMATS.items()
            if container in sf.available_formats()
            and subtype in sf.available_subtypes(container)]


def wav_stream_header(sample_rate: int) -> bytes:
    """A mono PCM16 WAV header for a stream of unknown length (sizes `STREAM_SIZE`)."""
    import struct

    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, 2 * sample_rate, 2, 16)  # PCM, mono, 16 bit
    return (b"RIFF" + struct.pack("<I", STREAM_SIZE) + b"WAVE" + b"fmt " +
            struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", STREAM_SIZE))


def encode_audio(audio, sample_rate: int, fmt: str) -> bytes:
    """Encoded file bytes for `fmt` (`wav` PCM16, `wav-float`, `flac`, or a lossy format)."""
    import numpy as np
    import soundfile as sf

    container, subtype, _ = FORMATS[fmt]
    samples = to_numpy(audio)
    if subtype == "PCM_16":
        samples = np.frombuffer(pcm16(samples), dtype="<i2")
    elif container != "WAV":  # the lossy encoders take [-1, 1]
        samples = np.clip(samples, -1.0, 1.0)
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
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"{where} {path} is unreadable or unsupported: {reason}") from None
    audio = torch.from_numpy(data.T.copy())  # [S, C] -> [C, S]
    if audio.shape[-1] == 0:
        raise InputError(f"{where} {path} has no samples")
    if not torch.isfinite(audio).all():
        raise InputError(f"{where} {path} contains NaN or infinite samples")
    return audio, int(rate)


# --- codes files --------------------------------------------------------------------------------


def save_codes(path: str | Path, pieces: list, metadata: dict) -> Path:
    """Stage-0 codes (one [8, T] int32 tensor per text piece) as safetensors + JSON metadata."""
    import torch
    from safetensors.torch import save

    tensors = {f"codes.{i}": p.to(torch.int32).cpu().contiguous() for i, p in enumerate(pieces)}
    meta = {"format": "mimo-tts-codes", "pieces": str(len(pieces)),
            "metadata": json.dumps(metadata, ensure_ascii=False)}
    data = save(tensors, metadata=meta)
    return atomic_write(path, lambda f: f.write(data))


CODE_CHANNELS = AUDIO_CHANNELS  # codebooks the LM emits and `decode` takes
MAX_PAUSE_FRAMES = 250  # 10 s of silence between pieces


def load_codes(path: str | Path) -> tuple[list, dict]:
    """Read codes saved by `save_codes` (or a bare `codes` tensor in any safetensors file).

    Every piece must be an integer [8, T] tensor (T >= 1) and `pause_frames` in the metadata an
    integer in [0, 250]; anything else is an InputError naming the file, so the other files of a
    `decode` run still go on.
    """
    from safetensors import SafetensorError, safe_open

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
    for key, piece in zip(keys, pieces, strict=True):
        if piece.is_floating_point() or piece.is_complex() or piece.dtype == _bool_dtype():
            raise InputError(f"{path}: {key} holds {piece.dtype} values; codes are integers")
        if piece.dim() != 2 or piece.shape[0] != CODE_CHANNELS or piece.shape[1] < 1:
            raise InputError(f"{path}: {key} has shape {list(piece.shape)}; codes are "
                             f"[{CODE_CHANNELS}, T] with T >= 1")
    metadata = metadata if isinstance(metadata, dict) else {}
    pause = metadata.get("pause_frames", 0)
    if isinstance(pause, bool) or not isinstance(pause, int) or \
            not 0 <= pause <= MAX_PAUSE_FRAMES:
        raise InputError(f"{path}: metadata pause_frames must be an integer in "
                         f"[0, {MAX_PAUSE_FRAMES}], got {str(pause)[:20]!r}")
    return [p.long() for p in pieces], metadata


def _bool_dtype():
    import torch

    return torch.bool


# --- stdout -----------------------------------------------------------------------------------


def _broken_pipe() -> OutputError:
    """The reader closed stdout: silence later writes (and the exit-time flush) to it."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return OutputError("stdout was closed by the reader (broken pipe)")


def write_stdout_bytes(data: bytes, stream=None) -> None:
    """Bytes on stdout, all of them, flushed: a short write is retried until the reader has
    everything or has gone away (then an OutputError: the data did not arrive)."""
    stream = stream or sys.stdout.buffer
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


def write_stdout_pcm(chunk, stream=None) -> None:
    """Audio as PCM16 on stdout (`--raw`), flushed at once."""
    write_stdout_bytes(pcm16(chunk), stream)


def write_stdout_audio(audio, sample_rate: int, fmt: str, stream=None) -> None:
    """A whole item's encoded audio file on stdout (`-o -`)."""
    write_stdout_bytes(encode_audio(audio, sample_rate, fmt), stream)


def write_stdout_line(text: str) -> None:
    """One line of data on stdout (a path, a JSON record); a closed pipe is an OutputError."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        raise _broken_pipe() from None


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
