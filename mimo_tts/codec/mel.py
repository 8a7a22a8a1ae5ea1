"""Mel front-end (spec §3.1): mono mix-down, resampling to the codec rate, log-magnitude mel.

The MelSpectrogram module is always constructed on CPU (its window and filterbank are derived
tensors) and then moved to the tokenizer device, even when a caller has a non-CPU default-device
context active (spec §8 item 2).
Shapes: C channels, S samples, M mel frames (1 + S // hop).
"""

from __future__ import annotations

import threading

import torch
import torchaudio
from torch import Tensor

from mimo_tts.codec.config import CodecConfig
from mimo_tts.errors import InputError

# Spec §3.1 step 3: natural log of the magnitude mel, clamped from below.
LOG_MEL_FLOOR = 1e-7


def to_mono(audio: Tensor) -> Tensor:
    """[S] or [C, S] (channels first) -> [S] float32, averaging the channels."""
    if audio.dim() == 1:
        return audio.float()
    if audio.dim() == 2:
        return audio.float().mean(dim=0)
    raise InputError(
        f"audio must be [samples] or [channels, samples], got shape {tuple(audio.shape)}"
    )


def prepare_audio(audio: Tensor, sample_rate: int, target_rate: int) -> Tensor:
    """Mix down to mono first, then resample to `target_rate` (the official order, spec §11.11)."""
    mono = to_mono(audio)
    if sample_rate != target_rate:
        mono = torchaudio.functional.resample(mono, int(sample_rate), int(target_rate))
    return mono


class LogMel:
    """Log-magnitude mel spectrogram of 24 kHz mono audio, built lazily per device."""

    def __init__(self, config: CodecConfig):
        self.config = config
        self._modules: dict[str, torch.nn.Module] = {}
        self._lock = threading.Lock()

    def _module(self, device: torch.device) -> torch.nn.Module:
        key = str(device)
        with self._lock:
            if key not in self._modules:
                c = self.config
                with torch.device("cpu"):
                    module = torchaudio.transforms.MelSpectrogram(
                        sample_rate=c.sampling_rate, n_fft=c.nfft, win_length=c.window_size,
                        hop_length=c.hop_length, f_min=c.fmin, f_max=c.fmax, n_mels=c.n_mels,
                        power=1.0, center=True,
                    )
                self._modules[key] = module.to(device)
            return self._modules[key]

    def __call__(self, audio: Tensor) -> Tensor:
        """Mono audio [S] at the codec rate -> log-mel [M, n_mels] float32 on audio's device."""
        mel = self._module(audio.device)(audio.float())  # [n_mels, M]
        return mel.clamp(min=LOG_MEL_FLOOR).log().t()
