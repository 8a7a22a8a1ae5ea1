"""`mimo-tts serve`: an OpenAI-compatible speech endpoint on the worker of `server/engine.py`.

`POST /v1/audio/speech` (the fields of `protocol.py`), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus, `metrics.py`), on FastAPI and uvicorn (the optional `serve` extra).
The status of a request is decided when its first audio bytes are ready, so every failure
before them is an OpenAI-style JSON error with the CLI's message; `pcm` and `wav` stream as
Stage-1 decodes them (a WAV header of unknown length), the other formats come whole, decoded
one-shot as `synth` does. Loopback by default, an optional
bearer token, bounded input, queue and concurrency (503 with Retry-After), a per-request timeout
that bounds every send too (a client that stops reading loses its place); a client that goes
away cancels its jobs. Binding, signals and the bounded shutdown are `server/lifecycle.py`'s.
"""

import asyncio
import base64
import functools
import hmac
import json
from typing import TYPE_CHECKING

from mimo_tts.errors import MimoTTSError, UsageError
from mimo_tts.server import voices
from mimo_tts.server.engine import (
    ContinuousStrategy,
    RequestQueue,
    SpeechJob,
    SpeechWorker,
    StaticBatcher,
    Ticket,
    deliver_on,
)
from mimo_tts.server.lifecycle import SHUTDOWN_GRACE_S, loaded, serve, url_of
from mimo_tts.server.metrics import ServerMetrics, Tally, outcome_of, tally_of
from mimo_tts.server.page import page_html, speech_openapi
from mimo_tts.server.protocol import (
    CAPTIONS_HEADER,
    CLIENT_GONE,
    STREAMED,
    ApiError,
    RequestParser,
    ServeConfig,
    SpeechParams,
    media_type,
    public_model_name,
    read_body,
    served_formats,
    sse,
)
from mimo_tts.synthesis.audio import (
    PAUSE_FRAMES,
    SAMPLE_RATE,
    encode_audio,
    join_pieces,
    pcm16,
    wav_stream_header,
)
from mimo_tts.synthesis.captions import cues, text_pieces

if TYPE_CHECKING:
    from mimo_tts.synthesis.options import SynthesisOptions
    from mimo_tts.synthesis.settings import OptionValues

EXTRA_HINT = "mimo-tts serve needs the serve extra: pip install 'mimo-tts[serve]'"
RETRY_AFTER_S = 1
POLL_S = 0.25  # how often a request waiting for its first audio checks for a disconnect


class StreamAborted(Exception):
    """A failure after the response started: the connection is closed without its end."""


class SpeechServer:
    """The HTTP face over one loaded `MiMoTTS` and its `SpeechWorker`."""

    def __init__(self, tts, cfg: ServeConfig, base: "SynthesisOptions", model: str, log=None):
        self.tts, self.cfg, self.model = tts, cfg, model  # model: the public name
        self.log = log or (lambda message: None)
        self.formats = served_formats()
        self.parser = RequestParser(cfg, base, model, tuple(self.formats))
        self.requests = RequestQueue(cfg.max_queue, cfg.max_concurrent)
        self.metrics = ServerMetrics(self.requests)
        strategy = ContinuousStrategy if tts.engine.continuous else StaticBatcher
        self.worker = SpeechWorker(tts, self.requests, strategy(tts, cfg.batch_size, self.log),
                                   base, self.log, cfg.stage1_batch, self.metrics)
        self.counts = {"ok": 0, "failed": 0, "cancelled": 0, "rejected": 0}
        self.serial = 0
        self.live: set[Speech] = set()

    # -- the request's life --
    async def speech(self, request):
        """Checked (400s), admitted (503), tokenised, then answered as its audio comes."""
        from fastapi.responses import Response
        from starlette.concurrency import run_in_threadpool

        params = self.parser.parse(await read_body(request))
        ticket, tally = Ticket(), tally_of(request)
        if not self.requests.admit(ticket):
            self.counts["rejected"] += 1
            tally.outcome = "rejected"
            raise ApiError(503, "the server is busy (queue full); retry later", code="busy",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        try:
            prompts = await run_in_threadpool(self.tts.prompts, params.text, params.options,
                                              params.options.seed)
        except BaseException as exc:
            self.requests.release(ticket)
            if isinstance(exc, MimoTTSError):
                raise ApiError.of(exc) from None
            raise
        self.serial += 1
        speech = Speech(self, params, prompts, ticket, self.serial, tally)
        body = speech.body(request)
        try:
            first = await anext(body)
        except BaseException as exc:  # the JSON error (or a bug's 500) follows; the place goes
            speech.release(outcome_of(exc))  # the client gone or the server's stop: cancelled
            raise
        tally.first_audio(params.fmt in STREAMED)
        headers = {"X-MiMo-Batch-Rows": str(speech.jobs[0].rows)}
        if params.fmt not in STREAMED and not params.sse:
            if params.captions:
                headers[CAPTIONS_HEADER] = json.dumps(speech.cues(), separators=(",", ":"))
            await body.aclose()
            speech.release("ok")
            return Response(first, media_type=media_type(params.fmt), headers=headers)
        content, kind = (speech.events(first, body), "text/event-stream") if params.sse \
            else (speech.rest(first, body), media_type(params.fmt))
        return _bounded_stream()(speech, content, media_type=kind, headers=headers)

    def close(self) -> None:
        """The server stops: requests still here are cancelled, the worker's threads end."""
        for speech in list(self.live):
            speech.release("cancelled")
        self.worker.close(timeout=SHUTDOWN_GRACE_S)

    def health(self) -> dict:
        return {"status": "ok", "model": self.model, **self.requests.counts(),
                "batch_size": self.cfg.batch_size, **self.worker.stats,
                "requests": dict(self.counts)}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                            "owned_by": "mimo-tts"}]}

    def page(self):
        """`/`: the page (open like /health; what it sends to /v1 needs the key, if any)."""
        from fastapi.responses import HTMLResponse

        voices = ["default", "natural", *self.cfg.voices]
        return HTMLResponse(page_html(self.model, voices, self.formats,
                                      self.cfg.api_key is not None))

    def authorized(self, request) -> bool:
        if self.cfg.api_key is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.cfg.api_key}".encode())

    def voice_routes(self, app, auth) -> None:
        """`/v1/audio/voices`: GET lists, POST (multipart) adds, DELETE /{name} removes."""
        from fastapi import Request
        from fastapi.responses import JSONResponse

        async def add(request: Request):
            return JSONResponse(await voices.add_voice(self, request), 201)

        async def delete(name: str):
            return JSONResponse(voices.delete_voice(self, name))

        app.get("/v1/audio/voices", dependencies=[auth])(
            lambda: JSONResponse(voices.list_voices(self)))
        app.post("/v1/audio/voices", dependencies=[auth])(add)
        app.delete("/v1/audio/voices/{name}", dependencies=[auth])(delete)

    def app(self):
        """The FastAPI application: its routes, errors as OpenAI-style JSON, each API request
        counted by `ServerMetrics.wrap`."""
        from fastapi import Depends, FastAPI, Request
        from fastapi.responses import JSONResponse
        from starlette.exceptions import HTTPException

        def auth(request: Request) -> None:
            if not self.authorized(request):
                raise ApiError(401, "missing or invalid API key (Authorization: Bearer ...)",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

        async def speech(request: Request):
            return await self.speech(request)

        app = FastAPI(title="mimo-tts", redoc_url=None)  # /docs: the interactive API page
        app.add_exception_handler(ApiError, lambda request, exc: exc.response())
        app.add_exception_handler(HTTPException, lambda request, exc: ApiError(
            exc.status_code, str(exc.detail)).response())
        app.add_exception_handler(Exception, lambda request, exc: ApiError(
            500, f"unexpected {type(exc).__name__}: {exc}").response())
        app.post("/v1/audio/speech", dependencies=[Depends(auth)],
                 openapi_extra=speech_openapi(self.formats))(speech)
        app.get("/", include_in_schema=False)(self.page)
        app.get("/v1/models", dependencies=[Depends(auth)])(lambda: JSONResponse(self.models()))
        app.get("/health")(lambda: JSONResponse(self.health()))
        app.get("/metrics", dependencies=[Depends(auth)], include_in_schema=False)(
            self.metrics.response)
        self.voice_routes(app, Depends(auth))
        return _Aborts(self.metrics.wrap(app))


class Speech:
    """One request's jobs (one per text piece) and the events they send to the event loop."""

    def __init__(self, server: SpeechServer, params: SpeechParams, prompts: list,
                 ticket: Ticket, serial: int, tally: Tally):
        self.server, self.params, self.ticket, self.tally = server, params, ticket, tally
        label = f"speech-{serial}"
        loop = asyncio.get_running_loop()
        self.deadline = loop.time() + server.cfg.timeout
        self.queues = [asyncio.Queue() for _ in prompts]
        options = params.options.generation_options(params.options.seed)
        self.jobs = [SpeechJob(prompt, options, params.options.seed, params.fmt in STREAMED,
                         deliver_on(loop, q), ticket, label, (serial, i))
                     for i, (prompt, q) in enumerate(zip(prompts, self.queues, strict=True))]
        self.usage = {"input_tokens": sum(p.n_groups for p in prompts), "output_tokens": 0}
        self.released = False
        self.lengths: list[int] = []  # each piece's samples, as they finish (captions)
        server.live.add(self)
        server.worker.submit(self.jobs)

    def release(self, outcome: str) -> None:
        """The request is over (`outcome`: one of `metrics.OUTCOMES`): its jobs are cancelled,
        its place freed (once)."""
        if not self.released:
            self.released = True
            self.server.worker.cancel(self.jobs)
            self.server.requests.release(self.ticket)
            self.tally.outcome = outcome
            counts = self.server.counts  # /health folds the failures into one count
            counts[outcome if outcome in counts else "failed"] += 1
            self.server.live.discard(self)

    def cues(self) -> list[dict]:
        """The request's captions: a cue per piece from its samples and the pauses."""
        stage1, o = self.server.tts.stage1, self.params.options
        found = cues(text_pieces(self.params.text, o), self.lengths, stage1.sample_rate,
                     stage1.samples_per_frame)
        return [c.record() for c in found]

    def bounded(self, send):
        """The response's `send`, each call cut off at the request's deadline: a client that
        stops reading blocks it (the socket is full), and would keep its place for good."""
        async def send_by_deadline(message) -> None:
            left = self.deadline - asyncio.get_running_loop().time()
            try:
                async with asyncio.timeout(max(left, 0)):
                    await send(message)
            except TimeoutError:
                self.server.log(f"{self.jobs[0].label}: the client stopped reading; closed "
                                f"at --timeout ({self.server.cfg.timeout:g} s)")
                self.release("timeout")
                raise StreamAborted from None

        return send_by_deadline

    async def next_event(self, index: int, request=None) -> tuple:
        """The job's next event; before the response starts (`request` given), a client that
        went away cancels it. Past the deadline: 504."""
        loop = asyncio.get_running_loop()
        while (left := self.deadline - loop.time()) > 0:
            try:
                return await asyncio.wait_for(self.queues[index].get(),
                                              min(left, POLL_S) if request else left)
            except TimeoutError:
                if request is not None and await request.is_disconnected():
                    raise ApiError(CLIENT_GONE, "client closed the request") from None
        raise ApiError(504, f"the request took longer than --timeout ({self.server.cfg.timeout:g}"
                       " s)", code="timeout")

    async def body(self, request):
        """The response body's bytes: pcm/wav as decoded, other formats whole at the end."""
        fmt, pause = self.params.fmt, PAUSE_FRAMES * self.server.tts.stage1.samples_per_frame
        header = wav_stream_header(SAMPLE_RATE) if fmt == "wav" else b""
        audios = []
        for i in range(len(self.jobs)):
            if i and fmt in STREAMED:
                self.tally.samples += pause
                yield pcm16(_zeros(pause))
            while (event := await self.next_event(i, request))[0] == "audio":
                self.tally.samples += int(event[1].shape[-1])
                yield header + pcm16(event[1])
                header, request = b"", None
            if event[0] == "error":
                raise ApiError.of(event[1])
            audios.append(event[1]["audio"])
            self.lengths.append(int(event[1]["audio"].shape[-1]))
            self.usage["output_tokens"] += event[1]["groups"]
        if fmt not in STREAMED:
            from starlette.concurrency import run_in_threadpool

            joined = join_pieces(audios, PAUSE_FRAMES,
                                     self.server.tts.stage1.samples_per_frame)
            self.tally.samples += int(joined.shape[-1])
            yield await run_in_threadpool(encode_audio, joined, SAMPLE_RATE, fmt)

    async def rest(self, first: bytes, body):
        """A streamed audio body: a failure closes the connection before the body's end."""
        try:
            yield first
            async for data in body:
                yield data
            self.release("ok")
        except ApiError as exc:
            self.server.log(f"{self.jobs[0].label}: aborted: {exc.message}")
            self.release(outcome_of(exc))
            raise StreamAborted from None
        finally:
            self.release("cancelled")

    async def events(self, first: bytes, body):
        """The body as server-sent events: audio deltas, then done (or an error event)."""
        try:
            yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(first).decode()})
            async for data in body:
                yield sse({"type": "speech.audio.delta",
                            "audio": base64.b64encode(data).decode()})
            total = self.usage["input_tokens"] + self.usage["output_tokens"]
            done = {"type": "speech.audio.done", "usage": {**self.usage, "total_tokens": total}}
            if self.params.captions:
                done["captions"] = self.cues()
            yield sse(done)
            self.release("ok")
        except ApiError as exc:
            self.release(outcome_of(exc))
            yield sse({"type": "error", "error": {"message": exc.message, "code": exc.code}})
        finally:
            self.release("cancelled")


@functools.cache
def _bounded_stream():
    """The response class of streamed bodies (built on first use: FastAPI is optional)."""
    from starlette.responses import StreamingResponse

    class BoundedStream(StreamingResponse):
        """A `StreamingResponse` of one `Speech`: every send bounded by its deadline, and the
        request released however the response ends (done, aborted, cut off, cancelled)."""

        def __init__(self, speech: Speech, content, **kwargs):
            super().__init__(content, **kwargs)
            self.speech = speech

        async def __call__(self, scope, receive, send) -> None:
            try:
                await super().__call__(scope, receive, self.speech.bounded(send))
            finally:
                self.speech.release("cancelled")

    return BoundedStream


class _Aborts:
    """ASGI wrapper: a stream aborted mid-body ends the connection quietly (no traceback)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        except StreamAborted:
            pass


def _zeros(n: int):
    import numpy as np

    return np.zeros(n, dtype=np.float32)


def require_extra() -> None:
    """The serve extra's packages import, else a UsageError naming the extra."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UsageError(EXTRA_HINT) from None


def main(cfg: ServeConfig, options: "OptionValues", config: str | None, reporter) -> int:
    """`mimo-tts serve` (after `require_extra`): check the voices, bind, load once, serve until
    a signal."""
    with loaded(cfg, options, config, reporter) as (settings, sock, tts):
        server = SpeechServer(tts, cfg, settings.synthesis,
                              public_model_name(settings.checkpoints.lm[0]), reporter.info)
        reporter.info(serving_line(server, sock, tts))
        try:
            stopped_by = serve(server.app(), sock, reporter.verbose)
        finally:
            server.close()
    reporter.info(f"server stopped ({stopped_by})")
    return 0


def serving_line(server: SpeechServer, sock, tts) -> str:
    """The start-up line: the model (its directory here, in the server's own log), the real
    address (`--port 0` too), whether /v1 and /metrics need a key, batching, formats, voices."""
    port = sock.getsockname()[1]
    path = getattr(getattr(tts, "lm_ref", None), "path", None)
    source = f" (from {path})" if path is not None else ""
    auth = "API key required on /v1 and /metrics" if server.cfg.api_key is not None else \
        "no API key: /v1 and /metrics are open"
    voices = ", ".join(["default", "natural", *server.cfg.voices])
    return (f"serving {server.model}{source} on {url_of(server.cfg.host, port)} ({auth}; "
            f"batch {server.cfg.batch_size}; formats {', '.join(server.formats)}; "
            f"voices {voices})")
