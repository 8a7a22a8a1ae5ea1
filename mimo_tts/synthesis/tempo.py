"""Speaking rate: a piece's audio made faster or slower with its pitch kept, after Stage-1, so
the codes (and the resume keys of speed 1) do not change.

A phase vocoder on torch's STFT with identity phase locking (Laroche and Dolson, "Improved
phase vocoder time-scale modification of audio", 1999): each analysis frame's magnitude
peaks advance by their own measured frequency, and the bins around a peak keep their phase
offset to it. torchaudio's `phase_vocoder` advances every bin on its own; at speeds below 1
that loses the vertical phase coherence of a harmonic (a steady 220 Hz tone came out with a
sixth of its fundamental's amplitude at 0.5), which the locking keeps. The length is exact:
`round(S / speed)` samples. No torch at import.
"""

from __future__ import annotations

import math

N_FFT = 1024  # 43 ms at 24 kHz: a speech pitch period several times over
HOP = N_FFT // 4  # 75 % overlap, as the Hann window's overlap-add needs
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

    samples = audio.detach().float().cpu()
    length = stretched_length(samples.shape[-1], speed)
    if samples.shape[-1] < N_FFT:  # too short for a frame: resampled in time (a click)
        return torch.nn.functional.interpolate(samples[None, None], size=length,
                                               mode="linear", align_corners=False)[0, 0]
    window = torch.hann_window(N_FFT)
    spec = torch.stft(samples, N_FFT, HOP, window=window, return_complex=True).numpy()
    out = _locked_frames(spec, speed, np)
    return torch.istft(torch.from_numpy(out), N_FFT, HOP, window=window, length=length)


def _locked_frames(spec, speed: float, np):
    """The synthesis frames [F, T'] of analysis frames `spec` [F, T] read `speed` apart."""
    bins, frames = spec.shape
    magnitude, phase_in = np.abs(spec), np.angle(spec)
    omega = 2 * math.pi * np.arange(bins) * HOP / N_FFT  # each bin's advance per hop
    positions = np.arange(0, frames - 1, speed)
    out = np.empty((bins, len(positions)), dtype=np.complex64)
    phase = phase_in[:, 0]
    every = np.arange(bins)
    for j, at in enumerate(positions):
        i, frac = int(at), at - int(at)
        if j:
            deviation = phase_in[:, i + 1] - phase_in[:, i] - omega
            deviation -= 2 * math.pi * np.round(deviation / (2 * math.pi))
            ref = magnitude[:, i]
            peaks = np.flatnonzero((ref[1:-1] > ref[:-2]) & (ref[1:-1] >= ref[2:])) + 1
            if peaks.size:  # each bin follows the peak whose region it is in
                owner = peaks[np.searchsorted((peaks[1:] + peaks[:-1]) / 2, every)]
                phase = (phase[owner] + omega[owner] + deviation[owner]
                         + phase_in[:, i] - phase_in[owner, i])
            else:
                phase = phase + omega + deviation
        level = (1 - frac) * magnitude[:, i] + frac * magnitude[:, i + 1]
        out[:, j] = level * np.exp(1j * phase)
    return out
