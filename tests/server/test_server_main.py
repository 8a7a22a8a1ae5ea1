"""`mimo-tts serve` start-up errors: one `Error:` line and the usage exit code, before loading."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mimo_tts.errors import EXIT_INPUT, EXIT_USAGE


def test_without_the_serve_extra_the_error_names_it(base_env):
    # the interpreter of the installed entry point, with fastapi made unimportable
    code = ("import sys; sys.modules['fastapi'] = None; sys.argv = ['mimo-tts', 'serve']; "
            "from mimo_tts.cli import main; main()")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=base_env, timeout=120)
    assert result.returncode == EXIT_USAGE
    assert result.stderr.strip() == \
        "Error: mimo-tts serve needs the serve extra: pip install 'mimo-tts[serve]'"


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--port", "70000"], EXIT_USAGE, "--port must be in [0, 65535]"),
    (["--batch-size", "0"], EXIT_USAGE, "--batch-size must be >= 1"),
    (["--timeout", "0"], EXIT_USAGE, "--timeout must be > 0 seconds"),
    (["--api-key", ""], EXIT_USAGE, "--api-key is empty"),
    (["--voice", "nobody"], EXIT_USAGE, "--voice takes NAME=PATH.wav, got 'nobody'"),
    (["--voice", "me=/no/such.wav"], EXIT_INPUT, "--voice me: prompt audio not found"),
    (["--voice", "default=x.wav"], EXIT_USAGE, "--voice default: the name is already taken"),
])
def test_bad_serve_options_exit_before_loading(mimo, args, code, message):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    result = mimo("serve", "--model", "tiny", *args, timeout=60)
    assert result.returncode == code
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0]
