"""Wyoming test fixtures: a real `mimo-tts wyoming` process on 127.0.0.1 (tiny preset).

`start_wyoming(*args, env=...)` runs the installed entry point on a port the kernel picks
(`--port 0`, read back from the serving line) and returns a `Served` whose str is
"127.0.0.1:PORT"; at the module's end each one still running is stopped with SIGTERM and must
exit 0. The modules skip without the `wyoming` package (CI: MIMO_TTS_REQUIRE_EXTRAS=wyoming
makes that a failure)."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from tests.server.conftest import STOP_TIMEOUT_S, Served

START_TIMEOUT_S = 180
SERVING = re.compile(r"^serving \S+ over Wyoming on tcp://(127\.0\.0\.1:\d+) ", re.MULTILINE)


@pytest.fixture(scope="module")
def start_wyoming(base_env, entry_point, tmp_path_factory):
    served: list[Served] = []

    def start(*args, env: dict | None = None) -> Served:
        log = tmp_path_factory.mktemp("wyoming") / "stderr.log"
        with open(log, "wb") as handle:
            where = [] if "--uri" in args else ["--port", "0"]
            proc = subprocess.Popen([str(entry_point), "wyoming", "--model", "tiny", *where,
                                     *map(str, args)], env={**base_env, **(env or {})},
                                    stdout=subprocess.DEVNULL, stderr=handle)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"wyoming exited {proc.returncode}: {log.read_text()}")
            if bound := SERVING.search(log.read_text(errors="replace")):
                served.append(Served(bound.group(1), proc, log))
                return served[-1]
            time.sleep(0.3)
        proc.kill()
        pytest.fail(f"wyoming did not start in {START_TIMEOUT_S} s: {log.read_text()}")

    yield start
    codes = []
    for server in served:
        try:
            codes.append(0 if server.stopped else server.stop())
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(timeout=STOP_TIMEOUT_S)
            codes.append(None)
    assert all(code == 0 for code in codes), "wyoming did not shut down cleanly on SIGTERM"
