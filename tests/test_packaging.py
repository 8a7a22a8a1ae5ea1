"""The wheel carries what a non-editable install needs at run time: the built-in profiles
(`--config ci-smoke`) and the CPU kernel's C source, as package data."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_ships_profiles_and_kernel_source(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "-w", str(tmp_path), "--no-deps",
         "--no-build-isolation", "-q"], capture_output=True, text=True, timeout=300,
        cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("mimo_tts-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    profiles = {p.name for p in (REPO / "mimo_tts" / "configs").glob("*.toml")}
    assert profiles == {"ci-smoke.toml", "cpu-tokenizer.toml", "default.toml"}
    assert {f"mimo_tts/configs/{name}" for name in profiles} <= names
    assert {"mimo_tts/lm/cpu_kernel.c", "mimo_tts/codec/gemm.c"} <= names
    assert not any(n.startswith(("tests/", "configs/")) for n in names)
