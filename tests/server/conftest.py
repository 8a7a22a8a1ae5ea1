"""Server test fixtures: a real `mimo-tts serve` process on 127.0.0.1 (tiny preset) per module.

`start_server(*args, env=..., port=...)` runs the installed entry point (on `port`; by default 0,
a port the server's kernel picks, read back from its serving line: no other process, such as
another test worker's server, can take it between the pick and the bind), waits for `/health` and
returns its base URL as a `Served` (a str that also holds the process and its stderr log). A
process still running at the module's end is stopped with SIGTERM and must exit 0; a test may
stop one itself (`Served.stop`). The modules skip without the serve extra or httpx; CI installs
both and sets MIMO_TTS_REQUIRE_EXTRAS=serve, which makes such a skip a failure (tests/conftest.py).
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

API_KEY_ENV = "MIMO_TTS_API_KEY"  # a key only where a module gives one
START_TIMEOUT_S = 180  # torch import and the tiny preset's load on a busy 2-core machine
STOP_TIMEOUT_S = 30
SERVING = re.compile(r"^serving \S+ .*on http://127\.0\.0\.1:(\d+) ", re.MULTILINE)


def free_port() -> int:
    """A port free now, for a server that says nothing (`-q`), so its port cannot be read back;
    another process may take it before the server binds (then the start fails: exit 5)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Served(str):
    """A running server's base URL, with its process and stderr log."""

    proc: subprocess.Popen
    log: Path
    stopped: bool  # by the test itself (`stop`)

    def __new__(cls, url: str, proc: subprocess.Popen, log: Path) -> Served:
        served = super().__new__(cls, url)
        served.proc, served.log, served.stopped = proc, log, False
        return served

    def stderr(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def stop(self, signum: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        """Send `signum` (unless it has exited) and wait; the exit code."""
        self.stopped = True
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        return self.proc.wait(timeout=timeout)


@pytest.fixture(scope="module")
def start_server(base_env, entry_point, tmp_path_factory):
    """start_server(*args, env={...}, port=0) -> "http://127.0.0.1:PORT" of a running
    server (a `Served`)."""
    import httpx

    served: list[Served] = []
    server_env = {k: v for k, v in base_env.items() if k != API_KEY_ENV}

    def start(*args, env: dict | None = None, port: int = 0) -> Served:
        log = tmp_path_factory.mktemp("serve") / "stderr.log"
        model = [] if "--model" in args else ["--model", "tiny"]
        with open(log, "wb") as handle:
            proc = subprocess.Popen([str(entry_point), "serve", *model, "--port", str(port),
                                     *map(str, args)], env={**server_env, **(env or {})},
                                    stdout=subprocess.DEVNULL, stderr=handle)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"server exited {proc.returncode}: {log.read_text()}")
            bound = SERVING.search(log.read_text(errors="replace"))
            url = f"http://127.0.0.1:{bound.group(1) if bound else port}"
            if port or bound:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        served.append(Served(url, proc, log))
                        return served[-1]
                except httpx.TransportError:
                    pass
            time.sleep(0.3)
        proc.kill()
        pytest.fail(f"server did not answer /health in {START_TIMEOUT_S} s: {log.read_text()}")

    yield start
    unclean = []
    for server in served:
        try:
            if not server.stopped and server.stop() != 0:
                unclean.append(server)
        except subprocess.TimeoutExpired:
            unclean.append(server)
        if server.proc.poll() is None:  # a stop that timed out (the test's own, or this one)
            server.proc.kill()
            server.proc.wait(timeout=STOP_TIMEOUT_S)
    assert not unclean, "the server did not shut down cleanly on SIGTERM"
