"""Audio decoder (spec §3.5), prefix `decoder.`: 25 Hz latent -> 100 Hz features -> vocoder.

dconv1 upsamples x avg_pooler and GroupNorms over the whole sequence (so it is not causal), causal
transformer layers and `layer_norm` follow, then dconv2 upsamples x decoder_stride_size, GroupNorms
over its full output (one frame longer) and drops the surplus frames.

Batches are right-padded with `lengths` [B] in code frames: GroupNorm statistics, ISTFT envelopes
and attention all skip the padding, so each sequence decodes exactly as it would alone.
Shapes: B batch, T code frames, L latent frames (2T), N vocoder frames (4T), S samples (960T).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mimo_tts.codec.config import CodecConfig
from mimo_tts.codec.layers import (
    AttnSpec,
    Rotary,
    TransformerLayer,
    group_norm_fp32,
    layer_norm_fp32,
    pending_use,
    run_layers,
    valid_mask,
)
from mimo_tts.codec.vocoder import Vocoder


class TransposedConvNorm(nn.Module):
    """ConvTranspose1d followed by GroupNorm(1, out) over the full conv output."""

    def __init__(self, channels_in: int, channels_out: int, kernel: int, stride: int):
        super().__init__()
        self.stride, self.kernel = stride, kernel
        self.conv = nn.ConvTranspose1d(channels_in, channels_out, kernel, stride=stride)
        self.norm = nn.GroupNorm(1, channels_out)

    def forward(self, x: Tensor, lengths: Tensor | None = None) -> Tensor:
        """x [B, C_in, L] -> [B, C_out, L*stride] (surplus frames dropped after the norm).

        With lengths, padding must be zero on input; the output is zero past lengths*stride.
        """
        y = self.conv(x)  # [B, C_out, (L-1)*stride + kernel]
        conv_lengths = None
        if lengths is not None:
            conv_lengths = (lengths - 1) * self.stride + self.kernel
        y = group_norm_fp32(self.norm, y, conv_lengths)[..., : x.shape[-1] * self.stride]
        if lengths is not None and self.kernel > self.stride:
            y = y * valid_mask(lengths * self.stride, y.shape[-1])[:, None, :].to(y.dtype)
        return y


class AudioDecoder(nn.Module):
    def __init__(self, config: CodecConfig):
        super().__init__()
        c = config
        self.config = c
        self.dconv1 = TransposedConvNorm(c.d_model, c.d_model, c.avg_pooler, c.avg_pooler)
        self.layers = nn.ModuleList(
            TransformerLayer(c.d_model, c.decoder_attention_heads, c.decoder_ffn_dim)
            for _ in range(c.decoder_layers)
        )
        self.layer_norm = nn.LayerNorm(c.d_model, eps=1e-5)
        self.dconv2 = TransposedConvNorm(c.d_model, c.n_mels, c.decoder_kernel_size,
                                         c.decoder_stride_size)
        self.vocoder = Vocoder(c)
        self.rotary = Rotary(c.decoder_head_dim, c.rope_theta)
        left, right = c.decoder_attn_window_size
        self.spec = AttnSpec(left, right, c.decoder_causal)

    def seconds(self, latent_frames: int) -> float:
        """The audio `latent_frames` of the transformer layers stand for."""
        c = self.config
        return latent_frames * c.decoder_stride_size * c.hop_length / c.sampling_rate

    def forward(self, hidden: Tensor, lengths: Tensor | None = None) -> Tensor:
        """hidden [B, T, d_model] (zero past lengths) -> waveform [B, 960*T] float32."""
        dtype = self.dconv1.conv.weight.dtype
        x = self.dconv1(hidden.to(dtype).transpose(1, 2), lengths)  # [B, d, L]
        latent_lengths = None if lengths is None else lengths * self.dconv1.stride
        frames = x.shape[0] * x.shape[2] if lengths is None else int(latent_lengths.sum())
        with pending_use(self, self.seconds(frames)):  # float32 layers packed once enough ran
            x, _ = run_layers(self.layers, self.rotary, x.transpose(1, 2), self.spec,
                              latent_lengths)
        x = layer_norm_fp32(self.layer_norm, x)  # [B, L, d]
        if latent_lengths is not None:
            x = x * valid_mask(latent_lengths, x.shape[1])[..., None].to(x.dtype)
        x = self.dconv2(x.transpose(1, 2), latent_lengths)  # [B, n_mels, N]
        frame_lengths = None if lengths is None else latent_lengths * self.dconv2.stride
        return self.vocoder(x.transpose(1, 2), frame_lengths)


def pad_hidden(items: list[Tensor]) -> Tensor:
    """Right-pad [T_i, d] tensors with zeros into [B, max T, d]."""
    longest = max(item.shape[0] for item in items)
    return torch.stack([F.pad(item, (0, 0, 0, longest - item.shape[0])) for item in items])
