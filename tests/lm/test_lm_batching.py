"""Continuous batching (mimo_tts/lm/batching.py): every job's groups equal its single run's,
rows are refilled while others decode, cancelled jobs free their row, seeds are per job."""

from __future__ import annotations

import shutil

import pytest
import torch

from mimo_tts.lm import cpu_kernel
from mimo_tts.lm.batching import IDLE, ContinuousBatcher, Job, JobDone, JobGroup, Jobs
from mimo_tts.lm.config import MAX_GROUPS
from mimo_tts.lm.generate import GenerationOptions, generate
from mimo_tts.lm.load import load_lm
from mimo_tts.lm.sampling import GREEDY, SamplerConfig

TOL = 1e-4
PROMPTS = ("gen_tts_en_forced", "gen_tts_zh_forced_interleaved", "gen_tts_instruct_forced")


@pytest.fixture(scope="module")
def prompts(case_tensors):
    """Three prompts of 54, 56 and 147 groups."""
    t = case_tensors("lm_generate")
    return [t[f"{n}.input_ids"] for n in PROMPTS]


def _script(special, audio: int) -> list[int]:
    """`audio` <|empty|> groups (the patch decoder runs), then <|eostm|> (a stop)."""
    return [special.empty] * audio + [special.eostm]


def _mixed_jobs(prompts, special, forcing) -> list[Job]:
    """Eight jobs: three prompts, forced scripts of 2-11 audio groups, budgets, free text
    sampling, greedy and sampled audio, five different seeds."""
    tts = GenerationOptions.for_task("tts")
    sampled = {"text_sampler": tts.text_sampler, "audio_sampler": tts.audio_sampler}
    greedy = {"text_sampler": GREEDY, "audio_sampler": GREEDY}
    hot = {"text_sampler": SamplerConfig(1.0), "audio_sampler": SamplerConfig(1.0, 20, 0.9)}
    plans = [  # (prompt, samplers, seed, audio groups forced (None: free text), budget)
        (0, sampled, 1, 11, MAX_GROUPS), (1, greedy, None, 3, MAX_GROUPS),
        (2, sampled, 2, 6, MAX_GROUPS), (0, hot, 3, None, 9), (1, sampled, 1, 2, MAX_GROUPS),
        (2, greedy, None, None, 4), (0, sampled, 4, 8, 5), (1, hot, 5, 7, MAX_GROUPS),
    ]
    jobs = []
    for n, (p, samplers, seed, audio, budget) in enumerate(plans):
        hook = None if audio is None else forcing([_script(special, audio)])
        options = GenerationOptions(**samplers, seed=seed, max_new_groups=budget,
                                    text_logits_processor=hook, keep_logits=True)
        jobs.append(Job(prompts[p], options, key=n))
    return jobs


def _run(model, special, jobs, rows, **kw) -> tuple[list, dict]:
    events = list(ContinuousBatcher(model, special, rows, Jobs(jobs), **kw).run())
    return events, {e.job.key: e for e in events if isinstance(e, JobDone)}


def _assert_single(model, special, job: Job, done: JobDone) -> None:
    alone = generate(model, [job.ids], job.options, special)[0]
    assert done.generation.text_tokens == alone.text_tokens, f"job {job.key}"
    assert torch.equal(done.generation.new_ids, alone.new_ids), f"job {job.key}"
    torch.testing.assert_close(done.generation.step_logits, alone.step_logits, atol=TOL, rtol=0)


def test_every_job_equals_its_single_run(lm, special, prompts, forcing):
    """Mixed lengths, seeds, greedy and sampled at 3 rows: each job's groups are those of
    its single run, and rows are refilled while the others decode."""
    jobs = _mixed_jobs(prompts, special, forcing)
    events, done = _run(lm, special, jobs, rows=3)
    assert sorted(done) == list(range(len(jobs)))
    for job in jobs:
        assert done[job.key].reason in ("stop", "budget")
        _assert_single(lm, special, job, done[job.key])
    assert {done[k].reason for k in (3, 5, 6)} == {"budget"}
    assert done[0].reason == "stop" and len(done[0].generation.text_tokens) == 12
    # Refills: 8 jobs went through 3 rows; a job started while another was mid-way.
    groups = [e for e in events if isinstance(e, JobGroup)]
    rows = {e.job.key: e.output.index for e in groups}
    assert set(rows.values()) == {0, 1, 2}
    start = next(i for i, e in enumerate(groups) if e.job.key == 3)
    assert any(e.output.step > 0 and e.job.key != 3 for e in groups[start - 2: start + 3])
    # The first group of each job carries its prefill time; every job's busy share is > 0.
    assert all(done[k].generation.prefill_s > 0 and done[k].busy_s > 0 for k in done)


def test_codes_do_not_depend_on_the_row_or_the_company(lm, special, prompts, forcing):
    """One seed gives one result in any row and beside any jobs; another seed differs."""
    tts = GenerationOptions.for_task("tts", text_logits_processor=forcing(
        [_script(special, 5)]))
    jobs = [Job(prompts[0], GenerationOptions(**{**tts.__dict__, "seed": s}), key=n)
            for n, s in enumerate((7, 7, 8))]
    _, done = _run(lm, special, jobs, rows=3)
    _, reversed_done = _run(lm, special, jobs[::-1], rows=2)
    ids = [done[k].generation.new_ids for k in range(3)]
    assert torch.equal(ids[0], ids[1]) and not torch.equal(ids[0], ids[2])
    for k in range(3):
        assert torch.equal(reversed_done[k].generation.new_ids, ids[k])


class Trickle:
    """A source that has nothing now on every other pull, then the next job."""

    def __init__(self, jobs):
        self.jobs, self.exhausted, self.pulls = list(jobs), False, 0

    def pull(self):
        self.pulls += 1
        if self.pulls % 2 or not self.jobs:
            self.exhausted = not self.jobs
            return None
        return self.jobs.pop(0)


def test_cancel_frees_the_row_for_the_next_job(lm, special, prompts, forcing):
    options = GenerationOptions(text_sampler=GREEDY, audio_sampler=GREEDY, max_new_groups=40,
                                text_logits_processor=forcing([[special.empty]]))
    jobs = [Job(prompts[n % 3], options, key=n) for n in range(3)]
    batcher = ContinuousBatcher(lm, special, 2, Jobs(jobs))
    for _ in range(3):
        events = batcher.step()
    assert [e.job.key for e in events] == [0, 1] and batcher.live == 2
    batcher.cancel(0)
    batcher.cancel("nobody")  # no such job: forgotten
    events = batcher.step()
    cancelled = events[0]
    assert isinstance(cancelled, JobDone) and cancelled.reason == "cancelled"
    assert len(cancelled.generation.text_tokens) == 3
    alone = generate(lm, [jobs[0].ids], GenerationOptions(**{**options.__dict__,
                                                             "max_new_groups": 3}), special)
    assert torch.equal(cancelled.generation.new_ids, alone[0].new_ids)
    started = [e for e in events if isinstance(e, JobGroup) and e.job.key == 2]
    assert started[0].output.step == 0 and started[0].output.index == 0  # job 0's row
    assert [e.output.step for e in events if isinstance(e, JobGroup) and e.job.key == 1] == [3]


def test_a_step_returns_its_groups_before_the_backbone_runs_over_them(lm, special, prompts,
                                                                       forcing):
    """A step's groups come out before the backbone runs over them (a stream's push and its
    Stage-1 turn do not wait for it): the next step feeds them first, so the backbone runs
    trail the groups by one, a finished job's last group is never fed, and the job still
    equals its single run."""
    options = GenerationOptions(text_sampler=GREEDY, audio_sampler=GREEDY, max_new_groups=3,
                                text_logits_processor=forcing([_script(special, 5)]))
    job = Job(prompts[0], options, key=0)
    batcher = ContinuousBatcher(lm, special, 1, Jobs([job]))
    assert [e.output.step for e in batcher.step()] == [0]
    runs = []
    backbone = batcher.decoder.backbone

    def counted(*args, **kwargs):
        runs.append(batcher.slots[0].length)
        return backbone(*args, **kwargs)

    batcher.decoder.backbone = counted
    assert [e.output.step for e in batcher.step()] == [1] and len(runs) == 1  # group 0 fed
    last = batcher.step()
    assert len(runs) == 2 and runs[1] == runs[0] + 1  # group 1 fed, at the next position
    done = [e for e in last if isinstance(e, JobDone)]
    assert [e.output.step for e in last if isinstance(e, JobGroup)] == [2] and done
    assert batcher.step() == [] and len(runs) == 2  # group 2 ended the job: never fed
    alone = generate(lm, [job.ids], options, special)[0]
    assert torch.equal(done[0].generation.new_ids, alone.new_ids)


def test_an_empty_source_yields_idle_and_a_bad_prompt_fails_alone(lm, special, prompts):
    options = GenerationOptions(text_sampler=GREEDY, audio_sampler=GREEDY, max_new_groups=2)
    too_long = prompts[0][:, :4].repeat(1, MAX_GROUPS)
    jobs = [Job(too_long, options, key="long"), Job(prompts[1], options, key="ok")]
    events = list(ContinuousBatcher(lm, special, 2, Trickle(jobs)).run())
    assert events[0] is IDLE
    done = {e.job.key: e for e in events if isinstance(e, JobDone)}
    assert done["long"].reason == "error" and "no room" in str(done["long"].error)
    assert done["long"].generation is None
    assert done["ok"].reason == "budget" and len(done["ok"].generation.text_tokens) == 2


@pytest.fixture(scope="module")
def kernel_lm(lm_dir):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    return load_lm(lm_dir, cpu_kernel="on")


@pytest.mark.parametrize("mode", ["static", "kernel"])
def test_other_decode_steps_equal_single_runs(lm, kernel_lm, special, prompts, forcing,
                                              mode):
    """The fixed-shape graph step uncaptured (its cache regrown and the step rebuilt for a
    longer job) and the CPU kernel step keep every job equal to its single run."""
    model = kernel_lm if mode == "kernel" else lm
    jobs = _mixed_jobs(prompts, special, forcing)
    for job in jobs[:3]:  # a first job short enough that a later one regrows the cache
        job.options = GenerationOptions(**{**job.options.__dict__, "max_new_groups": 20})
    _, done = _run(model, special, jobs, rows=3,
                   decode_step="static" if mode == "static" else "auto")
    for job in jobs:
        _assert_single(model, special, job, done[job.key])


@pytest.fixture(scope="module")
def bf16_kernel_lm(lm_dir):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    return load_lm(lm_dir, dtype=torch.bfloat16, cpu_kernel="on")


@pytest.mark.parametrize("amx", ["amx", "no-amx"])
def test_bfloat16_kernel_rows_equal_single_runs(bf16_kernel_lm, special, prompts, forcing,
                                                amx):
    """In bfloat16 the kernel's products take AMX tiles where the CPU grants them (or its
    dot products): a row's arithmetic must not depend on how many rows share the step, so
    every job still equals its single run (one row) exactly."""
    features = cpu_kernel.features()
    if amx == "amx" and not features["amx"]:
        pytest.skip("this CPU grants no AMX tiles")
    before = features["amx_min_rows"]
    cpu_kernel.set_amx_min_rows(cpu_kernel.MAX_ROWS + 1 if amx == "no-amx" else before)
    try:
        jobs = _mixed_jobs(prompts, special, forcing)[:5]
        _, done = _run(bf16_kernel_lm, special, jobs, rows=4)
        for job in jobs:
            _assert_single(bf16_kernel_lm, special, job, done[job.key])
    finally:
        cpu_kernel.set_amx_min_rows(before)


