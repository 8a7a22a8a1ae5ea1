"""Stage-0 (LM -> codes) then Stage-1 (codes -> 24 kHz audio), one item at a time.

`Synthesizer` resolves placement and checkpoints without reading weights (`preflight`), loads
both models once on first need, and `run` yields one typed `ItemResult` per input item: written,
skipped (already done with the same inputs) or failed with its exit code. Every file write goes
through `mimo_tts.io` (atomic). Without an output directory or file, results keep their audio
in memory (`ItemResult.audio`): the library and benchmark path.

With `engine="vllm"` Stage-0 runs on vLLM (loaded in `load`, shut down by `close`; the
Synthesizer is a context manager): items are generated max(batch_size, max_num_seqs) at a time,
all prompts of a window in one call, and sidecars record the engine and its settings.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from mimo_tts import __version__, memory, models
from mimo_tts import io as mio
from mimo_tts.devices import Placement, resolve_placement
from mimo_tts.engine import Engine, Piece, import_vllm_engine, vllm_options
from mimo_tts.errors import (
    CheckpointError,
    DeviceError,
    MimoTTSError,
    NoAudioError,
    OutputError,
    UsageError,
)
from mimo_tts.inputs import Item, split_text
from mimo_tts.options import SynthOptions, build_options, load_profile, replace_options
from mimo_tts.outputs import OutputDir
from mimo_tts.results import (
    PAUSE_FRAMES,
    ItemResult,
    check_audio,
    exit_code_for,
    fail,
    join_pieces,
    piece_record,
)
from mimo_tts.stream import chunk_cap, stream_piece

# Re-exported: the library surface in one place (`from mimo_tts.pipeline import ...`).
__all__ = ["PAUSE_FRAMES", "ItemResult", "Synthesizer", "SynthOptions", "build_options",
           "check_audio", "exit_code_for", "join_pieces", "load_profile", "replace_options",
           "stream_piece"]

VLLM_MAX_NUM_SEQS = 32  # VLLMOptions' default: the batch window when max_num_seqs is not given


class Synthesizer:
    """Loads the checkpoints once and turns items into results."""

    def __init__(self, options: SynthOptions, profile: Mapping | None = None,
                 env: Mapping[str, str] | None = None, probe=None, log=None):
        self.options = options
        self.profile = dict(profile or {})
        self.env = os.environ if env is None else env
        self.log = log or (lambda message: None)
        self.placement: Placement = resolve_placement(
            options.lm_device, options.tokenizer_device, options.dtype, options.tokenizer_dtype,
            options.cuda_graph, profile=self.profile, env=self.env, probe=probe,
            checkpoint_dtypes=self._checkpoint_dtypes())
        self.lengths = memory.Lengths.for_run([], options.batch_size, options.max_chars,
                                              options.max_new_groups)
        self.lm_ref = self.tok_ref = None
        self.engine = None
        self.timings: dict[str, float] = {}
        self.threads: dict = {}

    def _checkpoint_dtypes(self) -> tuple[str | None, str | None]:
        """The checkpoints' own torch_dtype (config.json), which `--dtype auto` follows."""
        try:
            (lm, lm_src), (tok, tok_src) = models.pick_names(
                self.options.model, self.options.tokenizer, self.profile, self.env)
        except MimoTTSError:  # reported by resolve() / preflight() with its own message
            return None, None
        return (models.checkpoint_dtype(lm, lm_src, "model", self.env),
                models.checkpoint_dtype(tok, tok_src, "tokenizer", self.env))

    def memory_needs(self, lm_path: Path | None, tok_path: Path | None) -> list:
        """Per-stage memory estimates (mimo_tts.memory) for this run's placement and lengths."""
        p, needs = self.placement, []
        if lm_path is not None and self.options.engine == "native":  # vLLM sizes its own
            needs.append(memory.lm_need(lm_path, p.lm_device.value, p.lm_dtype.value,
                                        self.lengths))
        if tok_path is not None:
            needs.append(memory.tokenizer_need(tok_path, p.tokenizer_device.value,
                                               p.tokenizer_dtype.value, self.lengths))
        return needs

    def check_memory(self) -> list[dict]:
        """Refuse (DeviceError, exit 4) before loading when the run cannot fit."""
        self.resolve()
        try:
            needs = self.memory_needs(self.lm_ref.path, self.tok_ref.path)
        except CheckpointError as exc:  # loading reports it, with the file at fault
            self.log(f"memory preflight skipped: {exc}")
            return []
        if self.options.no_memory_check:
            return memory.plan(needs, self.env)
        return memory.check(needs, self.lengths, self.env)

    def preflight(self) -> dict:
        """Placement with sources, CUDA facts, checkpoint presence and memory estimates."""
        from mimo_tts.devices import Probe

        probe = Probe.detect()
        (lm, lm_src), (tok, tok_src) = models.pick_names(
            self.options.model, self.options.tokenizer, self.profile, self.env)
        report = {"placement": self.placement.describe(),
                  "cuda": {"available": probe.cuda_count > 0, "device_count": probe.cuda_count,
                           "current": probe.cuda_current if probe.cuda_count else None},
                  "mps": probe.mps, "checkpoints": {}}
        for role, name, src in (("model", lm, lm_src), ("tokenizer", tok, tok_src)):
            path, status = models.locate(name, src, role, self.env)
            report["checkpoints"][role] = {"name": name, "source": src, "status": status,
                                           "path": str(path) if path else None}
        paths = [report["checkpoints"][r]["path"] for r in ("model", "tokenizer")]
        try:
            needs = self.memory_needs(*(Path(x) if x else None for x in paths))
            report["memory"] = memory.plan(needs, self.env)
            memory.check(needs, self.lengths, self.env)
        except DeviceError as exc:  # the run would be refused: the CLI exits 4
            report["memory_error"] = str(exc)
        except CheckpointError as exc:  # the checkpoint entries report the cause
            report["memory"] = {"error": str(exc)}
        report["engine"] = self.engine_record(preflight=True)
        return report

    def engine_record(self, preflight: bool = False) -> dict:
        """The Stage-0 engine and its settings (sidecar, preflight); no vLLM import."""
        if self.options.engine != "vllm":
            lm = getattr(self.engine, "lm", None)
            if lm is None:  # preflight: nothing loaded yet
                return {"name": "native"}
            # bfloat16 sums round differently in the fused CPU kernel: record which path ran
            return {"name": "native", "cpu_kernel": lm.local_transformer.kernel is not None}
        record: dict = {"name": "vllm"}
        try:
            record["settings"] = vllm_options(self.options, self.placement)
        except UsageError as exc:
            record["error"] = str(exc)
        if preflight:
            from importlib.util import find_spec

            record["installed"] = find_spec("vllm") is not None
        return record

    def resolve(self) -> None:
        """Locate the checkpoints; with `engine="vllm"` also import vLLM (both end a run early)."""
        if self.lm_ref is None:
            if self.options.engine == "vllm":
                import_vllm_engine()
            self.lm_ref, self.tok_ref = models.resolve_models(
                self.options.model, self.options.tokenizer, self.profile, self.env,
                self.options.allow_download)

    def load(self) -> None:
        """Load the LM, its text tokenizer and the audio tokenizer (once)."""
        if self.engine is not None:
            return
        self.resolve()
        plan = self.check_memory()
        p = self.placement
        self.log(f"LM dtype {p.lm_dtype.value} ({p.lm_dtype.source}); tokenizer dtype "
                 f"{p.tokenizer_dtype.value} ({p.tokenizer_dtype.source})")
        for entry in plan:
            self.log(f"memory on {entry['device']}: need ~{entry['need_gib']} GiB, available "
                     f"{entry['available_gib']} GiB ({entry['available_source']})")
        start = time.perf_counter()
        vllm = (vllm_options(self.options, self.placement)
                if self.options.engine == "vllm" else None)
        self.engine = Engine.load(self.lm_ref.path, self.tok_ref.path, self.placement, self.log,
                                  vllm=vllm)
        self.timings["load_s"] = time.perf_counter() - start
        self.threads = self.thread_budgets()
        self.engine.lm_threads = self.threads["lm"]
        self.engine.tokenizer_threads = self.threads["tokenizer"]
        self.log(f"loaded models in {self.timings['load_s']:.2f} s "
                 f"(LM on {self.placement.lm_device.value}, "
                 f"tokenizer on {self.placement.tokenizer_device.value}; "
                 f"threads {self.threads}; engine {self.options.engine})")

    def close(self) -> None:
        """Shut the Stage-0 engine down (vLLM frees its memory); loading again is possible."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()

    def __enter__(self) -> Synthesizer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def thread_budgets(self) -> dict:
        """Per-stage CPU threads: the options', else half each for `--stream` on one CPU."""
        o = self.options
        both_cpu = self.placement.lm_device.value == self.placement.tokenizer_device.value == "cpu"
        if o.lm_threads is None and o.tokenizer_threads is None and o.stream and both_cpu:
            import torch

            n = torch.get_num_threads()
            if n >= 2:
                return {"lm": n - n // 2, "tokenizer": n // 2, "source": "auto (--stream, cpu)"}
        return {"lm": o.lm_threads, "tokenizer": o.tokenizer_threads, "source": "options"}

    # -- running --
    def item_key(self, item: Item) -> str:
        """A hash of everything that determines an item's output (resume skips on a match)."""
        self.resolve()
        o = self.options
        prompt_audio = item.prompt_audio or o.prompt_audio
        inputs = {
            "text": item.text, "instruct": item.instruct or o.instruct, "seed": self.seed(item),
            "prompt_audio": _file_stamp(prompt_audio), "task": o.task, "template": o.template,
            "model": [str(self.lm_ref.path), self.lm_ref.revision],
            "tokenizer": [str(self.tok_ref.path), self.tok_ref.revision],
            "sampler": self.sampler_settings(), "max_new_groups": o.max_new_groups,
            "batch_size": o.batch_size,
            "max_chars": o.max_chars, "format": o.format, "sample_rate": o.sample_rate,
            "stream": o.stream, "dtypes": [self.placement.lm_dtype.value,
                                           self.placement.tokenizer_dtype.value],
        }
        if o.stream and o.stream_mode != "official":  # keeps the keys of earlier outputs
            inputs["stream_mode"] = o.stream_mode
        if o.stream and o.stream_mode == "official":  # its audio depends on the chunks
            inputs["stream_chunk_groups"] = [
                o.stream_chunk_groups,
                chunk_cap(o.stream_mode, o.stream_chunk_groups, o.stream_max_chunk_groups)]
        if o.engine != "native":  # likewise
            inputs["engine"] = o.engine
        blob = json.dumps(inputs, sort_keys=True, ensure_ascii=False, default=str)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]

    def seed(self, item: Item) -> int:
        return item.seed if item.seed is not None else self.options.seed

    def sampler_settings(self) -> dict:
        o = self.options
        return {"temperature": o.temperature, "top_k": o.top_k, "top_p": o.top_p,
                "audio_temperature": o.audio_temperature, "audio_top_k": o.audio_top_k,
                "audio_top_p": o.audio_top_p}

    def run(self, items: list[Item], out: OutputDir | None,
            chunk_sink=None) -> Iterator[ItemResult]:
        """Yield one result per item, in input order; a failed item is recorded, the rest go on.

        Items are generated `batch_size` at a time (vLLM: max(batch_size, max_num_seqs),
        scheduled by vLLM). Checkpoint and device errors while loading
        are not per-item: they end the run (raised). With `out=None` and no `output` option,
        nothing is written: each result carries its audio (`ItemResult.audio`).
        """
        o, items = self.options, list(items)
        self.lengths = memory.Lengths.for_run(
            [i.text for i in items if isinstance(i.text, str)],
            1 if o.stream else self.batch_window(), o.max_chars, o.max_new_groups)
        window: list[ItemResult] = []
        for item in items:
            window.append(self._prepare(item, out))
            if sum(r.status == "pending" for r in window) >= self.batch_window():
                yield from self._flush(window, out, chunk_sink)
                window = []
        yield from self._flush(window, out, chunk_sink)

    def batch_window(self) -> int:
        """Items per Stage-0 call: batch_size, or for vLLM at least its max_num_seqs."""
        o = self.options
        if o.engine != "vllm" or o.stream:
            return o.batch_size
        return max(o.batch_size, o.max_num_seqs or VLLM_MAX_NUM_SEQS)

    def _prepare(self, item: Item, out) -> ItemResult:
        result = ItemResult(item=item, status="pending", seed=item.seed)
        try:
            if item.error is not None:
                raise item.error
            result.seed = self.seed(item)
            result.key = self.item_key(item)
            if out is not None:
                self._skip(item, result, out)
        except MimoTTSError as exc:
            fail(result, exc)
        return result

    def _flush(self, window: list[ItemResult], out, chunk_sink) -> Iterator[ItemResult]:
        pending = [r for r in window if r.status == "pending"]
        if pending:
            self.load()
            self._synthesize_batch(pending, out, chunk_sink)
        for result in window:
            if out is not None and result.status in ("ok", "error"):
                out.manifest.add(result.record(self.options.task))
            yield result

    def _skip(self, item: Item, result: ItemResult, out: OutputDir) -> None:
        """Mark an item skipped when its audio and sidecar say it is done with the same inputs."""
        path = out.audio_path(item.id)
        done = out.done_record(item.id, result.key)
        if done is not None and not self.options.overwrite:
            result.status, result.path = "skipped", path
            result.seconds, result.rtf = done.get("seconds", 0.0), done.get("rtf")
            manifest = out.manifest.get(item.id) or {}
            if manifest.get("status") != "ok" or manifest.get("key") != result.key:
                out.manifest.add(done)  # killed after the audio was written: complete the line
        elif path.exists() and not self.options.overwrite:
            raise OutputError(f"{path} exists from other inputs; use --overwrite to replace it")

    def _synthesize_batch(self, results: list[ItemResult], out, chunk_sink) -> None:
        """Prompts for every item, one generate call per seed (batched), then finish each item."""
        pieces: dict[int, list[Piece]] = {}
        prompts = {id(r): self._prompts(r) for r in results}
        ready = [r for r in results if r.status == "pending"]
        if self.options.stream:
            for r in ready:
                pieces[id(r)] = _guard(r, self._stream_item, r, prompts[id(r)], chunk_sink)
        else:
            for seed in dict.fromkeys(r.seed for r in ready):
                group = [r for r in ready if r.seed == seed]
                self._generate_group(group, prompts, pieces)
        for r in results:
            if r.status == "pending" and pieces.get(id(r)) is not None:
                _guard(r, self._finish, r, pieces[id(r)], out)

    def _prompts(self, result: ItemResult) -> list:
        item, o = result.item, self.options
        start = time.perf_counter()
        found = _guard(result, lambda: [
            self.engine.prompt(o.task, text, item.instruct or o.instruct,
                               item.prompt_audio or o.prompt_audio, o.template, result.seed)
            for text in split_text(item.text, o.max_chars)])
        result.timings["prompt_s"] = time.perf_counter() - start
        if found:
            result.template_index = found[0].template_index
        return found or []

    def _generate_group(self, group: list[ItemResult], prompts: dict, pieces: dict) -> None:
        """Stage-0 for items sharing a seed: their prompts run `batch_size` at a time."""
        flat = [p for r in group for p in prompts[id(r)]]
        start = time.perf_counter()
        try:
            options = self.engine.generation_options(self.options, group[0].seed)
            made = self.engine.generate_pieces(flat, options, group[0].seed,
                                               self.options.batch_size)
        except MimoTTSError as exc:
            for r in group:
                fail(r, exc)
            return
        elapsed = time.perf_counter() - start
        for r in group:
            n = len(prompts[id(r)])
            pieces[id(r)], made = made[:n], made[n:]
            r.timings["generate_s"] = elapsed * n / max(len(flat), 1)

    def _stream_item(self, result: ItemResult, prompts: list, chunk_sink) -> list[Piece]:
        """Stage-0 with Stage-1 decoding concurrently in a worker thread, piece by piece."""
        import torch

        pieces = []
        start = time.perf_counter()
        options = self.engine.generation_options(self.options, result.seed)
        for i, prompt in enumerate(prompts):
            if i and chunk_sink is not None:
                chunk_sink(torch.zeros(PAUSE_FRAMES * self.engine.samples_per_frame))
            pieces.append(stream_piece(self.engine, prompt, options, result.seed, chunk_sink,
                                       self.options.stream_chunk_groups, self.log,
                                       self.options.stream_mode,
                                       self.options.stream_max_chunk_groups))
        result.timings["generate_s"] = time.perf_counter() - start
        for name in ("stage0_s", "stage1_s", "stage1_wait_s"):
            result.timings[name] = sum(p.timings.get(name, 0.0) for p in pieces)
        result.timings["first_audio_s"] = pieces[0].timings.get("first_audio_s", 0.0)
        return pieces

    def _finish(self, result: ItemResult, pieces: list[Piece], out) -> None:
        """Check for audio, decode (unless streamed), join, check, resample and write."""
        item, o = result.item, self.options
        result.generated_text_ids = [p.new_text_ids for p in pieces]
        result.text_out = [p.text for p in pieces]
        missing = [i for i, p in enumerate(pieces) if p.codes is None]
        if missing:
            where = f" (text piece {missing[0] + 1} of {len(pieces)})" if len(pieces) > 1 else ""
            raise NoAudioError(f"item {item.id!r}: the LM generated no audio tokens in "
                               f"{len(pieces[missing[0]].new_text_ids)} group(s){where}")
        start = time.perf_counter()
        if any(p.audio is None for p in pieces):
            for piece, audio in zip(pieces, self.engine.decode([p.codes for p in pieces]),
                                    strict=True):
                piece.audio = audio
            result.timings["decode_s"] = time.perf_counter() - start
        audio = join_pieces([p.audio for p in pieces], PAUSE_FRAMES,
                            self.engine.samples_per_frame)
        check_audio(audio, item.id)
        samples = mio.resample(audio, mio.SAMPLE_RATE, o.sample_rate)
        result.seconds = len(samples) / o.sample_rate
        busy = sum(v for k, v in result.timings.items() if k in BUSY_TIMINGS)
        result.timings["total_s"] = busy
        result.rtf = busy / max(result.seconds, 1e-9)
        self._write(item, result, out, samples, pieces)

    def _write(self, item: Item, result: ItemResult, out, samples, pieces: list[Piece]) -> None:
        """Codes, then the sidecar (with the result), then the audio: audio present => done.

        In an output directory, audio replaced by `--overwrite` is removed first, so a run
        stopped half-way leaves the item absent (redone next time), never old audio beside a
        new sidecar. A failed item leaves none of its files behind.
        """
        o = self.options
        result.status = "ok"
        if o.to_stdout:
            if not o.raw:
                mio.write_stdout_audio(samples, o.sample_rate, o.format)
            return
        if out is None and o.output is None:  # in-memory run (library, benchmarks)
            result.audio = samples
            return
        path, sidecar, codes_path = self._targets(item, out)
        if mio.is_special_file(path):  # -o /dev/null or a FIFO: the audio only
            result.path = mio.write_audio(path, samples, o.sample_rate, o.format)
            return
        if out is not None and path.exists():
            mio.remove_quietly(path)
        try:
            if o.save_codes:
                result.codes_path = mio.save_codes(
                    codes_path, [p.codes for p in pieces],
                    {"pause_frames": PAUSE_FRAMES, "id": item.id,
                     "tokenizer": str(self.tok_ref.path)})
            result.path, result.sidecar = path, sidecar
            mio.write_json(sidecar, self.provenance(item, result, pieces))
            mio.write_audio(path, samples, o.sample_rate, o.format)
        except BaseException:
            mio.remove_quietly(sidecar, result.codes_path)
            result.path = result.sidecar = result.codes_path = None
            raise

    def _targets(self, item: Item, out) -> tuple[Path, Path, Path]:
        """(audio, sidecar, codes) paths: in the output directory, or beside `-o FILE`."""
        if out is not None:
            return out.audio_path(item.id), out.sidecar_path(item.id), out.codes_path(item.id)
        path = Path(self.options.output)
        return (path, path.with_name(path.stem + ".json"),
                path.with_name(path.stem + ".codes.safetensors"))

    def provenance(self, item: Item, result: ItemResult, pieces: list[Piece]) -> dict:
        """Everything needed to reproduce this output (the sidecar JSON)."""
        o = self.options
        return {
            "runner": {"name": "mimo-tts", "version": __version__, "argv": sys.argv[1:]},
            "id": item.id, "source": item.source, "text": item.text, "task": o.task,
            "instruct": item.instruct or o.instruct,
            "prompt_audio": item.prompt_audio or o.prompt_audio,
            "model": self.lm_ref.describe(), "tokenizer": self.tok_ref.describe(),
            "placement": self.placement.describe(), "threads": self.threads,
            "engine": self.engine_record(),
            "sampler": self.sampler_settings(),
            "effective_sampler": self.engine.sampler_record(o),
            "seed": self.seed(item), "max_new_groups": o.max_new_groups,
            "batch_size": o.batch_size, "stream": o.stream, "stream_mode": o.stream_mode,
            "max_chars": o.max_chars, "audio": {"format": o.format, "sample_rate": o.sample_rate,
                      "seconds": round(result.seconds, 4), "pause_frames": PAUSE_FRAMES},
            "pieces": [piece_record(p) for p in pieces],
            "timings": {**{k: round(v, 4) for k, v in self.timings.items()},
                        **{k: round(v, 4) for k, v in result.timings.items()}},
            "result": result.record(o.task),
        }


# Per-item timings that are work (the rest describe the streaming overlap within them).
BUSY_TIMINGS = ("prompt_s", "generate_s", "decode_s")


def _guard(result: ItemResult, fn, *args):
    """Run one item step; a MimoTTSError fails that item only."""
    try:
        return fn(*args)
    except MimoTTSError as exc:
        fail(result, exc)
        return None


def _file_stamp(path: str | None) -> dict | None:
    if not path:
        return None
    try:
        stat = Path(path).stat()
    except OSError:
        return {"path": path}
    return {"path": str(Path(path).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
