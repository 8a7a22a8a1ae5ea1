"""The speech worker: the one place a synthesis runs, for every face.

A face (the library's calls, the batch runner behind `synth` and `book`, the Ray Stage-0 actor,
the HTTP and Wyoming servers) turns its text into `SpeechJob`s, one per text piece, and reads
each job's events: `Chunk`s of audio while a streamed job is decoded, then exactly one `Done`
(its `Piece`: text, codes and, unless `decode="none"`, audio) or `Failed`.

Stage-0 is one loop over the engine's continuous batch (`Engine.run_batch`: a job's codes do
not depend on what it ran beside). Stage-1 is one decoder schedule in rounds: the oldest job's
next push and the next push of every other streamed job queued by then (up to `stage1_batch`)
go through the codec together (`codec.push_streams`); a job's codes decoded whole (`decode=
"whole"`) are decoded once its row ends, in one `Stage1.decode` call with the other jobs of its
`group` (an item's pieces). Stage-1 runs in a thread of its own, or in turns with Stage-0
(`stage1="turns"`: its work runs in the Stage-0 thread after each step, with every CPU thread,
as small CPUs want it: `synthesis/loader.stage1_mode`).

Two ways to drive it: `run(jobs)` in the caller's thread, yielding events (the offline faces),
or `start()` a Stage-0 thread, then `submit`/`cancel` from any thread with each job's `deliver`
callback receiving its events in the worker's threads (the servers). A step that fails fails the
jobs it was running; a job that fails fails the rest of its group; a bug in routing one job
fails that job only.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from mimo_tts.errors import MimoTTSError
from mimo_tts.runtime.guards import oom_advice, thread_budget
from mimo_tts.runtime.openmp import release_team
from mimo_tts.synthesis.pieces import Piece
from mimo_tts.synthesis.streaming import FrameCollector, lead_groups, push_schedule
from mimo_tts.synthesis.tempo import stretch

STAGE1_BATCH = 16  # streamed jobs whose pushes one Stage-1 round decodes together
DECODES = ("stream", "whole", "none")
STAGE1_MODES = ("thread", "turns")


@dataclass(frozen=True)
class Chunk:
    """New audio of a streamed job, as Stage-1 decoded it: samples [S] float32 on the CPU."""

    job: SpeechJob
    samples: object


@dataclass(frozen=True)
class Done:
    """A job ended: its piece (text and codes by the official extraction; audio unless
    `decode="none"` or no audio was generated)."""

    job: SpeechJob
    piece: Piece


@dataclass(frozen=True)
class Failed:
    """A job failed (its step, its prompt, Stage-1, its group) or was cancelled."""

    job: SpeechJob
    error: MimoTTSError


Event = Chunk | Done | Failed


@dataclass(eq=False)
class SpeechJob:
    """One text piece to speak, and its state while the worker works on it.

    `decode`: "stream" (Stage-1 decodes its frames as they come), "whole" (once its row ends)
    or "none" (codes only). `group`: the jobs whose whole-decoded codes go through Stage-1
    together (one item's pieces; None: alone). `order`: Stage-1 serves the smallest first.
    `timings` (perf_counter seconds): `started_at` (it got a row), `prefill_s`, `stage0_s` (its
    share of the batch's steps), `generated_at`, `first_audio_at`, `stage1_s`, `done_at`.
    """

    prompt: object  # lm.prompts.Prompt
    options: object  # lm.generate.GenerationOptions, its seed included
    seed: int
    decode: str = "whole"
    deliver: Callable[[Event], None] | None = None
    group: list | None = None
    label: str = "speech"
    order: tuple = (0, 0)
    key: object = None  # the face's own handle
    speed: float = 1.0  # its audio time-stretched once decoded (`tempo.stretch`)
    cancelled: threading.Event = field(default_factory=threading.Event)
    rows: int = 0  # live rows of the batch when it joined
    timings: dict = field(default_factory=dict)
    ended: bool = False  # its last event was delivered
    piece: Piece | None = None
    frames: FrameCollector | None = None
    on_generated: Callable[[SpeechJob], None] | None = None  # its Stage-0 ended (progress)
    decoder: object = None
    chunks: list = field(default_factory=list)

    def __post_init__(self):
        if self.decode not in DECODES:
            raise ValueError(f"decode must be one of {DECODES}, got {self.decode!r}")


class Meter:
    """What the worker reports while it works; this base records nothing (faces without
    metrics). The server's `ServerMetrics` counts it."""

    def row_started(self) -> None:
        """A job got a Stage-0 row."""

    def row_finished(self, failed: bool = False) -> None:
        """A job's row ended (`failed`: by an engine error, not a cancel)."""

    def engine_error(self, stage: str) -> None:
        """The engine failed a job, or a bug stopped a batch, in `stage`."""

    @contextlib.contextmanager
    def stage(self, name: str):
        """Times one piece of work of stage `name`; an exception out of it is its error."""
        yield


class _Feed:
    """The engine's job source (`lm.batching.JobSource`, a non-blocking `pull`): submitted jobs
    (`put`, from any thread) or an iterable's (`jobs`, consumed lazily, so a face can build the
    next prompt only when a row is free)."""

    def __init__(self, worker: SpeechWorker, jobs: Iterable[SpeechJob] | None = None):
        self.worker, self.cond = worker, threading.Condition()
        self.queued: deque[SpeechJob] = deque()
        self.source = None if jobs is None else iter(jobs)
        self.closed = False

    @property
    def exhausted(self) -> bool:
        with self.cond:
            return self.closed and not self.queued

    def put(self, jobs: list[SpeechJob]) -> None:
        with self.cond:
            self.queued.extend(jobs)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def pull(self):
        from mimo_tts.lm.batching import Job

        while True:
            job = self._next()
            if job is None:
                return None
            if not job.cancelled.is_set():
                self.worker._joined(job)
                return Job(job.prompt.input_ids, job.options, key=job)

    def _next(self) -> SpeechJob | None:
        with self.cond:
            if self.queued:
                return self.queued.popleft()
            if self.source is None or self.closed:
                return None
        job = next(self.source, None)  # outside the lock: it may build the prompt
        if job is None:
            self.close()
        else:
            self.worker._prepare(job)
        return job

    def wait(self) -> None:
        """Block until a job is queued or the feed is closed."""
        with self.cond:
            self.cond.wait_for(lambda: self.queued or self.closed)


class SpeechWorker:
    """Stage-0 over `tts.engine.run_batch` with `rows` rows, Stage-1 in a thread or in turns."""

    def __init__(self, tts, rows: int, *, stage1: str = "turns", schedule=None,
                 stage1_batch: int = STAGE1_BATCH, meter: Meter | None = None, log=None):
        if stage1 not in STAGE1_MODES:
            raise ValueError(f"stage1 must be one of {STAGE1_MODES}, got {stage1!r}")
        o = tts.options
        self.tts, self.rows, self.stage1 = tts, max(int(rows), 1), stage1
        self.schedule = schedule or (o.stream_mode, o.stream_chunk_groups,
                                     o.stream_max_chunk_groups)
        self.stage1_batch = stage1_batch
        self.meter = meter or Meter()
        self.log = log or (lambda message: None)
        self.stats = {"rows": 0, "max_batch_rows": 0, "last_batch_rows": 0,
                      "stage1_rounds": 0, "max_stage1_jobs": 0}
        self.tasks: queue.PriorityQueue = queue.PriorityQueue()  # (order, seq, task | None)
        self.seq = itertools.count()
        self.live: set[SpeechJob] = set()
        self.batch = None  # the running `run_batch`, for cancels
        self.feed: _Feed | None = None
        self.threads: list[threading.Thread] = []
        self.lead: int | None = None

    # -- the online face: own threads, jobs from any thread ------------------------------------
    def start(self) -> SpeechWorker:
        """Start the Stage-0 thread (and Stage-1's, in thread mode); jobs come by `submit`.
        The calling thread gives its OpenMP team back first (`runtime.openmp.release_team`):
        kept beside the Stage-0 thread's own, it would make both spin short."""
        release_team()
        self.feed = _Feed(self)
        self.threads = [threading.Thread(target=self._serve, name="mimo-tts-stage0",
                                         daemon=True)]
        if self.stage1 == "thread":
            self.threads.append(threading.Thread(target=self._stage1_thread,
                                                 name="mimo-tts-stage1", daemon=True))
        for thread in self.threads:
            thread.start()
        return self

    def submit(self, jobs: list[SpeechJob]) -> None:
        for job in jobs:
            self._prepare(job)
        self.feed.put(list(jobs))

    def cancel(self, jobs: Iterable[SpeechJob]) -> None:
        """Stop these jobs: a queued one is never started, a live row ends at the next step,
        Stage-1 drops their work. They get no further events."""
        batch = self.batch
        for job in jobs:
            job.cancelled.set()
            job.ended = True
            if batch is not None and job in self.live:
                batch.cancel(job)

    def close(self, timeout: float = 30) -> None:
        """No more jobs; the threads end (waited for up to `timeout` s in all: a Stage-0 step in
        progress finishes first, and the threads are daemons, so the process can exit)."""
        if self.feed is not None:
            self.feed.close()
        self.tasks.put(((float("inf"),), next(self.seq), None))
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0))

    def _serve(self) -> None:
        while not self.feed.exhausted:
            try:
                for _ in self._stage0(self.feed, online=True):
                    pass
            except Exception:  # a bug in the loop: log it, go on with the next jobs
                self.log(traceback.format_exc())
                self.meter.engine_error("stage0")
                self._fail_live(MimoTTSError("unexpected error in Stage-0"))

    # -- the offline face: the caller's thread drives ------------------------------------------
    def run(self, jobs: Iterable[SpeechJob]) -> Iterator[Event]:
        """Run `jobs` (consumed lazily, as rows free up) to their ends, in this thread; yield
        every event. Leaving early cancels what is still running."""
        events: deque[Event] = deque()

        def given(job_iter):
            for job in job_iter:
                job.deliver = events.append
                yield job

        feed = _Feed(self, given(jobs))
        thread = None
        if self.stage1 == "thread":
            thread = threading.Thread(target=self._stage1_thread, name="mimo-tts-stage1",
                                      daemon=True)
            thread.start()
        try:
            for _ in self._stage0(feed, online=False):
                while events:
                    yield events.popleft()
            if thread is not None:
                self.tasks.put(((float("inf"),), next(self.seq), None))
                while thread.is_alive() or events:
                    thread.join(timeout=0.05)
                    while events:
                        yield events.popleft()
            else:
                self._turns()
            while events:
                yield events.popleft()
        finally:
            if thread is not None and thread.is_alive():
                self.cancel(list(self.live))
                self.tasks.put(((float("-inf"),), next(self.seq), None))
                thread.join(timeout=30)

    # -- Stage-0 ----------------------------------------------------------------------------
    def _prepare(self, job: SpeechJob) -> None:
        if job.decode == "stream" and job.frames is None:
            job.frames = FrameCollector(self.tts, push_schedule(self.tts, *self.schedule))

    def _joined(self, job: SpeechJob) -> None:
        """`job` got a row (called by the feed's `pull`, in the Stage-0 thread)."""
        self.live.add(job)
        job.rows = len(self.live)
        job.timings["started_at"] = time.perf_counter()
        self.meter.row_started()
        self.stats["rows"] += 1
        self.stats["last_batch_rows"] = job.rows
        self.stats["max_batch_rows"] = max(self.stats["max_batch_rows"], job.rows)

    @contextlib.contextmanager
    def _guard(self):
        """The context Stage-0 steps run in: the LM's thread budget, out-of-memory advice."""
        with thread_budget(self.tts.lm_threads), oom_advice("Stage-0 generation",
                                                             self.tts.lm_device):
            yield

    def _stage0(self, feed: _Feed, online: bool) -> Iterator[None]:
        """Step the engine's continuous batch over `feed` until it is exhausted and idle,
        routing its events; yields after each event (the offline face reads events then)."""
        from mimo_tts.lm.batching import IDLE, STEPPED

        self.batch = run = self.tts.engine.run_batch(feed, self.rows, self._guard)
        try:
            for event in run:
                if event is STEPPED or event is IDLE:
                    if self.stage1 == "turns":
                        self._turns()
                    if event is IDLE and online:
                        feed.wait()
                else:
                    self._event(event)
                yield
        finally:
            self.batch = None
            getattr(run, "close", lambda: None)()

    def _event(self, event) -> None:
        from mimo_tts.lm.batching import JobDone, JobGroup, StepFailed

        if isinstance(event, StepFailed):  # the rows it ran are lost; a fresh batch goes on
            self.meter.engine_error("stage0")
            self._fail_live(event.error)
            return
        job = event.job.key
        try:
            if isinstance(event, JobGroup):
                self._group(job, event.output)
            elif isinstance(event, JobDone):
                self._done(job, event)
        except Exception as exc:  # a bug routing one job: that job fails
            self.log(traceback.format_exc())
            self.meter.engine_error("stage0")
            self._fail(job, MimoTTSError(f"unexpected {type(exc).__name__}: {exc}"))

    def _group(self, job: SpeechJob, output) -> None:
        if output.prefill_s is not None:
            job.timings["prefill_s"] = output.prefill_s
        if job.decode == "stream" and not job.ended:
            codes = job.frames.add(output)
            if codes is not None:
                self._queue(job, ("push", job, codes, False))

    def _done(self, job: SpeechJob, event) -> None:
        self.live.discard(job)
        job.timings["stage0_s"] = event.busy_s
        job.timings["generated_at"] = time.perf_counter()
        if event.reason in ("cancelled", "error"):
            self.meter.row_finished(failed=event.reason == "error")
            if event.reason == "error":
                self.meter.engine_error("stage0")
            self._fail(job, event.error or MimoTTSError("request cancelled"))
            return
        self.meter.row_finished()
        if job.ended:
            return
        if job.on_generated is not None:
            job.on_generated(job)
        if job.decode == "stream":
            self._queue(job, ("push", job, job.frames.close(), True))
            return
        job.piece = self.tts.piece(job.prompt, event.generation, job.seed)
        if job.decode == "none":
            self._deliver(job, Done(job, job.piece))
        elif all(j.piece is not None or j.ended for j in job.group or [job]):
            self._queue(job, ("whole", job.group or [job]))

    def _fail_live(self, error: MimoTTSError) -> None:
        for job in list(self.live):
            self.meter.row_finished(failed=True)
            self._fail(job, error)
        self.live.clear()

    # -- Stage-1 ----------------------------------------------------------------------------
    def _queue(self, job: SpeechJob, task: tuple) -> None:
        self.tasks.put((job.order, next(self.seq), task))

    def _stage1_thread(self) -> None:
        with thread_budget(self.tts.tokenizer_threads):
            while (tasks := self._take_round(block=True)) is not None:
                self._round(tasks)

    def _turns(self) -> None:
        """Stage-1's queued work, now, in this (Stage-0's) thread, round after round."""
        with thread_budget(self.tts.tokenizer_threads):
            while tasks := self._take_round(block=False):
                self._round(tasks)

    def _take_round(self, block: bool) -> list | None:
        """The next round (None: the worker stops; [] in turns when there is none): the first
        queued task, then the first queued task of every other job, up to `stage1_batch` jobs.
        A job's later pushes wait for a later round: its decoder takes them in order, except
        that an incremental decoder (whose audio does not depend on how a stream is cut) takes
        every push of its job queued by then at once."""
        try:
            first = self.tasks.get() if block else self.tasks.get_nowait()
        except queue.Empty:
            return []
        if first[2] is None:
            return None
        tasks, later = [first[2]], []
        streams = {first[2][1]} if first[2][0] == "push" else set()
        merge = self.schedule[0] != "official"
        while len(streams) < self.stage1_batch:
            try:
                entry = self.tasks.get_nowait()
            except queue.Empty:
                break
            task = entry[2]
            if task is None:
                later.append(entry)
                break
            if task[0] != "push":
                tasks.append(task)
            elif task[1] not in streams:
                streams.add(task[1])
                tasks.append(task)
            elif merge and not tasks[at := _index_of(tasks, task[1])][3]:  # its last push: later
                tasks[at] = _merged(tasks[at], task)
            else:
                later.append(entry)
        for entry in later:  # back with their places in the order
            self.tasks.put(entry)
        return tasks

    def _round(self, tasks: list) -> None:
        """Streamed jobs' pushes decoded together (their audio delivered at once), then each
        job whose stream ended, then the whole decodes; a failure fails the jobs it touched."""
        pushes = [t for t in tasks if t[0] == "push" and not self._dropped(t[1])]
        if pushes:
            self._guarded(lambda: self._push(pushes), [t[1] for t in pushes])
        for _, job, _, last in pushes:
            if last and not job.ended:
                self._guarded(lambda job=job: self._finish_stream(job), [job])
        for task in tasks:
            if task[0] == "whole":
                group = [j for j in task[1] if not j.ended]
                if group:
                    self._guarded(lambda group=group: self._decode_whole(group), group)

    def _dropped(self, job: SpeechJob) -> bool:
        if job.ended:
            job.decoder = None
            return True
        return False

    def _guarded(self, work, jobs: list[SpeechJob]) -> None:
        try:
            with self.meter.stage("stage1"):
                work()
        except MimoTTSError as exc:
            error = exc
        except Exception as exc:  # a bug decoding: those jobs fail, the worker goes on
            self.log(traceback.format_exc())
            error = MimoTTSError(f"unexpected {type(exc).__name__}: {exc}")
        else:
            return
        self.meter.engine_error("stage1")
        for job in jobs:
            self._fail(job, error)

    def _push(self, pushes: list) -> None:
        """One push per streamed job [K, f_i], through the codec in one call."""
        from mimo_tts.codec import StreamingDecoder, push_streams

        for _, job, _, _ in pushes:
            if job.decoder is None:
                job.decoder = StreamingDecoder(self.tts.codec, mode=self.schedule[0])
        self.stats["stage1_rounds"] += 1
        self.stats["max_stage1_jobs"] = max(self.stats["max_stage1_jobs"], len(pushes))
        start = time.perf_counter()
        with oom_advice("Stage-1 streaming decode", str(self.tts.codec.device)):
            waves = push_streams([t[1].decoder for t in pushes], [t[2] for t in pushes],
                                 [t[3] for t in pushes])
            waves = [None if w is None or not w.numel() else w.detach().float().cpu()
                     for w in waves]
        share = (time.perf_counter() - start) / len(pushes)
        now = time.perf_counter()
        for (_, job, _, _), wave in zip(pushes, waves, strict=True):
            job.timings["stage1_s"] = job.timings.get("stage1_s", 0.0) + share
            if wave is not None:
                job.chunks.append(wave)  # [S_i]
                if job.speed == 1:  # else the stretched piece comes whole at its end
                    job.timings.setdefault("first_audio_at", now)
                    self._deliver(job, Chunk(job, wave), final=False)

    def _finish_stream(self, job: SpeechJob) -> None:
        """A streamed job's end: its piece by the official extraction, its audio what was
        streamed, unless the pushed frames are not the extracted codes (then one-shot)."""
        import torch

        job.decoder = None
        streamed = torch.cat(job.chunks) if job.chunks else None
        piece = job.frames.piece(job.prompt, job.seed, streamed, self.log, job.label)
        if piece.audio is None and piece.codes is not None:
            start = time.perf_counter()
            piece.audio = self.tts.stage1.decode([piece.codes])[0]
            job.timings["stage1_s"] = job.timings.get("stage1_s", 0.0) + (
                time.perf_counter() - start)
        if job.speed != 1 and piece.audio is not None:
            piece.audio = stretch(piece.audio, job.speed)
            job.timings.setdefault("first_audio_at", time.perf_counter())
            self._deliver(job, Chunk(job, piece.audio), final=False)
        t, now = job.timings, time.perf_counter()
        piece.timings = {"stage0_s": t.get("stage0_s", 0.0), "stage1_s": t.get("stage1_s", 0.0),
                         "stage1_wait_s": now - t["generated_at"],
                         "first_audio_s": t.get("first_audio_at", now) - t["started_at"],
                         "wall_s": now - t["started_at"], "lead_groups": float(self._lead()),
                         **({"prefill_s": t["prefill_s"]} if "prefill_s" in t else {})}
        job.piece = piece
        self._deliver(job, Done(job, piece))

    def _lead(self) -> int:
        """Groups a stream holds back before its first audio (the decoder's look-ahead)."""
        if self.lead is None:
            self.lead = lead_groups(self.tts.codec, self.schedule[0], self.tts.group_size)
        return self.lead

    def _decode_whole(self, group: list[SpeechJob]) -> None:
        """A group's codes decoded in one call (`Stage1.decode`), each job's audio its own;
        none when a piece has no audio codes (its face reports that)."""
        pieces = [job.piece for job in group]
        if all(p.codes is not None for p in pieces):
            start = time.perf_counter()
            audios = self.tts.stage1.decode([p.codes for p in pieces])
            share = (time.perf_counter() - start) / len(group)
            for job, piece, audio in zip(group, pieces, audios, strict=True):
                piece.audio = stretch(audio, job.speed)
                job.timings["stage1_s"] = job.timings.get("stage1_s", 0.0) + share
        for job in group:
            self._deliver(job, Done(job, job.piece))

    # -- events -------------------------------------------------------------------------------
    def _deliver(self, job: SpeechJob, event: Event, final: bool = True) -> None:
        if job.ended:
            return
        if final:
            job.ended = True
            job.timings["done_at"] = time.perf_counter()
        job.deliver(event)

    def _fail(self, job: SpeechJob, error: MimoTTSError) -> None:
        """`job` fails with `error`, and so do the other jobs of its group still going."""
        for other in job.group or [job]:
            if other.ended:
                continue
            self._deliver(other, Failed(other, error))
            other.cancelled.set()
            if other is not job and other in self.live and self.batch is not None:
                self.batch.cancel(other)


def _index_of(tasks: list, job: SpeechJob) -> int:
    return next(i for i, t in enumerate(tasks) if t[0] == "push" and t[1] is job)


def _merged(task: tuple, more: tuple) -> tuple:
    """Two pushes of one incremental stream as one (its audio does not depend on the cut)."""
    import torch

    return ("push", task[1], torch.cat((task[2], more[2]), dim=1), more[3])
