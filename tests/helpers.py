"""Plain helpers and paths shared by the tests: `from tests.helpers import error_line`.

Fixtures live in the conftests; what needs no fixture (paths, small readers and checks) lives
here, importable like any module (`pythonpath = ["."]` in pyproject's pytest section).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from mimo_tts.runtime.paths import TEMP_MARK

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("MIMO_TTS_FIXTURES") or REPO / "tests" / "fixtures")
TINY_A = FIXTURES / "tiny-a"
FULL_SIZE = FIXTURES / "full-size"
# The installed console script, beside the interpreter running the tests.
ENTRY_POINT = Path(sys.executable).with_name("mimo-tts")


def read_lines(path: Path) -> list[dict]:
    """Every line of a JSON-lines file must parse (a consistent manifest)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def read_manifest(directory: Path) -> list[dict]:
    """The parsed lines of a task folder's results.jsonl."""
    return read_lines(directory / "results.jsonl")


def error_line(stderr: str) -> str:
    """The single `Error:` line of a failed run."""
    lines = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def temp_files(directory: Path) -> list[Path]:
    """The temporary files a write leaves in `directory` (none after a clean run)."""
    return sorted(directory.rglob(f"{TEMP_MARK}*")) if directory.exists() else []


def audio_files(directory: Path) -> list[Path]:
    """The finished audio files in `directory` (hidden files are not finished outputs)."""
    if not directory.exists():
        return []
    return sorted(p for p in directory.iterdir() if p.suffix in (".wav", ".flac")
                  and not p.name.startswith("."))


def find_case(cases: dict, name: str) -> dict:
    """The case `name` of tiny-a's cases.json (`cases` fixture); names are unique across groups."""
    for group in cases["groups"].values():
        for case in group["cases"]:
            if case["name"] == name:
                return case
    raise KeyError(f"no case {name!r} in cases.json")
