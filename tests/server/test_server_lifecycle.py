"""`mimo-tts serve` as a process: its serving line and what clients see of a checkpoint path.

A real server (tiny preset) on 127.0.0.1, started by path with a key.
"""

from __future__ import annotations

import pytest

from mimo_tts.presets import ensure_tiny_preset
from mimo_tts.runtime.paths import CACHE_ENV

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

KEY = "lifecycle-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def preset(tiny_cache):
    return ensure_tiny_preset({CACHE_ENV: str(tiny_cache)})


@pytest.fixture(scope="module")
def by_path(start_server, preset):
    """Started from the preset's directories, with a key."""
    lm, tokenizer = preset
    return start_server("--model", lm, "--tokenizer", tokenizer, env={"MIMO_TTS_API_KEY": KEY})


def test_the_serving_line_names_the_path_and_the_key(by_path, preset):
    """Before: the line did not say whether /v1 needs a key."""
    line = by_path.stderr().splitlines()[0]
    port = int(by_path.rsplit(":", 1)[1])
    assert f"on http://127.0.0.1:{port} (API key required on /v1;" in line
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
