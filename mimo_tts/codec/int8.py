"""Opt-in int8 decode on CPU: dynamic quantisation of the decoder's transformer layers.

The decoder's 32 layers hold ~97% of the decode FLOPs. Their linear layers get int8 weights
(per-tensor, symmetric) and quantise their activations per call; everything else (convs, norms,
the vocoder head, the ISTFT, the RVQ) stays float32. On CPUs with VNNI/AMX int8 this runs below
the dense float32 floor. It changes the numerics well beyond the fixture tolerances, so it is
never the default: `scripts/bench_codec.py --sections int8` reports its error against float32.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from mimo_tts.codec.decoder import AudioDecoder
from mimo_tts.codec.layers import plain_state_dict
from mimo_tts.codec.tokenizer import AudioTokenizer
from mimo_tts.errors import UsageError

# oneDNN uses AMX/VNNI int8 kernels where the CPU has them; fbgemm/x86 are the fallbacks.
ENGINES = ("onednn", "x86", "fbgemm")


def _copy_decoder(decoder: AudioDecoder) -> AudioDecoder:
    """An independent copy (deepcopy cannot copy the RoPE caches' locks)."""
    with torch.device("meta"):
        fresh = AudioDecoder(decoder.config)
    fresh.load_state_dict({k: v.clone() for k, v in plain_state_dict(decoder).items()},
                          assign=True)
    return fresh.eval().requires_grad_(False)


def quantize_int8(tokenizer: AudioTokenizer) -> AudioTokenizer:
    """A tokenizer whose decoder and vocoder layers use int8 dynamic-quantised linears.

    Needs a float32 tokenizer on CPU. The float32 model is left untouched (the decoder is
    copied first); encode is unchanged.
    """
    if tokenizer.device.type != "cpu" or tokenizer.dtype != torch.float32:
        raise UsageError("int8 decode needs a float32 tokenizer on CPU, got "
                         f"{tokenizer.dtype} on {tokenizer.device}")
    model = copy.copy(tokenizer.model)  # shares the encoder; the decoder is replaced below
    model._modules = dict(model._modules)
    model._modules["decoder"] = _copy_decoder(tokenizer.model.decoder)
    previous, supported = (torch.backends.quantized.engine,
                           torch.backends.quantized.supported_engines)
    # weights are packed for this engine
    torch.backends.quantized.engine = next((e for e in ENGINES if e in supported), previous)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the eager API is deprecated in favour of torchao
            for stack in (model.decoder.layers, model.decoder.vocoder.layers):
                torch.ao.quantization.quantize_dynamic(stack, {nn.Linear}, dtype=torch.qint8,
                                                       inplace=True)
    finally:
        torch.backends.quantized.engine = previous
    return AudioTokenizer(model, tokenizer.device, tokenizer.dtype)
