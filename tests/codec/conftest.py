"""Codec test fixtures: the tiny-a audio tokenizer loaded once per session."""

from __future__ import annotations

import pytest
import torch

from mimo_tts.codec import load_audio_tokenizer

cuda = pytest.mark.cuda
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="session")
def tokenizer_dir(tiny_a):
    return tiny_a / "tokenizer"


@pytest.fixture(scope="session")
def codec(tokenizer_dir):
    """tiny-a tokenizer on CPU in float32 (matches the reference fixtures)."""
    return load_audio_tokenizer(tokenizer_dir, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def decode_cases(case_tensors):
    return case_tensors("codec_decode")


@pytest.fixture(scope="session")
def encode_cases(case_tensors):
    return case_tensors("codec_encode")
