"""What `mimo-tts serve` speaks: its options, the speech request's fields, OpenAI's names, errors.

A `POST /v1/audio/speech` body is read up to `MAX_BODY_BYTES`, then `RequestParser.parse` turns
its fields into `SpeechParams` (what to say, the synthesis options, the format, SSE or not).
Every bad value is an `ApiError`: a status and a message naming the request's fields, sent as
an OpenAI-style JSON error. Clients see the model's public name (`public_model_name`), never a
checkpoint path. No torch and no FastAPI at import.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from urllib.parse import urlsplit

from mimo_tts.errors import DeviceError, InputError, MimoTTSError, UsageError, short_repr
from mimo_tts.lm.tasks import TASKS
from mimo_tts.synthesis import aac
from mimo_tts.synthesis.audio import (
    AAC_FORMATS,
    FORMATS,
    LOSSY_FORMATS,
    check_prompt_file,
    lossy_formats,
    read_audio,
)
from mimo_tts.synthesis.markup import MarkupError, check_voices, script
from mimo_tts.synthesis.options import DEFAULT_TASK, MAX_SEED, SynthesisOptions, task_for
from mimo_tts.synthesis.tempo import SPEEDS
from mimo_tts.synthesis.text import clean_text
from mimo_tts.synthesis.voices import BUILT_IN, VoiceStore, served_voices
from mimo_tts.synthesis.worker import STAGE1_BATCH

FIELDS = ("model", "input", "voice", "instructions", "response_format", "stream_format", "seed",
          "speed", "captions")
MAX_VOICE_BYTES = 16 << 20  # an uploaded voice recording (POST /v1/audio/voices)
CAPTIONS_HEADER = "X-MiMo-Captions"  # the cues of a whole-file response, as JSON
# OpenAI's model, voice and response_format names, accepted so that existing clients work
# unchanged (aac is offered where PyAV is installed).
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage",
                 "shimmer", "verse")
OPENAI_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
PCM = "pcm"  # raw PCM16 samples: the server's stream, not a file format of `FORMATS`
PCM_MEDIA_TYPE = "audio/pcm"
STREAMED = (PCM, "wav")  # formats whose bytes go out as Stage-1 decodes them
MAX_BODY_BYTES = 1 << 20
CLIENT_GONE = 499  # the status nginx logs for a client that closed its request
API_KEY_ENV = "MIMO_TTS_API_KEY"
HOST_NAME = re.compile(r"[a-z0-9_-][a-z0-9._-]*")  # what --allowed-host takes
SHOWN_NAMES = 5  # unknown field names quoted in a refusal
KIND_WORDS = {str: "a string", int: "an integer", bool: "true or false"}  # else "a number"


@dataclass(frozen=True)
class ServeConfig:
    """The server's own options (the model's come from `options.resolve`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()  # Host names answered beside the bound ones (no key)
    voices: dict = field(default_factory=dict)  # name -> prompt-audio path
    batch_size: int = 8
    max_queue: int = 32
    max_concurrent: int = 16
    max_input_chars: int = 4096
    timeout: float = 300.0
    stage1_batch: int = STAGE1_BATCH  # streamed requests whose pushes one round decodes

    def __post_init__(self):
        for name in ("batch_size", "max_queue", "max_concurrent", "max_input_chars",
                     "stage1_batch"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
        if not 0 <= self.port <= 65535:
            raise UsageError("--port must be in [0, 65535]")
        if not self.timeout > 0:
            raise UsageError("--timeout must be > 0 seconds")
        if self.api_key is not None:
            check_api_key(self.api_key, "--api-key")
        object.__setattr__(self, "allowed_hosts", tuple(map(check_host_name,
                                                            self.allowed_hosts)))


# A server's options as its command gives them, by name: ServeConfig's fields, with the files
# of `--voice NAME=PATH` (`voice_files`) in place of the voices they make.
SERVE_KEYS = (*(f.name for f in fields(ServeConfig) if f.name != "voices"), "voice_files")
WYOMING_PORT = 10200  # the port Home Assistant's Wyoming integration suggests for TTS


def serve_config(given: Mapping[str, object], environ, port: int | None = None) -> ServeConfig:
    """The server's options from a command's (`SERVE_KEYS`, and Wyoming's `uri`; None: not
    given); the key may come from the environment, `port` is the face's default port."""
    values = {k: v for k, v in given.items()
              if v is not None and k not in ("api_key", "voice_files", "uri")}
    if given.get("uri") is not None:
        if "host" in values or "port" in values:
            raise UsageError("--uri and --host/--port both say where to listen; give one")
        values["host"], values["port"] = tcp_address(str(given["uri"]), port)
    elif port is not None:
        values.setdefault("port", port)
    return ServeConfig(**values, api_key=api_key_from(given.get("api_key"), environ),
                       voices=parse_voices(given.get("voice_files") or []))


def tcp_address(uri: str, port: int | None = None) -> tuple[str, int]:
    """`tcp://HOST:PORT` (as wyoming-piper's `--uri` takes it; `[::]` for IPv6) -> (host,
    port); without a port, `port`."""
    parts = urlsplit(uri)
    try:
        given = parts.port
    except ValueError:  # not a number, or past 65535
        given = -1
    if (parts.scheme != "tcp" or not parts.hostname or given == -1 or parts.path not in ("", "/")
            or parts.query or parts.fragment or parts.username is not None
            or given is None and port is None):
        raise UsageError(f"--uri takes tcp://HOST:PORT, got {uri!r}")
    return parts.hostname, port if given is None else given


def api_key_from(flag: str | None, environ) -> str | None:
    """The bearer token: `--api-key`, else `MIMO_TTS_API_KEY` when it is set at all (set but
    empty is refused, not read as "no key"), checked as `check_api_key` does."""
    if flag is not None:
        return check_api_key(flag, "--api-key")
    if API_KEY_ENV in environ:
        return check_api_key(environ[API_KEY_ENV], API_KEY_ENV)
    return None


def check_api_key(key: str, source: str) -> str:
    """A key a client can send in `Authorization: Bearer KEY`: printable ASCII, nothing around
    it (HTTP strips a header value's surrounding spaces, so such a key could never match)."""
    if key == "":
        raise UsageError(f"{source} is empty; give a key, or unset it to serve without one")
    if not key.strip():
        raise UsageError(f"{source} is only whitespace; no client could send it")
    if key != key.strip():
        raise UsageError(f"{source} starts or ends with whitespace; no client could send it")
    bad = next((c for c in key if not " " <= c <= "~"), None)
    if bad is not None:
        kind = "non-ASCII" if ord(bad) > 127 else "a control"
        raise UsageError(f"{source} has {kind} character U+{ord(bad):04X}; an HTTP header "
                         "carries printable ASCII only")
    return key


def check_host_name(name: str) -> str:
    """An `--allowed-host` name as a `Host` header carries it (lower case, an IPv6 address
    without brackets): a DNS name or an address, no scheme, port or path."""
    bare = name.strip().lower()
    if bare.startswith("[") and bare.endswith("]"):
        bare = bare[1:-1]
    if ":" in bare:
        try:
            return str(ipaddress.IPv6Address(bare))
        except ValueError:
            pass
    elif HOST_NAME.fullmatch(bare):
        return bare.rstrip(".")
    raise UsageError(f"--allowed-host takes a host name or address (no scheme, port or path), "
                     f"got {name!r}")


def public_model_name(name: str) -> str:
    """What clients see of the model (`/health`, `/v1/models`, errors): an HF id or a preset as
    given, a checkpoint directory by its own name only (its path stays in the server's log)."""
    path = os.path.expanduser(name)
    if os.path.isdir(path):  # a directory, as `runtime.checkpoints.resolve` takes it
        return os.path.basename(os.path.abspath(path)) or "mimo-tts"
    return name


def parse_voices(values: list[str]) -> dict:
    """`--voice NAME=PATH` options -> {name: path}; each path must be a regular file."""
    voices = {}
    for value in values:
        name, sep, path = value.partition("=")
        name = name.strip()
        if not sep or not name or not path:
            raise UsageError(f"--voice takes NAME=PATH.wav, got {value!r}")
        if name in voices or name in BUILT_IN:
            raise UsageError(f"--voice {name}: the name is already taken")
        # a directory or a FIFO (which would block the start-up read) is named as such
        check_prompt_file(path, f"--voice {name}: prompt audio")
        voices[name] = path
    return voices


def read_voices(voices: dict) -> None:
    """Each voice's prompt audio decoded once before the model loads (readable, with finite
    samples), a refusal naming the voice and the file."""
    for name, path in voices.items():
        _voice_step(name, path, lambda p=path: read_audio(p))


def encode_voices(tts, voices: dict, base: SynthesisOptions) -> None:
    """Each voice encoded once (the codes are kept) and built into a prompt, before the first
    request: a voice no request could use stops the start-up, naming the voice and its file."""
    options = replace(base, task="tts_sft_with_audio", instruct=None)
    for name, path in voices.items():
        _voice_step(name, path, lambda p=path: tts.prompts(
            "Hello.", replace(options, prompt_audio=p), options.seed))


def _voice_step(name: str, path: str, step) -> None:
    try:
        step()
    except MimoTTSError as exc:
        raise voice_error(name, path, exc) from None


def voice_error(name: str, path: str, exc: MimoTTSError) -> MimoTTSError:
    """`exc` (reading or encoding a voice's prompt audio at start-up) naming the voice and
    its file, with the same type and exit code."""
    message = str(exc) if path in str(exc) else f"{exc} ({path})"
    return type(exc)(f"--voice {name}: {message}")


def served_formats() -> list[str]:
    """The response formats this build answers in: pcm, then OpenAI's names among `FORMATS`
    in their order, the lossy ones only where this libsndfile has the encoder, aac only with
    PyAV."""
    lossy = lossy_formats()
    return [PCM, *(name for name in FORMATS if name in OPENAI_FORMATS
                   and (name not in LOSSY_FORMATS or name in lossy)
                   and (name not in AAC_FORMATS or aac.available()))]


def media_type(fmt: str) -> str:
    """The Content-Type of a response format."""
    return PCM_MEDIA_TYPE if fmt == PCM else FORMATS[fmt][3]


class ApiError(Exception):
    """An OpenAI-style JSON error: status, message, and optionally `param`, `code`, headers."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @classmethod
    def of(cls, exc: MimoTTSError, message: str | None = None) -> ApiError:
        """`exc` as a response: 400 for bad input, 503 for a device error, else 500;
        `message` in place of its own (the client's words, no server paths)."""
        status = 400 if isinstance(exc, UsageError | InputError) else \
            503 if isinstance(exc, DeviceError) else 500
        return cls(status, str(exc) if message is None else message)

    def response(self):
        from fastapi.responses import Response

        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}
        # ASCII JSON: whatever a message quotes, the body encodes (a lone surrogate too)
        return Response(json.dumps(body), self.status, self.headers,
                        media_type="application/json")


@dataclass
class SpeechParams:
    """A parsed speech request: the text, its synthesis options, the format, SSE or not."""

    text: str
    options: SynthesisOptions
    fmt: str
    sse: bool
    captions: bool = False  # cues in the X-MiMo-Captions header, or the SSE done event
    voice: str = "default"  # the voice as the request named it (a served name: the log's)


@dataclass(frozen=True)
class RequestParser:
    """Speech requests as this server takes them: its model name, voices, formats and limits,
    on top of the options it was started with (`base`)."""

    cfg: ServeConfig
    base: SynthesisOptions
    model: str
    formats: tuple[str, ...]
    store: VoiceStore = field(default_factory=VoiceStore)  # the registry (`tts.voices`)

    def parse(self, body: bytes) -> SpeechParams:
        """The request body -> what to say and how; bad values are 400s naming their fields.
        Everything is checked here, before the request is admitted or tokenised."""
        data = _json_object(body)
        unknown = sorted(_shown(name) for name in set(data) - set(FIELDS))
        if unknown:
            more = len(unknown) - SHOWN_NAMES
            listed = ", ".join(unknown[:SHOWN_NAMES]) + (f" and {more} more" if more > 0 else "")
            raise ApiError(400, f"unknown field(s): {listed}", unknown[0])
        model = _field(data, "model", str, required=True)
        if model not in (self.model, "mimo-tts", *OPENAI_MODELS):
            raise ApiError(404, f"model {short_repr(model)} is not served; use "
                           f"{self.model!r}", "model", "model_not_found")
        text = self.bounded(_field(data, "input", str, required=True), "input")
        instruct = _field(data, "instructions", str)
        if instruct is not None:
            self.bounded(instruct, "instructions")
            _require(bool(instruct.strip()), "instructions is empty", "instructions")
        fmt = _field(data, "response_format", str) or ("mp3" if "mp3" in self.formats else "wav")
        stream_format = _field(data, "stream_format", str) or "audio"
        seed = _field(data, "seed", int)
        speed = _field(data, "speed", int | float)
        captions = bool(_field(data, "captions", bool))
        _require(fmt in self.formats, f"response_format must be one of {', '.join(self.formats)}",
                 "response_format")
        _require(stream_format in ("audio", "sse"), "stream_format must be audio or sse",
                 "stream_format")
        _require(speed is None or SPEEDS[0] <= speed <= SPEEDS[1],
                 f"speed must be in [{SPEEDS[0]:g}, {SPEEDS[1]:g}]", "speed")
        _require(not captions or stream_format == "sse" or fmt not in STREAMED,
                 f"captions come with a whole file or stream_format sse, not a {fmt} stream",
                 "captions")
        _require(seed is None or 0 <= seed <= MAX_SEED, "seed must be in [0, 2**64 - 1]", "seed")
        text = _cleaned(text, "input")
        if instruct is not None:  # the rules of `input`, as a batch item's instruct follows
            instruct = _cleaned(instruct, "instructions")
        name = _field(data, "voice", str) or "default"
        task, prompt_audio, voice = self.voice(name, instruct)
        _require(instruct is None or TASKS[task].instruct != "none",
                 f"instructions: voice {name} takes no style instruction; use voice default or "
                 "a cloned voice with instructions", "instructions")
        try:
            options = replace(self.base, task=task, instruct=instruct, prompt_audio=prompt_audio,
                              voice=voice, captions=captions or self.base.captions,
                              seed=self.base.seed if seed is None else seed,
                              speed=self.base.speed if speed is None else float(speed))
        except MimoTTSError as exc:
            raise ApiError.of(exc, in_fields(str(exc))) from None
        self.tags(text, options, "input")  # read before it is queued
        return SpeechParams(text, options, fmt, stream_format == "sse", captions, name)

    def tags(self, text: str, options: SynthesisOptions, name: str,
             hint: str = "GET /v1/audio/voices lists them") -> None:
        """A text's pause and voice tags, each voice one this server serves: else a 400 on
        `name` saying which tag (and `hint`: where the served voices are listed)."""
        try:
            check_voices(script(text, options).named_voices,
                         lambda: [n for n, _ in served_voices(self.cfg.voices, self.store)],
                         hint)
        except MarkupError as exc:
            raise ApiError(400, str(exc), name) from None

    def bounded(self, text: str, name: str) -> str:
        """`input` or `instructions`, refused past `--max-input-chars`."""
        if len(text) > self.cfg.max_input_chars:
            raise ApiError(400, f"{name} is {len(text)} characters; this server's limit is "
                           f"{self.cfg.max_input_chars}", name,
                           "string_above_max_length")
        return text

    def voice(self, name: str, instruct: str | None) -> tuple[str, str | None, str | None]:
        """A voice -> (task, prompt audio, stored voice): a start-up voice clones its prompt
        audio, a registry voice its stored codes (read when the prompt is built)."""
        if name in self.cfg.voices:
            return task_for(instruct, self.cfg.voices[name]), self.cfg.voices[name], None
        if name in OPENAI_VOICES:
            name = "default"
        if name in BUILT_IN:
            task = BUILT_IN[name][0]
            return (task_for(instruct, None) if task == DEFAULT_TASK else task), None, None
        served = served_voices(self.cfg.voices, self.store)
        if (name, "registry") in served:
            return task_for(instruct, None, name), None, name
        raise ApiError(400, f"unknown voice {short_repr(name)}; choose one of "
                       f"{', '.join(n for n, _ in served)}", "voice")


async def read_body(request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refused (413) once it passes `MAX_BODY_BYTES`; a client that goes
    away during the upload is `CLIENT_GONE` (answered to nobody, no traceback)."""
    from starlette.requests import ClientDisconnect

    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"request body over {limit} bytes")
    except ClientDisconnect:
        raise ApiError(CLIENT_GONE, "client closed the request during the upload") from None
    return bytes(body)


# The CLI's flags in the options' own messages -> the request fields that set them
FLAG_FIELDS = {"--instruct": "instructions", "--seed": "seed", "--prompt-audio": "voice",
               "--voice": "voice"}


def in_fields(message: str) -> str:
    """A message of the synthesis options in a request's words: its fields, not the CLI's
    flags (`--instruct: task ...` -> `instructions: task ...`)."""
    for flag, name in FLAG_FIELDS.items():
        message = message.replace(flag, name)
    return message


def sse(event: dict) -> str:
    """One server-sent event carrying `event` as JSON."""
    return f"data: {json.dumps(event)}\n\n"


def _json_object(body: bytes) -> dict:
    """The body as a JSON object; anything `json.loads` refuses is a 400: bad UTF-8 or syntax,
    nesting too deep (RecursionError), an integer past Python's digit limit (ValueError)."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise ApiError(400, "request body is not valid JSON: nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except ValueError:  # an integer past the interpreter's digit limit
        raise ApiError(400, "request body is not valid JSON here: a number has more than "
                       f"{sys.get_int_max_str_digits()} digits") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    return data


def _shown(name: str) -> str:
    """A client's field name as an error message quotes it: as is when printable, else
    escaped (a lone surrogate cannot be encoded in the response), cut when long."""
    return name if name.isprintable() and len(name) <= 40 else short_repr(name)


def _cleaned(text: str, name: str) -> str:
    """`clean_text` on a request field: its refusal is a 400 naming the field."""
    try:
        return clean_text(text, name)
    except MimoTTSError as exc:
        raise ApiError(400, str(exc), name) from None


def _field(data: dict, name: str, kind, required: bool = False):
    value = data.get(name)
    if value is None:
        _require(not required, f"{name} is required", name)
        return None
    _require(isinstance(value, bool) if kind is bool else
             isinstance(value, kind) and not isinstance(value, bool),
             f"{name} must be {KIND_WORDS.get(kind, 'a number')}", name)
    return value


def _require(ok: bool, message: str, param: str | None = None) -> None:
    if not ok:
        raise ApiError(400, message, param)
