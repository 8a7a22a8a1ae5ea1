"""What a command does with the stdout it was given: closed (`>&-`), a pipe or a terminal
(issue 22, B and C)."""

from __future__ import annotations

import json
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


def _on_a_terminal(entry_point, env, cwd, *args) -> tuple[int, str]:
    """Run with stdout on a pseudo-terminal -> (exit code, what the terminal showed)."""
    import pty

    main, child = pty.openpty()
    proc = subprocess.Popen([str(entry_point), *args], cwd=cwd, env={**env, "COLUMNS": "100"},
                            stdin=subprocess.DEVNULL, stdout=child, stderr=subprocess.PIPE)
    os.close(child)
    shown = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        shown += chunk
    os.close(main)
    proc.wait(timeout=120)
    return proc.returncode, shown.decode("utf-8", "replace")


def test_b_devices_on_a_terminal_is_a_short_table_and_json_elsewhere(base_env, entry_point,
                                                                      tmp_path):
    code, shown = _on_a_terminal(entry_point, base_env, tmp_path, "devices", "--model", "tiny")
    assert code == 0
    assert len(shown.splitlines()) < 30 and "{" not in shown  # was: 75 lines of JSON
    for label in ("LM device", "tokenizer dtype", "CUDA graphs", "model", "memory cpu",
                  "engine", "shard"):
        assert label in shown, label
    code, shown = _on_a_terminal(entry_point, base_env, tmp_path, "devices", "--model", "tiny",
                                 "--json")
    assert code == 0 and json.loads(shown)["placement"]["lm_device"]["value"] == "cpu"
    piped = subprocess.run([str(entry_point), "devices", "--model", "tiny"], cwd=tmp_path,
                           env=base_env, capture_output=True, timeout=120)
    assert piped.returncode == 0 and "placement" in json.loads(piped.stdout)
