"""`--stream`'s schedule and thread split (synthesis/streaming.py): the growing pushes and the
stages taking turns give the audio of the previous stream (5 groups, then 10, in a worker)."""

from __future__ import annotations

import threading

import pytest
import torch

from mimo_tts.presets import ensure_tiny_preset
from mimo_tts.runtime.paths import CACHE_ENV
from mimo_tts.synthesis import streaming

SAME_TOL = 1e-5  # one computation, different pushes: rounding only (tests/codec)


@pytest.fixture(scope="module")
def tts(tiny_cache):
    import mimo_tts

    lm_dir, tok_dir = ensure_tiny_preset({CACHE_ENV: str(tiny_cache)})
    return mimo_tts.load(str(lm_dir), str(tok_dir), lm_device="cpu", tokenizer_device="cpu")


def _stream(tts, monkeypatch, threads: dict, lead: int | None, chunk: int):
    """One streamed piece: (piece, chunks given to the sink, frames per push, sink threads)."""
    from mimo_tts.synthesis.options import SynthesisOptions

    pushed, chunks, where = [], [], set()
    push = streaming.DecodeWorker.push

    def record(self, codes, last=False):
        pushed.append(codes.shape[1])
        return push(self, codes, last=last)

    def sink(wave):
        chunks.append(wave)
        where.add(threading.current_thread().name)

    monkeypatch.setattr(streaming.DecodeWorker, "push", record)
    if lead is not None:  # the schedule before the look-ahead was counted: lead 0
        monkeypatch.setattr(streaming, "lead_groups", lambda *args: lead)
    monkeypatch.setattr(tts, "threads", threads)
    options = SynthesisOptions(max_new_groups=40, stream_chunk_groups=chunk)
    (prompt,) = tts.prompts("The growing stream and the one before it.", options, 0)
    piece = tts.stream_piece(prompt, options, 0, sink, lambda m: None)
    monkeypatch.undo()
    return piece, chunks, pushed, where


def test_growing_stream_gives_the_previous_streams_audio(tts, monkeypatch, one_thread):
    """Default pushes (look-ahead + 1 group, then 2, 4, 8, 10) decoded between Stage-0 steps,
    against the stream before issue 24 (5 groups, then 10, in the worker thread): the same
    codes, the same samples to rounding."""
    new, new_chunks, new_pushed, new_where = _stream(tts, monkeypatch,
                                                     {"interleave": True}, None, 1)
    old, old_chunks, old_pushed, old_where = _stream(tts, monkeypatch, {}, 0, 5)
    assert torch.equal(new.codes, old.codes) and new.note is old.note is None
    frames = new.codes.shape[1]
    assert new_pushed[:3] == [40, 8, 16] and old_pushed[:2] == [20, 40]  # 9-group look-ahead
    assert sum(new_pushed) == sum(old_pushed) == frames
    assert new.audio.shape == old.audio.shape == (960 * frames,)
    assert torch.equal(torch.cat(new_chunks), new.audio)
    torch.testing.assert_close(new.audio, old.audio, atol=SAME_TOL, rtol=0)
    # taking turns: the sink runs in the generating thread, the old stream's in the worker
    assert new_where == {threading.current_thread().name} and old_where == {"mimo-tts-stage1"}
    t = new.timings
    assert t["lead_groups"] == 9 and t["prefill_s"] > 0 and t["first_audio_s"] < t["wall_s"]


def test_first_audio_leaves_with_the_first_push(tts, monkeypatch, one_thread):
    """Taking turns, the first push (10 groups on the tiny preset) already gives audio, and
    each later push gives its own groups at once."""
    piece, chunks, pushed, _ = _stream(tts, monkeypatch, {"interleave": True}, None, 1)
    assert len(chunks) == len(pushed)  # every push returned audio, the first one too
    assert chunks[0].numel() == 960 * 40 - tts.codec.model.decoder.vocoder.head.istft.pad - \
        2 * 10 * tts.codec.model.decoder.vocoder.head.istft.hop
