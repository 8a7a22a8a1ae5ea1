"""`mimo-tts serve` over real HTTP: formats, streaming, batching, overload, disconnects, errors.

One server (tiny preset, no API key) for the module; requests go through httpx.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import time

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
sf = pytest.importorskip("soundfile")

SAMPLES_PER_FRAME = 960
TEXT = "Hello from the server."
BATCH, CONCURRENT, QUEUE = 8, 8, 8
LOSSY = {"mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}


def writable(fmt: str) -> bool:
    """Whether this libsndfile writes a lossy format (the server offers it exactly then)."""
    container, subtype = LOSSY[fmt]
    return container in sf.available_formats() and subtype in sf.available_subtypes(container)


@pytest.fixture(scope="module")
def voice_wav(tmp_path_factory):
    path = tmp_path_factory.mktemp("voice") / "voice.wav"
    rng = np.random.default_rng(0)
    sf.write(str(path), (0.1 * rng.standard_normal(16000)).astype("float32"), 16000)
    return path


@pytest.fixture(scope="module")
def url(start_server, voice_wav):
    return start_server("--batch-size", BATCH, "--max-concurrent", CONCURRENT, "--max-queue",
                        QUEUE, "--voice", f"clone={voice_wav}")


@pytest.fixture(scope="module")
def client(url):
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


def speech(client, **fields):
    return client.post("/v1/audio/speech", json={"model": "tiny", "input": TEXT, **fields})


def health(client) -> dict:
    return client.get("/health").json()


def wait_idle(client, timeout: float = 20) -> dict:
    """/health once nothing is active or queued (the engine may still finish a cancelled row)."""
    deadline = time.monotonic() + timeout
    while True:
        state = health(client)
        if state["active"] == state["queued"] == 0 or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    state = health(client)
    assert state["status"] == "ok" and state["batch_size"] == BATCH


def test_every_format_decodes_with_the_same_length(client):
    pcm = speech(client, response_format="pcm", seed=1)
    assert pcm.status_code == 200 and pcm.headers["content-type"] == "audio/pcm"
    samples = len(pcm.content) // 2
    assert len(pcm.content) % 2 == 0 and samples % SAMPLES_PER_FRAME == 0 and samples > 0
    wav = speech(client, response_format="wav", seed=1)
    # streamed the same way: the WAV is the PCM behind a 44-byte header of unknown length
    assert wav.content[44:] == pcm.content and wav.content[:4] == b"RIFF"
    for fmt in ["wav", "flac", *filter(writable, LOSSY)]:
        response = speech(client, response_format=fmt, seed=1)
        assert response.status_code == 200, response.text
        audio, rate = sf.read(io.BytesIO(response.content), dtype="float32")
        assert rate == 24000 and np.isfinite(audio).all()
        assert abs(len(audio) - samples) <= (0 if fmt in ("wav", "flac") else 2 * 960), fmt


def test_lossy_formats_follow_libsndfile(client):
    """mp3 and opus are offered exactly where this libsndfile writes them."""
    error = speech(client, response_format="nope").json()["error"]["message"]
    for fmt in LOSSY:
        assert (fmt in error) == writable(fmt)
        assert (speech(client, response_format=fmt).status_code == 200) == writable(fmt)


def test_flac_bytes_equal_the_cli(client, mimo, tmp_path):
    """Alone in its batch, a request is the CLI's run: same codes, same one-shot decode."""
    response = speech(client, response_format="flac", seed=7)
    result = mimo("synth", "--model", "tiny", "--text", TEXT, "--seed", 7, "--format", "flac",
                  "-o", tmp_path / "cli.flac")
    assert result.returncode == 0, result.stderr
    assert response.content == (tmp_path / "cli.flac").read_bytes()


def test_aac_is_a_whole_file_equal_to_the_cli(client, mimo, tmp_path):
    """response_format aac (with PyAV, as CI installs it): ADTS bytes, the CLI's -o x.aac."""
    pytest.importorskip("av")
    response = speech(client, response_format="aac", seed=7)
    assert response.status_code == 200 and response.headers["content-type"] == "audio/aac"
    result = mimo("synth", "--model", "tiny", "--text", TEXT, "--seed", 7, "-o",
                  tmp_path / "cli.aac")
    assert result.returncode == 0, result.stderr
    assert response.content[:2] == b"\xff\xf1"
    assert response.content == (tmp_path / "cli.aac").read_bytes()


def test_speed_stretches_the_stream_and_the_file(client):
    """OpenAI's `speed` field: the pcm stream and a flac file at 2.0 hold half the samples of
    1.0's (one piece, stretched after Stage-1); 1.0 is today's bytes."""
    text = {"input": "One sentence here.", "seed": 5}
    plain = speech(client, response_format="pcm", **text).content
    assert speech(client, response_format="pcm", speed=1, **text).content == plain
    fast = speech(client, response_format="pcm", speed=2.0, **text)
    assert fast.status_code == 200, fast.text
    whole = speech(client, response_format="flac", speed=2.0, **text)
    samples = len(sf.read(io.BytesIO(whole.content))[0])
    assert len(fast.content) // 2 == samples == round(len(plain) // 2 / 2)


def test_pauses_in_the_input_are_exact_in_the_stream_and_the_file(client):
    """[pause:1] and a trailing [pause:0.5] in `input`: the pcm stream (sse, with its cues) and
    a wav file hold exactly those zero samples between and after the pieces; the file's
    captions header gives the same cues; a bad tag is a 400 naming it."""
    text = {"input": "One here. [pause:1] Two here. [pause:0.5]", "seed": 4, "captions": True}
    events = []
    with client.stream("POST", "/v1/audio/speech",
                       json={"model": "tiny", "response_format": "pcm", "stream_format": "sse",
                             **text}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events
                   if e["type"] == "speech.audio.delta")
    samples = np.frombuffer(pcm, "<i2")
    (cues,) = [e["captions"] for e in events if e["type"] == "speech.audio.done"]
    assert cues[0]["start_sample"] == 0
    assert cues[1]["start_sample"] - cues[0]["end_sample"] == 24000
    assert len(samples) == cues[1]["end_sample"] + 12000
    assert not samples[cues[0]["end_sample"]:cues[1]["start_sample"]].any()
    assert not samples[cues[1]["end_sample"]:].any()
    whole = speech(client, response_format="wav", stream_format="audio", **{**text,
                                                                         "captions": False})
    assert whole.status_code == 200
    file_samples, _ = sf.read(io.BytesIO(whole.content), dtype="int16")
    assert np.array_equal(file_samples, samples)
    bad = speech(client, input="<speak>Hi <emphasis>x</emphasis></speak>")
    assert bad.status_code == 400 and "<emphasis>" in bad.json()["error"]["message"]


def test_voice_tags_speak_in_each_voice_and_the_captions_name_them(client):
    """`[voice:natural]` and `[voice:clone]` (a `--voice NAME=FILE` start-up voice) in
    `input`: 200, the sse captions name each span's voice (WebVTT `<v NAME>` once written), the
    file's captions header the same cues; the tagged span is that text said alone in its
    voice (same samples in the pcm stream); an unknown voice in a tag is a 400 naming
    `input`."""
    from mimo_tts.synthesis.captions import caption_text

    def sse(**fields):
        with client.stream("POST", "/v1/audio/speech",
                           json={"model": "tiny", "response_format": "pcm",
                                 "stream_format": "sse", "seed": 4, **fields}) as response:
            assert response.status_code == 200, response.read()
            events = [json.loads(line[6:]) for line in response.iter_lines() if line]
        pcm = b"".join(base64.b64decode(e["audio"]) for e in events
                       if e["type"] == "speech.audio.delta")
        done = [e for e in events if e["type"] == "speech.audio.done"]
        return np.frombuffer(pcm, "<i2"), done[0].get("captions")

    text = "[voice:natural] Speak softly now. [voice:clone] Hello there."
    samples, cues = sse(input=text, captions=True)
    assert [(c["voice"], c["text"]) for c in cues] == [("natural", "Speak softly now."),
                                                      ("clone", "Hello there.")]
    assert len(samples) == cues[-1]["end_sample"]
    vtt = caption_text(cues, "vtt")
    assert "<v natural>Speak softly now." in vtt and "<v clone>Hello there." in vtt
    alone, _ = sse(input="Hello there.", voice="clone")
    assert np.array_equal(samples[cues[1]["start_sample"]:cues[1]["end_sample"]], alone)
    whole = speech(client, input=text, seed=4, response_format="flac", captions=True)
    assert whole.status_code == 200, whole.text
    assert len(sf.read(io.BytesIO(whole.content))[0]) == len(samples)  # decoded whole
    assert json.loads(whole.headers["x-mimo-captions"]) == cues
    for tagged in ("[voice:nobody] Hi.", '<speak><voice name="nobody">Hi.</voice></speak>'):
        bad = speech(client, input=tagged)
        error = bad.json()["error"]
        assert bad.status_code == 400 and error["param"] == "input", bad.text
        assert "'nobody'" in error["message"] and "clone" in error["message"]


def test_sse_streams_deltas_before_the_end(client):
    start = time.perf_counter()
    events = []
    with client.stream("POST", "/v1/audio/speech",
                       json={"model": "tiny", "input": TEXT, "response_format": "pcm",
                             "stream_format": "sse", "seed": 2}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line:
                assert line.startswith("data: ")
                events.append((time.perf_counter() - start, json.loads(line[6:])))
    deltas = [(t, e) for t, e in events if e["type"] == "speech.audio.delta"]
    (done_at, done), = [(t, e) for t, e in events if e["type"] == "speech.audio.done"]
    assert len(deltas) >= 2 and deltas[0][0] < done_at
    usage = done["usage"]
    assert usage["output_tokens"] > 0 and usage["total_tokens"] == \
        usage["input_tokens"] + usage["output_tokens"]
    audio = b"".join(base64.b64decode(e["audio"]) for _, e in deltas)
    assert audio == speech(client, response_format="pcm", seed=2).content


def test_streamed_pcm_arrives_in_several_chunks(client):
    with client.stream("POST", "/v1/audio/speech",
                       json={"model": "tiny", "input": TEXT, "response_format": "pcm"}) as r:
        arrivals = [time.perf_counter() for _ in r.iter_raw()]
    assert len(arrivals) >= 2 and arrivals[0] < arrivals[-1]


def test_concurrent_requests_are_batched(client):
    def one(i: int):
        return speech(client, input=f"Request number {i}.", response_format="wav")

    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        responses = list(pool.map(one, range(CONCURRENT)))
    assert [r.status_code for r in responses] == [200] * CONCURRENT
    rows = [int(r.headers["x-mimo-batch-rows"]) for r in responses]
    assert max(rows) > 1
    assert health(client)["max_batch_rows"] > 1
    for response in responses:
        audio, rate = sf.read(io.BytesIO(response.content))
        assert rate == 24000 and len(audio) > 0


def test_batched_requests_with_their_own_seeds_equal_their_solo_runs(client):
    """Continuous batching: requests with different seeds share the batch, and each one's
    audio is exactly what it gets alone (its row samples from its own generator)."""
    texts = [f"Seed test {i}." for i in range(4)]

    def one(i: int):
        return speech(client, input=texts[i], seed=100 + i, response_format="flac")

    solo = [one(i).content for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(one, range(4)))
    assert max(int(r.headers["x-mimo-batch-rows"]) for r in together) > 1
    assert [r.content for r in together] == solo


def test_overload_answers_503_with_retry_after(client):
    total = 3 * (CONCURRENT + QUEUE)
    with concurrent.futures.ThreadPoolExecutor(total) as pool:
        responses = list(pool.map(lambda i: speech(client, response_format="pcm"),
                                  range(total)))
    busy = [r for r in responses if r.status_code == 503]
    assert busy and len(busy) < total
    assert all(r.status_code in (200, 503) for r in responses)
    for response in busy:
        assert int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["code"] == "busy"
    state = wait_idle(client)
    assert state["active"] == state["queued"] == 0


def test_disconnect_mid_stream_frees_the_slot(client):
    cancelled = health(client)["requests"]["cancelled"]
    long = " ".join(f"Sentence {i} is long enough to fill most of a piece of its own, "
                    f"{'and it goes on ' * 14}until it ends." for i in range(10))  # 10 pieces
    with client.stream("POST", "/v1/audio/speech",
                       json={"model": "tiny", "input": long, "response_format": "pcm"}) as r:
        chunks = r.iter_raw()  # kept: a dropped iterator would close the response
        assert r.status_code == 200 and next(chunks)
        assert health(client)["active"] == 1
    state = wait_idle(client)
    assert state["active"] == 0 and state["requests"]["cancelled"] == cancelled + 1
    assert speech(client, response_format="wav").status_code == 200


def test_disconnect_before_audio_frees_the_slot(url, client):
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/audio/speech", timeout=0.2,
                   json={"model": "tiny", "input": TEXT, "response_format": "flac"})
    state = wait_idle(client)
    assert state["active"] == state["queued"] == 0
    assert speech(client, response_format="flac").status_code == 200


def test_voices_and_instructions(client):
    for fields in ({"voice": "clone"}, {"voice": "clone", "instructions": "calm"},
                   {"instructions": "calm, low voice"}, {"voice": "alloy"},
                   {"voice": "natural", "input": "Whisper: good night."}):
        response = speech(client, response_format="wav", **fields)
        assert response.status_code == 200, (fields, response.text)
        assert len(sf.read(io.BytesIO(response.content))[0]) > 0


@pytest.mark.parametrize(("fields", "status", "message"), [
    ({"input": ""}, 400, "input: empty text"),
    ({"input": "a\x01b"}, 400, "input: text has control character U+0001 at 1"),
    ({"input": "x" * 4097}, 400, "input is 4097 characters; this server's limit is 4096"),
    ({"voice": "nobody"}, 400, "unknown voice 'nobody'; choose one of default, natural, clone"),
    ({"response_format": "ogg"}, 400, "response_format must be one of pcm, wav, flac"),
    ({"stream_format": "chunks"}, 400, "stream_format must be audio or sse"),
    ({"seed": -1}, 400, "seed must be in [0, 2**64 - 1]"),
    ({"seed": "3"}, 400, "seed must be an integer"),
    ({"speed": 4.5}, 400, "speed must be in [0.25, 4]"),
    ({"speed": 0.2}, 400, "speed must be in [0.25, 4]"),
    ({"instructions": " "}, 400, "instructions is empty"),
    ({"instructions": "x" * 4097}, 400,
     "instructions is 4097 characters; this server's limit is 4096"),
    ({"instructions": "x" * 900_000}, 400, "instructions is 900000 characters"),
    ({"instructions": "a\x01b"}, 400, "instructions: text has control character U+0001"),
    ({"voice": "natural", "instructions": "calm"}, 400,
     "instructions: voice natural takes no style instruction"),
    ({"temperature": 0.5}, 400, "unknown field(s): temperature"),
    ({"model": "other"}, 404, "model 'other' is not served"),
    ({"model": None}, 400, "model is required"),
])
def test_bad_requests_get_json_errors(client, fields, status, message):
    response = speech(client, **fields)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and "Traceback" not in response.text
    assert error["type"] == "invalid_request_error"
    assert "--" not in error["message"]  # the request's fields, never the CLI's flags


def test_malformed_bodies_and_routes(client):
    for body, status, message in ((b"{nope", 400, "not valid JSON"),
                                  (b"[1, 2]", 400, "must be a JSON object"),
                                  (b"x" * (1 << 20 | 1), 413, "request body over")):
        response = client.post("/v1/audio/speech", content=body,
                               headers={"Content-Type": "application/json"})
        assert response.status_code == status and message in response.json()["error"]["message"]
    assert client.get("/v1/nothing").json()["error"]["message"] == "Not Found"
    assert client.get("/v1/audio/speech").status_code == 405
    assert health(client)["status"] == "ok"  # still serving after every failure


def test_bodies_json_refuses_and_odd_field_names_are_400s(client):
    """Before: these were 500s with tracebacks (RecursionError, the integer digit limit, a
    message with a lone surrogate the JSON response could not encode, the tokenizer on a lone
    surrogate in `instructions`)."""
    for body, message in ((b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
                          (b'{"model": "tiny", "input": "Hi.", "seed": ' + b"7" * 5000 + b"}",
                           "a number has more than"),
                          (b'{"model": "tiny", "input": "Hi.", "\\ud800": 1}',
                           "unknown field(s): '\\ud800'"),
                          (b'{"model": "tiny", "input": "Hi.", "instructions": "calm\\ud800"}',
                           "instructions: text is not valid Unicode (lone surrogate U+D800")):
        response = client.post("/v1/audio/speech", content=body,
                               headers={"Content-Type": "application/json"})
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]["message"]
    assert health(client)["status"] == "ok"


def test_the_serving_line_says_v1_is_open(url):
    assert "(no API key: /v1 and /metrics are open;" in url.stderr().splitlines()[0]
    assert "Traceback" not in url.stderr()
