"""Helpers every benchmark and check script shares: where the fixtures are, how busy the machine is.

Scripts run as `python scripts/NAME.py`, so `import _common` finds this file. The fixtures
default to the repository's copy (`tests/fixtures`); `MIMO_TTS_FIXTURES` points elsewhere.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("MIMO_TTS_FIXTURES") or REPO / "tests" / "fixtures")
TINY_A = FIXTURES / "tiny-a"
FULL_SIZE = FIXTURES / "full-size"


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot, from the first line of /proc/stat."""
    with open("/proc/stat", encoding="ascii") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    total = sum(fields[:8])
    return total - fields[3] - fields[4], total  # idle + iowait are not busy


def cpu_busy_s() -> float:
    """Seconds of CPU time all processes of the machine have used since boot (nan if unknown)."""
    try:
        return cpu_ticks()[0] / os.sysconf("SC_CLK_TCK")
    except OSError:
        return float("nan")


def busy_cores(window_s: float = 5.0) -> float:
    """Cores the machine's processes kept busy over the next `window_s` seconds."""
    start, before = time.perf_counter(), cpu_busy_s()
    time.sleep(window_s)
    return (cpu_busy_s() - before) / (time.perf_counter() - start)


def emit(report: dict, out: str | None = None) -> None:
    """Print a benchmark's JSON report, and write it to `out` too where one is named."""
    text = json.dumps(report, indent=2, ensure_ascii=False)
    print(text)
    if out:
        Path(out).write_text(text + "\n", encoding="utf-8")


def checkout_env(folder: str) -> dict:
    """The environment of a child `python -m mimo_tts.cli ...` that must run the package of
    the checkout at `folder`: it first on PYTHONPATH, and PYTHONSAFEPATH set, because `-m`
    otherwise puts the working directory first on sys.path, and a child started from a
    repository root imports that root's package whatever PYTHONPATH says."""
    path = str(Path(folder or ".").resolve())
    return {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": os.pathsep.join(
        [path, *filter(None, [os.environ.get("PYTHONPATH")])])}
