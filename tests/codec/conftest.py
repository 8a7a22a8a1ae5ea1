"""Codec test fixtures: the tiny-a tokenizer's directory and cases (the loaded tokenizer,
`codec`, is shared with tests/lm from tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

cuda = pytest.mark.cuda
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="session")
def tokenizer_dir(tiny_a):
    return tiny_a / "tokenizer"


@pytest.fixture(scope="session")
def decode_cases(case_tensors):
    return case_tensors("codec_decode")


@pytest.fixture(scope="session")
def encode_cases(case_tensors):
    return case_tensors("codec_encode")
