"""scripts/gpu_check.sh without CUDA: a dry run where every section says so, exit 0, one JSON;
and the `stream` section's script on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
SECTIONS = {"codec_graphs", "lm_graphs", "vllm", "cli_split", "full_width", "stream"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_gpu_check_is_a_dry_run_without_cuda(tmp_path):
    out = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", str(SCRIPT), "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report == json.loads(done.stdout)
    assert report["cuda"] is False and report["ok"] is True
    assert set(report["sections"]) == SECTIONS
    for name, section in report["sections"].items():
        assert section["status"] == "no CUDA", name
        assert 0 < section["limit_s"]
    # the limits fit the 8-minute budget of one run
    assert sum(s["limit_s"] for s in report["sections"].values()) <= 8 * 60


def test_stream_check_runs_on_the_cpu():
    """The `stream` section's script, on the CPU: the growing schedule's audio and the
    pushed-together Stage-1 both check out (what the GPU run reports, here on this machine)."""
    script = SCRIPT.parent / "check_stream_cuda.py"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--streams", "3"],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and report["device"]  # the CPU's model name
    schedule = report["schedule"]
    assert schedule["frames"]["first_audio_at_frame"] == schedule["first_audio_frames"] == 40
    assert schedule["growing"]["first_audio_at_frame"] == 40  # the first push: 9 + 1 groups
    assert report["together"]["equal_to_solo"] == [True] * 3  # one thread: exact
