"""`mimo-tts serve` without `--api-key` against what other web pages send (issue 32 item 15):
a Host that is not one of the server's names (DNS rebinding), a write from another origin
(`Origin`, `Sec-Fetch-Site`) and a body of a type its route does not take are refused before
any route runs; the same requests from the server's own page and from plain clients pass.
`tests/clients/test_cross_origin_browser.py` does it in a real browser."""

from __future__ import annotations

import pytest

from mimo_tts.server.guard import Guard, host_name
from mimo_tts.server.protocol import ServeConfig

JSON = {"Content-Type": "application/json"}
BODY = b'{"model": "tiny", "input": "Hi.", "response_format": "wav"}'
SPEECH = {"/v1/audio/speech": "application/json"}


def refused(guard: Guard, method: str = "POST", path: str = "/v1/audio/speech", **headers):
    error = guard.refusal(method, path, {k.replace("_", "-"): v for k, v in headers.items()})
    return None if error is None else (error.status, error.code)


def test_host_names_are_read_as_a_browser_sends_them():
    assert [host_name(h) for h in ("LocalHost:8000", "[::1]:8000", "127.0.0.1", "tts.lan.",
                                   "[0:0::1]", "::1")] == \
        ["localhost", "::1", "127.0.0.1", "tts.lan", "::1", "::1"]


def test_only_the_servers_own_names_are_answered():
    guard = Guard(ServeConfig(allowed_hosts=("tts.lan",)), SPEECH)
    for host in ("localhost:8000", "127.0.0.1:8000", "[::1]:8000", "tts.lan", "TTS.LAN:1"):
        assert refused(guard, "GET", "/", host=host) is None, host
    for host in ("attacker.test:8000", "127.0.0.1.nip.io", "10.0.0.5:8000", "localhost.evil"):
        assert refused(guard, "GET", "/health", host=host) == (403, "host_not_allowed"), host
    assert refused(guard, "GET", "/health") is None  # no Host: not a browser
    lan = Guard(ServeConfig(host="192.168.1.9"), SPEECH)
    assert refused(lan, "GET", "/", host="192.168.1.9:8000") is None
    every = Guard(ServeConfig(host="0.0.0.0"), SPEECH)  # any address, no name
    assert refused(every, "GET", "/", host="10.0.0.5:8000") is None
    assert refused(every, "GET", "/", host="[fe80::1]:8000") is None
    assert refused(every, "GET", "/", host="myhost:8000") == (403, "host_not_allowed")


def test_writes_from_another_origin_and_bodies_of_another_type_are_refused():
    guard = Guard(ServeConfig(), SPEECH)
    here = {"host": "127.0.0.1:8000", "content_type": "application/json"}
    assert refused(guard, origin="http://127.0.0.1:8000", sec_fetch_site="same-origin",
                   **here) is None
    assert refused(guard, sec_fetch_site="none", **here) is None
    for other in ({"origin": "http://attacker.test"}, {"origin": "null"},
                  {"origin": "http://127.0.0.1:9000"},  # same site, another origin
                  {"sec_fetch_site": "cross-site"}, {"sec_fetch_site": "same-site"}):
        assert refused(guard, **here, **other) == (403, "cross_origin"), other
        assert refused(guard, "DELETE", "/v1/audio/voices/me", **here, **other) == \
            (403, "cross_origin")
        assert refused(guard, "GET", "/v1/models", **here, **other) is None  # unread
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None):
        headers = {"host": "127.0.0.1:8000"} | ({} if kind is None else {"content_type": kind})
        assert refused(guard, **headers) == (415, "unsupported_media_type"), kind
    assert refused(guard, host="127.0.0.1", content_type="Application/JSON; charset=utf-8") \
        is None


@pytest.fixture(scope="module")
def url(start_server):
    pytest.importorskip("fastapi")
    return start_server("--allowed-host", "tts.lan")


def test_a_real_server_refuses_them_with_json_errors(url):
    httpx = pytest.importorskip("httpx")
    post = lambda **headers: httpx.post(url + "/v1/audio/speech", content=BODY,  # noqa: E731
                                        headers=headers, timeout=120)
    for response, status, code in (
            (httpx.get(url + "/v1/models", headers={"Host": "attacker.test"}), 403,
             "host_not_allowed"),
            (post(**JSON, Origin="http://attacker.test"), 403, "cross_origin"),
            (post(**JSON, **{"Sec-Fetch-Site": "cross-site"}), 403, "cross_origin"),
            (post(**{"Content-Type": "text/plain"}), 415, "unsupported_media_type"),
            (httpx.post(url + "/v1/audio/voices", data={"name": "x"},
                        headers={"Origin": "http://attacker.test"}), 403, "cross_origin")):
        assert response.status_code == status, response.text
        assert response.json()["error"]["code"] == code
    message = httpx.get(url + "/health", headers={"Host": "attacker.test"}).json()
    assert "'attacker.test' is not a name of this server" in message["error"]["message"]
    assert "--allowed-host" in message["error"]["message"]
    assert httpx.get(url + "/docs", headers={"Host": "attacker.test"}).status_code == 403
    ok = post(**JSON, Origin=url, **{"Sec-Fetch-Site": "same-origin"})
    assert ok.status_code == 200 and ok.content[:4] == b"RIFF"
    assert post(**JSON, Host="tts.lan:8000").status_code == 200  # --allowed-host
    assert httpx.get(url + "/health").json()["requests"]["ok"] == 2
