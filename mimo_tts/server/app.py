"""`mimo-tts serve`: an OpenAI-compatible speech endpoint on the speech worker
(`synthesis/worker.py`), each request a `server/session.py` session.

`POST /v1/audio/speech` (the fields of `protocol.py`), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus, `metrics.py`), `/v1/audio/voices` (`voices.py`): the routes are
`routes.py`'s, on FastAPI and uvicorn (the optional `serve` extra). The status of a request
is decided when its first audio bytes are ready, so every failure before them is an
OpenAI-style JSON error in the request's words; `pcm` and `wav` stream as Stage-1 decodes them
(a WAV header of unknown length), the other formats come whole, decoded one-shot as `synth`
does. Loopback by default, an optional bearer token, bounded input, requests in progress and
waiting (503 with Retry-After past both), a per-request timeout that bounds every send too (a
client that stops reading loses its place); a client that goes away cancels its jobs. Binding,
signals and the bounded shutdown are `server/lifecycle.py`'s.
"""

import asyncio
import base64
import functools
import hmac
import json

from mimo_tts.errors import MimoTTSError, UsageError
from mimo_tts.server.guard import Guard
from mimo_tts.server.lifecycle import SHUTDOWN_GRACE_S, loaded, serve, url_of
from mimo_tts.server.metrics import ServerMetrics, Tally, outcome_of, tally_of
from mimo_tts.server.page import page_html
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
from mimo_tts.server.requestlog import RequestLog
from mimo_tts.server.session import Session, Sessions
from mimo_tts.server.voices import client_message
from mimo_tts.synthesis.audio import (
    SAMPLE_RATE,
    encode_audio,
    join_pieces,
    pcm16,
    wav_stream_header,
)
from mimo_tts.synthesis.captions import cues
from mimo_tts.synthesis.markup import script
from mimo_tts.synthesis.options import SynthesisOptions
from mimo_tts.synthesis.settings import OptionValues
from mimo_tts.synthesis.voices import served_voices

EXTRA_HINT = "mimo-tts serve needs the serve extra: pip install 'mimo-tts[serve]'"
RETRY_AFTER_S = 1
POLL_S = 0.25  # how often a request waiting for its first audio checks for a disconnect


class StreamAborted(Exception):
    """A failure after the response started: the connection is closed without its end."""


class SpeechServer:
    """The HTTP face over one loaded `MiMoTTS` and its `SpeechWorker`."""

    def __init__(self, tts, cfg: ServeConfig, base: SynthesisOptions, model: str, log=None,
                 requests=None):
        """`log`: the server's messages; `requests`: the request log's lines (None: none)."""
        self.tts, self.cfg, self.model = tts, cfg, model  # model: the public name
        self.log = log or (lambda message: None)
        self.requests = requests
        self.formats = served_formats()
        self.parser = RequestParser(cfg, base, model, tuple(self.formats), tts.voices)
        self.metrics = ServerMetrics(lambda: self.sessions.places())
        self.sessions = Sessions(tts, cfg, base, self.log, self.metrics)
        self.live: set[Speech] = set()

    # -- the request's life --
    async def speech(self, request):
        """Checked (400s), admitted (503), tokenised, then answered as its audio comes."""
        from fastapi.responses import Response
        from starlette.concurrency import run_in_threadpool

        params = self.parser.parse(await read_body(request))
        tally = tally_of(request)
        tally.voice, tally.chars = params.voice, len(params.text)
        session = self.sessions.open("speech")
        if session is None:
            tally.outcome = "rejected"
            raise ApiError(503, "the server is busy (queue full); retry later", code="busy",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        try:
            prompts = await run_in_threadpool(self.tts.prompts, params.text, params.options,
                                              params.options.seed)
        except BaseException as exc:
            session.release("failed" if isinstance(exc, MimoTTSError) else "cancelled")
            if isinstance(exc, MimoTTSError):  # a voice that cannot be read, say
                raise ApiError.of(exc, client_message(str(exc), self)) from None
            raise
        speech = Speech(self, params, prompts, session, tally)
        body = speech.body(request)
        try:
            first = await anext(body)
        except BaseException as exc:  # the JSON error (or a bug's 500) follows; the place goes
            speech.release(outcome_of(exc))  # the client gone or the server's stop: cancelled
            raise
        tally.first_audio(params.fmt in STREAMED)
        headers = {"X-MiMo-Batch-Rows": str(session.rows)}
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
        self.sessions.close(timeout=SHUTDOWN_GRACE_S)

    def health(self) -> dict:
        return {"status": "ok", "model": self.model, **self.sessions.places(),
                "batch_size": self.cfg.batch_size, **self.sessions.worker.stats,
                "requests": dict(self.sessions.counts)}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                            "owned_by": "mimo-tts"}]}

    def page(self):
        """`/`: the page (open like /health; what it sends to /v1 needs the key, if any)."""
        from fastapi.responses import HTMLResponse

        voices = [name for name, _ in served_voices(self.cfg.voices, self.tts.voices)]
        return HTMLResponse(page_html(self.model, voices, self.formats,
                                      self.cfg.api_key is not None))

    def authorized(self, request) -> bool:
        if self.cfg.api_key is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.cfg.api_key}".encode())

    def app(self):
        """The FastAPI application: `routes.py`'s routes, errors as OpenAI-style JSON, each
        API request counted by `ServerMetrics.wrap`, each request's line in the request log;
        without a key, behind `guard.py`'s refusals of what other web pages send."""
        from mimo_tts.server.routes import BODY_TYPES, build_app

        app = build_app(self)
        if self.cfg.api_key is None:
            app = Guard(self.cfg, BODY_TYPES).wrap(app)
        app = self.metrics.wrap(app)
        return _Aborts(app if self.requests is None else RequestLog(app, self.requests))


class Speech:
    """One HTTP request: its session's events turned into the response's bytes."""

    def __init__(self, server: SpeechServer, params: SpeechParams, prompts: list,
                 session: Session, tally: Tally):
        self.server, self.params, self.session, self.tally = server, params, session, tally
        self.usage = {"input_tokens": sum(p.n_groups for p in prompts), "output_tokens": 0}
        self.lengths: list[int] = []  # each piece's samples, as they finish (captions)
        server.live.add(self)
        session.start(prompts, params.options, params.fmt in STREAMED)

    @property
    def label(self) -> str:
        return self.session.label

    def release(self, outcome: str) -> None:
        """The request is over (`outcome`: one of `metrics.OUTCOMES`): its jobs are cancelled,
        its place freed (once)."""
        if not self.session.released:
            self.tally.outcome = outcome
            self.session.release(outcome)
            self.server.live.discard(self)

    def cues(self) -> list[dict]:
        """The request's captions: a cue per piece from its samples and the pauses."""
        found = script(self.params.text, self.params.options)
        return [c.record() for c in cues(list(found.texts), self.lengths, SAMPLE_RATE,
                                         found.pauses, found.voices)]

    def bounded(self, send):
        """The response's `send`, each call cut off at the request's deadline: a client that
        stops reading blocks it (the socket is full), and would keep its place for good."""
        async def send_by_deadline(message) -> None:
            left = self.session.deadline - asyncio.get_running_loop().time()
            try:
                async with asyncio.timeout(max(left, 0)):
                    await send(message)
            except TimeoutError:
                self.server.log(f"{self.label}: the client stopped reading; closed "
                                f"at --timeout ({self.server.cfg.timeout:g} s)")
                self.release("timeout")
                raise StreamAborted from None

        return send_by_deadline

    async def next_event(self, index: int, request=None) -> tuple:
        """The piece's next event; before the response starts (`request` given), a client that
        went away cancels it. Past the deadline: 504."""
        while True:
            try:
                return await self.session.next_event(index, POLL_S if request else None)
            except TimeoutError:
                if self.session.loop.time() >= self.session.deadline:
                    raise ApiError(504, "the request took longer than this server's timeout "
                                   f"({self.server.cfg.timeout:g} s)", code="timeout") from None
                if request is not None and await request.is_disconnected():
                    raise ApiError(CLIENT_GONE, "client closed the request") from None

    async def body(self, request):
        """The response body's bytes: pcm/wav as decoded, other formats whole at the end."""
        fmt, pauses = self.params.fmt, script(self.params.text, self.params.options).pauses
        header = wav_stream_header(SAMPLE_RATE) if fmt == "wav" else b""
        audios = []
        for i in range(len(self.session.jobs)):
            if pauses[i] and fmt in STREAMED:
                self.tally.samples += pauses[i]
                yield header + bytes(2 * pauses[i])  # PCM16 silence
                header = b""
            while (event := await self.next_event(i, request))[0] == "audio":
                self.tally.samples += int(event[1].shape[-1])
                yield header + pcm16(event[1])
                header, request = b"", None
            if event[0] == "error":
                raise ApiError.of(event[1], client_message(str(event[1]), self.server))
            audios.append(event[1]["audio"])
            self.lengths.append(int(event[1]["audio"].shape[-1]))
            self.usage["output_tokens"] += event[1]["groups"]
        if pauses[-1] and fmt in STREAMED:
            self.tally.samples += pauses[-1]
            yield header + bytes(2 * pauses[-1])
        if fmt not in STREAMED:
            from starlette.concurrency import run_in_threadpool

            joined = join_pieces(audios, pauses)
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
            self.server.log(f"{self.label}: aborted: {exc.message}")
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


def require_extra() -> None:
    """The serve extra's packages import, else a UsageError naming the extra."""
    try:
        import fastapi  # noqa: F401
        import fastapi_offline  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UsageError(EXTRA_HINT) from None


def main(cfg: ServeConfig, options: OptionValues, config: str | None, reporter) -> int:
    """`mimo-tts serve` (after `require_extra`): check the voices, bind, load once, serve until
    a signal."""
    with loaded(cfg, options, config, reporter) as (settings, sock, tts):
        server = SpeechServer(tts, cfg, settings.synthesis,
                              public_model_name(settings.checkpoints.lm[0]), reporter.info,
                              reporter.info)  # the request log: -q silences it
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
    voices = ", ".join(name for name, _ in served_voices(server.cfg.voices, tts.voices))
    return (f"serving {server.model}{source} on {url_of(server.cfg.host, port)} ({auth}; "
            f"batch {server.cfg.batch_size}; formats {', '.join(server.formats)}; "
            f"voices {voices})")
