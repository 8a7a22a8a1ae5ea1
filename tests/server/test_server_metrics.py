"""`GET /metrics` of `mimo-tts serve`: what it counts equals what happened.

In process (the tiny preset loaded once, the app called through httpx's ASGI transport): answered
requests streamed, whole and as SSE, bad ones, refusals, a deadline, a client gone before its
audio; the audio seconds equal the bodies' samples. Then a real server on 127.0.0.1 with a key:
/metrics needs it, and a scrape after a few requests parses.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
prometheus_client = pytest.importorskip("prometheus_client")
sf = pytest.importorskip("soundfile")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from mimo_tts.presets import ensure_tiny_preset  # noqa: E402
from mimo_tts.runtime.paths import CACHE_ENV  # noqa: E402
from mimo_tts.server.metrics import OUTCOMES  # noqa: E402

RATE = 24000
KEY = "metrics-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TWO = "Hello from the server. A second sentence."
LONG = " ".join(f"Sentence {i} goes on for a while before it ends." for i in range(6))


def parse(text: str) -> dict:
    """A scrape -> {(sample name, ((label, value), ...)): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(scraped: dict, name: str, **labels) -> float:
    return scraped[(name, tuple(sorted(labels.items())))]


def requests_of(scraped: dict, endpoint: str = "speech") -> dict:
    return {o: value(scraped, "mimo_tts_requests_total", endpoint=endpoint, outcome=o)
            for o in OUTCOMES}


@pytest.fixture(scope="module")
def tiny_tts(tiny_cache):
    """The tiny preset loaded in this process once, and the options the server starts with."""
    from mimo_tts.synthesis.preflight import lengths_for
    from mimo_tts.synthesis.settings import resolve
    from mimo_tts.synthesis.synthesizer import MiMoTTS

    lm, tok = ensure_tiny_preset({CACHE_ENV: str(tiny_cache)})
    settings = resolve({"model": str(lm), "tokenizer": str(tok), "lm_device": "cpu",
                        "tokenizer_device": "cpu", "stream": True}, None, {})
    with MiMoTTS.from_settings(settings, lengths_for(settings, [], 8)) as tts:
        yield tts, settings.synthesis


class InProcess:
    """One `SpeechServer` on the tiny_tts model, and an httpx client on its ASGI app."""

    def __init__(self, tiny_tts, **cfg):
        from mimo_tts.server.app import SpeechServer
        from mimo_tts.server.protocol import ServeConfig

        tts, base = tiny_tts
        self.server = SpeechServer(tts, ServeConfig(**cfg), base, "tiny")
        self.app = self.server.app()
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                        base_url="http://localhost", timeout=120)

    async def speech(self, **fields) -> httpx.Response:
        return await self.client.post("/v1/audio/speech",
                                      json={"model": "tiny", "input": TWO, **fields})

    async def scrape(self) -> dict:
        response = await self.client.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"] == prometheus_client.CONTENT_TYPE_LATEST
        return parse(response.text)

    async def idle(self) -> dict:
        """A scrape once nothing is queued, active or generating (bounded)."""
        deadline = time.monotonic() + 20
        while True:
            scraped = await self.scrape()
            if not any(value(scraped, name) for name in ("mimo_tts_queue_depth",
                       "mimo_tts_active_requests", "mimo_tts_active_rows")) \
                    or time.monotonic() > deadline:
                return scraped
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self.client.aclose()
        self.server.close()


def in_process(tiny_tts, test, **cfg):
    async def run():
        served = InProcess(tiny_tts, **cfg)
        try:
            return await test(served)
        finally:
            await served.close()

    return asyncio.run(run())


def samples_of(response: httpx.Response, fmt: str) -> int:
    if fmt == "pcm":
        return len(response.content) // 2
    return sf.info(io.BytesIO(response.content)).frames


def test_counters_and_histograms_follow_the_requests(tiny_tts):
    async def test(served: InProcess):
        pcm = await served.speech(response_format="pcm", seed=1)
        flac = await served.speech(response_format="flac", seed=2)
        sse = await served.speech(response_format="pcm", stream_format="sse", seed=3)
        bad = await served.speech(input="")
        unknown = await served.speech(model="other")
        models = await served.client.get("/v1/models")
        return pcm, flac, sse, [bad, unknown, models], await served.idle()

    pcm, flac, sse, others, scraped = in_process(tiny_tts, test)
    assert [r.status_code for r in (pcm, flac, sse, *others)] == [200, 200, 200, 400, 404, 200]
    deltas = [json.loads(line[6:]) for line in sse.text.splitlines() if line.startswith("data")]
    sse_samples = sum(len(base64.b64decode(e["audio"])) // 2 for e in deltas
                      if e["type"] == "speech.audio.delta")
    assert requests_of(scraped) == {"ok": 3, "client_error": 2, "rejected": 0, "timeout": 0,
                                    "cancelled": 0, "error": 0}
    assert value(scraped, "mimo_tts_requests_total", endpoint="models", outcome="ok") == 1
    samples = samples_of(pcm, "pcm") + samples_of(flac, "flac") + sse_samples
    assert samples > 0
    assert abs(value(scraped, "mimo_tts_audio_seconds_total") - samples / RATE) < 1 / RATE
    assert value(scraped, "mimo_tts_real_time_factor_count") == 3
    assert value(scraped, "mimo_tts_real_time_factor_sum") > 0
    first = {m: value(scraped, "mimo_tts_time_to_first_audio_seconds_count", mode=m)
             for m in ("stream", "file")}
    assert first == {"stream": 2, "file": 1}
    assert value(scraped, "mimo_tts_time_to_first_audio_seconds_bucket", mode="file",
                 le="+Inf") == 1
    for stage in ("stage0", "stage1"):
        assert value(scraped, "mimo_tts_stage_seconds_total", stage=stage) > 0
        assert value(scraped, "mimo_tts_engine_errors_total", stage=stage) == 0


def test_refusals_and_deadlines_are_their_own_outcomes(tiny_tts):
    """503 busy is `rejected` (and a second app in the process keeps its own registry); a
    504 at --timeout is `timeout`."""
    async def busy(served: InProcess):
        responses = await asyncio.gather(*(served.speech(response_format="flac")
                                           for _ in range(4)))
        return [r.status_code for r in responses], await served.idle()

    async def late(served: InProcess):
        response = await served.speech(response_format="flac")
        return response.status_code, await served.idle()

    statuses, scraped = in_process(tiny_tts, busy, max_queue=1, max_concurrent=1)
    assert statuses.count(503) >= 1 and set(statuses) <= {200, 503}
    counts = requests_of(scraped)
    assert counts["rejected"] == statuses.count(503) and counts["ok"] == statuses.count(200)
    status, scraped = in_process(tiny_tts, late, timeout=0.05)
    assert status == 504
    assert requests_of(scraped) == {**dict.fromkeys(OUTCOMES, 0), "timeout": 1}


def test_a_client_gone_before_its_audio_is_cancelled(tiny_tts):
    """The ASGI app called by hand: the body, then `http.disconnect` before any audio."""
    body = json.dumps({"model": "tiny", "input": LONG, "response_format": "flac"}).encode()

    async def test(served: InProcess):
        messages = iter([{"type": "http.request", "body": body, "more_body": False}])
        sent = []

        async def receive():
            return next(messages, {"type": "http.disconnect"})

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/audio/speech", "raw_path": b"/v1/audio/speech",
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
                 "server": ("test", 80), "headers": [(b"content-type", b"application/json")]}
        await asyncio.wait_for(served.app(scope, receive, send), 60)
        return sent, await served.idle()

    sent, scraped = in_process(tiny_tts, test)
    assert sent[0]["status"] == 499  # to nobody
    assert requests_of(scraped) == {**dict.fromkeys(OUTCOMES, 0), "cancelled": 1}
    assert value(scraped, "mimo_tts_audio_seconds_total") == 0


def test_the_worker_reports_rows_stage_time_and_engine_errors(tiny_tts):
    """A worker whose steps fail: its rows and errors reach the metrics."""
    from mimo_tts.errors import DeviceError, MimoTTSError
    from mimo_tts.lm import batching
    from mimo_tts.server.metrics import ServerMetrics
    from mimo_tts.synthesis.options import SynthesisOptions
    from mimo_tts.synthesis.worker import Failed, SpeechJob

    def failing(self):
        if not self.idle:
            time.sleep(0.01)  # the batch's work
            raise DeviceError("out of memory on cpu during Stage-0 generation")
        return step(self)

    step = batching.ContinuousBatcher.step
    metrics = ServerMetrics(lambda: {"active": 0, "queued": 0})
    tts = tiny_tts[0]
    o = SynthesisOptions(max_new_groups=4)
    jobs = [SpeechJob(p, o.generation_options(0), 0) for p in tts.prompts("Hi.", o, 0) * 2]
    batching.ContinuousBatcher.step = failing
    try:
        events = list(tts.worker(2, meter=metrics).run(jobs))
    finally:
        batching.ContinuousBatcher.step = step
    assert [type(e) for e in events] == [Failed, Failed]
    with pytest.raises(MimoTTSError), metrics.stage("stage1"):
        raise MimoTTSError("decode failed")
    scraped = parse(prometheus_client.generate_latest(metrics.registry).decode())
    assert value(scraped, "mimo_tts_engine_errors_total", stage="stage0") >= 2
    assert value(scraped, "mimo_tts_engine_errors_total", stage="stage1") == 1
    assert value(scraped, "mimo_tts_active_rows") == 0
    assert value(scraped, "mimo_tts_stage_seconds_total", stage="stage0") >= 0.01


# -- a real server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def url(start_server):
    return start_server("--api-key", KEY)


def test_a_real_server_serves_metrics_behind_its_key(url):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = httpx.get(url + "/metrics", headers=headers, timeout=30)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(url + "/metrics", headers=AUTH, timeout=30).status_code == 405
    bodies = []
    for fmt in ("pcm", "flac"):
        answer = httpx.post(url + "/v1/audio/speech", headers=AUTH, timeout=120,
                            json={"model": "tiny", "input": TWO, "response_format": fmt})
        assert answer.status_code == 200
        bodies.append(samples_of(answer, fmt))
    assert httpx.post(url + "/v1/audio/speech", headers=AUTH, timeout=30,
                      json={"model": "tiny", "input": "a\x01b"}).status_code == 400
    assert httpx.post(url + "/v1/audio/speech", timeout=30,
                      json={"model": "tiny", "input": "Hi."}).status_code == 401
    scrape = httpx.get(url + "/metrics", headers=AUTH, timeout=30)
    assert scrape.status_code == 200
    assert scrape.headers["content-type"] == prometheus_client.CONTENT_TYPE_LATEST
    scraped = parse(scrape.text)
    assert requests_of(scraped) == {**dict.fromkeys(OUTCOMES, 0), "ok": 2, "client_error": 2}
    assert abs(value(scraped, "mimo_tts_audio_seconds_total") - sum(bodies) / RATE) < 1 / RATE
    assert value(scraped, "mimo_tts_real_time_factor_count") == 2
    assert value(scraped, "mimo_tts_stage_seconds_total", stage="stage1") > 0
    assert "# TYPE mimo_tts_time_to_first_audio_seconds histogram" in scrape.text
    assert "Traceback" not in url.stderr()
