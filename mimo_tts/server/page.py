"""The browser's side of `mimo-tts serve`: the page at `/` and the speech body for `/docs`.

The page is one static HTML file shipped in the package (no build step, no CDN), filled with
what this server offers (model, voices, formats). It plays streamed `pcm`/`wav` through Web
Audio as the bytes come and offers the answer as a file; with `--api-key` it asks for the key
once and keeps it in the browser's localStorage."""

from __future__ import annotations

import functools
import json
from importlib import resources

from mimo_tts.synthesis.audio import FORMATS, SAMPLE_RATE

PAGE = "page/index.html"
CONFIG_MARK = "__MIMO_TTS_CONFIG__"


@functools.cache
def _template() -> str:
    return resources.files("mimo_tts.server").joinpath(PAGE).read_text(encoding="utf-8")


def page_html(model: str, voices: list[str], formats: list[str], api_key: bool) -> str:
    """The page with its settings as JSON in a script tag (`<` escaped, so no name can end it)."""
    config = {"model": model, "voices": voices, "formats": formats, "api_key": api_key,
              "sample_rate": SAMPLE_RATE,
              "extensions": {f: FORMATS[f][2].lstrip(".") for f in formats if f in FORMATS}}
    return _template().replace(CONFIG_MARK, json.dumps(config).replace("<", "\\u003c"))


def speech_openapi(formats: list[str]) -> dict:
    """The speech request's body for `/docs` (the route reads its JSON itself, so FastAPI cannot
    infer it): the fields `protocol.RequestParser` takes, with this server's formats."""
    text = {"type": "string"}
    fields = {"model": {**text, "default": "mimo-tts"},
              "input": {**text, "description": "the text to speak"},
              "voice": {**text, "default": "default",
                        "description": "default, natural, or a --voice name"},
              "instructions": {**text, "description": "a style instruction"},
              "response_format": {"type": "string", "enum": formats},
              "stream_format": {"type": "string", "enum": ["audio", "sse"]},
              "seed": {"type": "integer", "minimum": 0}}
    schema = {"type": "object", "required": ["model", "input"], "properties": fields}
    audio = {"schema": {"type": "string", "format": "binary"}}
    return {"requestBody": {"required": True, "content": {"application/json": {
                "schema": schema, "example": {"model": "mimo-tts", "input": "Hello."}}}},
            "responses": {"200": {"description": "the audio (pcm and wav stream)",
                                  "content": {"audio/wav": audio, "audio/pcm": audio}}}}
