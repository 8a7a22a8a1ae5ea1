"""The page at `/` and FastAPI's `/docs` of `mimo-tts serve` (with an API key): both open,
shipped in the package, filled with this server's voices and formats. A real browser drives the
page in tests/clients/test_page_browser.py."""

from __future__ import annotations

import json
import re

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

KEY = "page-key"


@pytest.fixture(scope="module")
def url(start_server, tmp_path_factory):
    import numpy as np
    import soundfile as sf

    voice = tmp_path_factory.mktemp("voice") / "calm.wav"
    sf.write(voice, 0.2 * np.sin(np.arange(24000) / 9).astype(np.float32), 24000)
    return start_server("--voice", f"calm={voice}", env={"MIMO_TTS_API_KEY": KEY})


def page_config(html: str) -> dict:
    found = re.search(r'<script id="config" type="application/json">(.*?)</script>', html, re.S)
    return json.loads(found.group(1))


def test_the_page_is_open_and_lists_this_servers_voices_and_formats(url):
    response = httpx.get(url + "/")
    assert response.status_code == 200 and response.headers["content-type"].startswith(
        "text/html")
    config = page_config(response.text)
    assert config["voices"] == ["default", "natural", "calm"]
    assert {"pcm", "wav", "flac"} <= set(config["formats"]) and config["api_key"] is True
    assert config["model"] == "tiny" and config["sample_rate"] == 24000
    assert "http://" not in response.text and "https://" not in response.text  # no CDN
    assert KEY not in response.text


def test_docs_and_the_openapi_schema_describe_the_speech_body(url):
    docs = httpx.get(url + "/docs")
    assert docs.status_code == 200
    # Swagger UI from this server, not a CDN (issue 32 item 12; a browser without network in
    # tests/clients/test_docs_offline_browser.py)
    assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", docs.text)
    assert assets and all(a.startswith("/docs/assets/") for a in assets), assets
    for asset in assets:
        answer = httpx.get(url + asset)
        assert answer.status_code == 200 and len(answer.content) > 1000, asset
    schema = httpx.get(url + "/openapi.json").json()
    body = schema["paths"]["/v1/audio/speech"]["post"]["requestBody"]
    fields = body["content"]["application/json"]["schema"]["properties"]
    assert {"model", "input", "voice", "instructions", "response_format"} <= set(fields)
    assert "/" not in schema["paths"]  # the page is not an API route


def test_v1_still_needs_the_key(url):
    body = {"model": "tiny", "input": "Hi.", "response_format": "pcm"}
    assert httpx.post(url + "/v1/audio/speech", json=body).status_code == 401
