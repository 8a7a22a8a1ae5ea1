"""Audio in memory: output formats, checks, joins, resampling, encoding to bytes, the one audio
file writer (`write_audio`, atomic: the CLI's sinks and `Audio.save` both use it), and reading
prompt audio."""

from __future__ import annotations

import functools
import io as _io
import numbers
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from mimo_tts.errors import (
    AudioCheckError,
    InputError,
    NoAudioError,
    OptionTypeError,
    UsageError,
    short_repr,
)
from mimo_tts.runtime.paths import atomic_write
from mimo_tts.synthesis import aac

SAMPLE_RATE = 24000

PAUSE_FRAMES = 8  # silence between split text pieces: 8 frames = 0.32 s, whole frames
MAX_PAUSE_FRAMES = 250  # 10 s: the most a codes file's pause_frames (or decode's) may ask

SILENCE_PEAK = 1e-4  # peak |sample| below this is "all silent"


# format name: (libsndfile container, subtype, file extension, media type)
FORMATS = {"wav": ("WAV", "PCM_16", ".wav", "audio/wav"),
           "wav-float": ("WAV", "FLOAT", ".wav", "audio/wav"),
           "flac": ("FLAC", "PCM_16", ".flac", "audio/flac"),
           "mp3": ("MP3", "MPEG_LAYER_III", ".mp3", "audio/mpeg"),
           "opus": ("OGG", "OPUS", ".opus", "audio/opus"),
           "ogg": ("OGG", "VORBIS", ".ogg", "audio/ogg"),
           # AAC through PyAV (`synthesis/aac.py`), not libsndfile: ADTS frames, and MP4
           "aac": ("ADTS", "AAC", ".aac", "audio/aac"),
           "m4a": ("MP4", "AAC", ".m4a", "audio/mp4")}
AAC_FORMATS = ("aac", "m4a")


# The sample rates libsndfile's MP3 and Opus encoders take (any other rate is refused).
FORMAT_RATES = {"mp3": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000),
                "opus": (8000, 12000, 16000, 24000, 48000),
                "aac": aac.RATES, "m4a": aac.RATES}


# file extension -> the format it names (.wav: PCM16, as wav-float needs --format)
EXTENSIONS = {ext: name for name, (_, _, ext, _) in FORMATS.items() if name != "wav-float"}


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
    """MP3, Opus and AAC take only some rates: another is a usage error, before any work; so
    is AAC without PyAV."""
    if fmt in AAC_FORMATS:
        aac.require(fmt)
    rates = FORMAT_RATES.get(fmt)
    if rates is not None and sample_rate not in rates:
        raise UsageError(f"--format {fmt} takes --sample-rate {', '.join(map(str, rates))}, "
                         f"not {sample_rate}")


# Lossy formats `mimo-tts serve` offers where this libsndfile has the encoder (`lossy_formats`).
LOSSY_FORMATS = {name: FORMATS[name] for name in ("mp3", "opus")}

STREAM_SIZE = 0xFFFFFFFF  # RIFF and data sizes of a WAV streamed before its length is known


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


def join_pieces(audios: list, pauses):
    """Pieces' audio [S_i] joined with silence: `pauses[i]` zero samples before piece i and
    `pauses[-1]` after the last (`markup.Script.pauses`) -> [S] float32 on CPU."""
    import torch

    if len(pauses) != len(audios) + 1:
        raise ValueError(f"{len(pauses)} pauses for {len(audios)} pieces")
    parts = []
    for pause, audio in zip(pauses, audios, strict=False):
        if pause:
            parts.append(torch.zeros(int(pause)))
        parts.append(audio.detach().float().cpu())
    if pauses[-1]:
        parts.append(torch.zeros(int(pauses[-1])))
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

    return [name for name, (container, subtype, *_) in LOSSY_FORMATS.items()
            if container in sf.available_formats()
            and subtype in sf.available_subtypes(container)]


def wav_stream_header(sample_rate: int) -> bytes:
    """A mono PCM16 WAV header for a stream of unknown length (sizes `STREAM_SIZE`)."""
    import struct

    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, 2 * sample_rate, 2, 16)  # PCM, mono, 16 bit
    return (b"RIFF" + struct.pack("<I", STREAM_SIZE) + b"WAVE" + b"fmt " +
            struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", STREAM_SIZE))


def encode_audio(audio, sample_rate: int, fmt: str) -> bytes:
    """Encoded file bytes for `fmt` (`wav` PCM16, `wav-float`, `flac`, or a lossy format:
    libsndfile's, or AAC through PyAV)."""
    import numpy as np
    import soundfile as sf

    container, subtype, *_ = FORMATS[fmt]
    samples = to_numpy(audio)
    if fmt in AAC_FORMATS:
        return aac.encode_aac(np.clip(samples, -1.0, 1.0), sample_rate, fmt)
    if subtype == "PCM_16":
        samples = np.frombuffer(pcm16(samples), dtype="<i2")
    elif container != "WAV":  # the lossy encoders take [-1, 1]
        samples = np.clip(samples, -1.0, 1.0)
    buffer = _io.BytesIO()
    sf.write(buffer, samples, sample_rate, format=container, subtype=subtype)
    data = buffer.getvalue()
    if container == "OGG":
        return fixed_ogg_serial(data)
    return fixed_peak_time(data) if subtype == "FLOAT" else data


def fixed_peak_time(data: bytes) -> bytes:
    """A float WAV file with its PEAK chunk's time stamp set to 0.

    libsndfile writes float WAV files with a PEAK chunk (each channel's peak and where it is)
    stamped with the second the file was written, so the same samples would give different
    bytes a second later; the peaks stay, the stamp goes."""
    out = bytearray(data)
    at = 12  # past "RIFF", the size and "WAVE"
    while at + 8 <= len(out):
        size = int.from_bytes(out[at + 4:at + 8], "little")
        if out[at:at + 4] == b"PEAK" and size >= 8:
            out[at + 12:at + 16] = bytes(4)  # after the chunk's id, size and version
            break
        at += 8 + size + (size & 1)  # chunks are padded to an even size
    return bytes(out)


OGG_SERIAL = 0x6D696D6F  # "mimo": the one logical stream of every Ogg file the package writes
OGG_HEADER = 27  # a page's fixed header; then its segment table and the segments (RFC 3533 §6)


def fixed_ogg_serial(data: bytes) -> bytes:
    """An Ogg file with its stream serial number set to `OGG_SERIAL` and each page's CRC redone.

    libsndfile picks the serial at random, so the same samples would give different bytes on
    every run; with one serial, equal inputs give equal files (the CLI's and `Audio.save`'s)."""
    out = bytearray(data)
    at = 0
    while at + OGG_HEADER <= len(out) and out[at:at + 4] == b"OggS":
        segments = out[at + 26]
        end = at + OGG_HEADER + segments + sum(out[at + OGG_HEADER:at + OGG_HEADER + segments])
        out[at + 14:at + 18] = OGG_SERIAL.to_bytes(4, "little")
        out[at + 22:at + 26] = bytes(4)  # the CRC is computed with its own field zeroed
        out[at + 22:at + 26] = _ogg_crc(memoryview(out)[at:end]).to_bytes(4, "little")
        at = end
    return bytes(out)


def _ogg_crc(page) -> int:
    """Ogg's page checksum: CRC-32, polynomial 0x04C11DB7, not reflected, initial value 0."""
    crc, table = 0, _ogg_crc_table()
    for byte in page:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ table[(crc >> 24) ^ byte]
    return crc


def _ogg_crc_table(cache: list = []) -> list:  # noqa: B006 (built once, on first use)
    if not cache:
        for n in range(256):
            r = n << 24
            for _ in range(8):
                r = ((r << 1) ^ 0x04C11DB7) & 0xFFFFFFFF if r & 0x80000000 else r << 1
            cache.append(r)
    return cache


def write_audio(path: str | Path, audio, sample_rate: int, fmt: str = "wav") -> Path:
    """`encode_audio`'s bytes as a file, atomically (a temp file beside it, then a rename): a
    reader sees the old file or the new, never half of one."""
    data = encode_audio(audio, sample_rate, fmt)
    return atomic_write(path, lambda f: f.write(data))


MAX_PROMPT_SECONDS = 600  # a voice prompt file, decoded (a voice needs seconds, not hours)
MAX_PROMPT_SAMPLES = 1 << 26  # and its samples over all channels (256 MiB as float32)
UNKNOWN_FRAMES = 2**63 - 1  # what libsndfile reports for a stream that does not say its length
_BLOCK = 1 << 16  # frames decoded at a time from a file of unknown length


def check_prompt_file(path: str | Path, where: str = "prompt audio",
                      shown: str | None = None) -> Path:
    """`path` as a prompt file: a regular file, else an InputError saying what is there (a
    directory is not "not found"). `shown` names the file in messages instead of its path."""
    path, shown = Path(path), shown or str(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise InputError(f"{where} not found: {shown}") from None
    except OSError as exc:
        raise InputError(f"{where} {shown} cannot be read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise InputError(f"{where} {shown} is a directory, not an audio file")
    if not stat.S_ISREG(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device")
        raise InputError(f"{where} {shown} is {kind}, not a regular file")
    return path


def check_prompt_audio(path: str | Path, where: str = "prompt audio",
                       shown: str | None = None) -> Path:
    """A prompt file checked as a run checks it before its models load: a regular file
    (`check_prompt_file`) whose header decodes and whose length is within the limits
    (`audio_seconds`), so a corrupt file fails its item in seconds. Each file (by path, size
    and mtime) is probed once per process."""
    path = check_prompt_file(path, where, shown)
    info = path.stat()
    _probe(str(path), info.st_size, info.st_mtime_ns, where, shown or str(path))
    return path


@functools.lru_cache(maxsize=256)
def _probe(path: str, size: int, mtime_ns: int, where: str, shown: str) -> None:
    audio_seconds(path, where, shown)  # an InputError is raised again on every call


def read_audio(path: str | Path, where: str = "prompt audio", shown: str | None = None):
    """A [C, S] float32 tensor and its sample rate; unusable audio is an InputError. A file
    whose header does not give its length (a FLAC streamed to disk: STREAMINFO's total of 0)
    is decoded to its end. `shown` names the file in messages instead of its path."""
    import torch

    data, rate = _decode(path, where, shown or str(path), False)
    audio = torch.from_numpy(data.T.copy())  # [S, C] -> [C, S]
    if audio.shape[-1] == 0:
        raise InputError(f"{where} {shown or path} has no samples")
    if not torch.isfinite(audio).all():
        raise InputError(f"{where} {shown or path} contains NaN or infinite samples")
    return audio, int(rate)


def audio_seconds(path: str | Path, where: str = "prompt audio", shown: str | None = None,
                  max_seconds: float = MAX_PROMPT_SECONDS) -> float:
    """A prompt file's length in seconds: from its header, or (when the header does not say)
    by decoding it; past `max_seconds` it is refused (InputError) without decoding further."""
    frames, rate = _decode(path, where, shown or str(path), True, max_seconds)
    return frames / rate


def _decode(path, where: str, shown: str, frames_only: bool,
            max_seconds: float = MAX_PROMPT_SECONDS):
    """(samples [S, C] float32, rate), or (frames, rate) when `frames_only`; a file past
    `max_seconds` or `MAX_PROMPT_SAMPLES` is refused before it is decoded whole."""
    import soundfile as sf

    path = check_prompt_file(path, where, shown)
    try:
        with sf.SoundFile(str(path)) as handle:
            rate, frames = handle.samplerate, handle.frames
            limit = min(max_seconds * rate, MAX_PROMPT_SAMPLES // handle.channels)
            if 0 <= frames < UNKNOWN_FRAMES:
                _check_length(frames, handle, limit, max_seconds, where, shown)
                if frames_only:
                    return frames, rate
                data = handle.read(dtype="float32", always_2d=True)
            else:
                data = _decode_to_end(handle, limit, max_seconds, where, shown)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        reason = reason.replace(f"'{path}'", "it").replace(str(path), shown)  # libsndfile's
        raise InputError(f"{where} {shown} is unreadable or unsupported: {reason}") from None
    return (len(data), rate) if frames_only else (data, rate)


def _decode_to_end(handle, limit: float, max_seconds: float, where: str, shown: str):
    """All the frames of a file of unknown length, block by block ([S, C] float32).

    soundfile moves its position after each read by seeking, and libsndfile cannot seek in a
    stream of unknown length once it is at its end: the last read's frames arrive, then the
    seek fails. Each block is therefore read into NaN, and where that failure comes, the
    frames before the first NaN are the ones decoded (decoded PCM is never NaN)."""
    import numpy as np
    import soundfile as sf

    blocks, total = [], 0
    while True:
        block = np.full((_BLOCK, handle.channels), np.nan, dtype=np.float32)
        try:
            got = len(handle.read(_BLOCK, dtype="float32", always_2d=True, out=block))
            last = got < _BLOCK
        except sf.LibsndfileError:
            unread = np.flatnonzero(np.isnan(block[:, 0]))
            got, last = (int(unread[0]) if unread.size else _BLOCK), True
        blocks.append(block[:got])
        total += got
        _check_length(total, handle, limit, max_seconds, where, shown, "more than ")
        if last:
            return np.concatenate(blocks)


def _check_length(frames: int, handle, limit: float, max_seconds: float, where: str,
                  shown: str, more: str = "") -> None:
    if frames <= limit:
        return
    if frames > max_seconds * handle.samplerate:
        raise InputError(f"{where} {shown} is {more}{frames / handle.samplerate:.0f} s long; a "
                         f"voice prompt may be at most {max_seconds:g} s")
    raise InputError(f"{where} {shown} holds {more}{frames * handle.channels} samples "
                     f"({handle.channels} channels); a voice prompt may hold at most "
                     f"{MAX_PROMPT_SAMPLES}")


PROMPT_RATES = (1000, 768000)  # sample rates a voice prompt in memory may have, in Hz


@dataclass(frozen=True, eq=False)
class PromptAudio:
    """A voice prompt in memory: float32 samples [S] or [C, S] (channels first, read-only) at
    `sample_rate`, mixed down and resampled to 24 kHz as a file's are. Compared by identity,
    so Stage-1 encodes one object once."""

    samples: object  # numpy float32 [S] or [C, S]
    sample_rate: int

    def __repr__(self) -> str:
        return f"PromptAudio({list(self.samples.shape)} at {self.sample_rate} Hz)"

    def describe(self) -> dict:
        """What provenance records of it (not the samples)."""
        return {"samples": list(self.samples.shape), "sample_rate": self.sample_rate}


def prompt_audio_of(value, where: str = "prompt_audio"):
    """A voice prompt as the options hold it: a path (str or os.PathLike) as str, or
    `(samples, sample_rate)` as a checked `PromptAudio`. A wrong Python type is an
    OptionTypeError; samples that cannot be a voice (not floats, empty, NaN, [S, C], a rate
    past PROMPT_RATES) an InputError, as an unusable file is."""
    if value is None or isinstance(value, str | PromptAudio):
        return value
    if isinstance(value, os.PathLike) and isinstance(os.fspath(value), str):
        return os.fspath(value)
    if not (isinstance(value, tuple) and len(value) == 2):
        raise OptionTypeError(f"{where} must be a file path or a (samples, sample_rate) tuple, "
                              f"not {type(value).__name__} {short_repr(value)}")
    samples, rate = value
    if isinstance(rate, bool) or not isinstance(rate, numbers.Integral):
        raise OptionTypeError(f"{where} sample rate must be an integer, not "
                              f"{type(rate).__name__} {short_repr(rate)}")
    samples = _float_samples(samples, where)
    low, high = PROMPT_RATES
    if not low <= rate <= high:
        raise InputError(f"{where} sample rate must be in [{low}, {high}] Hz, got {rate}")
    if samples.ndim not in (1, 2) or samples.shape[-1] == 0:
        raise InputError(f"{where} samples must be [samples] or [channels, samples] with at "
                         f"least one sample, got shape {list(samples.shape)}")
    if samples.ndim == 2 and samples.shape[0] > samples.shape[1]:
        raise InputError(f"{where} samples of shape {list(samples.shape)} look like "
                         "[samples, channels]; pass channels first (samples.T)")
    import numpy as np

    if not np.isfinite(samples).all():
        raise InputError(f"{where} samples contain NaN or infinite values")
    samples.setflags(write=False)  # the codes Stage-1 caches stay those of these samples
    return PromptAudio(samples, int(rate))


def _float_samples(samples, where: str):
    """A float32 numpy copy of floating-point samples (a numpy array or a torch tensor)."""
    import numpy as np

    if hasattr(samples, "detach") and hasattr(samples, "is_floating_point"):  # torch
        if not samples.is_floating_point():
            raise InputError(f"{where} samples must be floating point in [-1, 1], not "
                             f"{samples.dtype}")
        samples = samples.detach().float().cpu().numpy()
    if not isinstance(samples, np.ndarray):
        raise OptionTypeError(f"{where} samples must be a numpy array or a torch tensor, not "
                              f"{type(samples).__name__}")
    if not np.issubdtype(samples.dtype, np.floating):
        raise InputError(f"{where} samples must be floating point in [-1, 1], not "
                         f"{samples.dtype}")
    return np.array(samples, dtype=np.float32)
