"""A speech response's sends end at the request's deadline (in process: no model, no socket).

A client that stops reading blocks `send` once the socket buffers are full; before, the deadline
was only checked while waiting for the engine, so such a client kept its place for good. The
same over a real socket, and the stop of a server holding one, is in `test_server_lifecycle.py`.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("starlette")

from mimo_tts.server.app import Speech, StreamAborted, _bounded_stream  # noqa: E402

BOUND_S = 30  # what the test itself waits at most


class FakeSpeech:
    """What `Speech.bounded` and the response class use of a request."""

    bounded = Speech.bounded
    label = "speech-1"

    def __init__(self, left_s: float):
        self.session = SimpleNamespace(deadline=asyncio.get_running_loop().time() + left_s)
        self.logs: list[str] = []
        self.server = SimpleNamespace(log=self.logs.append, cfg=SimpleNamespace(timeout=left_s))
        self.outcomes: list[str] = []

    def release(self, outcome: str) -> None:
        self.outcomes.append(outcome)


async def forever(*args) -> None:
    await asyncio.Event().wait()


def test_a_send_the_client_never_takes_ends_at_the_deadline():
    async def run():
        speech = FakeSpeech(0.2)
        with pytest.raises(StreamAborted):
            await asyncio.wait_for(speech.bounded(forever)({"type": "http.response.body"}),
                                   BOUND_S)
        return speech

    speech = asyncio.run(run())
    assert speech.outcomes == ["timeout"]
    assert speech.logs == ["speech-1: the client stopped reading; closed at --timeout (0.2 s)"]


def test_a_send_in_time_goes_through():
    async def run():
        speech, sent = FakeSpeech(BOUND_S), []

        async def send(message):
            sent.append(message)

        await speech.bounded(send)({"type": "http.response.body", "body": b"x"})
        return speech, sent

    speech, sent = asyncio.run(run())
    assert sent == [{"type": "http.response.body", "body": b"x"}] and speech.outcomes == []


def test_a_stream_whose_reader_stalls_is_released():
    """The response class: headers go out, the body's sends stall, the request is freed."""
    async def run():
        speech, sent = FakeSpeech(0.2), []

        async def send(message):
            sent.append(message["type"])
            if message["type"] == "http.response.body":
                await forever()

        async def body():
            yield b"first"
            yield b"second"

        response = _bounded_stream()(speech, body(), media_type="audio/pcm")
        scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
        with pytest.raises(StreamAborted):
            await asyncio.wait_for(response(scope, forever, send), BOUND_S)
        return speech, sent

    speech, sent = asyncio.run(run())
    assert sent == ["http.response.start", "http.response.body"]
    assert speech.outcomes[0] == "timeout"  # then "cancelled", which a real release ignores
