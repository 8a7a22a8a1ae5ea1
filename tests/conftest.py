"""Shared test fixtures: the reference fixtures and their tensors, one tiny preset per session,
and runners for the CLI.

The reference fixtures live in the repository (`tests/fixtures`: tiny-a and the full-size
configs, README there); `MIMO_TTS_FIXTURES` points the tests at another copy. `mimo` runs the
real console script (`<venv>/bin/mimo-tts`) in a subprocess; `invoke` runs the same Typer app
in-process through CliRunner (cheaper: no interpreter/torch start-up).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from mimo_tts.presets import ensure_tiny_preset
from mimo_tts.runtime.paths import CACHE_ENV
from tests.helpers import ENTRY_POINT, TINY_A, read_manifest


@pytest.fixture(scope="session")
def tiny_a() -> Path:
    if not TINY_A.is_dir():
        pytest.fail(f"reference fixtures not found at {TINY_A} (set MIMO_TTS_FIXTURES)")
    return TINY_A


@pytest.fixture(scope="session")
def cases(tiny_a) -> dict:
    """cases.json of tiny-a."""
    return json.loads((tiny_a / "cases" / "cases.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def case_tensors(tiny_a):
    """Load a case group's tensors: case_tensors("codec_decode")["decode_T4.codes"]."""
    from safetensors.torch import load_file

    cache: dict[str, dict] = {}

    def load(group: str) -> dict:
        if group not in cache:
            cache[group] = load_file(str(tiny_a / "cases" / f"{group}.safetensors"))
        return cache[group]

    return load


@pytest.fixture(scope="session")
def forcing():
    """forcing(scripts) -> a text-logits hook that makes row b's step-k token scripts[b][k] the
    only choice (how the tests replay the reference's forced token scripts)."""

    def make(scripts: list[list[int]]):
        def hook(step: int, logits):
            forced = logits.new_full(logits.shape, float("-inf"))
            for row, script in enumerate(scripts):
                forced[row, script[min(step, len(script) - 1)]] = 0.0
            return forced

        return hook

    return make


@pytest.fixture(scope="session")
def codec(tiny_a):
    """The tiny-a audio tokenizer (Stage-1) on CPU in float32, as the reference was made."""
    import torch

    from mimo_tts.codec import load_audio_tokenizer

    return load_audio_tokenizer(tiny_a / "tokenizer", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def greedy_options():
    """greedy_options(**kw) -> GenerationOptions with greedy text and audio samplers."""
    from mimo_tts.lm.generate import GenerationOptions
    from mimo_tts.lm.sampling import GREEDY

    return lambda **kw: GenerationOptions(text_sampler=GREEDY, audio_sampler=GREEDY, **kw)


# --- the tiny preset and the CLI runners ---------------------------------------------------------

# Environment variables that would change device/checkpoint resolution under test.
SCRUBBED = ("MIMO_AUDIO_TOKENIZER_DEVICE", "MIMO_AUDIO_TOKENIZER_PATH", "MIMO_TTS_LM_DEVICE",
            "MIMO_AUDIO_TOKENIZER_CUDA_GRAPH", "MIMO_TTS_CACHE")


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """A cache root holding the tiny preset, written once for the whole session."""

    root = tmp_path_factory.mktemp("mimo-cache")
    ensure_tiny_preset({CACHE_ENV: str(root)})
    return root


@pytest.fixture(scope="session")
def base_env(tiny_cache, tmp_path_factory) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
    env.update({"MIMO_TTS_CACHE": str(tiny_cache), "NO_COLOR": "1", "HF_HUB_OFFLINE": "1",
                "HF_HOME": str(tmp_path_factory.mktemp("hf-home")), "COLUMNS": "200",
                # one thread per process: the tiny models gain nothing from more, and threads
                # oversubscribed on a shared 2-core machine make every op wait
                "OMP_NUM_THREADS": "1"})
    return env


@pytest.fixture
def mimo(base_env, tmp_path):
    """Run the installed `mimo-tts` in `tmp_path`: mimo(*args, input=bytes, env={...})."""
    assert ENTRY_POINT.is_file(), f"console script not installed at {ENTRY_POINT}"

    def run(*args, input: bytes | str | None = None, env: dict | None = None, cwd=None,
            timeout: float = 300) -> subprocess.CompletedProcess:
        if isinstance(input, str):
            input = input.encode("utf-8")
        return subprocess.run(
            [str(ENTRY_POINT), *map(str, args)], input=input if input is not None else b"",
            capture_output=True, cwd=cwd or tmp_path, env={**base_env, **(env or {})},
            timeout=timeout,
        )

    return run


@pytest.fixture
def one_thread():
    """One torch intra-op thread for the test, restored after: small models on a shared
    2-core machine gain nothing from more, and oversubscribed threads make every op wait.
    A folder of small-model tests uses it autouse from its conftest (tests/lm, tests/vllm)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def invoke(base_env, tmp_path, monkeypatch, one_thread):
    """Run the Typer app in-process (CliRunner) with the session env, cwd = tmp_path."""
    from typer.testing import CliRunner

    from mimo_tts.cli.app import app

    for key in SCRUBBED:
        monkeypatch.delenv(key, raising=False)
    for key in ("MIMO_TTS_CACHE", "NO_COLOR", "HF_HUB_OFFLINE", "HF_HOME"):
        monkeypatch.setenv(key, base_env[key])
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()

    def run(*args, input=None, env=None):
        return runner.invoke(app, [str(a) for a in args], input=input, env=env,
                             catch_exceptions=False)

    return run


@pytest.fixture(scope="session")
def manifest():
    """manifest(task_dir) -> the parsed lines of results.jsonl (tests/helpers.py)."""
    return read_manifest


@pytest.fixture(scope="session")
def entry_point() -> Path:
    return ENTRY_POINT


# --- CI: an installed extra must not skip its tests ----------------------------------------------

# MIMO_TTS_REQUIRE_EXTRAS=serve,wyoming,book,vllm,ray (.ci/run*) names the extras the venv
# installed; a skip in their folders then means a broken install, and is reported as a failure.
EXTRA_FOLDERS = {"serve": "server", "wyoming": "wyoming", "book": "book", "vllm": "vllm",
                 "ray": "ray"}
REQUIRED = pytest.StashKey[tuple[Path, ...]]()


def pytest_configure(config):
    # A job started in the background (`bash .ci/run &`, nohup) inherits SIGINT ignored, and
    # an ignored signal stays ignored across exec: the Ctrl-C tests' children would never see
    # it. Python's own handler here gives every child the default disposition.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    names = {n.strip() for n in os.environ.get("MIMO_TTS_REQUIRE_EXTRAS", "").split(",")} - {""}
    if unknown := names - set(EXTRA_FOLDERS):
        raise pytest.UsageError(f"MIMO_TTS_REQUIRE_EXTRAS: unknown extra(s) {sorted(unknown)}; "
                                f"known: {', '.join(EXTRA_FOLDERS)}")
    config.stash[REQUIRED] = tuple(Path(__file__).parent / EXTRA_FOLDERS[n] for n in names)


def _fail_a_required_skip(config, report, path: Path) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and any(
            path.is_relative_to(folder) for folder in config.stash[REQUIRED]):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped, but MIMO_TTS_REQUIRE_EXTRAS requires it to run: {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module that skips itself at import (importorskip) in a required folder fails."""
    report = yield
    _fail_a_required_skip(collector.config, report, Path(collector.path))
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that skips (a marker or pytest.skip) in a required folder fails."""
    report = yield
    _fail_a_required_skip(item.config, report, Path(item.path))
    return report
