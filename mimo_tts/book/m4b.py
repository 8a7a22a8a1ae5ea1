"""`book.m4b`: AAC in MP4 (the `ipod` muxer: an audiobook's M4B), a chapter mark at each
chapter's first sample, the book's title and author, through PyAV (the `book` extra).

PyAV's wheels carry their own FFmpeg (its native AAC encoder and MP4 muxer), so no system
FFmpeg is needed and the version is the one pinned in `pyproject.toml`; since 14.x PyAV writes
chapters (`OutputContainer.set_chapters`), which the muxer stores as MP4 chapter atoms players
read. Only this module imports `av`, and only when a book is assembled.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from fractions import Fraction
from pathlib import Path

from mimo_tts.errors import OutputError, UsageError
from mimo_tts.runtime.paths import create_temp, publish, temp_beside

EXTRA = "pip install 'mimo-tts[book]'"
BIT_RATE = 64_000  # AAC-LC, mono speech (a chapter mark read back is within one AAC frame,
# 1024 samples, of the sample it was set at)


def require_av():
    """The `av` module, or a UsageError (exit 2) naming the extra to install."""
    try:
        import av
    except ImportError:
        raise UsageError(f"writing book.m4b needs PyAV: {EXTRA} (or give --no-m4b)") from None
    return av


def write_m4b(path: Path, blocks: Iterable, sample_rate: int, marks: list[tuple[int, int, str]],
              metadata: dict[str, str]) -> Path:
    """Encode `blocks` (float32 [S_i] arrays, the book's samples in order) as AAC into an M4B
    at `path`, atomically; `marks` are the chapters as (first sample, end sample, title)."""
    av = require_av()
    temp = temp_beside(path)
    try:
        with create_temp(temp) as handle:
            _encode(av, handle, blocks, sample_rate, marks, metadata)
            handle.flush()
            os.fsync(handle.fileno())
        publish(temp, path)
    except (OSError, av.FFmpegError) as exc:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise OutputError(f"cannot write {path}: {exc}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    return path


def _encode(av, handle, blocks, sample_rate: int, marks, metadata) -> None:
    import numpy as np

    time_base = Fraction(1, sample_rate)
    with av.open(handle, "w", format="ipod") as container:
        container.metadata.update(metadata)
        stream = container.add_stream("aac", rate=sample_rate, layout="mono")
        stream.bit_rate = BIT_RATE
        container.set_chapters([{"id": n, "start": start, "end": end, "time_base": time_base,
                                 "metadata": {"title": title}}
                                for n, (start, end, title) in enumerate(marks, 1)])
        pts = 0
        for block in blocks:
            samples = np.ascontiguousarray(block, dtype=np.float32).reshape(1, -1)  # [1, S]
            if not samples.size:
                continue
            frame = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = sample_rate, pts, time_base
            pts += samples.shape[1]
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)


def read_chapters(path: Path) -> list[dict]:
    """An M4B's chapters as (title, start and end in seconds), as a player reads them."""
    av = require_av()
    with av.open(str(path)) as container:
        return [{"title": c["metadata"].get("title"),
                 "start": float(c["start"] * c["time_base"]),
                 "end": float(c["end"] * c["time_base"])} for c in container.chapters()]
