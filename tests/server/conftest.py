"""Server test fixtures: a real `mimo-tts serve` process on 127.0.0.1 (tiny preset) per module.

`start_server(*args, env=...)` runs the installed entry point on a free port, waits for
`/health` and returns its base URL; the process is stopped with SIGTERM at the module's end
(and must exit 0). The modules skip without the serve extra or httpx; CI installs both and
sets MIMO_TTS_REQUIRE_EXTRAS=serve, which makes such a skip a failure (tests/conftest.py).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import pytest

START_TIMEOUT_S = 180  # torch import and the tiny preset's load on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def start_server(base_env, entry_point, tmp_path_factory):
    """start_server(*args, env={...}) -> "http://127.0.0.1:PORT" of a running server."""
    import httpx

    procs = []

    def start(*args, env: dict | None = None) -> str:
        port = free_port()
        log = tmp_path_factory.mktemp("serve") / "stderr.log"
        with open(log, "wb") as handle:
            proc = subprocess.Popen([str(entry_point), "serve", "--model", "tiny", "--port",
                                     str(port), *map(str, args)], env={**base_env, **(env or {})},
                                    stdout=subprocess.DEVNULL, stderr=handle)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"server exited {proc.returncode}: {log.read_text()}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return url
            except httpx.TransportError:
                time.sleep(0.3)
        pytest.fail(f"server did not answer /health in {START_TIMEOUT_S} s: {log.read_text()}")

    yield start
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, "the server did not shut down cleanly on SIGTERM"
