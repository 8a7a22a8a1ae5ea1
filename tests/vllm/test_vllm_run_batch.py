"""`VLLMEngine.run_batch`: the native engine's continuous-batch contract on vLLM (lm.batching).

Every job is its own request with its own seed and samplers, so its groups equal its solo run
whatever shares the batch and however many rows there are; rows refill from the source; a job
is cancelled alone, a refused prompt fails alone, a failed step loses only the live jobs; an
empty source gives IDLE and the run goes on when jobs come. `before_run_batch.json` holds the
static `generate` / `stream` of the engine before `run_batch` (row r drew with seed + r): a
job with that seed draws the same.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup_vllm_venv.sh)")

from mimo_tts.errors import DeviceError, InputError, UsageError
from mimo_tts.lm.batching import IDLE, STEPPED, Job, JobDone, JobGroup, Jobs, StepFailed
from mimo_tts.lm.generate import GenerationOptions
from mimo_tts.lm.sampling import GREEDY, TASK_SAMPLERS, SamplerConfig

from .conftest import KV_BYTES  # noqa: E402

BEFORE = json.loads((Path(__file__).parent / "before_run_batch.json").read_text())
ROWS = 4
TTS_TEXT, TTS_AUDIO = TASK_SAMPLERS["tts"]
HOT_TEXT = SamplerConfig(2.0, 4, 1.0)  # draws many tokens that are not the argmax


@pytest.fixture(scope="module")
def engine(preset_lm_dir):
    from mimo_tts.lm.vllm.engine import VLLMEngine, VLLMOptions

    eng = VLLMEngine(preset_lm_dir, VLLMOptions(dtype="float32", kv_cache_memory_bytes=KV_BYTES,
                                                max_num_seqs=ROWS))
    yield eng
    eng.close()


def tts(seed: int, groups: int = 12) -> GenerationOptions:
    """The tts samplers as the recording used them."""
    return GenerationOptions(text_sampler=TTS_TEXT, audio_sampler=TTS_AUDIO, seed=seed,
                             max_new_groups=groups)


@pytest.fixture(scope="module")
def mixed(prompts):
    """Jobs of different prompts, seeds, samplers, budgets and stop sets."""
    return [
        Job(prompts["short"], tts(5), key="a"),
        Job(prompts["voice"], GenerationOptions(text_sampler=HOT_TEXT, audio_sampler=TTS_AUDIO,
                                                seed=9, max_new_groups=24,
                                                stop_tokens=("im_end",)), key="b"),
        Job(prompts["zh"], GenerationOptions(text_sampler=GREEDY, audio_sampler=GREEDY,
                                             max_new_groups=120), key="c"),  # to its stop
        Job(prompts["instruct"], tts(5, 10), key="d"),  # a's seed, another prompt
        Job(prompts["long"], GenerationOptions(text_sampler=HOT_TEXT, audio_sampler=GREEDY,
                                               seed=1, min_new_groups=6, max_new_groups=14,
                                               stop_tokens=("im_end",)), key="e"),
        Job(prompts["short"], tts(6), key="f"),
    ]


def run_all(engine, jobs, rows: int, source=None, guard=None) -> list:
    """Every event of one run over `jobs` (or `source`), IDLE and STEPPED excluded."""
    run = engine.run_batch(source or Jobs(jobs), rows, guard)
    return [e for e in run if e is not IDLE and e is not STEPPED]


def outcomes(events) -> dict:
    """job key -> (reason, text tokens, new ids) from the JobDone events."""
    return {e.job.key: (e.reason, e.generation.text_tokens, e.generation.new_ids)
            for e in events if isinstance(e, JobDone)}


@pytest.fixture(scope="module")
def solo(engine, mixed) -> dict:
    """Each mixed job run alone, in a batch of one row."""
    found = {}
    for job in mixed:
        found |= outcomes(run_all(engine, [job], 1))
    return found


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, (reason, tokens, ids) in got.items():
        assert (reason, tokens) == want[key][:2], key
        assert torch.equal(ids, want[key][2]), key


def generation(record: dict):
    return record["text_tokens"], torch.tensor(record["new_ids"])


def test_one_job_streams_and_ends_as_the_static_engine_did(engine, prompts):
    # BEFORE: stream([short]) and generate([short, voice]) with seed 7, row 0 being seed 7.
    events = run_all(engine, [Job(prompts["short"], tts(7), key="short")], 1)
    groups = [e.output for e in events if isinstance(e, JobGroup)]
    assert [[o.index, o.step, o.text_token, o.finished, None if o.codes is None
             else o.codes.tolist()] for o in groups] == BEFORE["stream_short_seed7"]
    (done,) = [e for e in events if isinstance(e, JobDone)]
    assert events[-1] is done and done.reason == "budget" and done.busy_s > 0
    tokens, ids = generation(BEFORE["short_voice_seed7"][0])
    assert done.generation.text_tokens == tokens and torch.equal(done.generation.new_ids, ids)


def test_each_job_draws_with_its_own_seed_not_seed_plus_row(engine, prompts):
    # The static batch drew row r with seed + r; jobs given those seeds draw the same groups.
    names = ("short", "long", "zh", "instruct")
    for record, jobs in (
            ("short_voice_seed7", [Job(prompts["short"], tts(7), 0),
                                   Job(prompts["voice"], tts(8), 1)]),
            ("four_seed11", [Job(prompts[n], tts(11 + i), i) for i, n in enumerate(names)])):
        got = outcomes(run_all(engine, jobs, ROWS))
        for i, want in enumerate(BEFORE[record]):
            tokens, ids = generation(want)
            assert got[i][1] == tokens and torch.equal(got[i][2], ids), (record, i)
    # One seed for both jobs now: the second no longer draws seed + 1's groups.
    same = outcomes(run_all(engine, [Job(prompts["short"], tts(7), 0),
                                     Job(prompts["voice"], tts(7), 1)], ROWS))
    assert not torch.equal(same[1][2], generation(BEFORE["short_voice_seed7"][1])[1])


def test_jobs_of_different_seeds_and_samplers_each_equal_their_solo_run(engine, mixed, solo,
                                                                        preset_special):
    drawn = [t for _, tokens, _ in solo.values() for t in tokens]
    assert len(drawn) - drawn.count(preset_special.empty) >= 2  # text drawn, not only audio
    assert {reason for reason, _, _ in solo.values()} == {"stop", "budget"}
    events = run_all(engine, mixed[:ROWS], ROWS)
    assert_same(outcomes(events), {job.key: solo[job.key] for job in mixed[:ROWS]})


def test_a_jobs_groups_do_not_depend_on_its_batch_mates_or_rows(engine, mixed, solo):
    for rows, jobs in ((3, mixed[::-1]), (ROWS, mixed[3:] + mixed[:3])):
        assert_same(outcomes(run_all(engine, jobs, rows)), solo)


def test_rows_refill_from_the_source(engine, mixed, solo):
    # Six jobs on two rows: never more than two live, a freed slot takes the next job, and
    # each job's groups are still its solo run's.
    source = Jobs(mixed)
    events = run_all(engine, None, 2, source)
    live, most, slots = set(), 0, set()
    for event in events:
        if isinstance(event, JobGroup):
            live.add(event.job.key)
            slots.add(event.output.index)
            most = max(most, len(live))
        elif isinstance(event, JobDone):
            live.discard(event.job.key)
    assert most == 2 and slots == {0, 1} and source.exhausted
    assert_same(outcomes(events), solo)


def test_cancel_stops_one_job_and_the_others_go_on(engine, prompts, mixed, solo):
    from mimo_tts.lm.vllm import state

    long = Job(prompts["long"], GenerationOptions(text_sampler=GREEDY, audio_sampler=GREEDY,
                                                  min_new_groups=60, max_new_groups=60), "long")
    run = engine.run_batch(Jobs([long, mixed[0], mixed[2]]), ROWS)
    seen, done = 0, {}
    for event in run:
        if isinstance(event, JobGroup) and event.job is long:
            seen += 1
            if seen == 3:  # from another thread, as a server's request handler does
                thread = threading.Thread(target=run.cancel, args=("long",))
                thread.start()
                thread.join()
        elif isinstance(event, JobDone):
            done[event.job.key] = event
    cancelled = done.pop("long")
    assert cancelled.reason == "cancelled" and cancelled.error is None
    got = cancelled.generation.text_tokens
    assert 3 <= len(got) < 60  # the groups it had when the next step began
    full = outcomes(run_all(engine, [long], 1))["long"]
    assert got == full[1][:len(got)]
    assert torch.equal(cancelled.generation.new_ids, full[2][:, :4 * len(got)])
    assert_same({k: (e.reason, e.generation.text_tokens, e.generation.new_ids)
                 for k, e in done.items()}, {k: solo[k] for k in ("a", "c")})
    assert not engine.llm.llm_engine.has_unfinished_requests() and not state.STATES


def test_a_refused_prompt_fails_only_its_job(engine, prompts, mixed, solo):
    bad = [Job(prompts["short"][:, :6], mixed[0].options, "ragged"),  # not whole groups
           Job(prompts["short"], GenerationOptions(keep_logits=True), "logits"),
           Job(prompts["short"], GenerationOptions(text_logits_processor=lambda s, x: x), "hook"),
           Job(prompts["short"], GenerationOptions(text_sampler=SamplerConfig(3.0)), "hot")]
    events = run_all(engine, [mixed[0], *bad, mixed[2]], 2)
    errors = {e.job.key: e.error for e in events if isinstance(e, JobDone) and e.error}
    assert isinstance(errors.pop("ragged"), InputError)
    assert all(isinstance(e, UsageError) for e in errors.values())
    assert sorted(errors) == ["hook", "hot", "logits"]
    assert all(e.generation is None for e in events if isinstance(e, JobDone) and e.error)
    assert_same(outcomes(e for e in events if not (isinstance(e, JobDone) and e.error)),
                {k: solo[k] for k in ("a", "c")})


class Queue:
    """A small JobSource that gains jobs later (as a server's queue), closed when done."""

    def __init__(self):
        self.jobs: deque[Job] = deque()
        self.closed = False

    @property
    def exhausted(self) -> bool:
        return self.closed and not self.jobs

    def pull(self) -> Job | None:
        return self.jobs.popleft() if self.jobs else None


def test_idle_then_resume_when_the_source_gains_jobs(engine, mixed, solo):
    queue = Queue()
    events = iter(engine.run_batch(queue, ROWS))
    assert next(events) is IDLE and next(events) is IDLE  # nothing yet: idle, and again
    queue.jobs.append(mixed[0])
    first = []
    for event in events:
        if event is IDLE:
            break
        if event is not STEPPED:
            first.append(event)
    assert isinstance(first[-1], JobDone) and first[-1].job is mixed[0]
    queue.jobs.extend(mixed[1:3])
    queue.closed = True
    rest = [e for e in events if e is not STEPPED]  # ends: exhausted and nothing live
    assert IDLE not in rest
    assert_same(outcomes(first + rest), {k: solo[k] for k in ("a", "b", "c")})


def test_a_failed_step_loses_the_live_jobs_and_the_batch_goes_on(engine, mixed, solo):
    from mimo_tts.lm.vllm import state

    steps = 0

    @contextmanager
    def guard():  # the third step runs out of memory (the guard's advice, as oom_advice)
        nonlocal steps
        steps += 1
        yield
        if steps == 3:
            raise DeviceError("out of memory (test)")

    # a (12 groups) and e (at least 6) are live at the third step; c and d not yet begun
    a, c, d, e = (mixed[i] for i in (0, 2, 3, 4))
    events = run_all(engine, [a, e, c, d], 2, guard=guard)
    failed = [x for x in events if isinstance(x, StepFailed)]
    assert len(failed) == 1 and isinstance(failed[0].error, DeviceError)
    at = events.index(failed[0])
    assert {x.job.key for x in events[:at] if isinstance(x, JobGroup)} == {"a", "e"}
    assert {x.job.key for x in events if isinstance(x, JobDone)} == {"c", "d"}  # a, e lost
    assert_same(outcomes(events[at + 1:]), {k: solo[k] for k in ("c", "d")})
    assert not engine.llm.llm_engine.has_unfinished_requests() and not state.STATES


def test_leaving_early_aborts_and_frees_the_engine(engine, mixed, solo):
    from mimo_tts.lm.vllm import state

    for leave in ("close", "drop"):
        run = engine.run_batch(Jobs(mixed), ROWS)
        events = iter(run)
        while not isinstance(next(events), JobGroup):
            pass
        assert state.STATES and engine.llm.llm_engine.has_unfinished_requests()
        if leave == "close":
            run.close()
        else:
            del events, run  # the iterator's finaliser does the same
        assert not engine.llm.llm_engine.has_unfinished_requests() and not state.STATES
    assert_same(outcomes(run_all(engine, mixed[:2], ROWS)), {k: solo[k] for k in ("a", "b")})


def test_one_run_at_a_time_and_rows_checked(engine, mixed):
    with pytest.raises(UsageError, match="at least one row"):
        engine.run_batch(Jobs(mixed), 0)
    first = iter(engine.run_batch(Jobs(mixed), ROWS))
    next(first)
    with pytest.raises(UsageError, match="already running a batch"):
        next(iter(engine.run_batch(Jobs(mixed), ROWS)))
    first.close()
    assert len(outcomes(run_all(engine, mixed[:1], ROWS))) == 1
