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


# --- the CPU kernel's quantized products (test_lm_w8a8.py, test_lm_w4a8.py) -------------------
ISA_LEVELS = {"avx512": 2, "avx2": 1, "c": 0}


def isa_paths() -> list[str]:
    """The kernel's product paths this build has: AVX-512 and AVX2 where compiled in, C."""
    from mimo_tts.lm import cpu_kernel

    isa = cpu_kernel.features()
    return (["avx512"] if isa["avx512_bf16"] else []) + (["avx2"] if isa["avx2"] else []) + ["c"]


@pytest.fixture(params=isa_paths())
def isa_path(request):
    """Each product path in turn (`cpu_kernel.set_isa`), the widest restored after."""
    from mimo_tts.lm import cpu_kernel

    cpu_kernel.set_isa(ISA_LEVELS[request.param])
    yield request.param
    cpu_kernel.set_isa(2)


def operands(out=96, width=320, rows=17, seed=0):
    """Rows, a weight and a bias of Gaussian values, bfloat16."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=gen).bfloat16(),
            torch.randn(out, width, generator=gen).bfloat16(),
            torch.randn(out, generator=gen).bfloat16())


def on_every_path(product) -> list:
    """product() on each path this build has, the widest restored after."""
    from mimo_tts.lm import cpu_kernel

    results = []
    try:
        for level in sorted({ISA_LEVELS[p] for p in isa_paths()}):
            cpu_kernel.set_isa(level)
            results.append(product())
    finally:
        cpu_kernel.set_isa(2)
    return results


def assert_rows_alike_everywhere(x, packed, bias) -> torch.Tensor:
    """A packed weight's product of each row of x alone equals the row's bytes in batches of
    1-17 and all rows, on 1-3 threads and every path; -> the rows alone."""
    from mimo_tts.lm import cpu_kernel

    rows = x.shape[0]
    alone = torch.cat([cpu_kernel.packed_linear(x[r:r + 1], packed, bias) for r in range(rows)])
    before = torch.get_num_threads()

    def check():
        for n in (*range(1, 18), rows):
            assert torch.equal(cpu_kernel.packed_linear(x[:n], packed, bias), alone[:n]), n
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(cpu_kernel.packed_linear(x, packed, bias), alone), threads
        torch.set_num_threads(before)

    try:
        on_every_path(check)
    finally:
        torch.set_num_threads(before)
    return alone
