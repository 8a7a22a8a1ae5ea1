"""Speed choices between two ways to compute, measured once per machine and kept in the user cache.

Five choices pick between computations that round differently (the LM's kernel products, the
prefill's float32 blocks, the codec's bf16x3 GEMM, its float32 weights in oneDNN's layout (the
same sums but for one-row products) and its fused attention), so the bytes of the audio follow
them. Timed afresh at every load, a run at another thread count or beside a busy process
could choose the other way and change the audio of a seed; so each choice is timed once per
machine (at a fixed thread count: the CPUs this process may use) and the result kept in
`<cache>/choices/<name>-<key>.json`, keyed by the CPU model, its feature flags, the torch
version and the probe (dtype, shapes): never by the thread count. Every later load on that
machine reads it. A file that cannot be read or belongs to another key is measured again and
replaced; measuring holds a lock, so processes starting together agree.
MIMO_TTS_PRODUCT_CHOICES (`lm_kernel_products=1,lm_attention=1,prefill_upcast=0,codec_gemm=1,
codec_packed_float32=1,codec_attention=0`) sets any of them without measuring, e.g. to give
several machines of one kind the same choice.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from mimo_tts.errors import OutputError
from mimo_tts.runtime.devices import (
    PRODUCT_CHOICES_ENV,
    cpu_flags,
    cpuinfo_line,
    product_choices,
)
from mimo_tts.runtime.guards import thread_budget
from mimo_tts.runtime.paths import cache_root, write_json

CHOICES_ENV = PRODUCT_CHOICES_ENV
FORMAT = 1  # bump when what a file holds changes


@dataclass(frozen=True)
class Decision:
    """Whether our product was the faster one, the two speeds measured (0 when set by the
    environment) and where the decision came from, in words."""

    faster: bool
    ours: float
    theirs: float
    source: str

    def words(self, unit: str) -> str:
        """"60.0 vs 8.0 GFLOP/s measured ..." or the environment's words."""
        if self.ours or self.theirs:
            return f"{self.ours} vs {self.theirs} {unit} {self.source}"
        return self.source


def machine_key(name: str, probe: str) -> dict:
    """What a kept decision must match: the choice, its probe, the CPU and torch."""
    import torch

    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
    return {"format": FORMAT, "choice": name, "probe": probe, "cpu": cpuinfo_line("model name"),
            "cpu_flags": flags, "torch": torch.__version__}


def decision_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "choices" / f"{key['choice']}-{digest}.json"


def measure_threads() -> int:
    """The fixed thread count measurements run at: the CPUs this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _read(path: Path, key: dict) -> Decision | None:
    """The kept decision at `path` for `key`, or None (absent, unreadable, corrupt, stale)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data["key"] != key or not isinstance(data["faster"], bool):
            return None
        ours, theirs = float(data["ours"]), float(data["theirs"])
        when, threads = str(data["measured_at"]), int(data["threads"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Decision(data["faster"], ours, theirs,
                    f"measured {when} at {threads} threads, kept in the cache")


def _measure(measure: Callable[[], tuple[bool, float, float]]) -> tuple[tuple, int]:
    threads = measure_threads()
    with thread_budget(threads):
        return measure(), threads


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock beside `path` (released when the process dies)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def alternating_best(ours: Callable[[], object], theirs: Callable[[], object],
                     rounds: int = 5) -> tuple[float, float]:
    """The best seconds of each of two calls over `rounds` alternating rounds, after one
    warm-up call of each (thread teams, caches, CPU state): what a `measure` compares."""
    ours(), theirs()
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for index, fn in enumerate((ours, theirs)):
            start = time.perf_counter()
            fn()
            best[index] = min(best[index], time.perf_counter() - start)
    return best[0], best[1]


def decide(name: str, probe: str, measure: Callable[[], tuple[bool, float, float]],
           env: Mapping[str, str] | None = None) -> Decision:
    """The choice `name` on this machine: set by the environment, kept from an earlier
    measurement, or `measure()` (-> faster, ours, theirs) now at `measure_threads()` threads
    and kept for every later run."""
    forced = product_choices(env).get(name)
    if forced is not None:
        return Decision(forced, 0.0, 0.0, f"set by {CHOICES_ENV}")
    key = machine_key(name, probe)
    path = decision_path(key)
    try:
        with _locked(path):
            kept = _read(path, key)
            if kept is not None:
                return kept
            (faster, ours, theirs), threads = _measure(measure)
            return Decision(bool(faster), ours, theirs,
                            f"measured now at {threads} threads, " +
                            _keep(path, key, bool(faster), ours, theirs, threads))
    except OSError:  # no lock (a read-only cache): measured for this process only
        (faster, ours, theirs), threads = _measure(measure)
        return Decision(bool(faster), ours, theirs, f"measured now at {threads} threads, "
                                                    "not kept (the cache cannot be written)")


def _keep(path: Path, key: dict, faster: bool, ours: float, theirs: float,
          threads: int) -> str:
    """Write the decision (atomically); the words for its source."""
    when = time.strftime("%Y-%m-%d", time.gmtime())
    try:
        write_json(path, {"key": key, "faster": faster, "ours": ours, "theirs": theirs,
                          "threads": threads, "measured_at": when})
    except OutputError:
        return "not kept (the cache cannot be written)"
    return "kept in the cache"
