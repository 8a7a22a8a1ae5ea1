"""A 10-item smoke run of scripts/soak.py (the 200-item soak runs by hand: docs/reliability.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


@pytest.mark.slow
def test_soak_smoke(base_env, tmp_path):
    proc = subprocess.run([sys.executable, str(SOAK), "--items", "10", "--faults", "1",
                           "--seed", "3", "--workdir", str(tmp_path / "soak")],
                          capture_output=True, env=base_env, timeout=600)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ok"], report
    assert sum(report["faults"].values()) == 1  # the run was really interrupted
    assert report["wavs"] == report["good_items"] > 0 and report["temp_files_at_end"] == 0
    assert report["manifest_lines"] == report["good_items"] + report["bad_items"]
    assert sum(report["final_run"].values()) == report["manifest_lines"]
