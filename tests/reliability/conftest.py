"""Reliability test fixtures: broken checkpoint copies, limits (the CLI runners: tests/conftest;
plain helpers such as `error_line` and `temp_files`: tests/helpers.py).

Every case runs the real thing: the installed entry point in a subprocess (real signals, real
`setrlimit` limits) or the Typer app in-process, on real files and the tiny preset.
"""

from __future__ import annotations

import resource
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ENTRY_POINT


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

