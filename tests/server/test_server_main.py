"""`mimo-tts serve` start-up errors: one `Error:` line and the exit code, before serving.

Options, keys, voice files and the address are checked before the model loads (`--model` names
no checkpoint where that shows it: the check's exit code comes first, not 3); a voice prompt the
model refuses stops the start-up after the load, before anything is served.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from mimo_tts.errors import EXIT_INPUT, EXIT_IO, EXIT_USAGE

NO_MODEL = "/no/such/checkpoint"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_error_line(result) -> str:
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), lines
    return lines[0]


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
    (["--allowed-host", "http://tts.lan:8000"], EXIT_USAGE,
     "--allowed-host takes a host name or address (no scheme, port or path)"),
])
def test_bad_serve_options_exit_before_loading(mimo, args, code, message):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    result = mimo("serve", "--model", "tiny", *args, timeout=60)
    assert result.returncode == code
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0]


@pytest.mark.parametrize(("env", "args", "message"), [
    ({"MIMO_TTS_API_KEY": ""}, [], "MIMO_TTS_API_KEY is empty"),
    ({"MIMO_TTS_API_KEY": "  "}, [], "MIMO_TTS_API_KEY is only whitespace"),
    ({"MIMO_TTS_API_KEY": " key "}, [], "MIMO_TTS_API_KEY starts or ends with whitespace"),
    ({"MIMO_TTS_API_KEY": "kéy"}, [], "MIMO_TTS_API_KEY has non-ASCII character U+00E9"),
    ({}, ["--api-key", "k\x1by"], "--api-key has a control character U+001B"),
    ({}, ["--api-key", "key "], "--api-key starts or ends with whitespace"),
])
def test_keys_no_client_can_send_exit_2_before_loading(mimo, env, args, message):
    """Before: an empty MIMO_TTS_API_KEY served an open API (and the others a key that
    could never match)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    result = mimo("serve", "--model", NO_MODEL, *args, env=env, timeout=60)
    assert result.returncode == EXIT_USAGE
    assert message in one_error_line(result)


def test_a_taken_port_is_exit_5_before_loading(mimo):
    """Before: the model loaded, "serving on ..." was printed, then uvicorn exited 3."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for model in ("tiny", NO_MODEL):
            result = mimo("serve", "--model", model, "--port", port, timeout=120)
            assert result.returncode == EXIT_IO, result.stderr
            assert one_error_line(result) == \
                f"Error: cannot serve on http://127.0.0.1:{port}: Address already in use"
    result = mimo("serve", "--model", NO_MODEL, "--host", "no-such-host.invalid", timeout=60)
    assert result.returncode == EXIT_IO
    assert "cannot serve on http://no-such-host.invalid:8000" in one_error_line(result)


def test_voice_files_are_checked_before_serving(mimo, tmp_path):
    """Before: a directory or a FIFO was "not found", and the messages of a file the
    decoder or the codec refused did not name the voice."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    sf = pytest.importorskip("soundfile")
    (tmp_path / "folder.wav").mkdir()
    os.mkfifo(tmp_path / "pipe.wav")
    (tmp_path / "junk.wav").write_bytes(b"RIFF, but no audio")
    sf.write(str(tmp_path / "short.wav"), np.full(100, 0.1, dtype="float32"), 16000)
    for voice, model, words in (
            ("d=folder.wav", NO_MODEL, "--voice d: prompt audio folder.wav is a directory"),
            ("f=pipe.wav", NO_MODEL, "--voice f: prompt audio pipe.wav is a FIFO"),
            ("j=junk.wav", NO_MODEL, "--voice j: prompt audio junk.wav is unreadable"),
            ("s=short.wav", "tiny", "--voice s: prompt audio is 6.2 ms long")):
        result = mimo("serve", "--model", model, "--voice", voice, "--port", free_port(),
                      timeout=120)
        assert result.returncode == EXIT_INPUT, result.stderr
        line = one_error_line(result)
        assert words in line and voice.split("=")[1] in line


@pytest.mark.parametrize("face", ["serve", "wyoming"])
def test_a_startup_voice_named_like_a_stored_one_is_refused(mimo, tmp_path, face):
    """Issue 32 item 8: before, `--voice me=x.wav` beside a stored `me` was listed twice and
    won silently; now it is refused as `--voice default=...` is, before anything loads."""
    pytest.importorskip("fastapi" if face == "serve" else "wyoming")
    sf = pytest.importorskip("soundfile")
    sf.write(str(tmp_path / "me.wav"), np.full(16000, 0.1, dtype="float32"), 16000)
    env = {"MIMO_TTS_VOICES_DIR": str(tmp_path / "store")}
    added = mimo("voices", "add", "me", "me.wav", "--model", "tiny", env=env)
    assert added.returncode == 0, added.stderr
    result = mimo(face, "--model", NO_MODEL, "--voice", "me=me.wav", "--port", free_port(),
                  env=env, timeout=60)
    assert result.returncode == EXIT_USAGE, result.stderr
    assert one_error_line(result) == "Error: --voice me: the voice registry holds a voice of " \
        "that name; pick another name, or remove it (mimo-tts voices rm me)"


def test_wyoming_port_errors_name_a_tcp_address(mimo):
    """Issue 32 item 11: Wyoming's taken port said `cannot serve on http://...`."""
    pytest.importorskip("wyoming")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for where in (["--port", port], ["--uri", f"tcp://127.0.0.1:{port}"]):
            result = mimo("wyoming", "--model", NO_MODEL, *where, timeout=60)
            assert result.returncode == EXIT_IO, result.stderr
            assert one_error_line(result) == \
                f"Error: cannot serve on tcp://127.0.0.1:{port}: Address already in use"


@pytest.mark.parametrize(("args", "message"), [
    (["--uri", "unix:///run/tts.sock"], "--uri takes tcp://HOST:PORT, got 'unix:///run/tts.sock'"),
    (["--uri", "tcp://127.0.0.1:70000"], "--uri takes tcp://HOST:PORT"),
    (["--uri", "127.0.0.1:10200"], "--uri takes tcp://HOST:PORT"),
    (["--uri", "tcp://127.0.0.1:10200", "--port", "10300"],
     "--uri and --host/--port both say where to listen; give one"),
])
def test_bad_wyoming_uris_exit_2_before_loading(mimo, args, message):
    pytest.importorskip("wyoming")
    result = mimo("wyoming", "--model", NO_MODEL, *args, timeout=60)
    assert result.returncode == EXIT_USAGE, result.stderr
    assert message in one_error_line(result)
