"""Speaking rate: a piece's audio made faster or slower with its pitch kept, after Stage-1, so
the codes (and the resume keys of speed 1) do not change.

The stretch is Signalsmith Stretch (MIT), through its Python binding `python-stretch`, a
default dependency (wheels of about 100 kB, no Python dependency but numpy). Its default preset
(120 ms blocks, 30 ms apart) lost three quarters of a steady 220 Hz tone's fundamental at speed
0.25; blocks 15 ms apart keep every partial's level within 1 % from 0.25 to 4, so that is the
configuration here. The seed is fixed, so the same audio gives the same bytes in any process.
The length is exact: `round(S / speed)` samples (the library's own rounding is in float32, so
its output is cut or padded with silence to that). No torch or numpy at import.
"""

from __future__ import annotations

from mimo_tts.errors import UsageError

BLOCK = 2880  # 120 ms at 24 kHz: a speech pitch period many times over
INTERVAL = 360  # 15 ms between blocks (8 to a block)
SEED = 0  # the library's random phase choices, fixed
SPEEDS = (0.25, 4.0)  # the range the option takes


def stretched_length(samples: int, speed: float) -> int:
    """The samples of `samples` spoken at `speed`."""
    return samples if speed == 1 else max(round(samples / speed), 1)


def stretch(audio, speed: float):
    """[S] float32 (torch, CPU) spoken at `speed` (2.0: half as long), pitch kept:
    [round(S / speed)] float32; speed 1 returns `audio` itself."""
    if speed == 1:
        return audio
    import numpy as np
    import torch

    try:
        from python_stretch.Signalsmith import Stretch
    except ImportError:
        raise UsageError("--speed other than 1 needs python-stretch: "
                         "pip install 'python-stretch==0.3.1'") from None
    samples = np.ascontiguousarray(audio.detach().float().cpu().numpy().reshape(1, -1))
    length = stretched_length(samples.shape[-1], speed)
    stretcher = Stretch(SEED)
    stretcher.configure(1, BLOCK, INTERVAL)
    stretcher.timeFactor = speed
    out = stretcher.process(samples)[0, :length]
    if out.shape[0] < length:
        out = np.pad(out, (0, length - out.shape[0]))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))
