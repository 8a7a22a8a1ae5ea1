"""AAC output (`aac`: ADTS frames, `m4a`: AAC in MP4) through PyAV, whose wheels carry FFmpeg
with its native AAC encoder (the `book` extra, or `pip install av`).

The bytes are stable: FFmpeg's bit-exact flags keep its version string out of the file and the
MP4 muxer writes no creation time without one, so equal samples give equal files, as the Ogg
formats' fixed serial does (`audio.fixed_ogg_serial`). Only this module and `book/m4b.py`
import `av`, and this one only when such a file is written.
"""

from __future__ import annotations

import importlib.util
import io
from fractions import Fraction

from mimo_tts.errors import UsageError

EXTRA = "pip install 'mimo-tts[book]' (or pip install av)"
BIT_RATE = 64_000  # AAC-LC, mono speech: the rate book.m4b uses
MUXERS = {"aac": "adts", "m4a": "ipod"}  # format -> FFmpeg muxer (ipod: the .m4a/.m4b muxer)
# The rates an AAC stream may declare (ISO/IEC 14496-3, the sampling frequency index)
RATES = (7350, 8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200,
         96000)
BITEXACT = {"flags": "+bitexact"}  # codec and muxer: no "Lavc/Lavf" version strings


def available() -> bool:
    """Whether PyAV is installed (found, not imported: the check is cheap)."""
    try:
        return importlib.util.find_spec("av") is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules: blocked
        return False


def require(fmt: str) -> None:
    """A UsageError (exit 2, as for the other missing extras) unless PyAV is installed."""
    if not available():
        raise UsageError(f"--format {fmt} needs PyAV: {EXTRA}")


def encode_aac(samples, sample_rate: int, fmt: str) -> bytes:
    """`samples` (float32 [S] in [-1, 1]) as the bytes of an `aac` or `m4a` file."""
    require(fmt)
    import av
    import numpy as np

    frame_samples = np.ascontiguousarray(samples, dtype=np.float32).reshape(1, -1)  # [1, S]
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=MUXERS[fmt], options={"fflags": "+bitexact"}) as out:
        stream = out.add_stream("aac", rate=sample_rate, layout="mono", options=BITEXACT)
        stream.bit_rate = BIT_RATE
        frame = av.AudioFrame.from_ndarray(frame_samples, format="flt", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = sample_rate, 0, Fraction(1, sample_rate)
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buffer.getvalue()
