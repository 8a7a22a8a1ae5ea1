"""The audio-tokenizer half of a random checkpoint: its tensors (spec §3.7 names, EMA buffers
included) and config.json; the random codec decodes codes to noise at a moderate level."""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

import torch

from mimo_tts.presets.safetensors import Tensors, norm_weight, randn

TINY_CODEC = MappingProxyType({
    "d_model": 64, "encoder_layers": 4, "encoder_attention_heads": 4, "encoder_ffn_dim": 128,
    "decoder_layers": 2, "decoder_attention_heads": 4, "decoder_ffn_dim": 128,
    "vocoder_dim": 32, "vocoder_num_layers": 2, "vocoder_attention_heads": 4,
    "vocoder_intermediate_dim": 64,
})
# The published dimensions (spec §2.1; tests/fixtures/full-size/tokenizer-config.json).
FULL_CODEC = MappingProxyType({
    "d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120,
    "decoder_layers": 32, "decoder_attention_heads": 20, "decoder_ffn_dim": 5120,
    "vocoder_dim": 256, "vocoder_num_layers": 16, "vocoder_attention_heads": 16,
    "vocoder_intermediate_dim": 1024,
})
LOG_MAG = 1.0  # vocoder log-magnitude bias: decoded noise at roughly 0.1 RMS


def codec_config(dims: Mapping = TINY_CODEC, dtype: str = "float32") -> dict:
    """config.json of the audio tokenizer: the published front-end and RVQ, layers of `dims`."""
    return {
        "architectures": ["MiMoAudioTokenizer"], "model_type": "mimo_audio_tokenizer",
        "activation_function": "gelu", "avg_pooler": 2, "codebook_size": [1024, 1024] + [128] * 18,
        "decoder_attn_window_size": [-1, -1], "decoder_causal": True, "decoder_kernel_size": 3,
        "decoder_stride_size": 2, "encoder_attn_window_size": [-1, -1], "encoder_causal": False,
        "encoder_skip_layer_id": 3, "fmax": None, "fmin": 0, "hop_length": 240, "kernel_size": 3,
        "ln_type": "LayerNorm", "max_audio_seconds": 1800, "n_mels": 128, "nfft": 960,
        "num_quantizers": 20, "position_embedding_type": "rope", "rope_theta": 10000,
        "rope_type": "default", "sampling_rate": 24000, "scale_embedding": False,
        "stride_size": 2, "threshold_ema_dead_code": 2, "vocoder_attn_window_size": [40, 10],
        "vocoder_padding": "same", "window_size": 960, **dims,
        "torch_dtype": dtype, "transformers_version": "4.49.0",
    }


def _codec_layers(gen, prefix: str, layers: int, dim: int, ffn: int) -> Tensors:
    """Pre-LN layers of the codec (spec §3.2, §3.7 names), layer by layer; k_proj has no bias."""
    for i in range(layers):
        p = f"{prefix}layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            yield p + f"self_attn.{name}.weight", randn(gen, dim, dim, std=dim**-0.5)
            if name != "k_proj":
                yield p + f"self_attn.{name}.bias", randn(gen, dim, std=0.02)
        yield p + "fc1.weight", randn(gen, ffn, dim, std=dim**-0.5)
        yield p + "fc1.bias", randn(gen, ffn, std=0.02)
        yield p + "fc2.weight", randn(gen, dim, ffn, std=0.5 * ffn**-0.5)
        yield p + "fc2.bias", randn(gen, dim, std=0.02)
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            yield from _layer_norm(gen, f"{p}{norm}", dim)


def _layer_norm(gen, name: str, dim: int) -> Tensors:
    yield f"{name}.weight", norm_weight(gen, dim)
    yield f"{name}.bias", randn(gen, dim, std=0.02)


def _conv(gen, name: str, shape: tuple[int, int, int], fan_in: int, bias: bool = True) -> Tensors:
    """Conv1d weight [out, in, k] (ConvTranspose1d: [in, out, k], callers pass fan_in = in)."""
    yield f"{name}.weight", randn(gen, *shape, std=fan_in**-0.5)
    if bias:
        out = shape[1] if ".dconv" in name else shape[0]  # transposed convs of the decoder
        yield f"{name}.bias", randn(gen, out, std=0.02)


def _codec_encoder(gen, cfg: dict) -> Tensors:
    d, mels, k = cfg["d_model"], cfg["n_mels"], cfg["kernel_size"]
    yield from _conv(gen, "encoder.conv1", (d, mels, k), mels * k)
    yield from _conv(gen, "encoder.conv2", (d, d, k), d * k)
    yield from _codec_layers(gen, "encoder.", cfg["encoder_layers"], d, cfg["encoder_ffn_dim"])
    yield from _layer_norm(gen, "encoder.layer_norm", d)
    yield from _conv(gen, "encoder.down_sample_layer.0", (d, d, 2), 2 * d, bias=False)
    yield from _layer_norm(gen, "encoder.down_sample_norm", d)
    for i, size in enumerate(cfg["codebook_size"]):
        p = f"encoder.quantizer.vq.layers.{i}._codebook."
        embed = randn(gen, size, d, std=1.0 if i == 0 else 0.5)
        yield p + "embed", embed
        yield p + "embed_avg", embed.clone()  # EMA buffers (unused)
        yield p + "cluster_size", torch.ones(size)
        yield p + "inited", torch.ones(1)


def _codec_decoder(gen, cfg: dict) -> Tensors:
    d, mels, v = cfg["d_model"], cfg["n_mels"], cfg["vocoder_dim"]
    k = cfg["decoder_kernel_size"]
    yield from _conv(gen, "decoder.dconv1.conv", (d, d, cfg["decoder_stride_size"]), d)
    yield from _layer_norm(gen, "decoder.dconv1.norm", d)
    yield from _codec_layers(gen, "decoder.", cfg["decoder_layers"], d, cfg["decoder_ffn_dim"])
    yield from _layer_norm(gen, "decoder.layer_norm", d)
    yield from _conv(gen, "decoder.dconv2.conv", (d, mels, k), d)
    yield from _layer_norm(gen, "decoder.dconv2.norm", mels)
    yield "decoder.vocoder.embeddings.weight", randn(gen, v, mels, std=mels**-0.5)
    yield from _codec_layers(gen, "decoder.vocoder.", cfg["vocoder_num_layers"], v,
                             cfg["vocoder_intermediate_dim"])
    yield from _layer_norm(gen, "decoder.vocoder.layer_norm", v)
    bins = cfg["nfft"] // 2 + 1
    # log-magnitude ~ N(LOG_MAG, 0.5^2), phase spread over a few radians: noise at ~0.1 RMS
    mag, phase = randn(gen, bins, v, std=0.5 * v**-0.5), randn(gen, bins, v, std=3 * v**-0.5)
    yield "decoder.vocoder.head.out.weight", torch.cat([mag, phase])
    bias = torch.cat([torch.full((bins,), LOG_MAG), randn(gen, bins, std=math.pi)])
    yield "decoder.vocoder.head.out.bias", bias
    yield "decoder.vocoder.head.istft.window", torch.hann_window(cfg["window_size"],
                                                                  periodic=True)


def codec_tensors(gen: torch.Generator | None, cfg: dict) -> Tensors:
    """Every audio-tokenizer tensor by its official name (spec §3.7), EMA buffers included,
    one at a time; `gen` None under torch.device("meta"): names and shapes only."""
    yield from _codec_encoder(gen, cfg)
    yield from _codec_decoder(gen, cfg)
