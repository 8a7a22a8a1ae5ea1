"""Prometheus metrics of `mimo-tts serve`: `GET /metrics`, one registry per app.

`ServerMetrics` owns a `CollectorRegistry` of its own (never the global one), so two servers in
one process keep apart. It learns of a request's end from the ASGI wrapper `wrap` (status and
the outcome the request decided: every response path passes there once), of its audio from its
`Tally`, and of the engine from the `Meter` calls of the speech worker (`synthesis.worker`:
rows live, Stage-1 decode time, engine errors). The names, types and labels are the README's
table ("Metrics"). Nothing here imports prometheus_client until a `ServerMetrics` is built: the
worker's default `Meter` (the Wyoming face) needs no extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

from mimo_tts.server.protocol import CLIENT_GONE
from mimo_tts.synthesis.audio import SAMPLE_RATE
from mimo_tts.synthesis.worker import Meter

OUTCOMES = ("ok", "client_error", "rejected", "timeout", "cancelled", "error")
STAGES = ("stage0", "stage1")
MODES = ("stream", "file")  # pcm/wav bodies as decoded; flac/mp3/opus whole
# the API routes a request is counted under (other paths, /health and /metrics, are not)
ENDPOINTS = {"/v1/audio/speech": "speech", "/v1/audio/voices": "voices", "/v1/models": "models"}
TALLY_KEY = "mimo_tts.tally"  # where a request's `Tally` waits in its ASGI scope
# the tiny model on a CPU answers in tens of ms, a 7B on a CPU in tens of seconds
FIRST_AUDIO_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5,
                       10.0, 15.0, 30.0, 60.0, 120.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0)


def outcome_of_status(status: int | None) -> str:
    """A response's outcome from its status alone (None: no response was started)."""
    if status is None or status == CLIENT_GONE:
        return "cancelled"
    if status < 400:
        return "ok"
    return "timeout" if status == 504 else "client_error" if status < 500 else "error"


def outcome_of(exc: BaseException) -> str:
    """The outcome of a request that `exc` ended: an `ApiError` by its status, the server's
    stop (CancelledError) as cancelled, anything else (a bug) as an error."""
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    return outcome_of_status(getattr(exc, "status", 500))


class Tally:
    """One HTTP request as the metrics see it: when it came, what it decided, its audio."""

    def __init__(self, metrics: ServerMetrics | None = None):
        self.metrics, self.start = metrics, time.perf_counter()
        self.outcome: str | None = None  # set by the request; else its status decides
        self.samples = 0  # of audio in its body, at SAMPLE_RATE
        # a speech request's, for the request log: its voice and input's characters (once
        # parsed), the seconds to its first audio bytes
        self.voice: str | None = None
        self.chars: int | None = None
        self.first_at: float | None = None

    def first_audio(self, streamed: bool) -> None:
        """Its first audio bytes are ready (observed now: a long stream shows it at once)."""
        self.first_at = time.perf_counter() - self.start
        if self.metrics is not None:
            self.metrics.first_audio.labels("stream" if streamed else "file").observe(
                self.first_at)


def tally_of(request) -> Tally:
    """The request's `Tally` (a detached one when no `ServerMetrics.wrap` or `RequestLog` is
    in front)."""
    return request.scope.get(TALLY_KEY) or Tally()


class ServerMetrics(Meter):
    """The server's metrics: counters, histograms and gauges in the app's own registry."""

    def __init__(self, places):
        """`places()`: the requests in progress and waiting, {"active": n, "queued": m}."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.lock = threading.Lock()
        self.rows = 0
        self.busy = {name: 0.0 for name in STAGES}
        self.busy_since: float | None = None  # Stage-0 has rows since then
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("mimo_tts_requests", "API requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=registry)
        self.audio_seconds = Counter("mimo_tts_audio_seconds",
                                     "Seconds of audio in speech response bodies",
                                     registry=registry)
        self.real_time_factor = Histogram(
            "mimo_tts_real_time_factor", "Per answered speech request: seconds from arrival to "
            "the response's end over seconds of audio returned", buckets=RTF_BUCKETS,
            registry=registry)
        self.first_audio = Histogram(
            "mimo_tts_time_to_first_audio_seconds", "Seconds from a speech request's arrival "
            "to its first audio bytes (stream: the first chunk; file: the whole file)", ["mode"],
            buckets=FIRST_AUDIO_BUCKETS, registry=registry)
        self.engine_errors = Counter("mimo_tts_engine_errors", "Jobs failed by the engine, "
                                     "and batches stopped by a bug, by stage", ["stage"],
                                     registry=registry)
        Gauge("mimo_tts_queue_depth", "Admitted speech requests waiting for a place in "
              "progress (--max-queue)", registry=registry).set_function(
            lambda: places()["queued"])
        Gauge("mimo_tts_active_requests", "Speech requests in progress (--max-concurrent), "
              "admitted and not yet released", registry=registry).set_function(
            lambda: places()["active"])
        Gauge("mimo_tts_active_rows", "Stage-0 batch rows generating now", registry=registry
              ).set_function(lambda: self.rows)
        registry.register(_StageSeconds(self))
        for outcome in OUTCOMES:  # every speech outcome is a series from the start
            self.requests.labels("speech", outcome)
        for name in STAGES:
            self.engine_errors.labels(name)
        for mode in MODES:
            self.first_audio.labels(mode)

    # -- the worker's reports (its threads) --
    def row_started(self) -> None:
        with self.lock:
            if self.rows == 0:
                self.busy_since = time.perf_counter()
            self.rows += 1

    def row_finished(self, failed: bool = False) -> None:
        with self.lock:
            self.rows = max(self.rows - 1, 0)
            if self.rows == 0 and self.busy_since is not None:
                self.busy["stage0"] += time.perf_counter() - self.busy_since
                self.busy_since = None
        if failed:
            self.engine_error("stage0")

    def engine_error(self, stage: str) -> None:
        self.engine_errors.labels(stage).inc()

    @contextlib.contextmanager
    def stage(self, name: str):
        started = time.perf_counter()
        try:
            yield
        except Exception:
            self.engine_error(name)
            raise
        finally:
            with self.lock:
                self.busy[name] += time.perf_counter() - started

    def stage_seconds(self) -> dict:
        """Busy seconds per stage so far, Stage-0's current stretch included."""
        with self.lock:
            seconds = dict(self.busy)
            if self.busy_since is not None:
                seconds["stage0"] += time.perf_counter() - self.busy_since
            return seconds

    # -- HTTP --
    def wrap(self, app):
        """The ASGI `app`, each request to an API route counted once when it ends: by the
        outcome it set on its `Tally`, else by its status (none sent: cancelled)."""
        async def metered(scope, receive, send) -> None:
            endpoint = _endpoint(scope)
            if endpoint is None:
                return await app(scope, receive, send)
            tally, status = scope.setdefault(TALLY_KEY, Tally()), []  # the request log's
            tally.metrics = self

            async def watched(message) -> None:
                if message["type"] == "http.response.start":
                    status.append(message["status"])
                await send(message)

            try:
                await app(scope, receive, watched)
            finally:
                self.request_done(endpoint, tally, status[0] if status else None)

        return metered

    def request_done(self, endpoint: str, tally: Tally, status: int | None) -> None:
        outcome = tally.outcome or outcome_of_status(status)
        self.requests.labels(endpoint, outcome).inc()
        if tally.samples:
            seconds = tally.samples / SAMPLE_RATE
            self.audio_seconds.inc(seconds)
            if outcome == "ok":
                self.real_time_factor.observe((time.perf_counter() - tally.start) / seconds)

    def response(self):
        """`GET /metrics`: the registry in Prometheus' text format."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from starlette.responses import Response

        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _StageSeconds:
    """`mimo_tts_stage_seconds_total{stage}`, read from the worker's reports at each scrape."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(
            "mimo_tts_stage_seconds", "Busy seconds per stage: Stage-0 while it has rows, "
            "Stage-1 while it decodes", labels=["stage"])
        for name, seconds in self.metrics.stage_seconds().items():
            family.add_metric([name], seconds)
        yield family

    describe = collect


def _endpoint(scope) -> str | None:
    if scope["type"] != "http":
        return None
    path = scope["path"]
    return ENDPOINTS.get(path) or ("voices" if path.startswith("/v1/audio/voices/") else None)
