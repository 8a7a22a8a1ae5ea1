"""The speech worker (synthesis/worker.py), on the tiny preset: the one place a synthesis runs.

Stage-0 over the engine's continuous batch, Stage-1 in turns or in a thread, streamed pushes in
rounds, whole decodes by group, and its failure rules; each checked against what the parts give
alone (the engine's single runs, `Stage1.decode`, a `StreamingDecoder` of its own).
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

import mimo_tts.codec
from mimo_tts.errors import DeviceError, InputError
from mimo_tts.lm.batching import generate_all
from mimo_tts.presets import ensure_tiny_preset
from mimo_tts.runtime.paths import CACHE_ENV
from mimo_tts.synthesis.options import SynthesisOptions
from mimo_tts.synthesis.worker import Chunk, Done, Failed, SpeechJob, SpeechWorker

TEXTS = ["The first text, a little longer than the others.", "Second.", "A third one here."]
SAME_TOL = 1e-5  # one computation, different pushes: rounding only (tests/codec)


@pytest.fixture(scope="module")
def tts(tiny_cache):
    import mimo_tts

    lm_dir, tok_dir = ensure_tiny_preset({CACHE_ENV: str(tiny_cache)})
    return mimo_tts.load(str(lm_dir), str(tok_dir), lm_device="cpu", tokenizer_device="cpu")


def _jobs(tts, texts, decode="whole", seed=3, groups=False, **options):
    o = SynthesisOptions(max_new_groups=options.pop("max_new_groups", 30), **options)
    generation = o.generation_options(seed)
    out = []
    for n, text in enumerate(texts):
        group: list = []
        group += [SpeechJob(p, generation, seed, decode=decode, group=group if groups else None,
                            order=(n, i), key=(n, i))
                  for i, p in enumerate(tts.prompts(text, o, seed))]
        out += group
    return out


def _run(tts, jobs, rows=1, stage1="turns", **kw):
    events = list(SpeechWorker(tts, rows, stage1=stage1, **kw).run(jobs))
    assert not [e for e in events if isinstance(e, Failed)], events
    return events


def _solo(tts, codes, step: int = 20):
    """One incremental decoder fed `codes` [K, T] in pushes of `step` frames."""
    decoder = mimo_tts.codec.StreamingDecoder(tts.codec, mode="incremental")
    frames = codes.shape[1]
    waves = [decoder.push(codes[:, i:i + step], last=i + step >= frames)
             for i in range(0, frames, step)]
    return torch.cat([w for w in waves if w is not None]).float()


def _replay(tts, codes, pushed: list):
    """One incremental decoder fed `codes` [K, T] in the recorded pushes of one stream."""
    decoder = mimo_tts.codec.StreamingDecoder(tts.codec, mode="incremental")
    waves, at = [], 0
    for ((frames, last),) in pushed:
        waves.append(decoder.push(codes[:, at:at + frames], last=last))
        at += frames
    return torch.cat([w for w in waves if w is not None]).float()


def _pushes(monkeypatch) -> list:
    """Record the frames of every push Stage-1 decodes, per round."""
    pushed, original = [], mimo_tts.codec.push_streams

    def record(decoders, codes, lasts):
        pushed.append([(c.shape[1], last) for c, last in zip(codes, lasts, strict=True)])
        return original(decoders, codes, lasts)

    monkeypatch.setattr(mimo_tts.codec, "push_streams", record)
    return pushed


def test_codes_do_not_depend_on_the_rows_and_equal_the_engines_own_runs(tts, one_thread):
    alone = _run(tts, _jobs(tts, TEXTS), rows=1)
    together = _run(tts, _jobs(tts, TEXTS), rows=3)
    reference = generate_all(tts.engine, [j.prompt.input_ids for j in _jobs(tts, TEXTS)],
                             _jobs(tts, TEXTS[:1])[0].options, rows=1)
    for a, b, gen in zip(alone, together, reference, strict=True):
        assert isinstance(a, Done) and isinstance(b, Done)
        assert torch.equal(a.piece.codes, b.piece.codes)
        assert torch.equal(a.piece.audio, b.piece.audio)
        assert a.piece.new_text_ids == gen.text_tokens
    assert max(job.rows for job in [e.job for e in together]) == 3


def test_a_group_is_decoded_in_one_call_as_stage1_decodes_it(tts, one_thread):
    """An item's pieces (a group) are decoded together: their audio is `Stage1.decode` of all
    their codes in one call, which differs in the last bits from decoding each alone."""
    text = "One sentence here. Another sentence there. And a third one to end."
    jobs = _jobs(tts, [text], groups=True, max_chars=20)
    assert len(jobs) > 1 and all(j.group is jobs[0].group for j in jobs)
    events = _run(tts, jobs, rows=2)
    pieces = [e.piece for e in events]
    together = tts.stage1.decode([p.codes for p in pieces])
    for piece, audio in zip(pieces, together, strict=True):
        assert torch.equal(piece.audio, audio)


def test_codes_only_and_timings(tts, one_thread):
    events = _run(tts, _jobs(tts, TEXTS[:2], decode="none"), rows=2)
    assert all(isinstance(e, Done) and e.piece.audio is None and e.piece.codes is not None
               for e in events)
    t = events[0].job.timings
    assert t["stage0_s"] > 0 and t["prefill_s"] > 0 and t["done_at"] >= t["started_at"]


@pytest.mark.parametrize("stage1", ["turns", "thread"])
def test_a_stream_in_growing_pushes_equals_its_solo_decoder(tts, monkeypatch, one_thread,
                                                            stage1):
    """Pushes: the decoder's look-ahead plus one group (9 + 1 on the tiny preset), then 2, 4
    and 8 groups, one a round in turns; the chunks joined are the piece's audio, what one
    decoder gives on the same pushes."""
    pushed = _pushes(monkeypatch)
    jobs = _jobs(tts, TEXTS[:1], decode="stream", max_new_groups=40, stream_chunk_groups=1,
                 stream_max_chunk_groups=8)
    events = []
    for event in SpeechWorker(tts, 1, stage1=stage1, schedule=("incremental", 1, 8)).run(jobs):
        events.append(event)
    chunks = [e.samples for e in events if isinstance(e, Chunk)]
    done = events[-1]
    assert isinstance(done, Done) and done.piece.note is None
    assert torch.equal(torch.cat(chunks), done.piece.audio)
    if stage1 == "turns":  # one push per round, each as soon as it is due
        sizes = [r[0][0] for r in pushed]
        assert sizes[:3] == [40, 8, 16] and sum(sizes) == done.piece.codes.shape[1]
    assert torch.equal(done.piece.audio, _replay(tts, done.piece.codes, pushed))
    t = done.piece.timings
    assert t["lead_groups"] == 9 and t["prefill_s"] > 0 and t["first_audio_s"] <= t["wall_s"]


def test_pushes_queued_while_stage1_is_busy_go_in_one(tts, monkeypatch, one_thread):
    """In thread mode, an incremental stream's pushes that queued while Stage-1 decoded go
    through the decoder in one push; the audio is the same."""
    release = threading.Event()
    original = mimo_tts.codec.push_streams
    pushed = []

    def slow(decoders, codes, lasts):
        pushed.append([c.shape[1] for c in codes])
        if len(pushed) == 1:
            release.wait(timeout=60)  # hold Stage-1 on its first round
        return original(decoders, codes, lasts)

    monkeypatch.setattr(mimo_tts.codec, "push_streams", slow)
    jobs = _jobs(tts, TEXTS[:1], decode="stream", max_new_groups=40)
    worker = SpeechWorker(tts, 1, stage1="thread", schedule=("incremental", 1, 2))
    timer = threading.Timer(3.0, release.set)  # Stage-0 finishes while Stage-1 waits
    timer.start()
    events = list(worker.run(jobs))
    timer.cancel()
    done = events[-1]
    assert isinstance(done, Done) and len(pushed) == 2  # the first push, then all the rest
    assert sum(pushed[1]) == done.piece.codes.shape[1] - pushed[0][0]
    torch.testing.assert_close(done.piece.audio, _solo(tts, done.piece.codes), atol=SAME_TOL,
                               rtol=0)


def test_streams_of_different_lengths_share_rounds_and_keep_their_audio(tts, monkeypatch,
                                                                         one_thread):
    pushed = _pushes(monkeypatch)
    jobs = _jobs(tts, TEXTS, decode="stream")
    together = [e for e in _run(tts, jobs, rows=3, schedule=("incremental", 1, 2))
                if isinstance(e, Done)]
    assert max(len(r) for r in pushed) > 1  # some rounds decoded several streams at once
    for job in _jobs(tts, TEXTS, decode="stream"):
        (alone,) = [e for e in _run(tts, [job], schedule=("incremental", 1, 2))
                    if isinstance(e, Done)]
        mine = next(d for d in together if d.job.key == job.key)
        assert torch.equal(alone.piece.codes, mine.piece.codes)
        torch.testing.assert_close(alone.piece.audio, mine.piece.audio, atol=SAME_TOL, rtol=0)


def test_a_refused_prompt_fails_its_group_and_nothing_else(tts, one_thread):
    jobs = _jobs(tts, TEXTS, groups=True)
    bad = jobs[1]
    bad.prompt = replace(bad.prompt, input_ids=bad.prompt.input_ids[:, :-1])  # not whole groups
    events = list(SpeechWorker(tts, 2).run(jobs))
    failed = [e for e in events if isinstance(e, Failed)]
    assert [e.job for e in failed] == [bad] and isinstance(failed[0].error, InputError)
    assert sorted(e.job.key for e in events if isinstance(e, Done)) == [(0, 0), (2, 0)]


def test_a_failed_step_fails_its_rows_and_the_next_jobs_run(tts, monkeypatch, one_thread):
    from mimo_tts.lm import batching

    calls = {"n": 0}
    step = batching.ContinuousBatcher.step

    def failing(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise DeviceError("out of memory on cpu during Stage-0 generation")
        return step(self)

    monkeypatch.setattr(batching.ContinuousBatcher, "step", failing)
    events = list(SpeechWorker(tts, 1).run(_jobs(tts, TEXTS)))
    failed = [e for e in events if isinstance(e, Failed)]
    assert len(failed) == 1 and isinstance(failed[0].error, DeviceError)
    assert len([e for e in events if isinstance(e, Done)]) == 2


def test_online_jobs_from_another_thread_and_a_cancel(tts, one_thread):
    """`start`ed, jobs come by `submit`; each gets exactly one final event through `deliver`,
    in the worker's threads; a cancelled job gets none and its row frees."""
    worker = SpeechWorker(tts, 2, stage1="thread").start()
    got, ended = {}, threading.Event()

    def deliver(event):
        got.setdefault(event.job.key, []).append(event)
        if sum(isinstance(e[-1], Done | Failed) for e in got.values()) == 2:
            ended.set()

    jobs = _jobs(tts, TEXTS, decode="stream", max_new_groups=200)
    for job in jobs:
        job.deliver = deliver
    worker.submit(jobs)
    worker.cancel([jobs[0]])
    assert ended.wait(timeout=300)
    time.sleep(0.5)
    worker.close(timeout=30)
    assert (0, 0) not in got or not any(isinstance(e, Done) for e in got[(0, 0)])
    for key in ((1, 0), (2, 0)):
        finals = [e for e in got[key] if not isinstance(e, Chunk)]
        assert len(finals) == 1 and isinstance(finals[0], Done)
    assert not any(t.is_alive() for t in worker.threads)
