"""`mimo-tts serve`: an OpenAI-compatible speech endpoint on the worker of `server/engine.py`.

`POST /v1/audio/speech` (`model`, `input`, `voice`, `instructions`, `response_format`,
`stream_format`, `seed`), `GET /v1/models`, `GET /health`, on FastAPI and uvicorn (the optional
`serve` extra). The status of a request is decided when its first audio bytes are ready, so
every failure before them is an OpenAI-style JSON error with the CLI's message; `pcm` and `wav`
stream as Stage-1 decodes them (a WAV header of unknown length), the other formats come whole,
decoded one-shot as `synth` does. Loopback by default, an optional bearer token, bounded input,
queue and concurrency (503 with Retry-After), a per-request timeout; a client that goes away
cancels its jobs.
"""

import asyncio
import base64
import hmac
import json
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from mimo_tts.errors import DeviceError, InputError, MimoTTSError, UsageError
from mimo_tts.server.engine import (
    ContinuousStrategy,
    RequestQueue,
    SpeechJob,
    SpeechWorker,
    StaticBatcher,
    Ticket,
)
from mimo_tts.synthesis.audio import (
    PAUSE_FRAMES,
    SAMPLE_RATE,
    encode_audio,
    join_pieces,
    lossy_formats,
    pcm16,
    wav_stream_header,
)
from mimo_tts.synthesis.options import MAX_SEED
from mimo_tts.synthesis.text import clean_text

if TYPE_CHECKING:
    from mimo_tts.synthesis.options import SynthesisOptions

API_KEY_ENV = "MIMO_TTS_API_KEY"
EXTRA_HINT = "mimo-tts serve needs the serve extra: pip install 'mimo-tts[serve]'"
STREAMED = ("pcm", "wav")  # formats whose bytes go out as Stage-1 decodes them
MEDIA_TYPES = {"pcm": "audio/pcm", "wav": "audio/wav", "flac": "audio/flac", "mp3": "audio/mpeg",
               "opus": "audio/opus"}
FIELDS = ("model", "input", "voice", "instructions", "response_format", "stream_format", "seed",
          "speed")
# OpenAI's model and voice names, accepted so that existing clients work unchanged.
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage",
                 "shimmer", "verse")
MAX_BODY_BYTES = 1 << 20
RETRY_AFTER_S = 1
CLIENT_GONE = 499  # the status nginx logs for a client that closed its request
POLL_S = 0.25  # how often a request waiting for its first audio checks for a disconnect


@dataclass(frozen=True)
class ServeConfig:
    """The server's own options (the model's come from `options.resolve`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    voices: dict = field(default_factory=dict)  # name -> prompt-audio path
    batch_size: int = 8
    max_queue: int = 32
    max_concurrent: int = 16
    max_input_chars: int = 4096
    timeout: float = 300.0

    def __post_init__(self):
        for name in ("batch_size", "max_queue", "max_concurrent", "max_input_chars"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
        if not 0 <= self.port <= 65535:
            raise UsageError("--port must be in [0, 65535]")
        if not self.timeout > 0:
            raise UsageError("--timeout must be > 0 seconds")
        if self.api_key == "":
            raise UsageError("--api-key is empty")


def parse_voices(values: list[str]) -> dict:
    """`--voice NAME=PATH` options -> {name: path}; each file must exist."""
    voices = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path:
            raise UsageError(f"--voice takes NAME=PATH.wav, got {value!r}")
        if name in voices or name in ("default", "natural"):
            raise UsageError(f"--voice {name}: the name is already taken")
        if not os.path.isfile(path):
            raise InputError(f"--voice {name}: prompt audio not found: {path}")
        voices[name.strip()] = path
    return voices


class ApiError(Exception):
    """An OpenAI-style JSON error: status, message, and optionally `param`, `code`, headers."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @classmethod
    def of(cls, exc: MimoTTSError) -> "ApiError":
        status = 400 if isinstance(exc, UsageError | InputError) else \
            503 if isinstance(exc, DeviceError) else 500
        return cls(status, str(exc))

    def response(self):
        from fastapi.responses import JSONResponse

        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return JSONResponse({"error": {"message": self.message, "type": kind,
                                       "param": self.param, "code": self.code}},
                            self.status, self.headers)


class StreamAborted(Exception):
    """A failure after the response started: the connection is closed without its end."""


@dataclass
class SpeechParams:
    text: str
    options: "SynthesisOptions"
    fmt: str
    sse: bool


class SpeechServer:
    """The HTTP face over one loaded `MiMoTTS` and its `SpeechWorker`."""

    def __init__(self, tts, cfg: ServeConfig, base: "SynthesisOptions", model: str, log=None):
        self.tts, self.cfg, self.base, self.model = tts, cfg, base, model
        self.log = log or (lambda message: None)
        self.formats = ["pcm", "wav", "flac", *lossy_formats()]
        self.default_format = "mp3" if "mp3" in self.formats else "wav"
        self.requests = RequestQueue(cfg.max_queue, cfg.max_concurrent)
        strategy = ContinuousStrategy if tts.engine.continuous else StaticBatcher
        self.worker = SpeechWorker(tts, self.requests, strategy(tts, cfg.batch_size, self.log),
                                   base, self.log)
        self.counts = {"ok": 0, "failed": 0, "cancelled": 0, "rejected": 0}
        self.serial = 0

    # -- request parsing --
    def parse(self, body: bytes) -> SpeechParams:
        """The request body -> what to say and how; bad values are 400s with the CLI's words."""
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object")
        unknown = sorted(set(data) - set(FIELDS))
        if unknown:
            raise ApiError(400, f"unknown field(s): {', '.join(unknown)}", unknown[0])
        model = _field(data, "model", str, required=True)
        if model not in (self.model, "mimo-tts", *OPENAI_MODELS):
            raise ApiError(404, f"model {model!r} is not served; use {self.model!r}", "model",
                           "model_not_found")
        text = _field(data, "input", str, required=True)
        if len(text) > self.cfg.max_input_chars:
            raise ApiError(400, f"input is {len(text)} characters; the limit is "
                           f"{self.cfg.max_input_chars} (--max-input-chars)", "input",
                           "string_above_max_length")
        instruct = _field(data, "instructions", str)
        fmt = _field(data, "response_format", str) or self.default_format
        stream_format = _field(data, "stream_format", str) or "audio"
        seed = _field(data, "seed", int)
        speed = _field(data, "speed", int | float)
        _require(fmt in self.formats, f"response_format must be one of {', '.join(self.formats)}",
                 "response_format")
        _require(stream_format in ("audio", "sse"), "stream_format must be audio or sse",
                 "stream_format")
        _require(speed is None or speed == 1, "speed is not supported (only 1.0)", "speed")
        _require(seed is None or 0 <= seed <= MAX_SEED, "--seed must be in [0, 2**64 - 1]",
                 "seed")
        task, prompt_audio = self.voice(_field(data, "voice", str) or "default", instruct)
        try:
            text = clean_text(text, "input")
            options = replace(self.base, task=task, instruct=instruct, prompt_audio=prompt_audio,
                              seed=self.base.seed if seed is None else seed)
        except MimoTTSError as exc:
            raise ApiError.of(exc) from None
        return SpeechParams(text, options, fmt, stream_format == "sse")

    def voice(self, name: str, instruct: str | None) -> tuple[str, str | None]:
        """A voice -> (task, prompt audio): a registered voice clones its prompt audio."""
        if name in self.cfg.voices:
            return "tts_sft_with_audio", self.cfg.voices[name]
        if name == "natural":
            return "tts_sft_with_natural_instruction", None
        if name == "default" or name in OPENAI_VOICES:
            return ("tts_sft" if instruct is None else "tts_sft_with_instruct"), None
        choices = ", ".join(["default", "natural", *self.cfg.voices])
        raise ApiError(400, f"unknown voice {name!r}; choose one of {choices}", "voice")

    # -- the request's life --
    async def speech(self, request):
        from fastapi.responses import Response, StreamingResponse
        from starlette.background import BackgroundTask
        from starlette.concurrency import run_in_threadpool

        params = self.parse(await _read_body(request))
        try:
            prompts = await run_in_threadpool(self.tts.prompts, params.text, params.options,
                                              params.options.seed)
        except MimoTTSError as exc:
            raise ApiError.of(exc) from None
        ticket = Ticket()
        if not self.requests.admit(ticket):
            self.counts["rejected"] += 1
            raise ApiError(503, "the server is busy (queue full); retry later", code="busy",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.serial += 1
        speech = Speech(self, params, prompts, ticket, self.serial)
        body = speech.body(request)
        try:
            first = await anext(body)
        except BaseException as exc:  # the JSON error (or a bug's 500) follows; the place goes
            speech.release("cancelled" if getattr(exc, "status", None) == CLIENT_GONE
                           else "failed")
            raise
        headers = {"X-MiMo-Batch-Rows": str(speech.jobs[0].rows)}
        # The body's own `finally` releases the request; the background task does it when the
        # client went away before the body started (release is idempotent).
        done = BackgroundTask(speech.settle)
        if params.sse:
            return StreamingResponse(speech.events(first, body), media_type="text/event-stream",
                                     headers=headers, background=done)
        if params.fmt not in STREAMED:
            await body.aclose()
            speech.release("ok")
            return Response(first, media_type=MEDIA_TYPES[params.fmt], headers=headers)
        return StreamingResponse(speech.rest(first, body), media_type=MEDIA_TYPES[params.fmt],
                                 headers=headers, background=done)

    def health(self) -> dict:
        return {"status": "ok", "model": self.model, **self.requests.counts(),
                "batch_size": self.cfg.batch_size, **self.worker.stats,
                "requests": dict(self.counts)}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                            "owned_by": "mimo-tts"}]}

    def authorized(self, request) -> bool:
        if self.cfg.api_key is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.cfg.api_key}".encode())

    def app(self):
        """The FastAPI application: the three endpoints, errors as OpenAI-style JSON."""
        from fastapi import Depends, FastAPI, Request
        from fastapi.responses import JSONResponse
        from starlette.exceptions import HTTPException

        def auth(request: Request) -> None:
            if not self.authorized(request):
                raise ApiError(401, "missing or invalid API key (Authorization: Bearer ...)",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

        async def speech(request: Request):
            return await self.speech(request)

        app = FastAPI(title="mimo-tts", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(ApiError, lambda request, exc: exc.response())
        app.add_exception_handler(HTTPException, lambda request, exc: ApiError(
            exc.status_code, str(exc.detail)).response())
        app.add_exception_handler(Exception, lambda request, exc: ApiError(
            500, f"unexpected {type(exc).__name__}: {exc}").response())
        app.post("/v1/audio/speech", dependencies=[Depends(auth)])(speech)
        app.get("/v1/models", dependencies=[Depends(auth)])(lambda: JSONResponse(self.models()))
        app.get("/health")(lambda: JSONResponse(self.health()))
        return _Aborts(app)


class Speech:
    """One request's jobs (one per text piece) and the events they send to the event loop."""

    def __init__(self, server: SpeechServer, params: SpeechParams, prompts: list,
                 ticket: Ticket, serial: int):
        self.server, self.params, self.ticket = server, params, ticket
        label = f"speech-{serial}"
        loop = asyncio.get_running_loop()
        self.deadline = loop.time() + server.cfg.timeout
        self.queues = [asyncio.Queue() for _ in prompts]
        options = params.options.generation_options(params.options.seed)
        self.jobs = [SpeechJob(prompt, options, params.options.seed, params.fmt in STREAMED,
                         _deliver(loop, q), ticket, label, (serial, i))
                     for i, (prompt, q) in enumerate(zip(prompts, self.queues, strict=True))]
        self.usage = {"input_tokens": sum(p.n_groups for p in prompts), "output_tokens": 0}
        self.released = False
        server.worker.submit(self.jobs)

    def release(self, outcome: str) -> None:
        if not self.released:
            self.released = True
            self.server.worker.cancel(self.jobs)
            self.server.requests.release(self.ticket)
            self.server.counts[outcome] += 1

    async def settle(self) -> None:
        self.release("cancelled")

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
                yield pcm16(_zeros(pause))
            while (event := await self.next_event(i, request))[0] == "audio":
                yield header + pcm16(event[1])
                header, request = b"", None
            if event[0] == "error":
                raise ApiError.of(event[1])
            audios.append(event[1]["audio"])
            self.usage["output_tokens"] += event[1]["groups"]
        if fmt not in STREAMED:
            from starlette.concurrency import run_in_threadpool

            joined = join_pieces(audios, PAUSE_FRAMES,
                                     self.server.tts.stage1.samples_per_frame)
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
            self.release("failed")
            raise StreamAborted from None
        finally:
            self.release("cancelled")

    async def events(self, first: bytes, body):
        """The body as server-sent events: audio deltas, then done (or an error event)."""
        try:
            yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(first).decode()})
            async for data in body:
                yield _sse({"type": "speech.audio.delta",
                            "audio": base64.b64encode(data).decode()})
            total = self.usage["input_tokens"] + self.usage["output_tokens"]
            yield _sse({"type": "speech.audio.done", "usage": {**self.usage,
                                                               "total_tokens": total}})
            self.release("ok")
        except ApiError as exc:
            self.release("failed")
            yield _sse({"type": "error", "error": {"message": exc.message, "code": exc.code}})
        finally:
            self.release("cancelled")


class _Aborts:
    """ASGI wrapper: a stream aborted mid-body ends the connection quietly (no traceback)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        except StreamAborted:
            pass


async def _read_body(request) -> bytes:
    """The request body, refused (413) once it passes `MAX_BODY_BYTES`."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
    return bytes(body)


def _field(data: dict, name: str, kind, required: bool = False):
    value = data.get(name)
    if value is None:
        _require(not required, f"{name} is required", name)
        return None
    _require(isinstance(value, kind) and not isinstance(value, bool),
             f"{name} must be {_kind_words(kind)}", name)
    return value


def _kind_words(kind) -> str:
    return {str: "a string", int: "an integer"}.get(kind, "a number")


def _require(ok: bool, message: str, param: str | None = None) -> None:
    if not ok:
        raise ApiError(400, message, param)


def _deliver(loop, events: asyncio.Queue):
    """A job's `deliver`: from the worker threads into the request's queue on the loop."""
    def deliver(event: tuple) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    return deliver


def _zeros(n: int):
    import numpy as np

    return np.zeros(n, dtype=np.float32)


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


def main(flags: dict, config: str | None, reporter) -> int:
    """`mimo-tts serve`: resolve the options, load once, serve until interrupted."""
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise UsageError(EXTRA_HINT) from None
    from mimo_tts.synthesis.options import resolve
    from mimo_tts.synthesis.preflight import lengths_for
    from mimo_tts.synthesis.profiles import load_profile
    from mimo_tts.synthesis.synthesizer import MiMoTTS

    serve_keys = ("host", "port", "api_key", "batch_size", "max_queue", "max_concurrent",
                  "max_input_chars", "timeout")
    given = {k: flags[k] for k in serve_keys if flags.get(k) is not None}
    given.setdefault("api_key", os.environ.get(API_KEY_ENV) or None)
    cfg = ServeConfig(**given, voices=parse_voices(flags.get("voice") or []))
    model_flags = {k: v for k, v in flags.items() if k not in (*serve_keys, "voice")}
    # Stage-0 and Stage-1 run side by side, as with --stream (thread budgets split the CPU)
    settings = resolve({**model_flags, "stream": True}, load_profile(config), os.environ)
    with MiMoTTS.from_settings(settings, lengths_for(settings, [], cfg.batch_size),
                               reporter.log) as tts:
        for path in cfg.voices.values():
            tts.stage1.prompt_codes(path)  # encoded once, before the first request
        server = SpeechServer(tts, cfg, settings.synthesis, settings.checkpoints.lm[0],
                              reporter.info)
        reporter.info(f"serving {server.model} on http://{cfg.host}:{cfg.port} "
                      f"(batch {cfg.batch_size}; formats {', '.join(server.formats)}; voices "
                      f"{', '.join(['default', 'natural', *cfg.voices])})")
        try:
            uvicorn.Server(uvicorn.Config(
                server.app(), host=cfg.host, port=cfg.port, access_log=reporter.verbose,
                log_level="info" if reporter.verbose else "warning")).run()
        except KeyboardInterrupt:  # uvicorn re-raises the SIGINT/SIGTERM it shut down on
            reporter.info("server stopped")
        finally:
            server.worker.close()
    return 0
