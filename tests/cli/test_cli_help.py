"""Issue 13 item 7: the help is readable. Every help string is shown as written (no text eaten
as rich markup), every option has a plain metavar, `-h` is `--help` on every command, and each
option with a fixed list of values shows the list (from its one source) and refuses any other
value with exit 2, naming them all."""

from __future__ import annotations

import re

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from mimo_tts.cli.app import app
from mimo_tts.errors import EXIT_USAGE
from mimo_tts.lm.config import LM_QUANTS
from mimo_tts.lm.tasks import TASKS
from mimo_tts.runtime.devices import DTYPES
from mimo_tts.synthesis.audio import FORMATS
from mimo_tts.synthesis.options import ENGINES, STREAM_MODES

GROUP = get_command(app)
COMMANDS = sorted(GROUP.commands)
BOX = str.maketrans("", "", "│╭╮╰╯─")


def _help(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.stdout


def _flat(text: str) -> str:
    """Help output as one line of words: panel borders gone, wrapped lines joined."""
    return " ".join(text.translate(BOX).split())


@pytest.mark.parametrize("command", COMMANDS)
def test_every_help_string_is_shown_as_written(command):
    shown = _flat(_help(command))
    for param in GROUP.commands[command].params:
        written = param.help.replace("\\[", "[")  # the one markup a help string may hold
        assert " ".join(written.split()) in shown, (command, param.name)
    if command in ("synth", "devices"):
        assert "pip install 'mimo-tts[vllm]'" in shown


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_metavars_are_plain_names(command):
    text = _help(*([command] if command else []))
    assert not re.search(r"<(bool|str|int|float|list\[\w+\])>", text), text
    (usage,) = [line for line in text.splitlines() if "Usage:" in line]
    assert "{" not in usage, usage  # `CODES...`, not `{codes}...`
    for param in GROUP.commands[command].params if command else []:
        if not getattr(param, "is_flag", False):
            assert param.metavar and re.fullmatch(r"[A-Z][A-Z_|./]*", param.metavar), param.name


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_dash_h_is_help_on_every_command(command):
    args = [command] if command else []
    short = CliRunner().invoke(app, [*args, "-h"], env={"COLUMNS": "200"})
    assert short.exit_code == 0 and short.stdout == _help(*args)


CHOICES = [
    (["synth", "--task"], tuple(TASKS)),
    (["synth", "--format"], tuple(FORMATS)),
    (["decode", "--format"], tuple(FORMATS)),
    (["synth", "--engine"], ENGINES),
    (["devices", "--engine"], ENGINES),
    (["synth", "--stream-mode"], STREAM_MODES),
    (["synth", "--lm-quant"], LM_QUANTS),
    (["synth", "--dtype"], DTYPES),
    (["synth", "--tokenizer-dtype"], DTYPES),
    (["devices", "--dtype"], DTYPES),
    (["decode", "--tokenizer-dtype"], DTYPES),
]


@pytest.mark.parametrize(("where", "choices"), CHOICES, ids=[" ".join(w) for w, _ in CHOICES])
def test_choices_are_listed_and_enforced(invoke, where, choices):
    command, option = where
    (param,) = [p for p in GROUP.commands[command].params if option in p.opts]
    for choice in choices:
        assert re.search(rf"(?<![\w-]){re.escape(choice)}(?![\w-])", param.help), (option, choice)
    tail = {"synth": ["--model", "tiny", "--text", "hi", "--dry-run"],
            "devices": ["--model", "tiny"], "decode": ["missing.codes.safetensors"]}[command]
    result = invoke(command, option, "bogus", *tail)
    assert result.exit_code == EXIT_USAGE, result.output
    assert all(choice in result.stderr for choice in choices), result.stderr


@pytest.mark.parametrize("args", [["--help"], ["synth", "--help"], ["decode", "-h"],
                                  ["--version"], []], ids=lambda a: " ".join(a) or "bare")
def test_help_into_a_closed_pipe_is_quiet(base_env, tmp_path, entry_point, args):
    """`mimo-tts --help | head -c 10`: the reader is gone before the help is written; the
    command ends quietly, exit 0, as `git --help | head` does (before: "Error: stdout was
    closed by the reader", exit 5; Typer and rich exited 1)."""
    import os
    import subprocess

    read, write = os.pipe()
    os.close(read)  # the reader has gone: every write to stdout fails with EPIPE
    try:
        proc = subprocess.run([str(entry_point), *args], stdout=write, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, env=base_env, cwd=tmp_path, timeout=60)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (0, b"")


def test_b_each_command_describes_its_own_json():
    """`--json` is per item for synth only: devices, status and selftest print one report."""
    words = {command: next(p.help for p in GROUP.commands[command].params if p.name == "as_json")
             for command in ("synth", "devices", "status", "selftest")}
    voices = GROUP.commands["voices"].commands
    for name in ("add", "list"):  # (before: synth's "One JSON object per item" on both)
        words[f"voices {name}"] = next(p.help for p in voices[name].params
                                       if p.name == "as_json")
    assert words["synth"] == "One JSON object per item on stdout."
    assert len(set(words.values())) == 6  # was: synth's words on all six
    assert "voice" in words["voices add"] and "voice" in words["voices list"]
    assert words["devices"].startswith("The preflight report as one JSON object")
    assert words["status"].startswith("The report as one JSON object")
    assert words["selftest"].startswith("The result as one JSON object")
