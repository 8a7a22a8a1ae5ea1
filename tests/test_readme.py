"""Every README snippet runs: its fenced python and shell blocks, in order, on the tiny preset
on the CPU, in one folder. A block that cannot run here (a GPU, the network, a real checkpoint,
a server left running) carries `<!-- not run: REASON -->` on the line before its fence; the
test lists those and checks each says why. Nothing in a block is rewritten: what a reader
brings is provided as files (the recordings `me.wav` and `narrator.wav`, `novel.epub`,
`lines.txt`, `batch.jsonl` as the README shows it, `chapters/*.txt`, `smoke.txt`), and the
environment points the voice store, profiles and caches into the test's folders.

The Ray snippet runs where Ray is importable (`.ci/run-ray`'s venv) and skips otherwise.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.book.books import write_epub
from tests.helpers import REPO

README = REPO / "README.md"
SHELLS = {"bash", "sh", "shell"}
NOT_RUN = re.compile(r"^<!-- not run: (?P<reason>.*\S) -->$")
BATCH_LINE = '{"id": "item", "text": "Read me aloud.", "seed": 7}'


@dataclass(frozen=True)
class Block:
    line: int  # the fence's line, 1-based
    lang: str
    code: str
    reason: str | None  # why it is not run; None: it runs

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.lang or 'text'})"


def read_blocks(text: str) -> list[Block]:
    """The fenced blocks of `text`, each with the not-run reason on the line before it."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, lang = i, lines[i][3:].strip()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            mark = NOT_RUN.match(lines[i - 1].strip()) if i else None
            blocks.append(Block(start + 1, lang, "\n".join(lines[start + 1:end]) + "\n",
                                mark["reason"] if mark else None))
            i = end
        i += 1
    return blocks


BLOCKS = read_blocks(README.read_text(encoding="utf-8"))
RUNS = [b for b in BLOCKS if b.reason is None and b.lang in SHELLS | {"python"}]
RAY = [b for b in RUNS if b.lang == "python" and "import ray" in b.code]
PYTHON = [b for b in RUNS if b.lang == "python" and b not in RAY]
SHELL = [b for b in RUNS if b.lang in SHELLS]


def test_each_snippet_not_run_says_why():
    """The blocks left out are listed, each with a reason; a mark sits only before a runnable
    block's fence (a stray one would silently mark nothing)."""
    marked = [b for b in BLOCKS if b.reason is not None]
    print("\n".join(f"not run: {b}: {b.reason}" for b in marked))
    assert marked, "no block is marked: the README's server and GPU examples cannot run here"
    for block in marked:
        assert block.lang in SHELLS | {"python"}, f"{block}: only code blocks are run or marked"
        assert len(block.reason.split()) >= 2, f"{block}: say why it is not run"
    fences = {b.line - 1 for b in marked}
    text = README.read_text(encoding="utf-8").splitlines()
    strays = [n + 1 for n, line in enumerate(text)
              if line.lstrip().startswith("<!--") and "not run" in line and n + 1 not in fences]
    assert not strays, f"not-run marks not right before a fence: README.md lines {strays}"
    assert PYTHON and SHELL and RAY


@pytest.fixture(scope="module")
def folder(tmp_path_factory, base_env):
    """One folder for every snippet, with the files a reader brings, and its environment."""
    import soundfile as sf

    root = tmp_path_factory.mktemp("readme")
    rng = np.random.default_rng(0)
    for name in ("me.wav", "narrator.wav"):
        sf.write(str(root / name), (0.1 * rng.standard_normal(24000)).astype("float32"), 24000)
    write_epub(root / "novel.epub")
    (root / "chapters").mkdir()
    (root / "chapters" / "one.txt").write_text("The first chapter.\n", encoding="utf-8")
    (root / "lines.txt").write_text("The first line.\nThe second line.\n", encoding="utf-8")
    (root / "batch.jsonl").write_text(BATCH_LINE + "\n", encoding="utf-8")
    (root / "smoke.txt").write_text("A smoke test.\n", encoding="utf-8")
    env = {**base_env, "MIMO_TTS_VOICES_DIR": str(root / "voices"),
           "MIMO_TTS_CONFIG_DIR": str(root / "config"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{base_env.get('PATH', '')}"}
    return root, env


@pytest.fixture
def in_folder(folder, monkeypatch, one_thread):
    """cwd and os.environ as the shell snippets get them, for snippets run in this process."""
    root, env = folder
    monkeypatch.chdir(root)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return root


def test_the_batch_input_is_the_one_the_readme_shows():
    assert f"`{BATCH_LINE}`" in README.read_text(encoding="utf-8")


def test_the_python_snippets_run(in_folder):
    """The library's examples, in order in one namespace (the second uses the first's `tts`)."""
    namespace: dict = {"__name__": "__readme__"}
    for block in PYTHON:
        exec(compile(block.code, str(block), "exec"), namespace)  # noqa: S102
    assert (in_folder / "hello.flac").stat().st_size > 0


@pytest.mark.slow
def test_the_shell_snippets_run(folder):
    """Each shell block, in order, under `bash -e -o pipefail`: every command exits 0."""
    root, env = folder
    for block in SHELL:
        done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code], cwd=root,
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{block} exit {done.returncode}:\n{done.stderr[-3000:]}"
    assert (root / "item.wav").stat().st_size > 0  # decoded from the batch's saved codes
    assert (root / "novel" / "book.json").is_file()


def test_the_ray_snippet_runs(in_folder):
    """The Ray Data example, on a local Ray instance; skipped where Ray is not installed, unless
    MIMO_TTS_REQUIRE_EXTRAS names ray (.ci/run-ray: there a missing Ray is a broken install)."""
    if "ray" in os.environ.get("MIMO_TTS_REQUIRE_EXTRAS", "").split(","):
        import ray
    else:
        ray = pytest.importorskip("ray", reason="Ray is not installed here (pip install '.[ray]')")
    namespace: dict = {"__name__": "__readme__"}
    try:
        for block in RAY:
            exec(compile(block.code, str(block), "exec"), namespace)  # noqa: S102
    finally:
        ray.shutdown()
    assert sorted(p.suffix for p in (in_folder / "out-ray" / "tts_sft").glob("*.wav")) == [
        ".wav", ".wav"]  # lines.txt's two lines
