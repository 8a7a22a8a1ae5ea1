"""LM test fixtures: the tiny-a LM and text tokenizer, loaded once per session (the codec,
`codec`, and `greedy_options` come from tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from mimo_tts.lm.load import load_lm
from mimo_tts.lm.text import TextTokenizer


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """The tiny models' ops are far too small to split; on a shared 2-core machine the
    OpenMP threads of two processes spin against each other (30x slower)."""


@pytest.fixture(scope="session")
def lm_dir(tiny_a):
    return tiny_a / "lm"


@pytest.fixture(scope="session")
def lm(lm_dir):
    return load_lm(lm_dir, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def text_tokenizer(lm_dir):
    return TextTokenizer.from_dir(lm_dir)


@pytest.fixture(scope="session")
def special(text_tokenizer):
    return text_tokenizer.special


@pytest.fixture(scope="session")
def modes_agree(special, greedy_options):
    """modes_agree(model, prompt, (reference, other), groups, atol): greedy generation in two
    decode modes gives the same ids and step logits within `atol`."""
    from mimo_tts.lm.generate import generate

    def check(model, prompt, modes, groups: int, atol: float) -> None:
        options = [greedy_options(max_new_groups=groups, keep_logits=True, decode_step=mode)
                   for mode in modes]
        want, got = (generate(model, [prompt], o, special)[0] for o in options)
        assert torch.equal(got.new_ids, want.new_ids)
        torch.testing.assert_close(got.step_logits, want.step_logits, atol=atol, rtol=0)

    return check


@pytest.fixture(scope="session")
def gen_cases(cases, case_tensors):
    """Every generation case (lm_generate + voice_prompt): [(case, tensors), ...]."""
    out = []
    for group in ("lm_generate", "voice_prompt"):
        for case in cases["groups"][group]["cases"]:
            if case["task"] == "lm_generate":
                out.append((case, case_tensors(group)))
    return out
