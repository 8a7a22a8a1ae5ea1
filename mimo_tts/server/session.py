"""How a request lives on the speech worker, for both servers (HTTP and Wyoming).

`Sessions` is a server's hold on its worker (`synthesis.worker.SpeechWorker`, started with the
server's batch rows and Stage-1 rounds) and its capacity: at most `max_concurrent` requests in
progress, and at most `max_queue` more waiting for one of those places; one more is refused
(503, "busy"). A request in progress has its jobs in the worker; a waiting one is tokenised and
its jobs go to the worker the moment a place frees (first come, first served). So a burst of
`max_concurrent + max_queue` requests is taken whole, whatever the worker is doing.

A `Session` is one request: its jobs (one per text piece), a queue of events per piece on the
face's asyncio loop (`("audio", samples)` while streamed, then `("done", info)` or `("error",
MimoTTSError)`), its deadline, and `release`, which cancels what is left, frees its place and
counts its outcome once. A piece's audio is checked as `synth` checks it (no audio tokens, NaN,
silence) in the worker's thread before its "done".
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

from mimo_tts.errors import MimoTTSError
from mimo_tts.synthesis.worker import Chunk, Done, SpeechJob

OUTCOME_COUNTS = ("ok", "failed", "cancelled", "rejected")


class Sessions:
    """A server's worker and its places; `open` admits a request or says it is busy."""

    def __init__(self, tts, cfg, base, log=None, meter=None):
        self.tts, self.cfg, self.base = tts, cfg, base
        self.log = log or (lambda message: None)
        self.worker = tts.worker(cfg.batch_size, stream=True, stage1_batch=cfg.stage1_batch,
                                 meter=meter, log=self.log,
                                 schedule=(base.stream_mode, base.stream_chunk_groups,
                                           base.stream_max_chunk_groups)).start()
        self.lock = threading.Lock()
        self.active: set[Session] = set()
        self.waiting: deque[Session] = deque()
        self.counts = dict.fromkeys(OUTCOME_COUNTS, 0)
        self.serial = 0

    def places(self) -> dict:
        """Requests in progress and waiting (`/health`, the metrics)."""
        with self.lock:
            return {"active": len(self.active), "queued": len(self.waiting)}

    def open(self, kind: str) -> Session | None:
        """A place for a request, in progress or waiting; None when both are full (counted as
        rejected). Its jobs come with `Session.start`, once its text is tokenised."""
        loop = asyncio.get_running_loop()
        with self.lock:
            if len(self.active) >= self.cfg.max_concurrent and \
                    len(self.waiting) >= self.cfg.max_queue:
                self.counts["rejected"] += 1
                return None
            self.serial += 1
            session = Session(self, f"{kind}-{self.serial}", self.serial, loop)
            if len(self.active) < self.cfg.max_concurrent:
                self.active.add(session)
            else:
                self.waiting.append(session)
        return session

    def _start(self, session: Session) -> None:
        """Its jobs to the worker, if it holds a place in progress (else on its promotion)."""
        with self.lock:
            go = session in self.active and not session.submitted
            session.submitted = session.submitted or go
        if go:
            self.worker.submit(session.jobs)

    def release(self, session: Session, outcome: str) -> None:
        """`session` is over: its jobs stop, its place goes to the first waiting request."""
        with self.lock:
            if session in self.active:
                self.active.discard(session)
                promoted = self.waiting.popleft() if self.waiting else None
                if promoted is not None:
                    self.active.add(promoted)
                    if promoted.jobs and not promoted.submitted:
                        promoted.submitted = True
                    else:
                        promoted = None  # not tokenised yet: `start` submits it
            else:
                promoted = None
                if session in self.waiting:
                    self.waiting.remove(session)
            self.counts[outcome if outcome in self.counts else "failed"] += 1
        self.worker.cancel(session.jobs)
        if promoted is not None:  # tokenised while it waited
            self.worker.submit(promoted.jobs)

    def close(self, timeout: float) -> None:
        """The server stops: every request still here is cancelled, the worker ends."""
        with self.lock:
            sessions = [*self.active, *self.waiting]
        for session in sessions:
            session.release("cancelled")
        self.worker.close(timeout=timeout)


class Session:
    """One request's place, jobs and the events they send to its event loop."""

    def __init__(self, sessions: Sessions, label: str, serial: int, loop):
        self.sessions, self.label, self.serial, self.loop = sessions, label, serial, loop
        self.deadline = loop.time() + sessions.cfg.timeout
        self.queues: list[asyncio.Queue] = []
        self.jobs: list[SpeechJob] = []
        self.submitted = self.released = False
        self.outcome: str | None = None

    def start(self, prompts: list, options, streamed: bool) -> None:
        """Its jobs, one per text piece (streamed: decoded as they generate), to the worker
        now or when a place frees."""
        self.queues = [asyncio.Queue() for _ in prompts]
        generation = options.generation_options(options.seed)
        self.jobs = [SpeechJob(prompt, generation, options.seed,
                               decode="stream" if streamed else "whole",
                               deliver=self._deliverer(queue), label=self.label,
                               order=(self.serial, i), speed=options.speed)
                     for i, (prompt, queue) in enumerate(zip(prompts, self.queues, strict=True))]
        if not self.released:
            self.sessions._start(self)

    def _deliverer(self, queue: asyncio.Queue):
        """A job's `deliver`: in the worker's threads, each event into this piece's queue on
        the loop (none once the loop is closed: the server is shutting down); a finished
        piece is checked first, as `synth` checks an item."""
        def put(event: tuple) -> None:
            try:
                self.loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:
                pass

        def deliver(event) -> None:
            if isinstance(event, Chunk):
                put(("audio", event.samples))
            elif isinstance(event, Done):
                try:
                    audio = self.sessions.tts.stage1.finish([event.piece], self.label)
                except MimoTTSError as exc:
                    put(("error", exc))
                    return
                codes = event.piece.codes
                put(("done", {"audio": audio, "groups": len(event.piece.new_text_ids),
                              "frames": 0 if codes is None else int(codes.shape[1])}))
            else:
                put(("error", event.error))

        return deliver

    @property
    def rows(self) -> int:
        """The live Stage-0 rows when its first piece joined the batch."""
        return self.jobs[0].rows

    async def next_event(self, index: int, wait_s: float | None = None) -> tuple:
        """Piece `index`'s next event; `TimeoutError` past the deadline, or after `wait_s`
        (the face then checks its client and asks again)."""
        left = self.deadline - self.loop.time()
        if left <= 0:
            raise TimeoutError
        return await asyncio.wait_for(self.queues[index].get(),
                                      left if wait_s is None else min(left, wait_s))

    def release(self, outcome: str) -> None:
        """The request is over (`outcome`): its jobs are cancelled, its place freed (once)."""
        if not self.released:
            self.released, self.outcome = True, outcome
            self.sessions.release(self, outcome)
