"""Every benchmark and tool in scripts/ imports and parses its options (`--help`, exit 0).

The scripts are not run by the suite (they are minutes long), so an import they lose in a
refactor would otherwise only show when someone next benchmarks.
"""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted(p for p in (Path(__file__).resolve().parents[1] / "scripts").glob("*.py")
                 if not p.name.startswith("_"))


def test_the_scripts_are_found():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_help(script):
    run = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage" in run.stdout.lower()
