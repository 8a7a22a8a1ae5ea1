"""A request's life on the speech worker (`server/session.py`), for both servers: exactly
`--max-concurrent` requests in progress plus `--max-queue` waiting, then 503; a waiting request
starts the moment a place frees, first come first served; its jobs reach the worker only then.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from mimo_tts.presets import ensure_tiny_preset
from mimo_tts.runtime.paths import CACHE_ENV

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def tiny(tiny_cache):
    from mimo_tts.synthesis.preflight import lengths_for
    from mimo_tts.synthesis.settings import resolve
    from mimo_tts.synthesis.synthesizer import MiMoTTS

    lm, tok = ensure_tiny_preset({CACHE_ENV: str(tiny_cache)})
    settings = resolve({"model": str(lm), "tokenizer": str(tok), "lm_device": "cpu",
                        "tokenizer_device": "cpu", "stream": True}, None, {})
    with MiMoTTS.from_settings(settings, lengths_for(settings, [], 8)) as tts:
        yield tts, settings.synthesis


def _cfg(**given):
    from mimo_tts.server.protocol import ServeConfig

    return ServeConfig(**given)


def test_capacity_is_max_concurrent_plus_max_queue_and_a_place_passes_on(tiny):
    from mimo_tts.server.session import Sessions

    tts, base = tiny

    async def run():
        sessions = Sessions(tts, _cfg(max_concurrent=2, max_queue=3), base)
        try:
            opened = [sessions.open("t") for _ in range(5)]
            assert all(opened) and sessions.open("t") is None  # the sixth is refused
            assert sessions.places() == {"active": 2, "queued": 3}
            prompts = tts.prompts("Hi.", base, 0)
            for session in opened:
                session.start(prompts, base, streamed=False)
            assert [s.submitted for s in opened] == [True, True, False, False, False]
            opened[1].release("ok")  # its place goes to the first waiting request, now
            assert [s.submitted for s in opened] == [True, True, True, False, False]
            opened[3].release("cancelled")  # a waiting request leaves: nothing starts
            assert sessions.places() == {"active": 2, "queued": 1}
            assert sessions.open("t") and sessions.open("t") and sessions.open("t") is None
            assert sessions.counts == {"ok": 1, "failed": 0, "cancelled": 1, "rejected": 2}
            first = await opened[0].next_event(0)
            while first[0] == "audio":
                first = await opened[0].next_event(0)
            assert first[0] == "done" and first[1]["audio"].numel() > 0
        finally:
            sessions.close(timeout=30)

    asyncio.run(run())


def test_a_request_promoted_before_it_is_tokenised_starts_when_it_is(tiny):
    from mimo_tts.server.session import Sessions

    tts, base = tiny

    async def run():
        sessions = Sessions(tts, _cfg(max_concurrent=1, max_queue=1), base)
        try:
            first, second = sessions.open("t"), sessions.open("t")
            first.release("ok")  # the waiting one holds the place, with no jobs yet
            assert sessions.places() == {"active": 1, "queued": 0} and not second.submitted
            second.start(tts.prompts("Hi.", base, 0), base, streamed=True)
            assert second.submitted
            while (event := await second.next_event(0))[0] == "audio":
                pass
            assert event[0] == "done"
        finally:
            sessions.close(timeout=30)

    asyncio.run(run())


CAPACITIES = [({}, 40),  # the defaults, 16 in progress + 32 waiting: the burst of 40
              ({"max_concurrent": 2, "max_queue": 1}, 3),
              ({"max_concurrent": 2, "max_queue": 4, "batch_size": 2}, 6)]


@pytest.mark.parametrize(("given", "burst"), CAPACITIES)
def test_a_burst_at_capacity_is_answered_whole(tiny, given, burst):
    """A burst of at most max_concurrent + max_queue speech requests on an idle server: every
    one is answered 200 (issue 32 item 1: admitted requests the worker had not started counted
    against the queue, so 40 on the defaults got 6-7 503s, and 3 on 2 + 1 got 1-2 answers)."""
    from mimo_tts.server.app import SpeechServer

    tts, base = tiny

    async def run():
        server = SpeechServer(tts, _cfg(**given), base, "tiny")
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app()),
                                   base_url="http://localhost", timeout=300)
        try:
            body = {"model": "tiny", "input": "A burst.", "response_format": "pcm"}
            answers = await asyncio.gather(*[client.post("/v1/audio/speech", json=body)
                                             for _ in range(burst)])
            assert [a.status_code for a in answers] == [200] * burst
            health = (await client.get("/health")).json()
            assert health["requests"]["rejected"] == 0 and health["requests"]["ok"] == burst
        finally:
            await client.aclose()
            server.close()

    asyncio.run(run())


@pytest.mark.parametrize(("given", "burst"), CAPACITIES[:2])
def test_a_wyoming_burst_at_capacity_is_answered_whole(tiny, given, burst):
    """The same capacity on the Wyoming face: `burst` clients at once, each a text, all
    spoken (no `busy` error event)."""
    pytest.importorskip("wyoming")
    from wyoming.event import async_read_event, async_write_event
    from wyoming.tts import Synthesize

    from mimo_tts.server.wyoming import Connection, WyomingSpeech

    tts, base = tiny

    async def client(port: int) -> str:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            await async_write_event(Synthesize(text="A burst.").event(), writer)
            while (event := await async_read_event(reader)).type not in ("audio-stop", "error"):
                pass
            return event.type
        finally:
            writer.close()

    async def run():
        speech = WyomingSpeech(tts, _cfg(**given), base, "tiny")
        server = await asyncio.start_server(
            lambda r, w: Connection(speech, r, w).run(), "127.0.0.1", 0)
        try:
            port = server.sockets[0].getsockname()[1]
            ends = await asyncio.wait_for(asyncio.gather(*[client(port) for _ in range(burst)]),
                                          600)
            assert ends == ["audio-stop"] * burst
            assert speech.sessions.counts["rejected"] == 0
        finally:
            server.close()
            speech.close()

    asyncio.run(run())


def test_sessions_take_the_servers_worker_rows_and_rounds(tiny):
    from mimo_tts.server.session import Sessions

    tts, base = tiny

    async def run():
        sessions = Sessions(tts, _cfg(batch_size=3, stage1_batch=5), base)
        try:
            return SimpleNamespace(rows=sessions.worker.rows,
                                   stage1_batch=sessions.worker.stage1_batch)
        finally:
            sessions.close(timeout=30)

    assert vars(asyncio.run(run())) == {"rows": 3, "stage1_batch": 5}
