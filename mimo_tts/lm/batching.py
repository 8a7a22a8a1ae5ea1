"""Continuous batching: a fixed number of rows kept busy with generation jobs.

A `ContinuousBatcher` holds B rows over one backbone KV cache. Whenever a row is free it pulls
the next job from its source (a non-blocking pull), prefills that job's prompt alone (exactly
as its single run does) and copies the keys and values into the row; every `step` then
samples one group for each live row and returns them, and the next step first advances the
rows one backbone position over them (so a group is out before the backbone runs), while jobs
join and leave. A row keeps its own length: its prompt fills slots 0..P-1 and its group k
goes to slot P + k (its RoPE position), the key mask hides the rest. Each job samples from its
own generator, seeded from its seed and drawn in the order of its single run, so its codes do
not depend on what it was batched with or which row it got.

`step` and `run` give the events `lm/engine.py` lists (`run` until the source is exhausted and
every row is free), pulling from anything with a non-blocking `pull` (`Jobs` over an iterable;
the speech worker's feed, `synthesis/worker.py`). Shapes: B rows, H hidden, F frames, K
codebooks.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import Tensor

from mimo_tts.errors import MimoTTSError, UsageError
from mimo_tts.lm.config import MAX_GROUPS
from mimo_tts.lm.generate import (
    Collector,
    Generation,
    GenerationOptions,
    StepOutput,
    build_step,
    decode_patch,
    generator_for,
    prefill,
    step_kind,
)
from mimo_tts.lm.model import KVCache, MiMoAudioLM
from mimo_tts.lm.sampling import sample
from mimo_tts.lm.step import DecodeStep


@dataclass(eq=False)
class Job:
    """One prompt to generate from: ids [1 + K, F * G], its options (samplers, seed, budget,
    stop set, hooks) and the caller's `key` (opaque here; `cancel` names a job by it)."""

    ids: Tensor
    options: GenerationOptions
    key: object = None


@dataclass(frozen=True)
class JobGroup:
    """A new group of `job`; `output.index` is the row it runs in."""

    job: Job
    output: StepOutput


@dataclass(frozen=True)
class JobDone:
    """`job` ended: reason "stop" (a stop token), "budget" (its max groups), "cancelled" or
    "error" (its prompt was refused: `error`). `generation` holds its groups (None when it
    has none); `busy_s` its share of the batch's time (its prefill and 1/n of each step it
    was one of n live rows in)."""

    job: Job
    reason: str
    generation: Generation | None = None
    error: MimoTTSError | None = None
    busy_s: float = 0.0


class Idle:
    """From `run`: no row is live and the source has nothing now (wait for work, resume)."""


class Stepped:
    """From `run`: the events of one step have all been given (a consumer that works between
    steps, such as Stage-1 taking turns, does it now)."""


IDLE = Idle()
STEPPED = Stepped()
Event = JobGroup | JobDone | Idle | Stepped


class JobSource(Protocol):
    """Where a batcher takes jobs from; `pull` never blocks."""

    exhausted: bool  # no job will ever come again

    def pull(self) -> Job | None:
        """The next job, or None when there is none now."""


class Jobs:
    """A `JobSource` over an iterable (consumed lazily), exhausted when it ends."""

    def __init__(self, jobs: Iterable[Job]):
        self._jobs = iter(jobs)
        self.exhausted = False

    def pull(self) -> Job | None:
        job = None if self.exhausted else next(self._jobs, None)
        self.exhausted = job is None
        return job


@dataclass(eq=False)
class _Row:
    """A live row: its job, cache length (= the slot its next input goes to), budget, stop
    ids, generator and the groups so far."""

    job: Job
    length: int
    budget: int
    stop_ids: list[int]
    generator: torch.Generator | None
    collector: Collector
    prefill_s: float
    step: int = 0
    busy_s: float = 0.0


class ContinuousBatcher:
    """B rows of generation over one KV cache, refilled from `source` as rows free up.

    `decode_step` is GenerationOptions.decode_step for the whole batch (the jobs' own field is
    not read): eager, the CPU kernel, or the fixed-shape graph step (rows stay B; a refill
    writes in place; the cache is reserved for the longest job so far, and the step rebuilt
    when a job needs more).
    """

    def __init__(self, model: MiMoAudioLM, special, rows: int, source: JobSource,
                 decode_step: str = "auto"):
        if rows < 1:
            raise UsageError(f"a batch needs at least one row, got {rows}")
        GenerationOptions(decode_step=decode_step)  # validates the mode
        self.model, self.special, self.rows, self.source = model, special, rows, source
        self.kind = step_kind(model, decode_step)
        self.strict = decode_step == "graph"
        self.device = model.lm_head.weight.device
        self.slots: list[_Row | None] = [None] * rows
        # Key mask of every row over every slot a row can reach: one byte a slot, made once.
        self.valid = torch.zeros(rows, MAX_GROUPS, dtype=torch.bool, device=self.device)
        self.cache: KVCache | None = None  # made by the first prefill, in its dtype
        self.local_cache: KVCache | None = None
        self.hidden: Tensor | None = None  # [B, H] each row's newest backbone output
        self.decoder: DecodeStep | None = None
        self._cancel: list = []  # keys to cancel at the next step
        self._fed: tuple[Tensor, Tensor] | None = None  # groups sampled, not yet fed (`_feed`)
        self._lock = threading.Lock()

    @property
    def idle(self) -> bool:
        """No row holds a job."""
        return all(row is None for row in self.slots)

    @property
    def live(self) -> int:
        """Rows holding a job."""
        return sum(row is not None for row in self.slots)

    def cancel(self, key) -> None:
        """Stop the job with this key at the next step (its row frees; `JobDone` "cancelled").

        Safe from another thread. A key not held by a row at that step is forgotten.
        """
        with self._lock:
            self._cancel.append(key)

    def run(self) -> Iterator[Event]:
        """Step until the source is exhausted and no row is live; `IDLE` whenever no row is
        live and the source has nothing now (the speech worker's feed then waits for a job)."""
        while True:
            events = self.step()
            yield from events
            if events:
                yield STEPPED
            if self.idle:
                if self.source.exhausted:
                    return
                if not events:
                    yield IDLE

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """Fill free rows from the source, then one group for every live row."""
        events: list[Event] = []
        self._drop_cancelled(events)
        self._feed()  # the last step's groups, before a new row can take a free one
        self._refill(events)
        live = [r for r, row in enumerate(self.slots) if row is not None]
        if not live:
            return events
        start = time.perf_counter()
        decoder = self._decoder()
        tokens, codes, raw = self._sample(live, decoder)
        token_list, codes_cpu = tokens.tolist(), codes.cpu()
        done = []
        for r in live:
            row, token = self.slots[r], token_list[r]
            options = row.job.options
            stop = token in row.stop_ids and row.step + 1 >= options.min_new_groups
            finished = stop or row.step + 1 >= row.budget
            out = StepOutput(r, row.step, token,
                             codes_cpu[r] if token == self.special.empty else None, finished,
                             raw[r] if raw is not None and options.keep_logits else None,
                             row.prefill_s if row.step == 0 else None)
            row.collector.add(out)
            row.step += 1
            events.append(JobGroup(row.job, out))
            if finished:
                done.append((r, "stop" if stop else "budget"))
        ended = [(self.slots[r], reason) for r, reason in done]
        for r, _ in done:
            self._free(r)
        if not self.idle:  # fed at the next step, once this step's groups are out
            self._fed = (tokens, codes)
        share = (time.perf_counter() - start) / len(live)
        for r in live:
            if self.slots[r] is not None:
                self.slots[r].busy_s += share
        events += [JobDone(row.job, reason, row.collector.generation(),
                           busy_s=row.busy_s + share) for row, reason in ended]
        return events

    # -- rows joining and leaving ------------------------------------------------------------
    def _refill(self, events: list[Event]) -> None:
        for r in range(self.rows):
            while self.slots[r] is None:
                job = self.source.pull()
                if job is None:
                    return
                self._start(r, job, events)

    def _start(self, r: int, job: Job, events: list[Event]) -> None:
        """Prefill `job` alone and move its prompt's keys/values into row `r`."""
        start = time.perf_counter()
        try:
            state = prefill(self.model, [job.ids], job.options, self.special)
        except MimoTTSError as exc:
            events.append(JobDone(job, "error", error=exc))
            return
        length = state.prompt_len
        if self.cache is None:
            self._allocate(state)
        need = length + state.budgets[0] if self.kind in ("graph", "static") else length + 1
        self._reserve(need)
        for mine, theirs in ((self.cache.k, state.cache.k), (self.cache.v, state.cache.v)):
            mine[:, r, :, :length] = theirs[:, 0, :, :length]
        self.valid[r] = False
        self.valid[r, :length] = True
        self.hidden[r] = state.hidden[0]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.slots[r] = _Row(job, length, state.budgets[0], state.stop_ids,
                             generator_for(job.options, self.device), Collector(self.model.cfg),
                             elapsed, busy_s=elapsed)

    def _drop_cancelled(self, events: list[Event]) -> None:
        with self._lock:
            keys, self._cancel = self._cancel, []
        for r, row in enumerate(self.slots):
            if keys and row is not None and any(row.job.key is k or row.job.key == k for k in keys):
                generation = row.collector.generation() if row.step else None
                events.append(JobDone(row.job, "cancelled", generation, busy_s=row.busy_s))
                self._free(r)

    def _free(self, r: int) -> None:
        """Row `r` holds nothing from now on (its slots stay, masked off, until a refill)."""
        self.slots[r] = None
        self.valid[r] = False

    # -- the batch's tensors -----------------------------------------------------------------
    def _allocate(self, state) -> None:
        cfg, dtype = self.model.cfg, state.cache.k.dtype
        self.cache = KVCache(cfg.backbone, self.rows, state.cache.length, dtype=dtype,
                             device=self.device)
        self.local_cache = KVCache(cfg.patch_decoder, self.rows, cfg.local_steps, dtype=dtype,
                                   device=self.device)
        self.hidden = state.hidden.new_zeros(self.rows, state.hidden.shape[-1])

    def _reserve(self, slots: int) -> None:
        """Grow the cache to `slots` positions; a graph step is rebuilt over the new one."""
        before = self.cache.length
        self.cache.reserve(slots, MAX_GROUPS)
        if self.cache.length != before and self.kind in ("graph", "static"):
            self.decoder = None

    def _decoder(self) -> DecodeStep:
        if self.decoder is None:
            self.decoder = build_step(self.model, self.kind, self.cache, self.local_cache,
                                      self.valid, 0, self.strict)
        return self.decoder

    # -- one group -----------------------------------------------------------------------------
    def _sample(self, live: list[int], decoder: DecodeStep):
        """Each live row's text token (its hook, min-length rule, sampler and generator) and,
        for <|empty|> rows, its codes -> (tokens [B], codes [B, F, K], raw logits or None)."""
        logits = decoder.text_logits(self.hidden)  # [B, V]
        keep = any(self.slots[r].job.options.keep_logits for r in live)
        raw = logits.detach().to("cpu", copy=True) if keep else None
        tokens = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        # Each row's own hook and min-length rule, then every row drawn at once: row-wise
        # filters and each row's generator give what its single run draws (sampling.sample).
        index = torch.tensor(live, device=self.device)
        text = logits.index_select(0, index)  # [n, V], a copy the rules may write into
        for i, r in enumerate(live):
            row = self.slots[r]
            options = row.job.options
            if options.text_logits_processor is not None:
                text[i] = options.text_logits_processor(row.step, logits[r:r + 1])[0]
            if row.step < options.min_new_groups:
                text[i, row.stop_ids] = float("-inf")
        rows = [self.slots[r] for r in live]
        tokens[index] = sample(text, [row.job.options.text_sampler for row in rows],
                               [row.generator for row in rows])
        cfg = self.model.cfg
        codes = self.model.empty_ids.expand(self.rows, cfg.group_size, -1).clone()
        token_list = tokens.tolist()
        audio = [r for r in live if token_list[r] == self.special.empty]
        if audio:
            index = torch.tensor(audio, device=self.device)
            local_in = self.model.hidden_states_downcast(self.hidden[index])
            rows = [self.slots[r] for r in audio]
            codes[index] = decode_patch(self.model, local_in,
                                        [row.job.options.audio_sampler for row in rows],
                                        [row.generator for row in rows], decoder)
        return tokens, codes, raw

    def _feed(self) -> None:
        """Run the backbone over the groups the last step sampled (`_advance`), its time shared
        by the rows it ran. A step returns its groups before this, so a stream's push (and
        Stage-1's turn) comes one backbone position sooner; each row's arithmetic is the same."""
        if self._fed is None:
            return
        (tokens, codes), self._fed = self._fed, None
        rows = [row for row in self.slots if row is not None]
        if not rows:
            return
        start = time.perf_counter()
        self._advance(tokens, codes)
        share = (time.perf_counter() - start) / len(rows)
        for row in rows:
            row.busy_s += share

    def _advance(self, tokens: Tensor, codes: Tensor) -> None:
        """Feed every live row's new group through one backbone position at its own slot; a
        free row runs a text token at slot 0 (static shapes; it is masked and overwritten)."""
        slots = [0 if row is None else row.length for row in self.slots]
        free = [r for r, row in enumerate(self.slots) if row is None]
        if free:
            tokens[torch.tensor(free, device=self.device)] = 0
        self._reserve(max(slots) + 1)
        decoder = self._decoder()
        embeds = decoder.embed(tokens, codes, self.special.empty)  # [B, 1, H]
        positions = torch.tensor(slots, device=self.device).unsqueeze(1)
        self.hidden = decoder.backbone(embeds, positions, slots)
        for row in self.slots:
            if row is not None:
                row.length += 1


@dataclass(frozen=True)
class StepFailed:
    """From `BatchRun`: a step failed (out of memory, say); the rows it ran are lost, and a
    fresh batch goes on with the jobs not yet begun."""

    error: MimoTTSError


class BatchRun:
    """The one driver of a continuous batch: each step under `guard()`, a failing step
    reported as `StepFailed` and followed by a fresh batch over the same source. Both the batch
    runner and the server iterate it; `cancel(key)` reaches the batch that runs now."""

    def __init__(self, make: Callable[[], ContinuousBatcher], guard=None):
        self.make, self.guard = make, guard or contextlib.nullcontext
        self.batcher: ContinuousBatcher | None = None

    def cancel(self, key) -> None:
        if self.batcher is not None:
            self.batcher.cancel(key)

    def __iter__(self) -> Iterator[Event | StepFailed]:
        while True:
            self.batcher = self.make()
            steps = self.batcher.run()
            while True:
                try:
                    with self.guard():
                        event = next(steps, None)
                except MimoTTSError as exc:
                    yield StepFailed(exc)
                    break
                if event is None:
                    return
                yield event


# -- whole runs over any engine's `run_batch` (scripts and tests; the faces use the worker) ----
def generate_all(engine, prompts, options: GenerationOptions,
                 rows: int | None = None) -> list[Generation]:
    """Each prompt's whole generation, through `engine.run_batch` with `rows` rows (default:
    all prompts at once). Every prompt is a job with `options` (its seed included), so a
    prompt's generation does not depend on the others. A refused prompt or a failed step
    raises its error."""
    made: list[Generation | None] = [None] * len(prompts)
    for event in _whole_run(engine, prompts, options, rows):
        if isinstance(event, JobDone):
            made[event.job.key] = event.generation
    return made


def stream_steps(engine, prompts, options: GenerationOptions,
                 rows: int | None = None) -> Iterator[StepOutput]:
    """Each prompt's `StepOutput`s as they come, `index` the prompt's place in `prompts` (not
    its row); through `engine.run_batch` as `generate_all` runs it."""
    for event in _whole_run(engine, prompts, options, rows):
        if isinstance(event, JobGroup):
            yield replace(event.output, index=event.job.key)


def _whole_run(engine, prompts, options: GenerationOptions, rows: int | None):
    if not prompts:
        raise UsageError("no prompts to generate from")
    jobs = Jobs(Job(ids, options, key=i) for i, ids in enumerate(prompts))
    run = engine.run_batch(jobs, min(rows or len(prompts), len(prompts)))
    try:
        for event in run:
            if isinstance(event, StepFailed):
                raise event.error
            if isinstance(event, JobDone) and event.error is not None:
                raise event.error
            if event is not IDLE and event is not STEPPED:
                yield event
    finally:
        getattr(run, "close", lambda: None)()
