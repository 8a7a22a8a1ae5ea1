"""Issue 32 items 18-20 on `/v1/audio/voices` (server/voices.py, in process): no server path
reaches a client (the tokenizer's and the recording's path in a record, the store folder, the
codes file, the upload's temp file in errors), errors name the form's fields, a broken or
read-only store is listed or a clear JSON error, and an upload of unknown length is measured
by decoding it. The real server's side is in `test_server_voices.py`."""

from __future__ import annotations

import io
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
import torch

from mimo_tts.server import voices
from mimo_tts.server.protocol import ApiError
from mimo_tts.synthesis.voices import VoiceStore, add_voice, tokenizer_record
from tests.synthesis.test_prompt_audio import unknown_length

TOKENIZER = Path("/srv/models/secret-place/tokenizer")


class FakeStage1:
    """What `add_voice` needs of Stage-1: codes for a prompt file (read as a real one is)."""

    def prompt_codes(self, path):
        from mimo_tts.synthesis.audio import read_audio

        audio, rate = read_audio(path)
        return torch.full((20, max(1, audio.shape[-1] * 25 // rate)), 7)


class FakeTTS:
    def __init__(self, root: Path):
        self.voices = VoiceStore(root)
        self.tok_ref = SimpleNamespace(path=TOKENIZER, name=str(TOKENIZER))
        # the server reads the longest voice (one encoder segment) from the loaded codec's config
        self.codec = SimpleNamespace(config=SimpleNamespace(segment_seconds=60.0))

    def add_voice(self, name, path, transcript=None, overwrite=False, label=None):
        return add_voice(self.voices, FakeStage1(), self.tok_ref, name, path, transcript,
                         overwrite, label)


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setattr("mimo_tts.synthesis.voices.tokenizer_id", lambda path: "f" * 32)
    return SimpleNamespace(cfg=SimpleNamespace(voices={}), tts=FakeTTS(tmp_path / "store"))


def _wav(seconds: float, fmt: str = "WAV") -> bytes:
    buffer = io.BytesIO()
    samples = (0.1 * np.random.default_rng(0).standard_normal(int(16000 * seconds)))
    sf.write(buffer, samples.astype("float32"), 16000, format=fmt)
    return buffer.getvalue()


def _no_path(value, *paths) -> None:
    text = repr(value)
    for path in paths:
        assert str(path) not in text, (path, text)
    assert "/tmp" not in text and "/srv" not in text, text


def test_an_uploads_record_has_no_server_path(server, tmp_path):
    record = voices.client_record(voices._encode(server.tts, "me", _wav(1.0), "hi", False,
                                                 "upload:me.wav"))
    _no_path(record, tmp_path, TOKENIZER)  # before: tokenizer.path was the server's folder
    assert record["source"]["path"] == "upload:me.wav"
    assert record["tokenizer"] == {"id": "f" * 32, "name": "tokenizer"}
    assert record["codes"]["shape"] == [20, 25] and record["transcript"] == "hi"


def test_a_voice_added_on_the_server_machine_shows_its_file_name_only(server, tmp_path):
    (tmp_path / "me.wav").write_bytes(_wav(1.0))
    stored = server.tts.add_voice("local", tmp_path / "me.wav")
    assert stored["source"]["path"] == str((tmp_path / "me.wav").resolve())  # kept for the CLI
    assert stored["tokenizer"] == tokenizer_record(server.tts.tok_ref)
    shown = voices.client_record(stored)
    _no_path(shown, tmp_path, TOKENIZER)
    assert shown["source"]["path"] == "me.wav"


@pytest.mark.parametrize("data, words", [
    (b"RIFF\x00\x00", "the uploaded file upload:me.wav is unreadable or unsupported"),
    (_wav(0.0), "prompt audio upload:me.wav has no samples"),
])
def test_upload_errors_name_the_upload_not_its_temp_file(server, data, words):
    with pytest.raises(Exception) as caught:  # noqa: B017 (what the route catches: below)
        voices._encode(server.tts, "me", data, None, False, "upload:me.wav")
    message = voices.client_message(str(caught.value), server)
    assert words in message and "mimo-voice-" not in message and "/tmp" not in message


def test_a_flac_of_unknown_length_uploads(server):
    """Before: its length read as 384307168202282.3 s, refused as longer than 60 s."""
    record = voices._encode(server.tts, "stream", unknown_length(_wav(2.0, "FLAC")), None, False,
                            "upload:stream.flac")
    assert record["source"]["seconds"] == 2.0
    with pytest.raises(Exception, match=r"more than 6\d s long; a voice prompt may be at most "
                                        r"60 s"):
        voices._encode(server.tts, "long", unknown_length(_wav(61.0, "FLAC")), None, False,
                       "upload:long.flac")


def test_store_errors_name_the_forms_fields_and_no_folder(server, tmp_path):
    voices._encode(server.tts, "me", _wav(1.0), None, False, "upload:me.wav")
    with pytest.raises(Exception) as clash:  # noqa: B017
        voices._encode(server.tts, "me", _wav(1.0), None, False, "upload:me.wav")
    message = voices.client_message(str(clash.value), server, **voices._fields())
    assert message == "voice 'me' already exists; send overwrite=true to replace it"
    with pytest.raises(ApiError) as unknown:
        voices.delete_voice(server, "nobody")
    assert unknown.value.status == 404
    assert unknown.value.message == "unknown voice 'nobody' in the voice store; known: me"


def test_a_broken_voice_is_listed_with_an_error_naming_no_path(server, tmp_path):
    voices._encode(server.tts, "gone", _wav(1.0), None, False, "upload:gone.wav")
    voices._encode(server.tts, "fine", _wav(1.0), None, False, "upload:fine.wav")
    (tmp_path / "store" / "gone.safetensors").unlink()
    listed = {d["name"]: d for d in voices.list_voices(server)["data"]}
    assert listed["gone"]["error"] == ("voice 'gone' is broken: its codes file "
                                       "gone.safetensors is gone; add it again")
    assert "error" not in listed["fine"] and listed["fine"]["seconds"] == 1.0
    (tmp_path / "store" / "fine.json").write_text('{"name": "fine"}')
    listed = {d["name"]: d for d in voices.list_voices(server)["data"]}
    assert listed["fine"]["error"] == ("voice 'fine' is corrupt: fine.json is not a voice "
                                       "record; add it again")  # before: a 500, a KeyError


def test_a_store_that_cannot_be_read_is_a_json_500_saying_why(server, tmp_path):
    (tmp_path / "store").write_text("not a folder")
    with pytest.raises(ApiError) as caught:
        voices.list_voices(server)
    assert caught.value.status == 500
    assert caught.value.message == ("the voice store cannot be read: the voice store: it is a "
                                    "file, not a folder; move it away or set "
                                    "MIMO_TTS_VOICES_DIR to a folder")
    body = caught.value.response().body.decode()
    assert '"type": "server_error"' in body and str(tmp_path) not in body


def test_a_read_only_store_is_listed(server, tmp_path, monkeypatch):
    from tests.synthesis.test_voices import _read_only

    voices._encode(server.tts, "me", _wav(1.0), None, False, "upload:me.wav")
    os.remove(tmp_path / "store" / ".voices.lock")
    _read_only(monkeypatch)
    assert voices.list_voices(server)["voices"] == ["default", "natural", "me"]


def test_client_message_removes_every_absolute_path(server, tmp_path):
    store = server.tts.voices.root
    said = voices.client_message(f"voice store {store}: at {store}/x.json, {TOKENIZER} and "
                                 f"/etc/passwd or '/var/x y'; a/b and upload:me.wav stay",
                                 server)
    assert said == ("the voice store: at x.json, tokenizer and a server path or 'a server "
                    "path y'; a/b and upload:me.wav stay")


def test_an_unexpected_error_names_no_server_path(server):
    """A bug's 500 quotes its exception (before: with whatever path it held, e.g. a
    PermissionError's file); the message goes through `client_message`."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    import asyncio

    from mimo_tts.server.routes import build_app

    secret = TOKENIZER / "config.json"

    def models():
        raise PermissionError(f"[Errno 13] Permission denied: '{secret}'")

    server.models = models
    server.cfg.api_key = None
    server.authorized = lambda request: True

    async def run():
        transport = httpx.ASGITransport(app=build_app(server), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.get("/v1/models")

    response = asyncio.run(run())
    assert response.status_code == 500
    message = response.json()["error"]["message"]
    assert message.startswith("unexpected PermissionError: [Errno 13] Permission denied")
    _no_path(message, secret)
