"""`mimo-tts serve`'s request log, read from the server's stderr: one line per request (method,
path, status, voice, characters, audio seconds, time to first audio, total), never the text or
the key; uvicorn's access log off; `-q` silences it."""

from __future__ import annotations

import re
import time

import pytest

from tests.server.conftest import free_port

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

KEY = "k3y-never-logged"
TEXT = "Zebra quartz sentence."  # 22 characters, words no other line holds
AUTH = {"Authorization": f"Bearer {KEY}"}
SPEECH = re.compile(r"^POST /v1/audio/speech 200 voice=(\S+) chars=(\d+) audio=([\d.]+)s "
                    r"first=([\d.]+)s total=([\d.]+)s$")


def request_lines(served, before: int, count: int, timeout: float = 30) -> list[str]:
    """The server's log lines after its first `before`, once there are `count` of them (a
    request's line is written when its response has ended, just after the client has it).
    A start-up /health poll's line may come after `before` was read: those lead and are
    dropped (the test's own requests begin with a POST)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = served.stderr().splitlines()[before:]
        while lines and lines[0].startswith("GET /health "):
            lines.pop(0)
        if len(lines) >= count or time.monotonic() > deadline:
            return lines


@pytest.fixture(scope="module")
def logged(start_server):
    return start_server("--max-new-groups", "4", env={"MIMO_TTS_API_KEY": KEY})


def test_one_line_per_request_without_text_or_key(logged):
    before = logged.stderr().splitlines()
    assert before[0].startswith("serving tiny ") and all(  # start-up's own /health polls
        re.fullmatch(r"GET /health 200 total=[\d.]+s", line) for line in before[1:])
    with httpx.Client(base_url=logged, timeout=120) as client:
        whole = client.post("/v1/audio/speech", headers=AUTH, json={
            "model": "tiny", "input": TEXT, "response_format": "flac", "voice": "alloy"})
        streamed = client.post("/v1/audio/speech", headers=AUTH, json={
            "model": "tiny", "input": TEXT, "response_format": "pcm"})
        refused = client.post("/v1/audio/speech", json={"model": "tiny", "input": TEXT})
        health = client.get("/health")
    assert (whole.status_code, streamed.status_code, refused.status_code,
            health.status_code) == (200, 200, 401, 200)
    lines = request_lines(logged, len(before), 4)
    assert len(lines) == 4, lines
    for line, voice, samples in ((lines[0], "alloy", None), (lines[1], "default",
                                                              len(streamed.content) // 2)):
        voice_, chars, audio, first, total = SPEECH.match(line).groups()
        assert (voice_, int(chars)) == (voice, len(TEXT))
        assert float(audio) > 0 and 0 <= float(first) <= float(total)
        if samples is not None:  # the pcm body's own length, to the hundredth of a second
            assert float(audio) == pytest.approx(samples / 24000, abs=0.006)
    assert re.fullmatch(r"POST /v1/audio/speech 401 total=[\d.]+s", lines[2])
    assert re.fullmatch(r"GET /health 200 total=[\d.]+s", lines[3])
    log = logged.stderr()
    for secret in (KEY, "Zebra", "quartz", "Bearer"):
        assert secret not in log
    assert "HTTP/1.1" not in log  # uvicorn's access log is off


def test_quiet_silences_the_request_log(start_server):
    quiet = start_server("-q", "--max-new-groups", "2", port=free_port())
    with httpx.Client(base_url=quiet, timeout=120) as client:
        assert client.post("/v1/audio/speech", json={
            "model": "tiny", "input": TEXT, "response_format": "wav"}).status_code == 200
        assert client.get("/health").status_code == 200
    time.sleep(1)
    assert quiet.stderr() == ""
