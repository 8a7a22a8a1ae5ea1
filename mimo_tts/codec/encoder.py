"""Audio encoder: log-mel -> 25 Hz latent -> RVQ codes (spec §3.3), prefix `encoder.`.

conv1 (stride 1) and conv2 (stride `stride_size`) take the 100 Hz mel to 50 Hz; bidirectional
transformer layers follow, with the output of layer `encoder_skip_layer_id - 1` added to the last
layer's output before `layer_norm`; a bias-free down-sampling conv then gives 25 Hz.
Shapes: B batch, M mel frames (100 Hz), L latent frames (50 Hz), T code frames (25 Hz).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mimo_tts.codec.config import SEGMENT_MEL_FRAMES, CodecConfig
from mimo_tts.codec.layers import (
    AttnSpec,
    Rotary,
    TransformerLayer,
    layer_norm_fp32,
    pending_use,
    run_layers,
)
from mimo_tts.codec.quantizer import ResidualVectorQuantizer


class AudioEncoder(nn.Module):
    def __init__(self, config: CodecConfig):
        super().__init__()
        c = config
        self.config = c
        pad = c.kernel_size // 2
        self.conv1 = nn.Conv1d(c.n_mels, c.d_model, c.kernel_size, stride=1, padding=pad)
        self.conv2 = nn.Conv1d(c.d_model, c.d_model, c.kernel_size, stride=c.stride_size,
                               padding=pad)
        self.layers = nn.ModuleList(
            TransformerLayer(c.d_model, c.encoder_attention_heads, c.encoder_ffn_dim)
            for _ in range(c.encoder_layers)
        )
        self.layer_norm = nn.LayerNorm(c.d_model, eps=1e-5)
        self.down_sample_layer = nn.Sequential(
            nn.Conv1d(c.d_model, c.d_model, c.avg_pooler, stride=c.avg_pooler, bias=False)
        )
        self.down_sample_norm = nn.LayerNorm(c.d_model, eps=1e-5)
        self.quantizer = ResidualVectorQuantizer(c.codebook_size, c.d_model)
        self.rotary = Rotary(c.encoder_head_dim, c.rope_theta)
        left, right = c.encoder_attn_window_size
        self.spec = AttnSpec(left, right, c.encoder_causal)
        skip = c.encoder_skip_layer_id
        self.skip_index = skip - 1 if skip is not None else None

    def forward(self, mel: Tensor) -> Tensor:
        """One segment's log-mel [M, n_mels] -> latent [T, d_model] before quantisation."""
        # float32 layers packed once enough audio went through (layers.PendingPack)
        with pending_use(self, mel.shape[0] * self.config.hop_length / self.config.sampling_rate):
            return self._forward(mel)

    def _forward(self, mel: Tensor) -> Tensor:
        dtype = self.conv1.weight.dtype
        x = mel.to(dtype).t()[None]  # [1, n_mels, M]
        x = F.gelu(self.conv1(x))
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [1, L, d]
        x, skipped = run_layers(self.layers, self.rotary, x, self.spec, keep=self.skip_index)
        if skipped is not None:
            x = x + skipped
        x = layer_norm_fp32(self.layer_norm, x)
        pad = -x.shape[1] % self.config.avg_pooler
        x = F.pad(x, (0, 0, 0, pad)).transpose(1, 2)  # [1, d, L'] with L' a multiple of the pool
        x = F.gelu(self.down_sample_layer(x)).transpose(1, 2)  # [1, T, d]
        return layer_norm_fp32(self.down_sample_norm, x)[0]

    def encode(self, mel: Tensor, n_q: int | None = None) -> Tensor:
        """Log-mel [M, n_mels] -> codes [K, T] int64, segment by segment (spec §3.1)."""
        codes = [
            self.quantizer.encode(self.forward(mel[start:start + SEGMENT_MEL_FRAMES]), n_q)
            for start in range(0, mel.shape[0], SEGMENT_MEL_FRAMES)
        ]
        return torch.cat(codes, dim=1)
