"""`/v1/audio/voices` and captions on a real `mimo-tts serve` process (127.0.0.1, tiny)."""

from __future__ import annotations

import io
import json
import re
import subprocess

import httpx
import numpy as np
import pytest
import soundfile as sf

KEY = "sk-test-voices-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
FIVE = ("The first sentence is short. A second one follows it. Then a third, with a comma. "
        "The fourth asks why? And the fifth ends it!")


def _wav(seconds: float, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    sf.write(buffer, (0.1 * rng.standard_normal(int(16000 * seconds))).astype("float32"), 16000,
             format="WAV")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def served(start_server, tmp_path_factory, entry_point, base_env):
    root = tmp_path_factory.mktemp("voices-serve")
    (root / "me.wav").write_bytes(_wav(1.0))
    env = {"MIMO_TTS_VOICES_DIR": str(root / "store")}
    added = subprocess.run([str(entry_point), "voices", "add", "stored", str(root / "me.wav"),
                            "--model", "tiny"], env={**base_env, **env}, capture_output=True,
                           timeout=300)  # a registry voice before the server starts
    assert added.returncode == 0, added.stderr
    server = start_server("--api-key", KEY, "--voice", f"startup={root / 'me.wav'}", env=env)
    return server, root


def test_every_face_lists_the_same_voices(served):
    """Issue 32 item 8: the start-up line and the page left the registry's voices out, which
    /v1/audio/voices listed; now all three show `served_voices`, and an upload shows up on
    the page and the API alike."""
    server, root = served
    url = str(server)
    line = next(x for x in server.stderr().splitlines() if x.startswith("serving "))
    assert line.endswith("; voices default, natural, startup, stored)"), line
    files = {"file": ("x.wav", _wav(1.0, seed=3), "audio/wav")}
    added = httpx.post(url + "/v1/audio/voices", data={"name": "later"}, files=files,
                       headers=AUTH, timeout=60)
    assert added.status_code == 201, added.text
    listed = httpx.get(url + "/v1/audio/voices", headers=AUTH, timeout=10).json()
    page = re.search(r'<script id="config" type="application/json">(.*?)</script>',
                     httpx.get(url + "/", timeout=10).text, re.S)
    assert listed["voices"] == json.loads(page.group(1))["voices"] == \
        ["default", "natural", "startup", "later", "stored"]
    assert [d["kind"] for d in listed["data"]] == \
        ["builtin", "builtin", "startup", "registry", "registry"]
    assert httpx.delete(url + "/v1/audio/voices/later", headers=AUTH).status_code == 200


def _speech(url: str, voice: str, **extra) -> httpx.Response:
    body = {"model": "mimo-tts", "input": "Say it twice.", "voice": voice, "seed": 5,
            "response_format": "flac", **extra}
    return httpx.post(url + "/v1/audio/speech", json=body, headers=AUTH, timeout=120)


def test_upload_list_use_delete(served):
    server, root = served
    url = str(server)
    files = {"file": ("me.wav", _wav(1.0), "audio/wav")}
    assert httpx.post(url + "/v1/audio/voices", data={"name": "me"}, files=files,
                      timeout=60).status_code == 401
    added = httpx.post(url + "/v1/audio/voices", data={"name": "me", "transcript": "noise"},
                       files=files, headers=AUTH, timeout=60)
    assert added.status_code == 201, added.text
    assert added.json()["source"]["path"] == "upload:me.wav"
    assert set(added.json()["tokenizer"]) == {"id", "name"}  # issue 32 item 18: no path
    assert str(root) not in added.text and '"/' not in added.text
    assert (root / "store" / "me.json").is_file()
    clash = httpx.post(url + "/v1/audio/voices", data={"name": "me"}, files=files,
                       headers=AUTH, timeout=60)
    assert clash.status_code == 400 and "already exists" in clash.json()["error"]["message"]
    listed = httpx.get(url + "/v1/audio/voices", headers=AUTH, timeout=10).json()
    assert listed["voices"] == ["default", "natural", "startup", "me", "stored"]
    by_registry, by_file = _speech(url, "me"), _speech(url, "startup")
    assert by_registry.status_code == 200 and by_file.status_code == 200
    assert by_registry.content == by_file.content  # the stored codes are the file's
    deleted = httpx.delete(url + "/v1/audio/voices/me", headers=AUTH, timeout=10)
    assert deleted.status_code == 200 and not (root / "store" / "me.json").exists()
    assert httpx.delete(url + "/v1/audio/voices/me", headers=AUTH, timeout=10).status_code == 404
    gone = _speech(url, "me")
    assert gone.status_code == 400 and "unknown voice" in gone.json()["error"]["message"]


def test_bad_uploads_are_refused_and_nothing_is_kept(served):
    server, root = served
    url = str(server)
    cases = [({"name": "bad"}, {"file": ("x.wav", b"RIFF\x00\x00", "audio/wav")}, 400),
             ({"name": "long"}, {"file": ("x.wav", _wav(61.0), "audio/wav")}, 400),
             ({"name": "../x"}, {"file": ("x.wav", _wav(0.5), "audio/wav")}, 400),
             ({"name": "big"}, {"file": ("x.wav", b"\0" * (17 << 20), "audio/wav")}, 413)]
    for data, files, status in cases:
        answer = httpx.post(url + "/v1/audio/voices", data=data, files=files, headers=AUTH,
                            timeout=60)
        assert answer.status_code == status, (data, answer.text)
        assert "error" in answer.json()
        assert "/tmp" not in answer.text and "mimo-voice-" not in answer.text  # no temp path
    assert [p.stem for p in (root / "store").glob("*.json")] == ["stored"]


def test_captions_on_request(served):
    server, _ = served
    answer = _speech(str(server), "default", input=FIVE, captions=True)
    assert answer.status_code == 200, answer.text
    cues = json.loads(answer.headers["X-MiMo-Captions"])
    frames = sf.info(io.BytesIO(answer.content)).frames
    assert [c["index"] for c in cues] == [1, 2, 3, 4, 5] and cues[-1]["end_sample"] == frames
    assert all(a["end"] < b["start"] for a, b in zip(cues, cues[1:], strict=False))
    refused = _speech(str(server), "default", captions=True, response_format="pcm")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "captions"
