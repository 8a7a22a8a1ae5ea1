"""The batch runner: input items -> typed `ItemResult`s, written through one sink (`sinks.py`).

`BatchRunner` loads `MiMoTTS` once on first need and yields one result per item, in input
order: written, skipped (the sink holds it done with the same inputs: the resume key,
`resume.py`) or failed with its exit code (a failed item never stops the batch). Every item's
text pieces are jobs of the speech worker (`synthesis/worker.py`, so an item's output is its
single run's) with `--batch-size` rows (vLLM: at least its max_num_seqs); with `--stream` one
piece runs at a time and the sink's `on_chunk` gets its audio as Stage-1 decodes it. An item
goes to the sink as data (`finish_item`: join, check, resample, its sidecar record) once it
and every item before it are done; the sink decides where the bytes go and never calls back
into the runner. `codes` (Stage-0 alone) and `finish_item` are also what the Ray pipeline's
actors run (`batch/ray.py`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace

from mimo_tts.batch.items import Item, printable
from mimo_tts.batch.results import ItemResult, fail, guarded
from mimo_tts.batch.resume import item_key, item_options, run_inputs, sidecar_record
from mimo_tts.errors import InputError, MimoTTSError
from mimo_tts.lm.engine import engine_spec
from mimo_tts.lm.tasks import TASKS, validate_inputs
from mimo_tts.synthesis.audio import PAUSE_FRAMES, SAMPLE_RATE, check_prompt_audio, resample
from mimo_tts.synthesis.captions import at_rate, cues, piece_samples
from mimo_tts.synthesis.loader import resolve_checkpoints
from mimo_tts.synthesis.markup import script
from mimo_tts.synthesis.options import SynthesisOptions
from mimo_tts.synthesis.pieces import Piece
from mimo_tts.synthesis.preflight import lengths_for
from mimo_tts.synthesis.settings import Settings
from mimo_tts.synthesis.voices import VoiceStore, tokenizer_record

# Per-item timings that are work (the rest describe the streaming overlap within them).
BUSY_TIMINGS = ("prompt_s", "generate_s", "decode_s")


class BatchRunner:
    """Loads the checkpoints once and turns items into results, through a sink."""

    def __init__(self, settings: Settings, log=None, env: Mapping[str, str] | None = None):
        self.settings = settings
        self.log = log or (lambda message: None)
        self.env = os.environ if env is None else env
        self.refs = None  # (lm, tokenizer) ModelRefs once resolved
        self.tts = None  # MiMoTTS once loaded
        self.timings: dict[str, float] = {}
        self.threads: dict = {}
        self.lengths = lengths_for(settings, [])  # sized from the items by `run`
        self.spec = engine_spec(settings.engine.engine)
        self.on_piece = None  # called with an item's result as each of its pieces is generated

    def piece_count(self, item: Item) -> int:
        """How many text pieces an item is read in (a bad item: one)."""
        try:
            return len(script(item.text, self.options(item)).texts) or 1
        except (MimoTTSError, TypeError):
            return 1

    def resolve(self):
        """Locate the checkpoints; a missing engine package or checkpoint ends a run early."""
        if self.refs is None:
            self.refs = resolve_checkpoints(self.settings, self.env)
        return self.refs

    def ensure_loaded(self):
        """Load both stages once, through the one loader (`MiMoTTS.from_settings`)."""
        if self.tts is None:
            from mimo_tts.synthesis.synthesizer import MiMoTTS

            refs = self.resolve()
            if not self.lengths.encodes and self.settings.synthesis.voice:
                self.lengths = replace(self.lengths, encodes=reencodes(
                    self.settings.synthesis.voice, refs[1]))
            self.tts = MiMoTTS.from_settings(self.settings, self.lengths, self.log, self.env,
                                             refs)
            self.threads = self.tts.threads
            self.timings.update(self.tts.timings)
        return self.tts

    def close(self) -> None:
        """Shut the Stage-0 engine down (vLLM frees its memory); loading again is possible."""
        tts, self.tts = self.tts, None
        if tts is not None:
            tts.close()

    def __enter__(self) -> BatchRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def seed(self, item: Item) -> int:
        return item.seed if item.seed is not None else self.settings.synthesis.seed

    def options(self, item: Item) -> SynthesisOptions:
        """The synthesis options an item runs with (`item_options`: its line's task)."""
        return item_options(self.settings.synthesis, item)

    def item_key(self, item: Item) -> str:
        """A hash of everything that determines an item's output (resume skips on a match)."""
        return item_key(self.settings, self.resolve(), item, self.seed(item))

    def task(self, item: Item) -> str:
        return item.task or self.settings.synthesis.task

    def rows(self) -> int:
        """Stage-0 rows: one with --stream (a stream at a time), else --batch-size (vLLM: at
        least its max_num_seqs)."""
        s = self.settings
        return 1 if s.run.stream else self.spec.rows(s.engine, s.run.batch_size)

    def run(self, items: list[Item], sink) -> Iterator[ItemResult]:
        """Yield one result per item, in input order; a failed item is recorded, the rest go on.

        Checkpoint and device errors while loading are not per-item: they end the run (raised).
        """
        items = list(items)
        texts = [i.text for i in items if isinstance(i.text, str)]
        prompt_audio = self.settings.synthesis.prompt_audio or any(i.prompt_audio for i in items)
        self.lengths = lengths_for(self.settings, texts, self.rows(),
                                   encodes=bool(prompt_audio))
        results = [self.prepare(item, sink) for item in items]
        pending = [r for r in results if r.status == "pending"]
        pieces: dict[int, list[Piece | None]] = {}  # id(result) -> its pieces, None until done
        done = 0
        for _ in self._generate(pending, pieces, sink.on_chunk) if pending else ():
            done, ready = self._ready(results, done, pieces, sink)
            yield from ready
        yield from self._ready(results, done, pieces, sink)[1]

    def prepare(self, item: Item, sink) -> ItemResult:
        """A pending result with its seed and resume key, or skipped (done) or failed."""
        result = ItemResult(item=item, status="pending", seed=item.seed,
                            format=self.settings.run.format)
        try:
            if item.error is not None:
                raise item.error
            check_inputs(item, self.options(item))  # before its key and its target
            result.seed = self.seed(item)
            result.key = self.item_key(item)
            sink.check(result)
        except MimoTTSError as exc:
            fail(result, exc)
        return result

    def codes(self, results: list[ItemResult]) -> dict[int, list[Piece] | None]:
        """Stage-0 alone for pending results (the Ray pipeline's Stage-0 actors): prompts and
        generation, no decode; {id(result): pieces}. A failing item is marked failed."""
        self.ensure_loaded()
        pieces: dict[int, list[Piece | None]] = {}
        for _ in self._generate([r for r in results if r.status == "pending"], pieces,
                                decode="none"):
            pass
        return {k: v for k, v in pieces.items() if None not in v}

    def _generate(self, pending: list[ItemResult], pieces: dict, on_chunk=None,
                  decode: str | None = None) -> Iterator[None]:
        """Every pending item's pieces through one speech worker; yields after each event
        (finished items can go to the sink then). A failing piece fails its item."""
        import torch

        from mimo_tts.synthesis.worker import Chunk, Done, Failed

        self.ensure_loaded()
        stream = self.settings.run.stream
        decode = decode or ("stream" if stream else "whole")
        count = sum(len(script(r.item.text, self.options(r.item)).texts) for r in pending)
        o = self.settings.synthesis
        worker = self.tts.worker(min(self.rows(), max(count, 1)), stream=stream,
                                 schedule=(o.stream_mode, o.stream_chunk_groups,
                                           o.stream_max_chunk_groups))
        begun: set = set()
        for event in worker.run(self._jobs(pending, pieces, decode)):
            r, index = event.job.key
            if isinstance(event, Failed):
                if r.status == "pending":
                    fail(r, event.error)
                pieces.pop(id(r), None)
            elif r.status != "pending" or id(r) not in pieces:
                pass
            elif isinstance(event, Chunk):
                if on_chunk is not None:
                    if event.job not in begun and self.pauses(r)[index]:  # the pause before it
                        on_chunk(torch.zeros(self.pauses(r)[index]))
                    on_chunk(event.samples)
                begun.add(event.job)
            elif isinstance(event, Done):
                pieces[id(r)][index] = event.piece
                last = self.pauses(r)[-1]
                if on_chunk is not None and last and index == len(pieces[id(r)]) - 1:
                    on_chunk(torch.zeros(last))  # the text's pause after its last words
                if None not in pieces[id(r)]:
                    _item_timings(r, [job for job in event.job.group], stream)
            yield

    def _jobs(self, pending: list[ItemResult], pieces: dict, decode: str):
        """Jobs (one per text piece) of the pending items, in order, prompts built lazily."""
        from mimo_tts.synthesis.worker import SpeechJob

        for n, r in enumerate(pending):
            prompts = self.prompts(r)
            if r.status != "pending":
                continue
            pieces[id(r)] = [None] * len(prompts)
            item_options = self.options(r.item)
            options = item_options.generation_options(r.seed)  # its task's
            group: list = []
            group += [SpeechJob(prompt, options, r.seed, decode=decode, group=group,
                                label=r.item.id, order=(n, i), key=(r, i),
                                speed=item_options.speed, on_generated=self._generated)
                      for i, prompt in enumerate(prompts)]
            yield from group

    def _generated(self, job) -> None:
        if self.on_piece is not None:
            self.on_piece(job.key[0])

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
                guarded(r, self.finish, r, mine, sink)
            if r.status in ("ok", "error"):
                sink.finished(r, self.task(r.item))
            out.append(r)
        return done + len(out), out

    def pauses(self, result: ItemResult) -> tuple[int, ...]:
        """The item's pauses in samples (`markup.Script.pauses`)."""
        return script(result.item.text, self.options(result.item)).pauses

    def prompts(self, result: ItemResult) -> list:
        item, start = result.item, time.perf_counter()
        found = guarded(result, self.tts.prompts, item.text, self.options(item), result.seed,
                        item.instruct, item.prompt_audio)
        result.timings["prompt_s"] = time.perf_counter() - start
        if found:
            result.template_index = found[0].template_index
        return found or []

    def finish(self, result: ItemResult, pieces: list[Piece], sink) -> None:
        """Stage-1's end (`finish_item`); then the sink writes it."""
        sink.write(result, *finish_item(self.tts.stage1, self.settings, self.context(), result,
                                        pieces))

    def context(self) -> dict:
        """What every sidecar of this run shares: checkpoints, placement, engine, threads,
        load timings, argv (the Ray pipeline ships it from Stage-0 to Stage-1)."""
        return {"described": self.tts.describe(self.settings.synthesis),
                "resume": run_inputs(self.settings, self.refs),
                "tokenizer": str(self.refs[1].path), "threads": self.threads,
                "timings": dict(self.timings), "argv": [printable(a) for a in sys.argv[1:]]}


def _item_timings(result: ItemResult, jobs: list, stream: bool) -> None:
    """An item's timings from its pieces' jobs: Stage-0 work (its share of each step), Stage-1
    decode; streamed, the overlap: its wall time from the first row to the last audio, each
    stage's seconds, the wait for Stage-1 after generating, and the first audio."""
    t = [job.timings for job in jobs]
    stage0, stage1 = sum(x.get("stage0_s", 0.0) for x in t), sum(x.get("stage1_s", 0.0) for x in t)
    if not stream:
        result.timings["generate_s"] = stage0
        if any(x.get("stage1_s") for x in t):
            result.timings["decode_s"] = stage1
        return
    start = t[0]["started_at"]
    result.timings["generate_s"] = t[-1]["done_at"] - start
    result.timings["stage0_s"], result.timings["stage1_s"] = stage0, stage1
    result.timings["stage1_wait_s"] = sum(x["done_at"] - x["generated_at"] for x in t)
    first = next((x["first_audio_at"] for x in t if "first_audio_at" in x), t[-1]["done_at"])
    result.timings["first_audio_s"] = first - start

def reencodes(voice: str, tok_ref) -> bool:
    """Whether a stored voice's codes come from another audio tokenizer, so that it is
    re-encoded from its source (the memory preflight then counts the encoder)."""
    try:
        record = VoiceStore().record(voice)
    except MimoTTSError:  # unknown or unreadable: the item fails with that error
        return False
    return record.get("tokenizer", {}).get("id") != tokenizer_record(tok_ref)["id"]


def check_inputs(item: Item, o) -> None:
    """What an item's task needs, and its voice prompt a file (InputError, exit 9), checked
    before its output's name is looked at: a bad input is never reported as a collision."""
    instruct, prompt_audio = item.instruct or o.instruct, item.prompt_audio or o.prompt_audio
    try:
        o.check_item(item.instruct, item.prompt_audio)  # a missing input names its flag
        validate_inputs(TASKS[o.task], item.text, instruct, bool(prompt_audio or o.voice))
        if prompt_audio:  # a corrupt file fails here, before the models load
            check_prompt_audio(prompt_audio)
    except InputError as exc:
        raise InputError(f"{item.source}: {exc}") from None


def finish_item(stage1, settings: Settings, context: dict, result: ItemResult,
                pieces: list[Piece]) -> tuple:
    """Stage-1's end for one item: decode (unless done), join, check and resample ->
    (samples, codes, sidecar record), the result marked ok with its length and timings."""
    run = settings.run
    result.generated_text_ids = [p.new_text_ids for p in pieces]
    result.text_out = [p.text for p in pieces]
    start = time.perf_counter()
    decoding = all(p.codes is not None for p in pieces) and any(p.audio is None for p in pieces)
    o = settings.synthesis
    found = script(result.item.text, o)
    audio = stage1.finish(pieces, result.item.id, found.pauses)
    if decoding:
        result.timings["decode_s"] = time.perf_counter() - start
    samples = resample(audio, SAMPLE_RATE, run.sample_rate)
    result.seconds = len(samples) / run.sample_rate
    busy = sum(v for k, v in result.timings.items() if k in BUSY_TIMINGS)
    result.timings["total_s"] = busy
    result.rtf = busy / max(result.seconds, 1e-9)
    result.status = "ok"
    plain = found.plain(PAUSE_FRAMES * stage1.samples_per_frame)
    codes = {"pieces": [p.codes for p in pieces],
             "metadata": {"pause_frames": PAUSE_FRAMES, "id": result.item.id,
                          "tokenizer": context["tokenizer"],
                          **({} if plain else {"pause_samples": list(found.pauses)})}}
    record = sidecar_record(settings, context, result, pieces)
    if not plain:
        record["audio"]["pause_samples"] = list(found.pauses)
    if o.captions:  # cues from the pieces' samples, in the output's rate
        spf = stage1.samples_per_frame
        made = at_rate(cues(list(found.texts), [piece_samples(p, spf) for p in pieces],
                            SAMPLE_RATE, found.pauses, found.voices), run.sample_rate)
        formats = (run.caption_formats or "").split(",") if run.caption_formats else []
        record["captions"] = {"formats": formats, "cues": [c.record() for c in made]}
    return samples, codes, record
