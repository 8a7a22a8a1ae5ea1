"""`--speed`: the time-stretch keeps the pitch and gives the asked length; every face takes it
(the library here; the CLI, the server and the book in their folders)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mimo_tts.errors import UsageError
from mimo_tts.synthesis.options import SynthesisOptions
from mimo_tts.synthesis.tempo import stretch

RATE = 24000
F0 = 220.0


def harmonic_tone(seconds: float = 4.0) -> torch.Tensor:
    """A voiced test signal: 220 Hz and four harmonics, falling as 1/k."""
    t = torch.arange(int(seconds * RATE), dtype=torch.float64) / RATE
    return sum(0.2 / k * torch.sin(2 * np.pi * F0 * k * t) for k in range(1, 6)).float()


def pitch(samples: np.ndarray) -> float:
    """The fundamental by autocorrelation, refined by a parabola through its peak."""
    y = samples - samples.mean()
    r = np.correlate(y, y, "full")[len(y) - 1:]
    lo, hi = RATE // 500, RATE // 60
    k = lo + int(np.argmax(r[lo:hi]))
    shift = 0.5 * (r[k - 1] - r[k + 1]) / (r[k - 1] - 2 * r[k] + r[k + 1])
    return RATE / (k + shift)


def level(samples: np.ndarray, frequency: float) -> float:
    """The amplitude of one partial (a Hann-windowed DFT at its frequency)."""
    t = np.arange(len(samples)) / RATE
    window = np.hanning(len(samples))
    return 2 * abs(np.sum(samples * window * np.exp(-2j * np.pi * frequency * t))) / window.sum()


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.5, 2.0, 4.0])
def test_stretch_keeps_the_pitch_and_gives_the_length(speed):
    tone = harmonic_tone()
    out = stretch(tone, speed).numpy()
    assert len(out) == round(len(tone) / speed)  # the duration: within 2 % of 1/speed, exact
    middle = out[len(out) // 4: 3 * len(out) // 4][:12000]
    assert pitch(middle) == pytest.approx(F0, rel=0.02)
    assert pitch(tone.numpy()[:12000]) == pytest.approx(F0, rel=0.002)
    # the partials keep their levels (a vocoder without phase locking, or Signalsmith Stretch's
    # default preset with blocks 30 ms apart, lost most of the fundamental at 0.25)
    for k in (1, 2, 3):
        assert level(middle, F0 * k) == pytest.approx(0.2 / k, rel=0.1), k


def test_speed_one_is_the_audio_itself_and_the_range_is_checked():
    tone = harmonic_tone(0.5)
    assert stretch(tone, 1.0) is tone
    for bad in (0.2, 4.5, 0.0, -1.0):
        with pytest.raises(UsageError, match=r"--speed must be in \[0.25, 4\]"):
            SynthesisOptions(speed=bad)
    assert SynthesisOptions(speed=2).speed == 2.0  # an int is a real number


def test_a_piece_shorter_than_a_frame_still_gets_its_length():
    short = harmonic_tone(0.02)  # 480 samples
    assert stretch(short, 2.0).shape == (240,)


def test_the_stretch_is_the_same_bytes_in_another_process():
    """The library's random phase choices are seeded: a run repeats to the byte anywhere."""
    import hashlib
    import subprocess
    import sys

    code = ("import hashlib, sys, torch; from mimo_tts.synthesis.tempo import stretch; "
            "t = torch.sin(torch.arange(24000) * 0.0576) * 0.3; "
            "print(' '.join(hashlib.sha256(stretch(t, s).numpy().tobytes()).hexdigest() "
            "for s in (0.5, 1.7)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    t = torch.sin(torch.arange(24000) * 0.0576) * 0.3
    here = [hashlib.sha256(stretch(t, s).numpy().tobytes()).hexdigest() for s in (0.5, 1.7)]
    assert out.stdout.split() == here


@pytest.fixture(scope="module")
def tts(tiny_cache):
    import mimo_tts
    from mimo_tts.presets import ensure_tiny_preset
    from mimo_tts.runtime.paths import CACHE_ENV

    lm, tok = ensure_tiny_preset({CACHE_ENV: str(tiny_cache)})
    return mimo_tts.load(str(lm), str(tok), lm_device="cpu", tokenizer_device="cpu")


TWO = "First sentence here. Second one."
SHORT = {"seed": 3, "captions": True, "max_new_groups": 6}


def test_library_speed_stretches_each_piece_keeps_pauses_and_scales_captions(tts):
    """`speed=` on `synthesize` and `stream`: each piece round(S / speed) samples, the pause
    between them its own length, the cues following the stretched pieces."""
    from mimo_tts.synthesis.audio import PAUSE_FRAMES

    pause = PAUSE_FRAMES * 960
    plain = tts.synthesize(TWO, **SHORT)
    same = tts.synthesize(TWO, **SHORT, speed=1.0)
    assert np.array_equal(plain.samples, same.samples)  # speed 1: today's audio
    for speed in (0.5, 2.0):
        fast = tts.synthesize(TWO, **SHORT, speed=speed)
        lengths = [c.end_sample - c.start_sample for c in plain.cues]
        assert [c.end_sample - c.start_sample for c in fast.cues] == \
            [round(n / speed) for n in lengths]
        assert fast.cues[1].start_sample - fast.cues[0].end_sample == pause
        assert len(fast.samples) == sum(round(n / speed) for n in lengths) + pause
        assert abs(len(fast.samples) - pause - (len(plain.samples) - pause) / speed) \
            <= 0.02 * len(plain.samples) / speed
        streamed = np.concatenate([c.samples for c in tts.stream(TWO, **SHORT, speed=speed)])
        assert len(streamed) == len(fast.samples)
