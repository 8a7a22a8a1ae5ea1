"""The worker of `mimo-tts serve`: one Stage-0 thread owns the model, requests share its batches.

A request becomes one `SpeechJob` per text piece in the bounded `RequestQueue`. The worker's
Stage-0 thread asks a batching strategy for Stage-0 events and routes each row's groups to its
job. The strategy is the one swappable piece, chosen on `tts.engine.continuous`:
`ContinuousStrategy` keeps one continuous batch full (`MiMoTTS.run_batch`, the driver the batch
runner uses too); `StaticBatcher` runs the jobs queued now with the same generation options, up
to `batch_size` rows, one `MiMoTTS.stream_steps` call at a time. A streamed job's audio frames go
to the Stage-1 thread as they gather (one streaming decoder per job, pushes growing from the
decoder's look-ahead plus one group, `push_schedule`). Stage-1 decodes in rounds: the oldest
request's next push and the next push of every other streamed job queued by then, up to
`stage1_batch` jobs, go through the decoder together (`codec.push_streams`: one pass over its
weights; each job's audio is what it gets alone). The other jobs are decoded one-shot when their
row ends, like `synth`. Each job reports through its `deliver` callback: ("audio", samples [S])
while streaming, then ("done", info) or ("error", MimoTTSError). A cancelled job is dropped; a
failure fails only its own batch (of Stage-0 rows, or of Stage-1 pushes).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from mimo_tts.errors import MimoTTSError
from mimo_tts.runtime.guards import oom_advice, thread_budget
from mimo_tts.server.metrics import Meter
from mimo_tts.synthesis.streaming import FrameCollector, push_schedule

# Streamed jobs whose pushes Stage-1 decodes in one call (`ServeConfig.stage1_batch`).
STAGE1_BATCH = 16


@dataclass(eq=False)
class Ticket:
    """One admitted request: waiting until the worker takes its first job, then active."""

    started: bool = False


@dataclass(eq=False)
class SpeechJob:
    """One prompt (text piece) of a request, and its state while the worker works on it."""

    prompt: object  # prompts.Prompt
    options: object  # lm.generate.GenerationOptions; rows of a batch share them
    seed: int
    stream: bool  # decode while generating (else one-shot when the row ends)
    deliver: Callable[[tuple], None]
    ticket: Ticket
    label: str = "request"
    order: tuple = (0, 0)  # Stage-1 serves the smallest first: (request number, piece index)
    cancelled: threading.Event = field(default_factory=threading.Event)
    rows: int = 0  # rows of the Stage-0 batch it ran in
    frames: FrameCollector | None = None
    decoder: object | None = None
    chunks: list = field(default_factory=list)


class RequestQueue:
    """Admitted requests and their waiting jobs: the batching strategy's source.

    At most `max_queued` requests wait for the worker, and at most `max_active` are in progress
    (from their first job taken to their release, so a slow reader holds its place).
    """

    def __init__(self, max_queued: int, max_active: int):
        self.max_queued, self.max_active = max_queued, max_active
        self.cond = threading.Condition()
        self.jobs: deque[SpeechJob] = deque()
        self.tickets: set[Ticket] = set()
        self.closed = False

    def counts(self) -> dict:
        with self.cond:
            active = sum(t.started for t in self.tickets)
            return {"active": active, "queued": len(self.tickets) - active}

    def admit(self, ticket: Ticket) -> bool:
        """Take a request in, unless the queue is full."""
        with self.cond:
            if self.closed or len(self.tickets) - sum(t.started for t in self.tickets) \
                    >= self.max_queued:
                return False
            self.tickets.add(ticket)
            return True

    def put(self, jobs: list[SpeechJob]) -> None:
        with self.cond:
            self.jobs.extend(jobs)
            self.cond.notify_all()

    def release(self, ticket: Ticket) -> None:
        """The request is over (answered, failed or gone): its place and waiting jobs go."""
        with self.cond:
            self.tickets.discard(ticket)
            for job in [j for j in self.jobs if j.ticket is ticket]:
                self.jobs.remove(job)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def take(self, limit: int, block: bool = True) -> list[SpeechJob] | None:
        """Up to `limit` waiting jobs with the first one's options (None once closed); with
        `block`, wait until there is one."""
        with self.cond:
            while not self.closed:
                picked = self._pick(limit)
                if picked or not block:
                    return picked
                self.cond.wait()
            return None

    def _pick(self, limit: int) -> list[SpeechJob]:
        active = sum(t.started for t in self.tickets)
        picked: list[SpeechJob] = []
        for job in list(self.jobs):
            if len(picked) >= limit:
                break
            if picked and job.options != picked[0].options:
                continue
            if not job.ticket.started:
                if active >= self.max_active:
                    continue
                job.ticket.started, active = True, active + 1
            picked.append(job)
            self.jobs.remove(job)
        return picked


@dataclass(frozen=True)
class Started:
    """A job got a Stage-0 row, in a batch of `rows`."""

    job: SpeechJob
    rows: int


@dataclass(frozen=True)
class Group:
    """One generated group (`lm.generate.StepOutput`) of a job's row."""

    job: SpeechJob
    step: object


@dataclass(frozen=True)
class Finished:
    """A job's row ended: stopped, or failed with `error`."""

    job: SpeechJob
    error: MimoTTSError | None = None


class StaticBatcher:
    """Batching strategy: the jobs queued now (same options, up to `batch_size` rows) run as
    one Stage-0 stream; the next batch starts when it ends. A batch nobody waits for stops.

    The contract of a strategy (`run(source)`): take jobs with `source.take`, yield `Started`
    once per job, `Group` per generated group and `Finished` once per job (with the error if
    its row failed), skip cancelled jobs, and return when `take` returns None.
    """

    def __init__(self, tts, batch_size: int, log=None):
        self.tts, self.batch_size = tts, batch_size
        self.log = log or (lambda message: None)

    def run(self, source: RequestQueue) -> Iterator[Started | Group | Finished]:
        while (jobs := source.take(self.batch_size)) is not None:
            yield from self.batch(jobs)

    def batch(self, jobs: list[SpeechJob]) -> Iterator[Started | Group | Finished]:
        for job in jobs:
            yield Started(job, len(jobs))
        ended: set[int] = set()
        error = steps = None
        try:
            with oom_advice("Stage-0 generation", self.tts.lm_device):
                steps = self.tts.stream_steps([j.prompt.input_ids for j in jobs],
                                              jobs[0].options)
                for step in steps:
                    if all(j.cancelled.is_set() for j in jobs):
                        break
                    job = jobs[step.index]
                    if step.index in ended or job.cancelled.is_set():
                        continue
                    yield Group(job, step)
                    if step.finished:
                        ended.add(step.index)
                        yield Finished(job)
        except MimoTTSError as exc:
            error = exc
        except Exception as exc:  # a bug: this batch fails, the server goes on
            self.log(traceback.format_exc())
            error = MimoTTSError(f"unexpected {type(exc).__name__} in Stage-0: {exc}")
        finally:
            getattr(steps, "close", lambda: None)()
        for i, job in enumerate(jobs):
            if i not in ended:
                yield Finished(job, error or MimoTTSError("request cancelled"))


class ContinuousStrategy:
    """Batching strategy on the native engine: `lm.batching.ContinuousBatcher` keeps up to
    `batch_size` rows busy; a row that ends takes the next queued job at once, whatever its
    seed or samplers (each row samples from its own generator), so a request's audio does not
    depend on what it was batched with. Same contract as `StaticBatcher`."""

    def __init__(self, tts, batch_size: int, log=None):
        self.tts, self.batch_size = tts, batch_size
        self.log = log or (lambda message: None)

    def run(self, source: RequestQueue) -> Iterator[Started | Group | Finished]:
        from mimo_tts.lm.batching import IDLE, JobDone, JobGroup, StepFailed

        feed = _QueueFeed(source)
        batch = self.tts.run_batch(feed, self.batch_size)
        live: set[SpeechJob] = set()
        for event in batch:
            live.update(feed.started)
            for job in feed.started:  # rows: the live rows it joined
                yield Started(job, len(live))
            feed.started.clear()
            if isinstance(event, StepFailed):  # the step failed (out of memory): its rows fail
                for job in live:
                    yield Finished(job, event.error)
                live.clear()  # a fresh batch goes on with the jobs still queued
                continue
            for job in [j for j in live if j.cancelled.is_set()]:
                batch.cancel(job)
            if event is IDLE:
                if not feed.wait():
                    return
            elif isinstance(event, JobGroup):
                if not event.job.key.cancelled.is_set():
                    yield Group(event.job.key, event.output)
            elif isinstance(event, JobDone):
                job = event.job.key
                live.discard(job)
                error = event.error if event.reason != "cancelled" else \
                    MimoTTSError("request cancelled")
                yield Finished(job, error)


class _QueueFeed:
    """The `RequestQueue` as an `lm.batching.JobSource` (non-blocking `pull`); `wait` blocks
    until a job is queued (False once the queue is closed)."""

    def __init__(self, source: RequestQueue):
        self.source, self.started, self.exhausted = source, [], False
        self._next: SpeechJob | None = None

    def pull(self):
        from mimo_tts.lm.batching import Job

        job, self._next = self._next, None
        if job is None:
            taken = self.source.take(1, block=False)
            if taken is None:
                self.exhausted = True
                return None
            job = taken[0] if taken else None
        if job is None or job.cancelled.is_set():
            return None
        self.started.append(job)
        return Job(job.prompt.input_ids, job.options, key=job)

    def wait(self) -> bool:
        taken = self.source.take(1, block=True)
        if taken is None:
            self.exhausted = True
            return False
        self._next = taken[0] if taken else None
        return True


class SpeechWorker:
    """The Stage-0 thread (through a batching strategy) and the Stage-1 thread of the server."""

    def __init__(self, tts, requests: RequestQueue, batcher, options, log=None,
                 stage1_batch: int = STAGE1_BATCH, meter: Meter | None = None):
        self.tts, self.requests, self.batcher = tts, requests, batcher
        self.log = log or (lambda message: None)
        self.stage1_batch = stage1_batch  # streamed jobs decoded together (1: one at a time)
        self.meter = meter or Meter()  # what the server's metrics hear of the work
        self.schedule = (options.stream_mode, options.stream_chunk_groups,
                         options.stream_max_chunk_groups)
        self.stream_mode = options.stream_mode
        self.stats = {"rows": 0, "max_batch_rows": 0, "last_batch_rows": 0,
                      "stage1_rounds": 0, "max_stage1_jobs": 0}
        self.decodes: queue.PriorityQueue = queue.PriorityQueue()  # (order, seq, task)
        self.seq = itertools.count()
        self.threads = [threading.Thread(target=self._stage0, name="mimo-tts-stage0", daemon=True),
                        threading.Thread(target=self._stage1, name="mimo-tts-stage1", daemon=True)]
        for thread in self.threads:
            thread.start()

    def submit(self, jobs: list[SpeechJob]) -> None:
        for job in jobs:
            job.frames = FrameCollector(self.tts, push_schedule(self.tts, *self.schedule))
        self.requests.put(jobs)

    def cancel(self, jobs: list[SpeechJob]) -> None:
        for job in jobs:
            job.cancelled.set()

    def close(self, timeout: float = 30) -> None:
        """No more jobs; the threads end (waited for up to `timeout` s in all: a Stage-0 step
        in progress finishes first, and the threads are daemons, so the process can exit)."""
        self.requests.close()
        self.decodes.put(((float("inf"),), next(self.seq), None))
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0))

    def _stage0(self) -> None:
        with thread_budget(self.tts.lm_threads):
            while not self.requests.closed:
                try:
                    for event in self.batcher.run(self.requests):
                        self._event(event)
                except Exception:  # a bug in the strategy: log it and take the next jobs
                    self.log(traceback.format_exc())
                    self.meter.engine_error("stage0")

    def _event(self, event) -> None:
        try:
            self._route(event)
        except Exception as exc:  # a bug routing one job: that job fails
            self.log(traceback.format_exc())
            self.meter.engine_error("stage0")
            self._fail(event.job, MimoTTSError(f"unexpected {type(exc).__name__}: {exc}"))

    def _route(self, event) -> None:
        job = event.job
        if isinstance(event, Started):
            job.rows = event.rows
            self.meter.row_started()
            self.stats["rows"] += 1
            self.stats["last_batch_rows"] = event.rows
            self.stats["max_batch_rows"] = max(self.stats["max_batch_rows"], event.rows)
        elif isinstance(event, Group):
            codes = job.frames.add(event.step)
            if codes is not None and job.stream:
                self._queue_decode(job, codes, False)
        elif event.error is not None:
            self.meter.row_finished(failed=not job.cancelled.is_set())
            self._fail(job, event.error)
        else:
            self.meter.row_finished()
            self._queue_decode(job, job.frames.close(), True)

    def _queue_decode(self, job: SpeechJob, codes, last: bool) -> None:
        self.decodes.put((job.order, next(self.seq), (job, codes, last)))

    def _fail(self, job: SpeechJob, error: MimoTTSError) -> None:
        if not job.cancelled.is_set():
            job.cancelled.set()  # later work for it is dropped
            job.deliver(("error", error))

    def _stage1(self) -> None:
        with thread_budget(self.tts.tokenizer_threads):
            while (tasks := self._take_decodes()) is not None:
                self._decode_round([t for t in tasks if not self._dropped(t[0])])

    def _take_decodes(self) -> list | None:
        """The next round of Stage-1 work (None once closed): the first queued task, then the
        first queued task of every other job, up to `stage1_batch` jobs. A job's later pushes
        wait for a later round: its decoder takes them one by one, in order."""
        first = self.decodes.get()
        if first[2] is None:
            return None
        tasks, jobs, later = [first[2]], {first[2][0]}, []
        while len(tasks) < self.stage1_batch:
            try:
                entry = self.decodes.get_nowait()
            except queue.Empty:
                break
            if entry[2] is not None and entry[2][0] not in jobs:
                jobs.add(entry[2][0])
                tasks.append(entry[2])
                continue
            later.append(entry)
            if entry[2] is None:
                break
        for entry in later:  # back with their places in the order
            self.decodes.put(entry)
        return tasks

    def _dropped(self, job: SpeechJob) -> bool:
        if job.cancelled.is_set():
            job.decoder = None
            return True
        return False

    def _decode_round(self, tasks: list) -> None:
        """Streamed jobs' pushes decoded together (their audio delivered at once); then each
        job that ended is finished. A failure fails the jobs it touched."""
        pushes = [t for t in tasks if t[0].stream]
        failed = self._guarded(lambda: self._push(pushes), [t[0] for t in pushes]) \
            if pushes else set()
        for job, _, last in tasks:
            if last and job not in failed:
                self._guarded(lambda job=job: self._finish(job), [job])

    def _guarded(self, work, jobs: list[SpeechJob]) -> set:
        """Run `work` (Stage-1 time to the metrics, a failure their engine error); if it
        fails, fail `jobs` (returned; empty when it succeeds)."""
        try:
            with self.meter.stage("stage1"):
                work()
            return set()
        except MimoTTSError as exc:
            error = exc
        except Exception as exc:  # a bug decoding: those jobs fail, the server goes on
            self.log(traceback.format_exc())
            error = MimoTTSError(f"unexpected {type(exc).__name__}: {exc}")
        for job in jobs:
            self._fail(job, error)
        return set(jobs)

    def _push(self, pushes: list) -> None:
        """One push per streamed job [K, f_i], through the decoder in one call."""
        from mimo_tts.codec import StreamingDecoder, push_streams

        for job, _, _ in pushes:
            if job.decoder is None:
                job.decoder = StreamingDecoder(self.tts.codec, mode=self.stream_mode)
        self.stats["stage1_rounds"] += 1
        self.stats["max_stage1_jobs"] = max(self.stats["max_stage1_jobs"], len(pushes))
        with oom_advice("Stage-1 streaming decode", str(self.tts.codec.device)):
            waves = push_streams([job.decoder for job, _, _ in pushes],
                                 [codes for _, codes, _ in pushes],
                                 [last for _, _, last in pushes])
        for (job, _, _), wave in zip(pushes, waves, strict=True):
            if wave is not None and wave.numel():
                job.chunks.append(wave.detach().float().cpu())  # [S_i]
                job.deliver(("audio", job.chunks[-1]))

    def _finish(self, job: SpeechJob) -> None:
        """A job whose row ended: its audio checked like `synth`'s, decoded one-shot unless it
        was streamed."""
        import torch

        job.decoder = None
        # the streamed audio is already sent: a mismatch is checked as decoded one-shot
        streamed = torch.cat(job.chunks) if job.stream and job.chunks else None
        piece = job.frames.piece(job.prompt, job.seed, streamed, self.log, job.label)
        audio = self.tts.finish([piece], job.label)  # no audio tokens, NaN, silence: errors
        job.deliver(("done", {"audio": audio, "groups": len(piece.new_text_ids),
                              "frames": int(piece.codes.shape[1])}))


def deliver_on(loop, events):
    """A job's `deliver` for a face on an asyncio loop: each event from the worker threads goes
    into that request's queue (`events`, an asyncio.Queue) on the loop; none once the loop is
    closed (the server is shutting down)."""
    def deliver(event: tuple) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:
            pass

    return deliver
