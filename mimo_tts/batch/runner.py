"""The batch runner: input items -> typed `ItemResult`s, written through one sink (`outputs.py`).

`BatchRunner` loads `MiMoTTS` once on first need and yields one result per item, in input
order: written, skipped (the sink holds it done with the same inputs: the resume key) or failed
with its exit code (a failed item never stops the batch). On the native engine with
`batch_size` > 1 every item's pieces run through one continuous batch (`lm.batching`: a row that
stops takes the next piece, each piece samples from its own seeded generator, so an item's
output is its single run's); otherwise items are generated `batch_size` at a time (vLLM:
max(batch_size, max_num_seqs)), prompts of one seed in one call. Each finished item
goes to the sink as data: its samples, codes and provenance record (`sidecar_record`); the sink
decides where the bytes go and never calls back into the runner. `BatchRunner.codes` (Stage-0
of a window) and `finish_item` (Stage-1 of one item) are also what the Ray pipeline's actors
run (`batch/ray.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, replace
from pathlib import Path

from mimo_tts.batch.continuous import ContinuousRun
from mimo_tts.batch.items import Item, printable
from mimo_tts.batch.results import ItemResult, fail, guarded
from mimo_tts.errors import InputError, MimoTTSError, UsageError
from mimo_tts.lm.engine import DEFAULT_ENGINE, engine_spec
from mimo_tts.lm.tasks import TASKS, validate_inputs
from mimo_tts.runtime import runner_record
from mimo_tts.synthesis.audio import PAUSE_FRAMES, SAMPLE_RATE, resample
from mimo_tts.synthesis.captions import cues, piece_samples, text_pieces
from mimo_tts.synthesis.loader import resolve_checkpoints
from mimo_tts.synthesis.options import SynthesisOptions
from mimo_tts.synthesis.pieces import Piece
from mimo_tts.synthesis.preflight import engine_record, lengths_for
from mimo_tts.synthesis.settings import Settings
from mimo_tts.synthesis.streaming import chunk_cap
from mimo_tts.synthesis.voices import VoiceStore

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

    def resolve(self):
        """Locate the checkpoints; a missing engine package or checkpoint ends a run early."""
        if self.refs is None:
            self.refs = resolve_checkpoints(self.settings, self.env)
        return self.refs

    def load(self):
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

    def batch_window(self) -> int:
        """Items per Stage-0 call: batch_size, or what the engine takes at once (vLLM: at
        least its max_num_seqs)."""
        s = self.settings
        return self.spec.rows_per_call(s.engine, s.run.batch_size, s.run.stream)

    def run(self, items: list[Item], sink) -> Iterator[ItemResult]:
        """Yield one result per item, in input order; a failed item is recorded, the rest go on.

        Checkpoint and device errors while loading are not per-item: they end the run (raised).
        """
        items = list(items)
        texts = [i.text for i in items if isinstance(i.text, str)]
        prompt_audio = self.settings.synthesis.prompt_audio or any(i.prompt_audio for i in items)
        self.lengths = lengths_for(self.settings, texts,
                                   1 if self.settings.run.stream else self.batch_window(),
                                   encodes=bool(prompt_audio))
        if self.continuous():
            yield from ContinuousRun(self, [self.prepare(item, sink) for item in items], sink)
            return
        window: list[ItemResult] = []
        for item in items:
            window.append(self.prepare(item, sink))
            if sum(r.status == "pending" for r in window) >= self.batch_window():
                yield from self._flush(window, sink)
                window = []
        yield from self._flush(window, sink)

    def continuous(self) -> bool:
        """Whether items run through one continuous batch (a continuous engine, batch size
        > 1)."""
        s = self.settings
        return self.spec.continuous and not s.run.stream and s.run.batch_size > 1

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

    def _flush(self, window: list[ItemResult], sink) -> Iterator[ItemResult]:
        pending = [r for r in window if r.status == "pending"]
        if pending:
            self.load()
            self._synthesize(pending, sink)
        for result in window:
            if result.status in ("ok", "error"):
                sink.finished(result, self.task(result.item))
            yield result

    def task(self, item: Item) -> str:
        return item.task or self.settings.synthesis.task

    def _synthesize(self, results: list[ItemResult], sink) -> None:
        """Stage-0 for every item (`codes`), then finish each item into the sink."""
        pieces = self.codes(results, sink.on_chunk)
        for r in results:
            if r.status == "pending" and pieces.get(id(r)) is not None:
                guarded(r, self.finish, r, pieces[id(r)], sink)

    def codes(self, results: list[ItemResult], on_chunk=None) -> dict[int, list[Piece] | None]:
        """Stage-0: prompts for every item, one generate call per seed (batched), or each
        streamed; {id(result): pieces}. A failing item is marked failed, the rest go on."""
        pieces: dict[int, list[Piece] | None] = {}
        prompts = {id(r): self.prompts(r) for r in results}
        ready = [r for r in results if r.status == "pending"]
        if self.settings.run.stream:
            for r in ready:
                pieces[id(r)] = guarded(r, self._stream_item, r, prompts[id(r)], on_chunk)
        else:  # one generate call per seed and task (the task's samplers and stop set)
            for seed, task in dict.fromkeys((r.seed, self.task(r.item)) for r in ready):
                self._generate_group([r for r in ready if (r.seed, self.task(r.item)) == (
                    seed, task)], prompts, pieces)
        return pieces

    def prompts(self, result: ItemResult) -> list:
        item, start = result.item, time.perf_counter()
        found = guarded(result, self.tts.prompts, item.text, self.options(item), result.seed,
                        item.instruct, item.prompt_audio)
        result.timings["prompt_s"] = time.perf_counter() - start
        if found:
            result.template_index = found[0].template_index
        return found or []

    def _generate_group(self, group: list[ItemResult], prompts: dict, pieces: dict) -> None:
        """Stage-0 for items sharing a seed and a task: their prompts run `batch_size` at a
        time."""
        flat = [p for r in group for p in prompts[id(r)]]
        seed, start = group[0].seed, time.perf_counter()
        options = self.options(group[0].item).generation_options(seed)
        try:
            made = self.tts.generate(flat, options, seed, self.settings.run.batch_size)
        except MimoTTSError as exc:
            for r in group:
                fail(r, exc)
            return
        elapsed = time.perf_counter() - start
        for r in group:
            n = len(prompts[id(r)])
            pieces[id(r)], made = made[:n], made[n:]
            r.timings["generate_s"] = elapsed * n / max(len(flat), 1)

    def _stream_item(self, result: ItemResult, prompts: list, on_chunk) -> list[Piece]:
        """Stage-0 with Stage-1 decoding concurrently in a worker thread, piece by piece."""
        import torch

        pieces, start = [], time.perf_counter()
        for i, prompt in enumerate(prompts):
            if i and on_chunk is not None:
                on_chunk(torch.zeros(PAUSE_FRAMES * self.tts.stage1.samples_per_frame))
            pieces.append(self.tts.stream_piece(prompt, self.options(result.item), result.seed,
                                                on_chunk, self.log))
        result.timings["generate_s"] = time.perf_counter() - start
        for name in ("stage0_s", "stage1_s", "stage1_wait_s"):
            result.timings[name] = sum(p.timings.get(name, 0.0) for p in pieces)
        result.timings["first_audio_s"] = pieces[0].timings.get("first_audio_s", 0.0)
        return pieces

    def finish(self, result: ItemResult, pieces: list[Piece], sink) -> None:
        """Stage-1 (`finish_item`); then the sink writes it."""
        sink.write(result, *finish_item(self.tts.stage1, self.settings, self.context(), result,
                                        pieces))

    def context(self) -> dict:
        """What every sidecar of this run shares: checkpoints, placement, engine, threads,
        load timings, argv (the Ray pipeline ships it from Stage-0 to Stage-1)."""
        return {"described": self.tts.describe(self.settings.synthesis),
                "resume": run_inputs(self.settings, self.refs),
                "tokenizer": str(self.refs[1].path), "threads": self.threads,
                "timings": dict(self.timings), "argv": [printable(a) for a in sys.argv[1:]]}


def reencodes(voice: str, tok_ref) -> bool:
    """Whether a stored voice's codes come from another audio tokenizer, so that it is
    re-encoded from its source (the memory preflight then counts the encoder)."""
    from mimo_tts.synthesis.voices import tokenizer_record

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
        if prompt_audio and not Path(prompt_audio).is_file():
            raise InputError(f"prompt audio not found: {prompt_audio}")
    except InputError as exc:
        raise InputError(f"{item.source}: {exc}") from None


def finish_item(stage1, settings: Settings, context: dict, result: ItemResult,
                pieces: list[Piece]) -> tuple:
    """Stage-1 for one item: decode (unless streamed), join, check and resample ->
    (samples, codes, sidecar record), the result marked ok with its length and timings."""
    run = settings.run
    result.generated_text_ids = [p.new_text_ids for p in pieces]
    result.text_out = [p.text for p in pieces]
    start = time.perf_counter()
    decoding = all(p.codes is not None for p in pieces) and any(p.audio is None for p in pieces)
    audio = stage1.finish(pieces, result.item.id)
    if decoding:
        result.timings["decode_s"] = time.perf_counter() - start
    samples = resample(audio, SAMPLE_RATE, run.sample_rate)
    result.seconds = len(samples) / run.sample_rate
    busy = sum(v for k, v in result.timings.items() if k in BUSY_TIMINGS)
    result.timings["total_s"] = busy
    result.rtf = busy / max(result.seconds, 1e-9)
    result.status = "ok"
    codes = {"pieces": [p.codes for p in pieces],
             "metadata": {"pause_frames": PAUSE_FRAMES, "id": result.item.id,
                          "tokenizer": context["tokenizer"]}}
    record = sidecar_record(settings, context, result, pieces)
    if settings.synthesis.captions:  # cues from the pieces' samples, at 24 kHz
        spf = stage1.samples_per_frame
        found = cues(text_pieces(result.item.text, settings.synthesis),
                     [piece_samples(p, spf) for p in pieces], stage1.sample_rate, spf)
        formats = (run.caption_formats or "").split(",") if run.caption_formats else []
        record["captions"] = {"formats": formats, "cues": [c.record() for c in found]}
    return samples, codes, record


def sidecar_record(settings: Settings, context: dict, result: ItemResult,
                   pieces: list[Piece]) -> dict:
    """Everything needed to reproduce one output; the sink adds `result` last."""
    s, item = settings, result.item
    o, described = item_options(s.synthesis, item), context["described"]
    text, audio = o.samplers()  # the item's task's (the run's are described)
    return {
        "runner": {**runner_record(), "argv": context["argv"]},
        "id": item.id, "source": item.source, "text": item.text, "task": o.task,
        "instruct": item.instruct or o.instruct,
        "prompt_audio": item.prompt_audio or o.prompt_audio,
        **_voice_fields(o.voice, item),
        "model": described["model"], "tokenizer": described["tokenizer"],
        "placement": described["placement"], "threads": context["threads"],
        "engine": engine_record(s, described["engine"]),
        "sampler": o.sampler_settings(),
        "effective_sampler": {"text": asdict(text), "audio": asdict(audio)},
        "seed": result.seed, "max_new_groups": o.max_new_groups,
        "batch_size": s.run.batch_size, "stream": s.run.stream, "stream_mode": o.stream_mode,
        "max_chars": o.max_chars,
        "audio": {"format": s.run.format, "sample_rate": s.run.sample_rate,
                  "seconds": round(result.seconds, 4), "pause_frames": PAUSE_FRAMES},
        "pieces": [p.record() for p in pieces],
        "timings": {**{k: round(v, 4) for k, v in context["timings"].items()},
                    **{k: round(v, 4) for k, v in result.timings.items()}},
        "resume": context.get("resume"),  # the run's part of the key (`run_inputs`)
    }


def _voice_fields(voice: str | None, item: Item) -> dict:
    """The stored voice of an item cloned from one (its record: source, tokenizer, codes)."""
    if not voice or item.prompt_audio:
        return {}
    try:
        return {"voice": VoiceStore().record(voice)}
    except MimoTTSError:
        return {"voice": {"name": voice}}


def item_options(o: SynthesisOptions, item: Item) -> SynthesisOptions:
    """The run's synthesis options in the task an item's line names; a run's --instruct or
    --prompt-audio that this task takes none of fails the item (InputError, exit 9)."""
    if item.task is None or item.task == o.task:
        return o
    try:
        return replace(o, task=item.task)
    except UsageError as exc:
        raise InputError(f"{item.source}: task {item.task}: {exc}") from None


def item_key(settings: Settings, refs, item: Item, seed: int) -> str:
    """The resume key: a hash of every input that determines an item's output bytes."""
    o = item_options(settings.synthesis, item)
    return resume_key({**run_inputs(settings, refs),
                       **item_inputs(item.text, item.instruct or o.instruct, seed,
                                     item.prompt_audio or o.prompt_audio, o.task)})


def run_inputs(settings: Settings, refs) -> dict:
    """The resume key's inputs that one run gives all its items (JSON values): every sidecar
    records them, so `status` keys an item from its input line as `synth` does."""
    o, run, p, (lm, tok) = settings.synthesis, settings.run, settings.placement, refs
    inputs = {
        "template": o.template, "model": [str(lm.path), lm.revision],
        "tokenizer": [str(tok.path), tok.revision], "sampler": o.sampler_settings(),
        "max_new_groups": o.max_new_groups, "batch_size": run.batch_size,
        "max_chars": o.max_chars, "format": run.format, "sample_rate": run.sample_rate,
        "stream": run.stream, "dtypes": [p.lm_dtype.value, p.tokenizer_dtype.value],
    }
    if run.stream and o.stream_mode != "official":  # keeps the keys of earlier outputs
        inputs["stream_mode"] = o.stream_mode
    if run.stream and o.stream_mode == "official":  # its audio depends on the chunks
        inputs["stream_chunk_groups"] = [
            o.stream_chunk_groups,
            chunk_cap(o.stream_mode, o.stream_chunk_groups, o.stream_max_chunk_groups),
            "past the look-ahead"]  # the first push's groups count after it (issue 24)
    if settings.engine.engine != DEFAULT_ENGINE:  # likewise
        inputs["engine"] = settings.engine.engine
    if o.voice:  # the stored voice's codes, by their hash
        inputs["voice"] = _voice_stamp(o.voice)
    if o.captions:  # a piece per sentence: other audio
        inputs["captions"] = True
    return inputs


def item_inputs(text: str, instruct: str | None, seed: int, prompt_audio: str | None,
                task: str) -> dict:
    """The resume key's inputs of one item: its text and the values it runs with."""
    return {"text": text, "instruct": instruct, "seed": seed,
            "prompt_audio": _file_stamp(prompt_audio), "task": task}


def resume_key(inputs: dict) -> str:
    """The hash of a key's inputs (`run_inputs` with `item_inputs`)."""
    blob = json.dumps(inputs, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def _voice_stamp(name: str) -> dict:
    try:
        record = VoiceStore().record(name)
    except MimoTTSError:
        return {"name": name}
    return {"name": name, "codes": record["codes"].get("sha256"),
            "tokenizer": record["tokenizer"].get("id")}


def _file_stamp(path: str | None) -> dict | None:
    if not path:
        return None
    try:
        stat = Path(path).stat()
    except OSError:
        return {"path": path}
    return {"path": str(Path(path).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
