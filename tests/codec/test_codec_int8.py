"""Opt-in int8 decode: close to float32, never touching the float32 tokenizer."""

from __future__ import annotations

import pytest
import torch

from mimo_tts.codec import load_audio_tokenizer
from mimo_tts.codec.int8 import quantize_int8
from mimo_tts.errors import UsageError


@pytest.fixture(scope="module")
def int8_codec(codec):
    return quantize_int8(codec)


def test_int8_decode_is_close_to_float32(int8_codec, decode_cases):
    reference = decode_cases["decode_T101.waveform"]
    wave = int8_codec.decode(decode_cases["decode_T101.codes"])
    assert wave.dtype == torch.float32 and wave.shape == reference.shape
    error = (wave - reference).norm() / reference.norm()
    assert 0 < error < 0.05, error  # int8 changes numerics, so the path is opt-in


def test_int8_leaves_the_float32_tokenizer_exact(codec, int8_codec, decode_cases):
    fc1 = int8_codec.model.decoder.layers[0].fc1
    assert type(fc1).__module__.startswith("torch.ao.nn.quantized")
    assert isinstance(codec.model.decoder.layers[0].fc1, torch.nn.Linear)
    assert int8_codec.model.encoder is codec.model.encoder  # encode is unchanged
    wave = codec.decode(decode_cases["decode_T37.codes"])
    torch.testing.assert_close(wave, decode_cases["decode_T37.waveform"], atol=1e-4, rtol=0)


def test_int8_needs_float32_on_cpu(tokenizer_dir):
    with pytest.raises(UsageError, match="float32"):
        quantize_int8(load_audio_tokenizer(tokenizer_dir, dtype="bfloat16"))
