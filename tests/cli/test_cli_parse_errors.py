"""Issue 13 root cause N: a command line the parser refuses ends with exit 2 and, when stderr is
not a terminal (CI logs, `2> log`, `| tail -1`), one `Error:` line naming the problem and the
help command; a terminal keeps Typer's boxed message."""

from __future__ import annotations

import re

import pytest

from mimo_tts.errors import EXIT_USAGE

CASES = [
    (["synth", "--bogus"], "No such option: --bogus"),
    (["synth", "--seed", "x"], "'--seed'"),
    (["synth", "--text"], "'--text' requires an argument"),
    (["synth", "--text", "hi", "extra"], "unexpected extra argument(s) (extra)"),
    (["bogus"], "No such command 'bogus'"),
    (["--nope"], "No such option: --nope"),
    (["decode"], "Missing argument 'CODES'"),
]


@pytest.mark.parametrize(("args", "needle"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_parse_error_is_one_error_line_off_a_terminal(mimo, args, needle):
    proc = mimo(*args)
    assert proc.returncode == EXIT_USAGE
    assert proc.stdout == b""
    lines = proc.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), lines
    assert needle in lines[0], lines[0]


def test_parse_error_in_process_is_one_line_too(invoke):
    result = invoke("synth", "--top-k", "many")
    assert result.exit_code == EXIT_USAGE
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: Invalid value for '--top-k'")
    assert line.endswith("; see mimo-tts synth --help"), line


def test_a_terminal_keeps_the_box(mimo):
    proc = mimo("synth", "--bogus", env={"FORCE_COLOR": "1"})  # rich: stderr is a terminal
    assert proc.returncode == EXIT_USAGE
    text = re.sub(r"\x1b\[[0-9;]*m", "", proc.stderr.decode())
    assert "No such option: --bogus" in text and "╭" in text and len(text.splitlines()) > 1
