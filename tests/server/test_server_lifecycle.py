"""`mimo-tts serve` as a process: its serving line, what clients see of a checkpoint path,
clients that go away or stop reading, and the stop on SIGHUP and SIGTERM.

Real servers (tiny preset) on 127.0.0.1, started by path on `--port 0` with a key, and one with
a single request place; every wait is bounded in count and time.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import time

import pytest

from mimo_tts.presets import ensure_tiny_preset
from mimo_tts.runtime.paths import CACHE_ENV
from mimo_tts.server.lifecycle import SHUTDOWN_GRACE_S

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

KEY = "lifecycle-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
STOP_BOUND_S = SHUTDOWN_GRACE_S + 25  # the grace, the engine's stop, a busy machine
DEADLINE_S = 20  # --timeout of the stalling server
FILL_S = 8  # a stalled response fills the loopback buffers (about 3 MB) well before this
# 40 text pieces: about 6 MB of PCM, twice what the socket buffers take
LONG = " ".join(f"Sentence {i} is long enough to fill most of a piece of its own, "
                f"{'and it goes on ' * 14}until it ends." for i in range(40))


@pytest.fixture(scope="module")
def preset(tiny_cache):
    return ensure_tiny_preset({CACHE_ENV: str(tiny_cache)})


@pytest.fixture(scope="module")
def by_path(start_server, preset):
    """Started from the preset's directories, on a port of the kernel's choice, with a key."""
    lm, tokenizer = preset
    return start_server("--model", lm, "--tokenizer", tokenizer, port=0,
                        env={"MIMO_TTS_API_KEY": KEY})


@pytest.fixture(scope="module")
def stalling(start_server):
    return start_server("--max-concurrent", 1, "--max-input-chars", 20000, "--timeout",
                        DEADLINE_S)


def health(url) -> dict:
    return httpx.get(url + "/health", timeout=30).json()


def wait_for(check, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@contextlib.contextmanager
def stalled_request(url):
    """A long pcm request from a client that never reads its answer (a small receive window),
    yielded once the server has started it; the connection closes at the end."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "input": LONG, "response_format": "pcm"}).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(30)
        sock.connect((host, int(port)))
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_for(lambda: health(url)["active"] == 1)
        yield sock


def test_the_serving_line_names_the_real_port_the_path_and_the_key(by_path, preset):
    """Before: `--port 0` printed port 0, and the line did not say whether /v1 needs a key."""
    line = by_path.stderr().splitlines()[0]
    port = int(by_path.rsplit(":", 1)[1])
    assert port > 0 and \
        f"on http://127.0.0.1:{port} (API key required on /v1 and /metrics;" in line
    assert line.startswith(f"serving lm (from {preset[0]}) on ")  # the path: log only


def test_clients_see_the_models_name_never_its_path(by_path, tiny_cache):
    """Before: /health, the /v1/models id and the 404 message held the absolute path."""
    state = httpx.get(by_path + "/health", timeout=30)
    models = httpx.get(by_path + "/v1/models", headers=AUTH, timeout=30)
    missing = httpx.post(by_path + "/v1/audio/speech", headers=AUTH, timeout=30,
                         json={"model": "other", "input": "Hi."})
    assert state.json()["model"] == "lm" and models.json()["data"][0]["id"] == "lm"
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "model 'other' is not served; use 'lm'"
    for response in (state, models, missing):
        assert str(tiny_cache) not in response.text and "/" not in response.json().get(
            "model", "")
    ok = httpx.post(by_path + "/v1/audio/speech", headers=AUTH, timeout=120,
                    json={"model": "lm", "input": "Hi.", "response_format": "flac"})
    assert ok.status_code == 200


def test_a_client_gone_during_the_upload_leaves_no_traceback(by_path):
    """Before: starlette's ClientDisconnect was logged with a traceback."""
    host, port = by_path.removeprefix("http://").split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nAuthorization: "
                         b"Bearer " + KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n{\"model\": \"lm\", \"in")
            time.sleep(0.3)
    time.sleep(1)  # the server sees the disconnects
    assert health(by_path)["status"] == "ok"
    assert "Traceback" not in by_path.stderr() and "ERROR" not in by_path.stderr()


def test_sighup_stops_it_with_one_line(by_path):
    """Before: SIGHUP raised KeyboardInterrupt inside the event loop: two tracebacks."""
    assert by_path.stop(signal.SIGHUP, timeout=STOP_BOUND_S) == 0
    lines = by_path.stderr().splitlines()
    assert lines[0].startswith("serving lm ") and lines[-1] == "server stopped (SIGHUP)"
    assert "Traceback" not in by_path.stderr()


def test_a_client_that_stops_reading_loses_its_place_at_the_deadline(stalling):
    """Before: its send waited forever, so with one place every later request got 504."""
    failed = health(stalling)["requests"]["failed"]
    with stalled_request(stalling):
        time.sleep(FILL_S)
        response = httpx.post(stalling + "/v1/audio/speech", timeout=120, json={
            "model": "tiny", "input": "Hello.", "response_format": "flac"})
        assert response.status_code == 200, response.text
    assert health(stalling)["requests"]["failed"] == failed + 1
    assert re.search(r"speech-\d+: the client stopped reading; closed at --timeout \(20 s\)",
                     stalling.stderr())


def test_sigterm_with_a_stalled_client_stops_within_the_grace(stalling):
    """Before: uvicorn waited for the stalled response without end."""
    with stalled_request(stalling):
        time.sleep(FILL_S)
        assert stalling.stop(signal.SIGTERM, timeout=STOP_BOUND_S) == 0
    lines = stalling.stderr().splitlines()
    assert lines[-1] == "server stopped (SIGTERM)"
    assert "Traceback" not in stalling.stderr() and "ERROR" not in stalling.stderr()
