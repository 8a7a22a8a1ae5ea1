"""`import mimo_tts` sets OpenMP's spin count before torch loads libgomp (streamed steps beside a
busy process), and leaves a wait policy the user chose alone; a thread that hands its work to
another gives its OpenMP team back (`release_team`), as the worker's start and the library's
stream do."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from mimo_tts.presets import ensure_tiny_preset
from mimo_tts.runtime import openmp
from mimo_tts.runtime.paths import CACHE_ENV

PROBE = ("import os, sys, mimo_tts; print(os.environ.get('GOMP_SPINCOUNT'), "
         "os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")


def _child(**env) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in openmp.USER_KEYS}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          env={**base, **env}, check=True)
    return done.stdout.split()


def test_import_sets_the_spin_count_before_torch_loads():
    assert _child() == [openmp.SPINCOUNT, "None", "False"]


def test_a_users_choice_is_kept():
    assert _child(GOMP_SPINCOUNT="500") == ["500", "None", "False"]
    assert _child(OMP_WAIT_POLICY="active") == ["None", "active", "False"]


def test_configure_reports_what_it_did():
    assert openmp.configure({"OMP_WAIT_POLICY": "passive"}) == "user"
    env: dict[str, str] = {}
    assert openmp.configure(env) in ("set", "late") and env == {"GOMP_SPINCOUNT": "10000"}


# A thread's OpenMP team: its worker threads, seen as this process's tasks in /proc.
TEAM = '''
import os, sys, threading, time, torch
from mimo_tts.runtime import openmp
torch.set_num_threads(2)
def tasks(expected=None):
    for _ in range(100):  # a released worker leaves the task list as it exits
        n = len(os.listdir("/proc/self/task"))
        if n == expected:
            break
        time.sleep(0.01)
    return n
def work():
    torch.ones(1 << 22).exp_()  # one parallel region of 2 threads: the team has 1 worker
'''
RELEASE = TEAM + '''
work(); a = tasks()
released = openmp.release_team(); b = tasks(a - 1)
work(); c = tasks(b + 1)
print(released, a - b, c - b)
'''
HAND_OVER = TEAM + '''
import mimo_tts
tts = mimo_tts.load(sys.argv[1], sys.argv[2], lm_device="cpu", tokenizer_device="cpu")
work(); before, python = tasks(), threading.active_count()
worker = tts.worker(1, stream=True).start()
started = threading.active_count() - python
after = tasks(before - 1 + started)
worker.close()
print(started, before - 1 + started - after)
'''

linux = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc (Linux)")


def _run(code: str, *args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          check=True, timeout=300)
    return done.stdout.split()


@linux
def test_release_team_gives_back_this_threads_workers_and_they_come_back_when_needed():
    assert _run(RELEASE) == ["True", "1", "1"]


@linux
def test_a_started_worker_takes_the_callers_team_away(tiny_cache):
    """The server's face: the model loaded (and a parallel op run) in this thread, Stage-0 in
    the worker's: the caller's team is given back, so only the worker's thread keeps one."""
    lm, tok = ensure_tiny_preset({CACHE_ENV: str(tiny_cache)})
    started, extra = _run(HAND_OVER, str(lm), str(tok))
    assert int(started) >= 1 and extra == "0"


def test_the_librarys_stream_gives_the_team_back_before_its_thread_starts(tiny_cache,
                                                                          monkeypatch):
    import mimo_tts
    from mimo_tts.synthesis import speech

    calls = []

    def spy():
        calls.append((threading.current_thread().name,
                      sorted(t.name for t in threading.enumerate())))
        return openmp.release_team()

    monkeypatch.setattr(speech, "release_team", spy)
    lm, tok = ensure_tiny_preset({CACHE_ENV: str(tiny_cache)})
    tts = mimo_tts.load(str(lm), str(tok), lm_device="cpu", tokenizer_device="cpu")
    chunks = list(tts.stream("Hello there.", seed=1))
    assert chunks and len(calls) == 1
    caller, alive = calls[0]
    assert caller == threading.current_thread().name and "mimo-tts-stream" not in alive
