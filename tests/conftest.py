"""Shared test fixtures: paths to the reference fixtures and their tensors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("MIMO_TTS_FIXTURES", REPO.parent / "shared" / "fixtures"))
TINY_A = FIXTURES / "tiny-a"
FULL_SIZE = FIXTURES / "full-size"


@pytest.fixture(scope="session")
def tiny_a() -> Path:
    if not TINY_A.is_dir():
        pytest.fail(f"reference fixtures not found at {TINY_A} (set MIMO_TTS_FIXTURES)")
    return TINY_A


@pytest.fixture(scope="session")
def cases(tiny_a) -> dict:
    """cases.json of tiny-a."""
    return json.loads((tiny_a / "cases" / "cases.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def case_tensors(tiny_a):
    """Load a case group's tensors: case_tensors("codec_decode")["decode_T4.codes"]."""
    from safetensors.torch import load_file

    cache: dict[str, dict] = {}

    def load(group: str) -> dict:
        if group not in cache:
            cache[group] = load_file(str(tiny_a / "cases" / f"{group}.safetensors"))
        return cache[group]

    return load


@pytest.fixture(scope="session")
def forcing():
    """forcing(scripts) -> a text-logits hook that makes row b's step-k token scripts[b][k] the
    only choice (how the tests replay the reference's forced token scripts)."""

    def make(scripts: list[list[int]]):
        def hook(step: int, logits):
            forced = logits.new_full(logits.shape, float("-inf"))
            for row, script in enumerate(scripts):
                forced[row, script[min(step, len(script) - 1)]] = 0.0
            return forced

        return hook

    return make
