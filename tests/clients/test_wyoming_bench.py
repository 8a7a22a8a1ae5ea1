"""`mimo-tts wyoming` measured by `wyoming-bench` (a Wyoming TTS benchmark from PyPI that nobody
here wrote): it must describe the server, and finish every round in both of its modes
(non-streaming `synthesize`; streaming `synthesize-start/-chunk/-stop`), reading TTFT, total
time, RTF and the audio's duration."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("wyoming")
BENCH = shutil.which("wyoming-bench") or str(Path(sys.executable).with_name("wyoming-bench"))
pytestmark = pytest.mark.skipif(not Path(BENCH).is_file(),
                                reason="needs wyoming-bench (pip install wyoming-bench)")


def bench(*args: str) -> str:
    run = subprocess.run([BENCH, *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_wyoming_bench_describes_and_measures_both_modes(start_wyoming):
    server = start_wyoming()
    info = bench("info", server)
    assert "mimo-tts (synthesize streaming)" in info and "voice natural [en, zh]" in info
    out = bench("tts", server, "--texts", "Measured by a stranger. Then a second sentence.",
                "--rounds", "2", "--warmup", "0", "--timeout", "120")
    print(out)  # what it measured: -s shows the table
    assert "[non_streaming] ok=2 fail=0" in out and "[streaming] ok=2 fail=0" in out
    for metric in ("TTFT (ms)", "Total (ms)", "RTF (x)"):
        assert out.count(metric) == 2
    durations = [float(s) for s in re.findall(r"Audio\s+mean=([\d.]+)s", out)]
    assert len(durations) == 2 and all(d > 0 for d in durations)
