"""The server's `protocol.py` in process: request fields -> `SpeechParams`, formats, errors.

No HTTP and no model: `RequestParser` runs on plain `SynthesisOptions`. The same rules seen over
HTTP (statuses, the JSON error body) are in `test_server_app.py`.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from mimo_tts.errors import DeviceError, InputError, MimoTTSError, UsageError
from mimo_tts.server import protocol
from mimo_tts.server.protocol import (
    MAX_BODY_BYTES,
    ApiError,
    RequestParser,
    ServeConfig,
    media_type,
    read_body,
    served_formats,
    sse,
)
from mimo_tts.synthesis.audio import FORMATS
from mimo_tts.synthesis.options import SynthesisOptions

FORMATS_ALL = ("pcm", "wav", "flac", "mp3", "opus")


def parser(formats=FORMATS_ALL, **cfg) -> RequestParser:
    return RequestParser(ServeConfig(**cfg), SynthesisOptions(seed=5), "tiny", tuple(formats))


def parse(p: RequestParser, **fields):
    return p.parse(json.dumps({"model": "tiny", "input": "Hello  there.", **fields}).encode())


def refused(p: RequestParser, **fields) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(p, **fields)
    return info.value


def test_a_plain_request_takes_the_servers_options():
    params = parse(parser())
    assert params.text == "Hello there." and params.fmt == "mp3" and not params.sse
    assert params.options == SynthesisOptions(seed=5)
    assert parse(parser(("pcm", "wav", "flac"))).fmt == "wav"  # no mp3 encoder here
    params = parse(parser(), model="tts-1", seed=9, response_format="pcm", stream_format="sse",
                   speed=1)
    assert params.options.seed == 9 and params.fmt == "pcm" and params.sse


def test_voices_choose_the_task(tmp_path):
    clip = tmp_path / "clip.wav"
    clip.write_bytes(b"")
    p = parser(voices={"clone": str(clip)})
    cases = {(None, None): ("tts_sft", None), ("alloy", None): ("tts_sft", None),
             ("default", "calm"): ("tts_sft_with_instruct", None),
             ("natural", None): ("tts_sft_with_natural_instruction", None),
             ("clone", None): ("tts_sft_with_audio", str(clip))}
    for (voice, instructions), (task, prompt_audio) in cases.items():
        fields = {k: v for k, v in (("voice", voice), ("instructions", instructions)) if v}
        options = parse(p, **fields).options
        assert (options.task, options.prompt_audio) == (task, prompt_audio)
    assert refused(p, voice="nobody").param == "voice"


def test_refusals_name_the_field_and_code():
    p = parser(max_input_chars=20)
    error = refused(p, model="other")
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")
    error = refused(p, input="x" * 21)
    assert (error.status, error.param, error.code) == (400, "input", "string_above_max_length")
    error = refused(p, temperature=0.5, top_k=3)
    assert (error.status, error.param) == (400, "temperature")
    assert error.message == "unknown field(s): temperature, top_k"
    error = refused(p, seed=True)  # a JSON boolean is no integer
    assert (error.message, error.param) == ("seed must be an integer", "seed")
    assert refused(p, speed="1").message == "speed must be a number"
    assert refused(p, response_format="ogg").param == "response_format"
    for body in (b"{nope", b"[1]", b"\xff"):
        with pytest.raises(ApiError) as info:
            p.parse(body)
        assert info.value.status == 400


def test_served_formats_are_openais_among_formats(monkeypatch):
    monkeypatch.setattr(protocol.aac, "available", lambda: False)
    monkeypatch.setattr(protocol, "lossy_formats", lambda: ["opus"])
    assert served_formats() == ["pcm", "wav", "flac", "opus"]
    monkeypatch.setattr(protocol, "lossy_formats", lambda: ["mp3", "opus"])
    assert served_formats() == ["pcm", "wav", "flac", "mp3", "opus"]
    monkeypatch.setattr(protocol.aac, "available", lambda: True)  # PyAV: aac, never m4a
    assert served_formats() == ["pcm", "wav", "flac", "mp3", "opus", "aac"]


def test_media_types_come_from_formats():
    assert media_type("pcm") == "audio/pcm"
    assert media_type("mp3") == "audio/mpeg" and media_type("wav") == "audio/wav"
    for fmt in ("wav", "flac", "mp3", "opus"):
        assert media_type(fmt) == FORMATS[fmt][3]


def test_library_errors_map_to_statuses():
    assert ApiError.of(UsageError("u")).status == ApiError.of(InputError("i")).status == 400
    assert ApiError.of(DeviceError("d")).status == 503
    error = ApiError.of(MimoTTSError("boom"))
    assert (error.status, error.message, error.headers) == (500, "boom", {})


class Body:
    def __init__(self, *chunks: bytes):
        self.chunks = chunks

    async def stream(self):
        for chunk in self.chunks:
            yield chunk


def test_the_body_reader_stops_past_the_limit():
    assert asyncio.run(read_body(Body(b"ab", b"c"))) == b"abc"
    assert len(asyncio.run(read_body(Body(b"x" * MAX_BODY_BYTES)))) == MAX_BODY_BYTES
    with pytest.raises(ApiError) as info:
        asyncio.run(read_body(Body(b"x" * MAX_BODY_BYTES, b"y", b"never read")))
    assert info.value.status == 413


def test_sse_frames_one_json_event():
    assert sse({"type": "speech.audio.done"}) == 'data: {"type": "speech.audio.done"}\n\n'


# -- hostile bodies, instructions, keys, names, voices --------------------------------------------

def test_any_body_json_refuses_is_a_400_and_field_names_are_escaped():
    """Before: RecursionError, the digit-limit ValueError and a lone-surrogate field name
    (unencodable in the response) were 500s with tracebacks."""
    p = parser()
    for body, words in ((b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
                        (b'{"seed": ' + b"1" * 5000 + b"}", "a number has more than"),
                        (b'"\\ud800', "not valid JSON")):
        with pytest.raises(ApiError) as info:
            p.parse(body)
        assert info.value.status == 400 and words in info.value.message
    with pytest.raises(ApiError) as info:
        p.parse(b'{"model": "tiny", "input": "Hi.", "\\ud800": 1}')
    error = info.value
    assert (error.status, error.message, error.param) == \
        (400, "unknown field(s): '\\ud800'", "'\\ud800'")
    error.message.encode("utf-8")  # what the response body carries
    many = {f"field{i:02d}": 0 for i in range(12)}
    assert refused(p, **many).message == \
        "unknown field(s): field00, field01, field02, field03, field04 and 7 more"


def test_a_response_body_encodes_whatever_a_message_quotes():
    pytest.importorskip("fastapi")
    response = ApiError(400, "bad \ud800 name", "\udcff").response()
    assert json.loads(response.body)["error"]["message"] == "bad \ud800 name"


def test_refusals_name_the_requests_fields_never_the_clis_flags(tmp_path):
    """Issue 32 item 9: before, a request read `--seed must be ...`, `--instruct: task
    tts_sft_with_natural_instruction takes no instruction`, `instruct is empty` and
    `(--max-input-chars)`."""
    p = parser(voices={"clone": str(tmp_path / "clone.wav")}, max_input_chars=20)
    cases = {(("seed", -1),): ("seed", "seed must be in [0, 2**64 - 1]"),
             (("seed", 2**64),): ("seed", "seed must be in [0, 2**64 - 1]"),
             (("voice", "natural"), ("instructions", "calm")):
                 ("instructions", "instructions: voice natural takes no style instruction"),
             (("instructions", " "),): ("instructions", "instructions is empty"),
             (("input", "x" * 21),): ("input", "input is 21 characters; this server's limit"),
             (("captions", True), ("response_format", "wav")): ("captions", "captions come")}
    for fields, (param, words) in cases.items():
        error = refused(p, **dict(fields))
        assert error.param == param and error.message.startswith(words), error.message
        assert "--" not in error.message
    assert protocol.in_fields("--instruct: task x takes no instruction") == \
        "instructions: task x takes no instruction"


def test_instructions_are_checked_like_input_before_tokenising():
    """Before: no bound, no clean_text (a lone surrogate was a 500 in the tokenizer)."""
    p = parser(max_input_chars=20)
    error = refused(p, instructions="x" * 21)
    assert (error.status, error.param, error.code) == \
        (400, "instructions", "string_above_max_length")
    assert error.message == "instructions is 21 characters; this server's limit is 20"
    error = refused(p, instructions="calm\ud800")
    assert error.param == "instructions" and "lone surrogate U+D800 at 4" in error.message
    error = refused(p, instructions="a\x01b")
    assert error.message == "instructions: text has control character U+0001 at 1"
    assert refused(p, instructions=" \n ").message == "instructions is empty"
    assert parse(p, instructions="calm,   low").options.instruct == "calm, low"


@pytest.mark.parametrize(("key", "words"), [
    ("", "is empty"), ("   ", "is only whitespace"), (" key", "starts or ends with whitespace"),
    ("key\t", "starts or ends with whitespace"), ("kéy", "non-ASCII character U+00E9"),
    ("k\x01y", "a control character U+0001"), ("k\x7fy", "a control character U+007F"),
])
def test_keys_no_client_can_send_are_refused(key, words):
    for flag, environ, source in ((key, {}, "--api-key"),
                                  (None, {protocol.API_KEY_ENV: key}, protocol.API_KEY_ENV)):
        with pytest.raises(UsageError) as info:
            protocol.api_key_from(flag, environ)
        assert str(info.value).startswith(f"{source} ") and words in str(info.value)


def test_the_key_comes_from_the_flag_then_the_environment():
    env = {protocol.API_KEY_ENV: "from-env"}
    assert protocol.api_key_from("a b", env) == "a b"  # an inner space is sent as is
    assert protocol.api_key_from(None, env) == "from-env"
    assert protocol.api_key_from(None, {}) is None


def test_clients_see_a_checkpoint_directory_by_its_name(tmp_path, monkeypatch):
    checkpoint = tmp_path / "MiMo-Audio-7B"
    checkpoint.mkdir()
    assert protocol.public_model_name(str(checkpoint)) == "MiMo-Audio-7B"
    assert protocol.public_model_name(f"{checkpoint}/") == "MiMo-Audio-7B"
    monkeypatch.chdir(tmp_path)
    assert protocol.public_model_name("./MiMo-Audio-7B") == "MiMo-Audio-7B"
    for name in ("XiaomiMiMo/MiMo-Audio-7B-Instruct", "tiny"):
        assert protocol.public_model_name(name) == name


def test_voice_files_must_be_regular_files(tmp_path):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, words in ((tmp_path, "is a directory"), (fifo, "is a FIFO"),
                        (tmp_path / "none.wav", "prompt audio not found")):
        with pytest.raises(InputError) as info:
            protocol.parse_voices([f"me={path}"])
        assert str(info.value).startswith("--voice me: ") and words in str(info.value)
        assert str(path) in str(info.value)
    error = protocol.voice_error("me", "x.wav", InputError("prompt audio is 6 ms long"))
    assert isinstance(error, InputError) and str(error) == \
        "--voice me: prompt audio is 6 ms long (x.wav)"


class GoneBody:
    async def stream(self):
        from starlette.requests import ClientDisconnect

        yield b"{"
        raise ClientDisconnect()


def test_a_client_gone_during_the_upload_is_no_error():
    """Before: starlette's ClientDisconnect escaped as a 500 and a traceback."""
    pytest.importorskip("starlette")
    with pytest.raises(ApiError) as info:
        asyncio.run(read_body(GoneBody()))
    assert info.value.status == protocol.CLIENT_GONE


def test_a_wyoming_uri_gives_the_host_and_port():
    """Issue 32 item 14: `--uri tcp://HOST:PORT`, as wyoming-piper takes it."""
    assert protocol.tcp_address("tcp://0.0.0.0:10200") == ("0.0.0.0", 10200)
    assert protocol.tcp_address("tcp://[::]:10300") == ("::", 10300)
    assert protocol.tcp_address("tcp://localhost", 10200) == ("localhost", 10200)
    for bad in ("tcp://localhost", "unix:///run/x.sock", "stdio://", "tcp://:10200",
                "tcp://h:99999", "tcp://h:port", "tcp://h:1/path", "0.0.0.0:10200"):
        with pytest.raises(UsageError, match="--uri takes tcp://HOST:PORT"):
            protocol.tcp_address(bad)
    cfg = protocol.serve_config({"uri": "tcp://0.0.0.0:10201"}, {}, port=10200)
    assert (cfg.host, cfg.port) == ("0.0.0.0", 10201)
    assert protocol.serve_config({}, {}, port=10200).port == 10200
    with pytest.raises(UsageError, match="give one"):
        protocol.serve_config({"uri": "tcp://h:1", "host": "h"}, {}, port=10200)
