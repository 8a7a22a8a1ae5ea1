"""A continuous batch on vLLM: `VLLMEngine.run_batch`, with the events of `lm.batching`.

vLLM already keeps its rows full; this loop only decides which jobs become vLLM requests. While
fewer than `rows` requests are live it pulls `lm.batching.Job`s from the source and adds each as
its own request (its own seed, samplers, budget and stop set: jobs of different options share
the batch), then runs one `LLMEngine.step()`, takes the codes the worker decided in it
(state.py) and turns the new groups into the events `lm/engine.py` lists. Where vLLM differs:

- an `<|empty|>` group's codes are decided when its token is fed back (model.py), so its
  `JobGroup` arrives one step late, or at the finish; `StepOutput.index` is the request's slot;
- "budget" is also `max_model_len` reached; "error" is a prompt refused before it runs (too
  long, not whole groups, options vLLM cannot honour) or a request vLLM ended itself;
- after a `StepFailed` the live requests are aborted and lost (no `JobDone`).

Leaving early (`close`, or a dropped iterator) aborts the live requests and drops their worker
state. Each request's text draws come from vLLM's per-request generator and its codes from the
worker's, both seeded with the job's seed, so a job's groups do not depend on its batch-mates
or its slot, as far as vLLM's kernels give the same logits for a row whatever the batch
(docs/vllm-engine.md).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mimo_tts.errors import MimoTTSError
from mimo_tts.lm.batching import IDLE, STEPPED, Event, Job, JobDone, JobGroup, StepFailed
from mimo_tts.lm.generate import Collector, StepOutput

# vLLM's finish reasons -> JobDone's; any other ("abort", "error") is an error of that job.
FINISH_REASONS = {"stop": "stop", "length": "budget"}


@dataclass(eq=False)
class Request:
    """One job's vLLM request: its slot, worker-state key (None once dropped), the tokens vLLM
    drew so far and the codes decided so far (generated index -> [F, K])."""

    job: Job
    req_id: str  # vLLM's request id (outputs, aborts)
    number: int  # the run's n-th pulled job (VLLMEngine.last_joins' key)
    slot: int
    key: str | None
    prompt_len: int
    collector: Collector
    tokens: list[int] = field(default_factory=list)
    codes: dict[int, Tensor] = field(default_factory=dict)
    emitted: int = 0
    finished: bool = False
    reason: str | None = None  # vLLM's finish reason
    busy_s: float = 0.0


class VLLMBatchRun:
    """What `VLLMEngine.run_batch` returns: iterate it for the events (once at a time per
    engine); `cancel(key)` from any thread stops that job's request at the next step; `close`
    leaves early."""

    def __init__(self, engine, source, rows: int, guard=None):
        self.engine, self.source, self.rows = engine, source, rows
        self.guard = guard or contextlib.nullcontext
        self._cancel: list = []
        self._lock = threading.Lock()
        self._pulled = 0
        # weak: the iterator's frame holds this run, and a cycle would keep a dropped iterator
        # (and its live requests) until the cyclic collector ran
        self._iterator: weakref.ref | None = None

    def cancel(self, key) -> None:
        """Abort the live job with this key at the next step (`JobDone` "cancelled"); a key
        no live job holds then is forgotten."""
        with self._lock:
            self._cancel.append(key)

    def __iter__(self) -> Iterator[Event | StepFailed]:
        events = self._events()
        self._iterator = weakref.ref(events)
        return events

    def close(self) -> None:
        """Stop iterating: abort the live requests and drop their worker state."""
        events = self._iterator() if self._iterator is not None else None
        if events is not None:
            events.close()

    def _events(self) -> Iterator[Event | StepFailed]:
        self.engine._claim()
        live: dict[str, Request] = {}  # vLLM request id -> request
        try:
            while True:
                events: list = []
                self._drop_cancelled(live, events)
                self._refill(live, events)
                yield from events
                if not live:
                    if self.source.exhausted:
                        return
                    if not events:
                        yield IDLE
                    continue
                try:
                    with self.guard():
                        events = self._step(live)
                except MimoTTSError as exc:
                    self.engine._abandon(live.values())
                    live.clear()
                    yield StepFailed(exc)
                    continue
                yield from events
                yield STEPPED
        finally:
            try:
                self.engine._abandon(live.values())
            finally:
                self.engine._busy = False

    # -- jobs joining and leaving ----------------------------------------------------------
    def _refill(self, live: dict[str, Request], events: list) -> None:
        while len(live) < self.rows:
            job = self.source.pull()
            if job is None:
                return
            number, self._pulled = self._pulled, self._pulled + 1
            taken = {r.slot for r in live.values()}
            slot = next(s for s in range(self.rows) if s not in taken)
            try:
                request = self.engine._add(job, slot, number)
            except MimoTTSError as exc:
                events.append(JobDone(job, "error", error=exc))
                continue
            live[request.req_id] = request

    def _drop_cancelled(self, live: dict[str, Request], events: list) -> None:
        with self._lock:
            keys, self._cancel = self._cancel, []
        if not keys:
            return
        dropped = {rid: r for rid, r in live.items()
                   if any(r.job.key is k or r.job.key == k for k in keys)}
        for rid in dropped:
            del live[rid]
        self.engine._abandon(dropped.values())
        for r in sorted(dropped.values(), key=lambda r: r.slot):
            generation = r.collector.generation() if r.emitted else None
            events.append(JobDone(r.job, "cancelled", generation, busy_s=r.busy_s))

    # -- one step --------------------------------------------------------------------------
    def _step(self, live: dict[str, Request]) -> list:
        """One vLLM step: the groups it completed, then the jobs it ended."""
        engine = self.engine.llm.llm_engine
        if not engine.has_unfinished_requests():
            raise RuntimeError("vLLM stopped before every MiMo request finished")
        start = time.perf_counter()
        for out in engine.step():
            request = live.get(out.request_id)
            if request is not None:
                completion = out.outputs[0]
                request.tokens = list(completion.token_ids)
                request.finished, request.reason = out.finished, completion.finish_reason
        self._collect(live.values())
        share = (time.perf_counter() - start) / len(live)
        groups, ended = [], []
        for rid, r in sorted(live.items(), key=lambda item: item[1].slot):
            r.busy_s += share
            groups += [JobGroup(r.job, out) for out in self._ready(r)]
            if r.finished:
                ended.append(live.pop(rid))
        return groups + [self._done(r) for r in ended]

    def _collect(self, requests) -> None:
        """Fetch newly decided codes; finish (and drop the state of) finished requests."""
        held = [r for r in requests if r.key is not None]
        if not held:
            return
        taken = self.engine._rpc("mimo_audio_take", [r.key for r in held])
        for r in held:
            self._store(r, taken.get(r.key, []))
            if r.finished:
                position = r.prompt_len + len(r.tokens) - 1
                codes, joins = self.engine._rpc("mimo_audio_finish", r.key, r.tokens[-1],
                                                position)
                self._store(r, codes)
                self.engine.last_joins[r.number] = joins
                r.key = None

    @staticmethod
    def _store(r: Request, decided: list) -> None:
        for position, codes in decided:
            r.codes[position - r.prompt_len] = torch.tensor(codes, dtype=torch.long)

    def _ready(self, r: Request) -> Iterator[StepOutput]:
        """The request's groups whose codes are known, in order (each kept in its collector)."""
        empty = self.engine.special.empty
        while r.emitted < len(r.tokens):
            j, token = r.emitted, r.tokens[r.emitted]
            codes = None
            if token == empty:
                codes = r.codes.get(j)
                if codes is None:
                    if r.key is None:  # finished, yet never decided: a bug, not a wait
                        raise RuntimeError(f"no codes for audio group {j} of job {r.number}")
                    return
            r.emitted += 1
            out = StepOutput(r.slot, j, token, codes, r.finished and r.emitted == len(r.tokens))
            r.collector.add(out)
            yield out

    @staticmethod
    def _done(r: Request) -> JobDone:
        generation = r.collector.generation() if r.emitted else None
        reason = FINISH_REASONS.get(r.reason)
        if reason is None:
            error = MimoTTSError(f"vLLM ended the request of job {r.number} ({r.reason})")
            return JobDone(r.job, "error", generation, error=error, busy_s=r.busy_s)
        return JobDone(r.job, reason, generation, busy_s=r.busy_s)
