"""The LM's measured product choices (`cpu_kernel.products_faster`, `upcast_faster`) are kept
per machine: a later load at another thread count, whatever its timing would say now, makes
the same choices and the same bytes."""

from __future__ import annotations

import pytest
import torch

from mimo_tts.lm import cpu_kernel
from mimo_tts.lm import generate as gen
from mimo_tts.lm.load import load_lm
from mimo_tts.runtime.guards import thread_budget
from mimo_tts.runtime.measured import CHOICES_ENV
from mimo_tts.runtime.paths import CACHE_ENV


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty user cache and no decision taken yet in this process; cleared after."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(CHOICES_ENV, raising=False)
    for fn in (cpu_kernel.products_faster, cpu_kernel.upcast_faster):
        fn.cache_clear()
    yield tmp_path
    for fn in (cpu_kernel.products_faster, cpu_kernel.upcast_faster):
        fn.cache_clear()


def _timings(monkeypatch, faster: bool) -> list[str]:
    """Make both measurements say `faster` (ours 1.5x theirs or the reverse); the names of
    those that ran."""
    ran = []

    def timing(name):
        def measure():
            ran.append(name)
            return (faster, 3.0, 1.0) if faster else (faster, 1.0, 3.0)
        return measure

    monkeypatch.setattr(cpu_kernel, "measure_products", timing("products"))
    monkeypatch.setattr(cpu_kernel, "measure_upcast", timing("upcast"))
    return ran


def _load_and_run(lm_dir, prompt, special, options, threads: int):
    """A new process's load at `threads` threads: the decisions, the prefill's hidden state
    and the generated ids."""
    for fn in (cpu_kernel.products_faster, cpu_kernel.upcast_faster):
        fn.cache_clear()  # as a new process
    with thread_budget(threads):
        model = load_lm(lm_dir, "cpu", torch.bfloat16)
        decisions = (cpu_kernel.products_faster().faster, cpu_kernel.upcast_faster().faster)
        with torch.inference_mode():
            hidden = gen.prefill(model, [prompt], options, special).hidden.clone()
        (out,) = gen.generate(model, [prompt], options, special)
        reasons = (cpu_kernel.choose(model).reason, cpu_kernel.prefill_products(model)[1].reason)
    return decisions, hidden, out.new_ids, reasons


def test_an_opposite_timing_at_a_later_load_changes_nothing(fresh, lm_dir, special, case_tensors,
                                                            greedy_options, monkeypatch):
    prompt = case_tensors("lm_generate")["gen_tts_en_free_greedy.input_ids"]
    options = greedy_options(max_new_groups=3)
    ran = _timings(monkeypatch, True)
    first = _load_and_run(lm_dir, prompt, special, options, threads=1)
    assert sorted(ran) == ["products", "upcast"] and first[0] == (True, True)
    assert "measured now" in first[3][1]
    ran = _timings(monkeypatch, False)  # the other way round, as a busy machine might time
    second = _load_and_run(lm_dir, prompt, special, options, threads=2)
    assert ran == []  # read from the kept decisions
    assert second[0] == first[0]
    assert torch.equal(second[1], first[1]) and torch.equal(second[2], first[2])
    assert "kept in the cache" in second[3][1]
    # without the kept file the same timing would have chosen the other way
    for path in (fresh / "choices").glob("*.json"):
        path.unlink()
    third = _load_and_run(lm_dir, prompt, special, options, threads=2)
    assert third[0] == (False, False) and sorted(ran) == ["products", "upcast"]


@pytest.mark.skipif(not cpu_kernel.features()["avx2"], reason="the kernel has no AVX2 path here")
def test_the_avx2_path_runs_the_kernel_where_its_products_measured_faster(
        fresh, lm_dir, special, case_tensors, greedy_options, monkeypatch):
    """A CPU whose widest path is AVX2 (forced here with `set_isa`): auto runs the kernel,
    weights packed, exactly as "on" does, when its products timed faster than PyTorch's, and
    leaves the weights and the steps to PyTorch when they timed slower."""
    prompt = case_tensors("lm_generate")["gen_tts_en_free_greedy.input_ids"]
    options = greedy_options(max_new_groups=3)
    cpu_kernel.set_isa(1)
    try:
        assert cpu_kernel.features()["packed_isa"] == "AVX2"
        for faster in (True, False):
            for path in (fresh / "choices").glob("*.json"):
                path.unlink()
            cpu_kernel.products_faster.cache_clear()
            ran = _timings(monkeypatch, faster)
            model = load_lm(lm_dir, "cpu", torch.bfloat16)
            choice = cpu_kernel.choose(model)
            assert "products" in ran and choice.active == faster
            assert choice.reason.startswith("auto: AVX2")
            assert bool(model.packed_bytes) == faster
            (auto,) = gen.generate(model, [prompt], options, special)
            twin = load_lm(lm_dir, "cpu", torch.bfloat16,
                           cpu_kernel="on" if faster else "off")
            (same,) = gen.generate(twin, [prompt], options, special)
            assert auto.new_ids.numel() > 0 and torch.equal(auto.new_ids, same.new_ids)
    finally:
        cpu_kernel.set_isa(2)
