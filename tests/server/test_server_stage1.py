"""The server's Stage-1 in rounds (`SpeechWorker`, `codec.push_streams`): streamed requests of
different lengths, decoded together, each get the bytes they get alone.

Stage-1 runs on one thread here (`--tokenizer-threads 1`), where a pushed-together decode is
exactly a solo one (tests/codec/test_codec_batched.py says why more threads round ~1e-8 apart).
"""

from __future__ import annotations

import concurrent.futures
import re

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

# (text, instructions): the tiny preset's circuit speaks longer in the instruct layout
REQUESTS = (("Short one.", None), ("A longer request, spoken calmly.", "calm and slow"),
            ("Medium length text here.", None), ("The last request of them all.", "cheerful"))


@pytest.fixture(scope="module")
def client(start_server):
    url = start_server("--batch-size", 4, "--max-concurrent", 8, "--max-queue", 8,
                       "--tokenizer-threads", 1, "--stage1-batch", 4)
    with httpx.Client(base_url=url, timeout=300) as c:
        yield c


def _pcm(client, request) -> bytes:
    text, instructions = request
    body = {"model": "tiny", "input": text, "response_format": "pcm"}
    body |= {"instructions": instructions} if instructions else {}
    with client.stream("POST", "/v1/audio/speech", json=body) as response:
        assert response.status_code == 200
        return b"".join(response.iter_raw())


def test_streamed_requests_decoded_together_equal_their_solo_runs(client):
    solo = [_pcm(client, request) for request in REQUESTS]
    rounds = client.get("/health").json()
    assert rounds["max_stage1_jobs"] == 1  # one request at a time: every round held one push
    # Whether a burst's pushes meet in one Stage-1 round depends on timing (a loaded machine
    # can serve them one after another): send it again until they have met, at most 5 times;
    # every burst must equal the solo runs.
    for _ in range(5):
        with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
            together = list(pool.map(lambda request: _pcm(client, request), REQUESTS))
        assert together == solo
        state = client.get("/health").json()
        if state["max_stage1_jobs"] > 1:
            break
    assert state["max_stage1_jobs"] > 1 and state["max_batch_rows"] > 1
    assert len({len(b) for b in solo}) > 1  # different lengths
    assert together == solo


def test_a_server_packs_the_decoder_before_it_serves(start_server):
    """Where loading leaves the float32 decoder's packing for later (oneDNN's layout, which a
    one-shot run never pays for), a server packs it at start-up, so no stream waits for it in
    the middle; and says so with -v."""
    url = start_server("-v", env={"MIMO_TTS_PRODUCT_CHOICES":
                                  "codec_gemm=0,codec_packed_float32=1"})
    log = url.stderr()
    assert "decoder after 100 s of audio" in log  # the load's plan ...
    assert re.search(r"tokenizer decoder packed for serving in \d+\.\d\d s", log)  # ... kept
    with httpx.Client(base_url=url, timeout=300) as c:
        assert _pcm(c, REQUESTS[0])
