"""Vocoder (`decoder.vocoder`, spec §3.6): 100 Hz features -> windowed transformer -> ISTFT.

The official vocoder numbers RoPE positions over the packed batch. Attention here is banded
(window (40, 10)) and RoPE is relative, so positions only matter up to a constant offset; this
implementation numbers each sequence from 0, which is exactly the official single-sequence decode
and makes every sequence of a batch decode as if alone.
Shapes: B batch, N vocoder frames (100 Hz), F frequency bins (nfft/2 + 1), S samples.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mimo_tts.codec.config import CodecConfig
from mimo_tts.codec.layers import (
    AttnSpec,
    Rotary,
    TransformerLayer,
    layer_norm_fp32,
    run_layers,
    valid_mask,
)

# Spec §3.6 step 5: the log-magnitude is exponentiated and capped at 100.
MAX_MAGNITUDE = 100.0
# Below this the overlap-added window envelope counts as empty (only padding frames reach it).
MIN_ENVELOPE = 1e-11


def periodic_hann(size: int) -> Tensor:
    """Periodic Hann window built on CPU in float32 (the checkpoint also stores it)."""
    with torch.device("cpu"):
        n = torch.arange(size, dtype=torch.float64)
        return (0.5 - 0.5 * torch.cos(2 * math.pi * n / size)).float()


class ISTFT(nn.Module):
    """Inverse STFT with 'same' padding: overlap-add, trim, divide by the window envelope."""

    def __init__(self, nfft: int, hop: int):
        super().__init__()
        self.nfft, self.hop = nfft, hop
        self.pad = (nfft - hop) // 2
        self.register_buffer("window", torch.empty(nfft, dtype=torch.float32))

    def _overlap_add(self, frames: Tensor, trim: bool = True) -> Tensor:
        """frames [B, N, nfft] -> [B, N*hop] after overlap-add and trimming (untrimmed:
        [B, (N-1)*hop + nfft])."""
        n = frames.shape[1]
        total = (n - 1) * self.hop + self.nfft
        out = F.fold(frames.transpose(1, 2), output_size=(1, total),
                     kernel_size=(1, self.nfft), stride=(1, self.hop))  # [B, 1, 1, total]
        return out[:, 0, 0, self.pad:total - self.pad] if trim else out[:, 0, 0]

    def frames(self, spec: Tensor) -> Tensor:
        """Complex spec [B, N, F] (float32) -> windowed inverse-FFT frames [B, N, nfft]."""
        return torch.fft.irfft(spec, n=self.nfft, dim=-1) * self.window.float()

    def forward(self, spec: Tensor, lengths: Tensor | None = None) -> Tensor:
        """Complex spec [B, N, F] (float32) -> waveform [B, N*hop] float32."""
        window = self.window.float()
        frames = self.frames(spec)  # [B, N, nfft]
        squared = (window * window).expand(1, spec.shape[1], self.nfft)
        if lengths is not None:
            keep = valid_mask(lengths, spec.shape[1])[..., None].float()  # [B, N, 1]
            frames, squared = frames * keep, squared * keep
        envelope = self._overlap_add(squared)
        return self._overlap_add(frames) / envelope.clamp(min=MIN_ENVELOPE)


class ISTFTHead(nn.Module):
    """`head.out` predicts log-magnitude and phase; the ISTFT runs in float32 (spec §3.6)."""

    def __init__(self, dim: int, nfft: int, hop: int):
        super().__init__()
        self.out = nn.Linear(dim, nfft + 2)
        self.istft = ISTFT(nfft, hop)

    def spectrum(self, x: Tensor) -> Tensor:
        """x [B, N, dim] -> complex spectrum [B, N, F] float32."""
        log_mag, phase = self.out(x).float().chunk(2, dim=-1)  # [B, N, F] each
        mag = log_mag.exp().clamp(max=MAX_MAGNITUDE)
        return torch.complex(mag * phase.cos(), mag * phase.sin())

    def forward(self, x: Tensor, lengths: Tensor | None = None) -> Tensor:
        """x [B, N, dim] -> waveform [B, N*hop] float32."""
        return self.istft(self.spectrum(x), lengths)


class Vocoder(nn.Module):
    def __init__(self, config: CodecConfig):
        super().__init__()
        c = config
        self.embeddings = nn.Linear(c.n_mels, c.vocoder_dim, bias=False)
        self.layers = nn.ModuleList(
            TransformerLayer(c.vocoder_dim, c.vocoder_attention_heads, c.vocoder_intermediate_dim)
            for _ in range(c.vocoder_num_layers)
        )
        self.layer_norm = nn.LayerNorm(c.vocoder_dim, eps=1e-5)
        self.head = ISTFTHead(c.vocoder_dim, c.nfft, c.hop_length)
        self.rotary = Rotary(c.vocoder_head_dim, c.rope_theta)
        left, right = c.vocoder_attn_window_size
        self.spec = AttnSpec(left, right, causal=False)

    def forward(self, features: Tensor, lengths: Tensor | None = None) -> Tensor:
        """features [B, N, n_mels] -> waveform [B, N*hop] float32; lengths [B] in frames N."""
        x = self.embeddings(features)
        x, _ = run_layers(self.layers, self.rotary, x, self.spec, lengths)
        return self.head(layer_norm_fp32(self.layer_norm, x), lengths)
