"""What a command does with the stdout it was given: closed (`>&-`), a pipe or a terminal
(issue 22, B and C)."""

from __future__ import annotations

import os
import subprocess

import pytest

from mimo_tts.errors import EXIT_IO

CLOSED = "Error: cannot write to stdout: it is closed (started with >&-); redirect it to a " \
         "file or /dev/null instead\n"


@pytest.mark.parametrize("args", [
    ("synth", "--model", "tiny", "--text", "Hello.", "--max-new-groups", "2"),
    ("devices", "--model", "tiny"),
    ("devices", "--model", "tiny", "--json"),
    ("status", "out"),
    ("status", "out", "--json"),
], ids=" ".join)
def test_c_a_closed_stdout_is_the_io_error(base_env, entry_point, tmp_path, args):
    (tmp_path / "out" / "tts_sft").mkdir(parents=True)
    (tmp_path / "out" / "tts_sft" / "results.jsonl").write_text("")
    run = subprocess.run([str(entry_point), *args], cwd=tmp_path, env=base_env,
                         stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         preexec_fn=lambda: os.close(1), timeout=120)  # `>&-`
    assert (run.returncode, run.stderr.decode()) == (EXIT_IO, CLOSED)
    assert not (tmp_path / "output_audio").exists()  # synth stops before any work
