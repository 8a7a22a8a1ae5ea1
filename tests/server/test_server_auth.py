"""`mimo-tts serve` with an API key (from the environment) and a short request timeout."""

from __future__ import annotations

import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def url(start_server):
    return start_server("--timeout", "0.05", env={"MIMO_TTS_API_KEY": KEY})


def test_v1_needs_the_bearer_token(url):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.get(url + "/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_api_key"
    response = httpx.post(url + "/v1/audio/speech", json={"model": "tiny", "input": "Hi."})
    assert response.status_code == 401
    ok = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny"


def test_health_stays_open(url):
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_a_request_past_the_timeout_gets_504_and_frees_its_slot(url):
    response = httpx.post(url + "/v1/audio/speech", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "tiny", "input": "Hello there.",
                                "response_format": "flac"}, timeout=60)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"
    assert "this server's timeout (0.05 s)" in response.json()["error"]["message"]
    deadline = time.monotonic() + 20
    while (state := httpx.get(url + "/health").json())["active"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert state["active"] == state["queued"] == 0 and state["requests"]["failed"] == 1


def test_with_a_key_the_key_decides_not_the_host_or_origin(url):
    """The guard of a server without a key (`server/guard.py`) is off: no page can send the
    key, and a proxy's or a LAN name's Host is answered."""
    auth = {"Authorization": f"Bearer {KEY}", "Host": "tts.lan", "Origin": "http://other.lan"}
    assert httpx.get(url + "/v1/models", headers=auth).status_code == 200
    assert httpx.get(url + "/health", headers={"Host": "tts.lan"}).status_code == 200
