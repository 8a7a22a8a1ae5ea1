"""`import mimo_tts` sets OpenMP's spin count before torch loads libgomp (streamed steps beside a
busy process), and leaves a wait policy the user chose alone."""

from __future__ import annotations

import os
import subprocess
import sys

from mimo_tts.runtime import openmp

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
