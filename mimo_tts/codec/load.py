"""Build the audio tokenizer on the meta device and load its checkpoint strictly (house style).

meta build (parameters already in the chosen dtype) -> safetensors (single file or sharded index;
memory-mapped, converted tensor by tensor where the dtype differs) -> strict
load_state_dict(assign=True) -> move to the tokenizer device -> eval. The RVQ codebooks and
the ISTFT window are buffers and stay float32 whatever the dtype (spec §3.4, §8 item 4).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mimo_tts.codec.config import CodecConfig
from mimo_tts.codec.decoder import AudioDecoder
from mimo_tts.codec.encoder import AudioEncoder
from mimo_tts.codec.gemm import Packing
from mimo_tts.codec.layers import prepack
from mimo_tts.codec.tokenizer import AudioTokenizer
from mimo_tts.runtime.devices import normalize_device, torch_dtype
from mimo_tts.runtime.safetensors import load_module_weights, parse_config

# Checkpoint tensors that exist only for training (RVQ EMA state); everything else must match.
IGNORED_TENSORS = (
    r"encoder\.quantizer\.vq\.layers\.\d+\._codebook\.(embed_avg|cluster_size|inited)",
)


class CodecModel(nn.Module):
    """The checkpoint's module tree: `encoder.*` (with the quantizer) and `decoder.*`."""

    def __init__(self, config: CodecConfig):
        super().__init__()
        self.config = config
        self.encoder = AudioEncoder(config)
        self.decoder = AudioDecoder(config)


def build_model(config: CodecConfig, dtype: torch.dtype = torch.float32) -> CodecModel:
    """The module tree on the meta device (no memory, no init), ready for assign-loading.

    Parameters take `dtype` already, so loading converts each tensor as it is read; buffers (RVQ
    codebooks, ISTFT window) stay float32.
    """
    with torch.device("meta"):
        model = CodecModel(config)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


def place_model(model: CodecModel, device: torch.device, dtype: torch.dtype,
                packing: Packing | None = None, codec_kernel: str = "auto") -> CodecModel:
    """Move to `device`; parameters (not the float32 codebook/window buffers) to `dtype`.

    On CPU the transformer layers' linears are then prepacked (`layers.prepack`; float32 ones
    as `packing`, or else `gemm.choose` in mode `codec_kernel`, says).
    """
    model.to(device)
    for param in model.parameters():
        if param.dtype != dtype:
            param.data = param.data.to(dtype)
    model.eval().requires_grad_(False)
    prepack(model, packing, codec_kernel)
    return model


def load_audio_tokenizer(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    cuda_graph: bool = False,
    packing: Packing | None = None,
    codec_kernel: str = "auto",
) -> AudioTokenizer:
    """Load a MiMo-Audio tokenizer directory (config.json + safetensors) onto `device`;
    `packing` overrides `gemm.choose()` for float32 on the CPU (the pipeline's, with the LM's
    weights beside it), which otherwise decides in mode `codec_kernel` ("auto", "on", "off":
    the run's `Placement.codec_kernel`)."""
    device = torch.device(normalize_device(str(device)))
    dtype = torch_dtype(dtype, "tokenizer")
    config = parse_config(path, CodecConfig.from_json)
    model = build_model(config, dtype)
    load_module_weights(model, path, f"audio tokenizer {path}", ignore=IGNORED_TENSORS)
    return AudioTokenizer(place_model(model, device, dtype, packing, codec_kernel), device,
                          dtype, cuda_graph=cuda_graph)
