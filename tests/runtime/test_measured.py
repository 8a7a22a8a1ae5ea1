"""Speed choices measured once per machine and kept in the user cache (`runtime.measured`):
later loads at any thread count read the kept decision instead of timing again."""

from __future__ import annotations

import json

import pytest
import torch

from mimo_tts.errors import UsageError
from mimo_tts.runtime import measured
from mimo_tts.runtime.guards import thread_budget
from mimo_tts.runtime.paths import CACHE_ENV


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(measured.CHOICES_ENV, raising=False)
    return tmp_path


class _Timer:
    """A measurement that returns `result` and records the thread count it ran at."""

    def __init__(self, result):
        self.result, self.threads = result, []

    def __call__(self):
        self.threads.append(torch.get_num_threads())
        return self.result


def _files(cache):
    return sorted((cache / "choices").glob("*.json"))


def test_the_decision_is_written_once_and_reused_at_another_thread_count(cache):
    first = _Timer((True, 60.0, 8.0))
    with thread_budget(1):
        decision = measured.decide("prefill_upcast", "probe", first)
    assert decision.faster and (decision.ours, decision.theirs) == (60.0, 8.0)
    assert first.threads == [measured.measure_threads()]  # timed at the fixed count, not 1
    assert "measured now" in decision.source and "kept in the cache" in decision.source
    [path] = _files(cache)
    kept = json.loads(path.read_text())
    assert kept["faster"] is True and "threads" not in kept["key"]
    stamp = path.stat().st_mtime_ns
    again = _Timer((False, 1.0, 2.0))
    with thread_budget(2):
        second = measured.decide("prefill_upcast", "probe", again)
    assert again.threads == []  # read, not timed
    assert second.faster and (second.ours, second.theirs) == (60.0, 8.0)
    assert "kept in the cache" in second.source and "measured now" not in second.source
    assert _files(cache) == [path] and path.stat().st_mtime_ns == stamp


def test_another_probe_or_choice_is_measured_on_its_own(cache):
    measured.decide("prefill_upcast", "probe", _Timer((True, 2.0, 1.0)))
    other = _Timer((False, 1.0, 2.0))
    assert not measured.decide("prefill_upcast", "other shapes", other).faster
    assert not measured.decide("codec_gemm", "probe", other).faster
    assert len(other.threads) == 2 and len(_files(cache)) == 3


@pytest.mark.parametrize("content", ["", "{not json", "[]", '{"key": 1}', "null",
                                     '{"key": {}, "faster": true, "ours": 1, "theirs": 1}'])
def test_a_corrupt_or_foreign_file_is_measured_again_not_a_crash(cache, content):
    measured.decide("codec_gemm", "probe", _Timer((True, 2.0, 1.0)))
    [path] = _files(cache)
    path.write_text(content)
    timer = _Timer((False, 1.0, 3.0))
    decision = measured.decide("codec_gemm", "probe", timer)
    assert len(timer.threads) == 1 and not decision.faster and "measured now" in decision.source
    assert json.loads(path.read_text())["faster"] is False  # replaced by the new measurement
    assert not measured.decide("codec_gemm", "probe", _Timer((True, 9.0, 1.0))).faster


def test_the_environment_sets_a_choice_without_measuring(cache, monkeypatch):
    monkeypatch.setenv(measured.CHOICES_ENV, "prefill_upcast=0, codec_gemm=1")
    timer = _Timer((True, 2.0, 1.0))
    decision = measured.decide("prefill_upcast", "probe", timer)
    assert not decision.faster and timer.threads == [] and not _files(cache)
    assert decision.words("GFLOP/s") == f"set by {measured.CHOICES_ENV}"
    assert measured.decide("codec_gemm", "probe", timer).faster
    monkeypatch.setenv(measured.CHOICES_ENV, "prefill=2")
    with pytest.raises(UsageError, match=measured.CHOICES_ENV):
        measured.decide("prefill_upcast", "probe", timer)


def test_a_cache_that_cannot_be_written_still_measures(cache, monkeypatch):
    blocker = cache / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))  # below a file: no folder there
    decision = measured.decide("codec_gemm", "probe", _Timer((True, 2.0, 1.0)))
    assert decision.faster and "not kept" in decision.source and str(cache) not in decision.source


def test_a_bad_setting_is_refused_when_the_placement_resolves():
    from mimo_tts.runtime.devices import resolve_placement

    for bad in ("prefill_upcast", "gemm=1", "codec_gemm=maybe"):
        with pytest.raises(UsageError, match=measured.CHOICES_ENV):
            resolve_placement(lm_device="cpu", tokenizer_device="cpu",
                              env={measured.CHOICES_ENV: bad})
    resolve_placement(lm_device="cpu", tokenizer_device="cpu",
                      env={measured.CHOICES_ENV: "codec_gemm=off, prefill_upcast=yes"})


def test_alternating_best_warms_up_then_alternates_and_keeps_each_best():
    calls = []
    best = measured.alternating_best(lambda: calls.append("ours"), lambda: calls.append("theirs"),
                                     rounds=3)
    assert calls == ["ours", "theirs"] * 4  # one warm-up call each, then 3 alternating rounds
    assert all(isinstance(t, float) and 0 <= t < 1 for t in best)
