"""A batch run's items as jobs of one continuous batch (`lm.batching`): a row that stops takes
the next text piece, whatever item it belongs to; items finish (decode, write, manifest) in input
order, each as soon as it and every item before it are done. Each piece samples from its own
seeded generator, so an item's audio is its single run's."""

from __future__ import annotations

from collections.abc import Iterator

from mimo_tts.batch.results import ItemResult, fail, guarded


class ContinuousRun:
    """The continuous mode of `BatchRunner.run` (a continuous engine, `batch_size` > 1)."""

    def __init__(self, runner, results: list[ItemResult], sink):
        self.runner, self.results, self.sink = runner, results, sink

    def __iter__(self) -> Iterator[ItemResult]:
        """Every pending item's pieces as jobs of one continuous batch (lm.batching): a row
        that stops takes the next piece. Items finish (decode, write, manifest) and are
        yielded in input order, each as soon as it and those before it are done."""
        from mimo_tts.lm.batching import JobDone
        from mimo_tts.synthesis.text import split_text

        results, sink = self.results, self.sink
        pending = [r for r in results if r.status == "pending"]
        if pending:
            self.runner.load()
        max_chars = self.runner.settings.synthesis.max_chars
        rows = min(self.runner.settings.run.batch_size,
                   sum(len(split_text(r.item.text, max_chars)) for r in pending) or 1)
        pieces: dict[int, list] = {}  # id(result) -> its pieces, None until generated
        done = 0
        for event in self._events(pending, pieces, rows) if pending else ():  # (all done)
            if isinstance(event, JobDone):
                self._job_done(event, pieces)
                done, ready = self._ready(results, done, pieces, sink)
                yield from ready
        yield from self._ready(results, done, pieces, sink)[1]

    def _events(self, pending: list[ItemResult], pieces: dict, rows: int):
        """The batch's events (`MiMoTTS.run_batch`). A step that fails (out of memory) fails
        the items it was running; a fresh batch takes the jobs not yet begun."""
        from mimo_tts.lm.batching import Jobs, StepFailed

        for event in self.runner.tts.run_batch(Jobs(self._jobs(pending, pieces)), rows):
            if isinstance(event, StepFailed):
                for r in pending:
                    if r.status == "pending" and None in pieces.get(id(r), ()):
                        fail(r, event.error)
                        del pieces[id(r)]
                continue
            yield event

    def _jobs(self, pending: list[ItemResult], pieces: dict):
        """Jobs (one per text piece) of the pending items, in order, prompts built lazily."""
        from mimo_tts.lm.batching import Job

        for r in pending:
            prompts = self.runner.prompts(r)
            if r.status != "pending":
                continue
            pieces[id(r)] = [None] * len(prompts)
            r.timings["generate_s"] = 0.0
            options = self.runner.options(r.item).generation_options(r.seed)  # its task's
            for index, prompt in enumerate(prompts):
                if r.status == "pending":  # not failed meanwhile
                    yield Job(prompt.input_ids, options, key=(r, index, prompt))

    def _job_done(self, event, pieces: dict) -> None:
        r, index, prompt = event.job.key
        if r.status != "pending" or id(r) not in pieces:
            return
        if event.error is not None:
            fail(r, event.error)
            del pieces[id(r)]
            return
        r.timings["generate_s"] += event.busy_s
        pieces[id(r)][index] = self.runner.tts.piece(prompt, event.generation, r.seed)

    def _ready(self, results: list[ItemResult], done: int, pieces: dict,
               sink) -> tuple[int, list[ItemResult]]:
        """From result `done` on, finish and hand out those settled, in order, up to the
        first still generating -> (new `done`, the results handed out)."""
        out = []
        for r in results[done:]:
            mine = pieces.get(id(r))
            if r.status == "pending":
                if mine is None or None in mine:
                    break
                guarded(r, self.runner.finish, r, mine, sink)
            if r.status in ("ok", "error"):
                sink.finished(r, self.runner.task(r.item))
            out.append(r)
        return done + len(out), out
