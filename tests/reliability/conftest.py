"""Reliability test fixtures: broken checkpoint copies, limits (the CLI runners: tests/conftest).

Every case runs the real thing: the installed entry point in a subprocess (real signals, real
`setrlimit` limits) or the Typer app in-process, on real files and the tiny preset.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ENTRY_POINT = Path(sys.executable).with_name("mimo-tts")
TEMP_MARK = ".mimo-tmp-"


@pytest.fixture
def preset_copy(tiny_cache, tmp_path):
    """copy("lm" | "tokenizer") -> a private copy of that tiny-preset directory to break."""

    def copy(kind: str, name: str | None = None) -> Path:
        source = next(tiny_cache.glob(f"presets/*/{kind}"))
        target = tmp_path / (name or f"broken-{kind}")
        shutil.copytree(source, target)
        return target

    return copy


@pytest.fixture
def limited(base_env, tmp_path):
    """limited(*args, limits={resource.RLIMIT_X: bytes}) -> CompletedProcess of `mimo-tts`."""

    def run(*args, limits: dict, env: dict | None = None, timeout: float = 300):
        def apply() -> None:
            for which, value in limits.items():
                resource.setrlimit(which, (value, value))

        return subprocess.run([str(ENTRY_POINT), *map(str, args)], capture_output=True,
                              cwd=tmp_path, env={**base_env, **(env or {})}, timeout=timeout,
                              preexec_fn=apply, stdin=subprocess.DEVNULL)

    return run


def error_line(stderr: str) -> str:
    """The single `Error:` line of a failed run."""
    lines = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def temp_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob(f"{TEMP_MARK}*")) if directory.exists() else []


def audio_files(directory: Path) -> list[Path]:
    if not directory.exists():
        return []
    return sorted(p for p in directory.iterdir() if p.suffix in (".wav", ".flac")
                  and not p.name.startswith("."))


def read_lines(path: Path) -> list[dict]:
    """Every line of a JSON-lines file must parse (a consistent manifest)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def synth_broken(invoke, preset_copy, tmp_path):
    """synth_broken(kind, build) -> (result, broken dir): one synth run with the tiny preset's
    `kind` ("lm" or "tokenizer") copied and broken by `build`; no audio may be written."""

    def run(kind: str, build):
        broken = preset_copy(kind)
        build(broken)
        model = broken if kind == "lm" else "tiny"
        tokenizer = broken if kind == "tokenizer" else "tiny"
        result = invoke("synth", "--model", model, "--tokenizer", tokenizer, "--text", "Hello.",
                        "--max-new-groups", "1")
        assert not list(tmp_path.rglob("*.wav"))
        return result, broken

    return run


@pytest.fixture(scope="session")
def rel():
    """Helpers shared by the reliability tests (conftest modules are not importable here)."""
    return SimpleNamespace(error_line=error_line, temp_files=temp_files,
                           audio_files=audio_files, read_lines=read_lines,
                           TEMP_MARK=TEMP_MARK, RLIMIT_AS=resource.RLIMIT_AS,
                           RLIMIT_FSIZE=resource.RLIMIT_FSIZE)
