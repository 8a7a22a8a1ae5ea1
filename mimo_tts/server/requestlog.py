"""The request log of `mimo-tts serve`: one line on stderr per HTTP request when it ends, in
place of uvicorn's access log (which is off).

`POST /v1/audio/speech 200 voice=default chars=22 audio=1.28s first=0.35s total=0.52s`: the
method, the path, the status (`-` when no response was started: the client went away or the
server stopped), and for a speech request its voice, the characters of its input, the seconds
of audio in its body, the seconds to its first audio bytes and to its end. Never the text, the
query string or a header (the API key is one). `-q` silences it with the other info lines.
"""

from __future__ import annotations

import time
from urllib.parse import quote

from mimo_tts.server.metrics import TALLY_KEY, Tally
from mimo_tts.synthesis.audio import SAMPLE_RATE

PATH_SAFE = "/:@!$&'()*+,;=-._~"  # a path's own characters; anything else is %-escaped


class RequestLog:
    """ASGI wrapper: each HTTP request's `Tally` (in its scope, where the metrics and the
    speech route find it), then its line through `write` when the request ends."""

    def __init__(self, app, write):
        self.app, self.write = app, write

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        tally = scope.setdefault(TALLY_KEY, Tally())
        status: list[int] = []

        async def watched(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            self.write(request_line(scope, tally, status[0] if status else None))


def request_line(scope, tally: Tally, status: int | None) -> str:
    """The line of one request (see the module's docstring)."""
    words = [scope.get("method", "-"), quote(scope.get("path", ""), safe=PATH_SAFE),
             str(status) if status is not None else "-"]
    if tally.voice is not None:
        words.append(f"voice={tally.voice}")
    if tally.chars is not None:
        words.append(f"chars={tally.chars}")
    if tally.samples:
        words.append(f"audio={tally.samples / SAMPLE_RATE:.2f}s")
    if tally.first_at is not None:
        words.append(f"first={tally.first_at:.3f}s")
    words.append(f"total={time.perf_counter() - tally.start:.3f}s")
    return " ".join(words)
