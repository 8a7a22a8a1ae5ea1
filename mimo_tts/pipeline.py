"""Stage-0 (LM -> codes) then Stage-1 (codes -> 24 kHz audio), one item at a time.

`Synthesizer` resolves placement and checkpoints without reading weights (`preflight`), loads
both models once on first need, and `run` yields one typed `ItemResult` per input item: written,
skipped (already done with the same inputs) or failed with its exit code. The CLI only routes
these results to its reporter; every file write goes through `mimo_tts.io` (atomic).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from mimo_tts import __version__, models
from mimo_tts import io as mio
from mimo_tts.devices import Placement, resolve_placement
from mimo_tts.errors import (
    EXIT_OK,
    EXIT_PARTIAL,
    AudioCheckError,
    MimoTTSError,
    NoAudioError,
    OutputError,
    UsageError,
)
from mimo_tts.models import Piece

PAUSE_FRAMES = 8  # silence between split text pieces: 8 frames = 0.32 s, whole frames
SILENCE_PEAK = 1e-4  # peak |sample| below this is "all silent"
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
# Resolved downstream with their env vars (devices.py, models.py), so the profile is not merged
# into these fields here: flag > env > profile > default needs the env step in between.
DEFERRED_FIELDS = ("lm_device", "tokenizer_device", "dtype", "tokenizer_dtype", "cuda_graph",
                   "model", "tokenizer")


@dataclass(frozen=True)
class SynthOptions:
    """Every run option of `mimo-tts synth`; TOML profile keys equal these field names."""

    task: str = "tts_sft"
    instruct: str | None = None
    prompt_audio: str | None = None
    template: int | None = None
    model: str | None = None
    tokenizer: str | None = None
    allow_download: bool = False
    lm_device: str | None = None
    tokenizer_device: str | None = None
    dtype: str | None = None
    tokenizer_dtype: str | None = None
    cuda_graph: bool | None = None
    seed: int = 0
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    audio_temperature: float | None = None
    audio_top_k: int | None = None
    audio_top_p: float | None = None
    max_new_groups: int | None = None
    batch_size: int = 1
    max_chars: int = 300
    output_dir: str = "output_audio"
    output: str | None = None
    format: str = "wav"
    sample_rate: int = mio.SAMPLE_RATE
    save_codes: bool = False
    overwrite: bool = False
    stream: bool = False
    raw: bool = False
    stream_chunk_groups: int = 5

    def validate(self) -> SynthOptions:
        """Check values and combinations in one place (UsageError, exit 2)."""
        _check(self.format in mio.FORMATS, f"--format must be one of {', '.join(mio.FORMATS)}")
        _check(self.sample_rate >= 8000, "--sample-rate must be at least 8000")
        _check(self.batch_size >= 1, "--batch-size must be >= 1")
        _check(self.max_chars >= 0, "--max-chars must be >= 0 (0 disables splitting)")
        _check(self.seed >= 0, "--seed must be >= 0")
        _check(self.max_new_groups is None or self.max_new_groups >= 1,
               "--max-new-groups must be >= 1")
        _check(self.stream_chunk_groups >= 1, "stream_chunk_groups must be >= 1")
        for name in ("temperature", "audio_temperature"):
            _check(getattr(self, name) is None or getattr(self, name) >= 0, f"{name} must be >= 0")
        for name in ("top_p", "audio_top_p"):
            value = getattr(self, name)
            _check(value is None or 0 < value <= 1, f"{name} must be in (0, 1]")
        for name in ("top_k", "audio_top_k"):
            _check(getattr(self, name) is None or getattr(self, name) >= 0, f"{name} must be >= 0")
        _check(not (self.raw and self.output not in (None, "-")),
               "--raw writes PCM to stdout; it cannot be combined with -o FILE")
        _check(self.template is None or self.template >= 0, "--template must be >= 0")
        return self

    @property
    def to_stdout(self) -> bool:
        return self.raw or self.output == "-"


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


def load_profile(name: str | None) -> dict:
    """A TOML profile (a path, or a name in the repo's `configs/`); keys must be option fields."""
    if not name:
        return {}
    path = Path(name).expanduser()
    if not path.is_file() and (CONFIG_DIR / f"{name}.toml").is_file():
        path = CONFIG_DIR / f"{name}.toml"
    if not path.is_file():
        raise UsageError(f"config profile not found: {name}")
    try:
        profile = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"invalid TOML in {path}: {exc}") from None
    known = {f.name for f in fields(SynthOptions)}
    unknown = sorted(set(profile) - known)
    if unknown:
        raise UsageError(f"{path}: unknown key(s) {', '.join(unknown)}")
    return profile


def build_options(flags: Mapping[str, object], profile: Mapping[str, object]) -> SynthOptions:
    """flag > profile > default per field, tested with `is not None` (explicit 0/false wins).

    Device and checkpoint fields stay None here: `devices.resolve_placement` and
    `models.pick_names` apply env and profile themselves.
    """
    values = {}
    for spec in fields(SynthOptions):
        flag = flags.get(spec.name)
        if flag is not None:
            values[spec.name] = flag
        elif spec.name not in DEFERRED_FIELDS and profile.get(spec.name) is not None:
            values[spec.name] = profile[spec.name]
    try:
        return SynthOptions(**values).validate()
    except TypeError as exc:
        raise UsageError(f"bad option value: {exc}") from None


# --- results ------------------------------------------------------------------------------------


@dataclass
class ItemResult:
    """The outcome of one item: status `ok`, `skipped` or `error` (with its exit code)."""

    item: mio.Item
    status: str
    key: str = ""
    path: Path | None = None
    sidecar: Path | None = None
    codes_path: Path | None = None
    seconds: float = 0.0
    rtf: float | None = None
    seed: int | None = None
    error: str | None = None
    exit_code: int = EXIT_OK
    timings: dict = field(default_factory=dict)
    generated_text_ids: list[list[int]] = field(default_factory=list)
    text_out: list[str] = field(default_factory=list)
    template_index: int | None = None

    def record(self, task: str) -> dict:
        """The manifest line / `--json` object of this item."""
        return {
            "id": self.item.id, "text": self.item.text, "task": task,
            "path": str(self.path) if self.path else None, "seconds": round(self.seconds, 4),
            "seed": self.seed, "rtf": None if self.rtf is None else round(self.rtf, 4),
            "status": self.status, "error": self.error, "exit_code": self.exit_code,
            "key": self.key, "source": self.item.source, "source_id": self.item.source_id,
            "codes_path": str(self.codes_path) if self.codes_path else None,
            "template_index": self.template_index,
            "generated_text_ids": self.generated_text_ids, "generated_text": self.text_out,
            "timings": {k: round(v, 4) for k, v in self.timings.items()},
        }


def exit_code_for(results: Iterable[ItemResult]) -> int:
    """0 if every item is fine; one failure kind -> its code; mixed outcomes -> partial (8)."""
    results = list(results)
    failed = [r for r in results if r.status == "error"]
    if not failed:
        return EXIT_OK
    codes = {r.exit_code for r in failed}
    if len(failed) == len(results) and len(codes) == 1:
        return codes.pop()
    return EXIT_PARTIAL


# --- the synthesizer ----------------------------------------------------------------------------


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
            options.cuda_graph, profile=self.profile, env=self.env, probe=probe)
        self.lm_ref = self.tok_ref = None
        self.engine = None
        self.timings: dict[str, float] = {}

    # -- preflight (no weights) --
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
        for role, name, src, dtype in (("model", lm, lm_src, self.placement.lm_dtype.value),
                                       ("tokenizer", tok, tok_src,
                                        self.placement.tokenizer_dtype.value)):
            path, status = models.locate(name, src, role, self.env)
            entry = {"name": name, "source": src, "path": str(path) if path else None,
                     "status": status}
            if path is not None:
                entry["memory"] = _safe_estimate(path, dtype)
            report["checkpoints"][role] = entry
        return report

    # -- loading --
    def resolve(self) -> None:
        if self.lm_ref is None:
            self.lm_ref, self.tok_ref = models.resolve_models(
                self.options.model, self.options.tokenizer, self.profile, self.env,
                self.options.allow_download)

    def load(self) -> None:
        """Load the LM, its text tokenizer and the audio tokenizer (once)."""
        if self.engine is not None:
            return
        self.resolve()
        start = time.perf_counter()
        self.engine = models.Engine.load(self.lm_ref.path, self.tok_ref.path, self.placement,
                                         self.log)
        self.timings["load_s"] = time.perf_counter() - start
        self.log(f"loaded models in {self.timings['load_s']:.2f} s "
                 f"(LM on {self.placement.lm_device.value}, "
                 f"tokenizer on {self.placement.tokenizer_device.value})")

    # -- running --
    def item_key(self, item: mio.Item) -> str:
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
        blob = json.dumps(inputs, sort_keys=True, ensure_ascii=False, default=str)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]

    def seed(self, item: mio.Item) -> int:
        return item.seed if item.seed is not None else self.options.seed

    def sampler_settings(self) -> dict:
        o = self.options
        return {"temperature": o.temperature, "top_k": o.top_k, "top_p": o.top_p,
                "audio_temperature": o.audio_temperature, "audio_top_k": o.audio_top_k,
                "audio_top_p": o.audio_top_p}

    def run(self, items: list[mio.Item], out: mio.OutputDir | None,
            chunk_sink=None) -> Iterator[ItemResult]:
        """Yield one result per item, in input order; a failed item is recorded, the rest go on.

        Items are generated `batch_size` at a time. Checkpoint and device errors while loading
        are not per-item: they end the run (raised).
        """
        window: list[ItemResult] = []
        for item in items:
            window.append(self._prepare(item, out))
            if sum(r.status == "pending" for r in window) >= self.options.batch_size:
                yield from self._flush(window, out, chunk_sink)
                window = []
        yield from self._flush(window, out, chunk_sink)

    def _prepare(self, item: mio.Item, out) -> ItemResult:
        result = ItemResult(item=item, status="pending", seed=item.seed)
        try:
            if item.error is not None:
                raise item.error
            result.seed = self.seed(item)
            result.key = self.item_key(item)
            if out is not None:
                self._skip(item, result, out)
        except MimoTTSError as exc:
            _fail(result, exc)
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

    def _skip(self, item: mio.Item, result: ItemResult, out: mio.OutputDir) -> None:
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
                pieces[id(r)] = self._guard(r, self._stream_item, r, prompts[id(r)], chunk_sink)
        else:
            for seed in dict.fromkeys(r.seed for r in ready):
                group = [r for r in ready if r.seed == seed]
                self._generate_group(group, prompts, pieces)
        for r in results:
            if r.status == "pending" and pieces.get(id(r)) is not None:
                self._guard(r, self._finish, r, pieces[id(r)], out)

    def _guard(self, result: ItemResult, fn, *args):
        """Run one item step; a MimoTTSError fails that item only."""
        try:
            return fn(*args)
        except MimoTTSError as exc:
            _fail(result, exc)
            return None

    def _prompts(self, result: ItemResult) -> list:
        item, o = result.item, self.options
        start = time.perf_counter()
        found = self._guard(result, lambda: [
            self.engine.prompt(o.task, text, item.instruct or o.instruct,
                               item.prompt_audio or o.prompt_audio, o.template, result.seed)
            for text in mio.split_text(item.text, o.max_chars)])
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
                _fail(r, exc)
            return
        elapsed = time.perf_counter() - start
        for r in group:
            n = len(prompts[id(r)])
            pieces[id(r)], made = made[:n], made[n:]
            r.timings["generate_s"] = elapsed * n / max(len(flat), 1)

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
        audio = self.join_audio(pieces)
        check_audio(audio, item.id)
        samples = mio.resample(audio, mio.SAMPLE_RATE, o.sample_rate)
        result.seconds = len(samples) / o.sample_rate
        busy = sum(v for k, v in result.timings.items() if k != "total_s")
        result.timings["total_s"] = busy
        result.rtf = busy / max(result.seconds, 1e-9)
        self._write(item, result, out, samples, pieces)

    def _write(self, item, result: ItemResult, out, samples, pieces: list[Piece]) -> None:
        """Codes, then the sidecar (with the result), then the audio: audio present => done."""
        o = self.options
        result.status = "ok"
        if o.to_stdout:
            if not o.raw:
                mio.write_stdout_audio(samples, o.sample_rate, o.format)
            return
        if out is None:  # -o FILE
            path = Path(o.output)
            sidecar = path.with_name(path.stem + ".json")
            codes_path = path.with_name(path.stem + ".codes.safetensors")
        else:
            path, sidecar = out.audio_path(item.id), out.sidecar_path(item.id)
            codes_path = out.codes_path(item.id)
        if o.save_codes:
            result.codes_path = mio.save_codes(codes_path, [p.codes for p in pieces],
                                               {"pause_frames": PAUSE_FRAMES, "id": item.id,
                                                "tokenizer": str(self.tok_ref.path)})
        result.path, result.sidecar = path, sidecar
        try:
            mio.write_json(sidecar, self.provenance(item, result, pieces))
            mio.write_audio(path, samples, o.sample_rate, o.format)
        except MimoTTSError:
            result.path = result.sidecar = None
            raise

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
                                       self.options.stream_chunk_groups, self.log))
        result.timings["generate_s"] = time.perf_counter() - start
        return pieces

    def join_audio(self, pieces: list[Piece]):
        """The pieces' audio with a whole-frame pause between pieces (CPU, [S])."""
        return join_pieces([p.audio for p in pieces], PAUSE_FRAMES, self.engine.samples_per_frame)

    def provenance(self, item: mio.Item, result: ItemResult, pieces: list[Piece]) -> dict:
        """Everything needed to reproduce this output (the sidecar JSON)."""
        o = self.options
        return {
            "runner": {"name": "mimo-tts", "version": __version__, "argv": sys.argv[1:]},
            "id": item.id, "source": item.source, "text": item.text, "task": o.task,
            "instruct": item.instruct or o.instruct,
            "prompt_audio": item.prompt_audio or o.prompt_audio,
            "model": self.lm_ref.describe(), "tokenizer": self.tok_ref.describe(),
            "placement": self.placement.describe(), "sampler": self.sampler_settings(),
            "effective_sampler": self.engine.sampler_record(o),
            "seed": self.seed(item), "max_new_groups": o.max_new_groups,
            "batch_size": o.batch_size, "stream": o.stream, "max_chars": o.max_chars,
            "audio": {"format": o.format, "sample_rate": o.sample_rate,
                      "seconds": round(result.seconds, 4), "pause_frames": PAUSE_FRAMES},
            "pieces": [_piece_record(p) for p in pieces],
            "timings": {**{k: round(v, 4) for k, v in self.timings.items()},
                        **{k: round(v, 4) for k, v in result.timings.items()}},
            "result": result.record(o.task),
        }


def _fail(result: ItemResult, exc: MimoTTSError) -> None:
    result.status, result.error, result.exit_code = "error", str(exc), exc.exit_code


def _piece_record(piece: Piece) -> dict:
    prompt = piece.prompt
    return {"text": prompt.text, "rendered_prompt": prompt.rendered,
            "template_index": prompt.template_index, "template": prompt.template,
            "prompt_groups": prompt.n_groups, "seed": piece.seed,
            "generated_text_ids": piece.new_text_ids, "generated_text": piece.text,
            "frames": 0 if piece.codes is None else int(piece.codes.shape[1])}


def check_audio(audio, item_id: str) -> None:
    """Refuse NaN/inf or all-silent audio (exit 6) rather than write a broken file."""
    import torch

    if audio.numel() == 0:
        raise NoAudioError(f"item {item_id!r}: no audio samples")
    if not bool(torch.isfinite(audio).all()):
        raise AudioCheckError(f"item {item_id!r}: decoded audio has NaN or infinite samples")
    if float(audio.abs().max()) < SILENCE_PEAK:
        raise AudioCheckError(f"item {item_id!r}: decoded audio is silent "
                              f"(peak below {SILENCE_PEAK})")


def _file_stamp(path: str | None) -> dict | None:
    if not path:
        return None
    try:
        stat = Path(path).stat()
    except OSError:
        return {"path": path}
    return {"path": str(Path(path).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _safe_estimate(path: Path, dtype: str) -> dict:
    try:
        return models.estimate_memory(path, {"float32": 4}.get(dtype, 2))
    except (MimoTTSError, OSError, ValueError, KeyError) as exc:
        return {"error": str(exc)}


def replace_options(options: SynthOptions, **changes) -> SynthOptions:
    return replace(options, **changes).validate()


# --- streaming: Stage-1 in a worker thread while Stage-0 generates ------------------------------


class _DecodeWorker:
    """Runs a StreamingDecoder on the tokenizer device in a thread; chunks go to the sink."""

    def __init__(self, codec, sink):
        import queue
        import threading

        self.codec, self.sink = codec, sink
        self.queue: queue.Queue = queue.Queue()
        self.chunks: list = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="mimo-tts-stage1", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from mimo_tts.codec import StreamingDecoder

        decoder = StreamingDecoder(self.codec)
        try:
            while True:
                codes, last = self.queue.get()
                if codes is None:
                    return
                wave = decoder.push(codes, last=last)
                if wave is not None and wave.numel():
                    wave = wave.detach().float().cpu()  # [S]
                    self.chunks.append(wave)
                    if self.sink is not None:
                        self.sink(wave)
                if last:
                    return
        except BaseException as exc:  # re-raised in the generating thread by `join`
            self.error = exc

    def push(self, codes, last: bool = False) -> None:
        self.queue.put((codes, last))

    def abort(self) -> None:
        self.queue.put((None, True))
        self.thread.join(timeout=30)

    def join(self):
        """Wait for the last chunk; the whole streamed waveform [S] (CPU)."""
        import torch

        self.thread.join()
        if self.error is not None:
            raise self.error
        return torch.cat(self.chunks) if self.chunks else torch.zeros(0)


def _group_ids(step, empty_codes):
    """One generated group as ids [1 + K, F]: the text token repeated, then the codes."""
    import torch

    codes = empty_codes if step.codes is None else step.codes.long()  # [F, K]
    text = torch.full((1, codes.shape[0]), step.text_token, dtype=torch.long)
    return torch.cat((text, codes.T), dim=0)


def stream_piece(engine, prompt, options, seed: int, sink, chunk_groups: int, log) -> Piece:
    """Generate one prompt while decoding its audio frames as they arrive (spec §7.2 scheme).

    Frames are streamed from the first audio group to `<|eostm|>`. If the official extraction
    (spec §4.8) ends up different, e.g. a `<|sostm|>` generated after audio, the file output
    is re-decoded from the extracted codes and a note is logged.
    """
    import torch

    from mimo_tts.lm.extract import extract
    from mimo_tts.lm.generate import stream

    special, empty0 = engine.text.special, engine.empty_ids[0]
    empty_codes = torch.tensor(engine.empty_ids).unsqueeze(0).expand(engine.group_size, -1)
    worker = _DecodeWorker(engine.codec, sink)
    blocks, pending, sent = [], [], []
    try:
        for step in stream(engine.lm, [prompt.input_ids], options, special):
            blocks.append(_group_ids(step, empty_codes))
            if step.text_token == special.sostm:
                pending.clear()  # official extraction reads audio after a generated <|sostm|>
            elif step.codes is not None and step.text_token == special.empty:
                frames = step.codes[step.codes[:, 0] != empty0].long().T  # [K, f]
                pending.append(frames)
                if len(pending) >= chunk_groups:
                    sent.append(torch.cat(pending, dim=1))
                    worker.push(sent[-1])
                    pending = []
        sent.append(torch.cat(pending, dim=1) if pending else empty_codes.T[:, :0])
        worker.push(sent[-1], last=True)
        audio = worker.join()
    except BaseException:
        worker.abort()
        raise
    found = extract(torch.cat(blocks, dim=1), engine.text, engine.empty_ids, engine.group_size)
    note = None
    if found.codes is not None and not torch.equal(torch.cat(sent, dim=1), found.codes):
        note = "streamed frames differ from the extracted codes; the file is decoded one-shot"
        log(f"note: {note}")
        audio = engine.decode([found.codes])[0]
    return Piece(prompt, seed, list(found.text_tokens), found.text, found.codes,
                 audio if found.codes is not None else None, note)


# --- command bodies (called by cli.py) ----------------------------------------------------------


def _option_flags(flags: Mapping[str, object]) -> dict:
    names = {f.name for f in fields(SynthOptions)}
    return {k: v for k, v in flags.items() if k in names}


def prepare_synth(flags: Mapping[str, object], config: str | None, stdin, log):
    """Options (flag > profile > default), items and a Synthesizer; usage errors up front."""
    profile = load_profile(config)
    options = build_options(_option_flags(flags), profile)
    from mimo_tts.tasks import TASKS

    _check(options.task in TASKS, f"unknown --task {options.task!r}; choose one of "
                                  f"{', '.join(TASKS)}")
    _check(not (options.stream and options.batch_size > 1),
           "--stream generates one prompt at a time; drop --batch-size")
    _check(not (options.raw and options.sample_rate != mio.SAMPLE_RATE),
           "--raw streams 24 kHz PCM; --sample-rate cannot be used with it")
    _check(not (flags.get("as_json") and options.to_stdout),
           "--json prints to stdout, which -o - / --raw already use")
    items = mio.read_items(flags.get("text") or [], flags.get("input") or [], stdin)
    _check(bool(items), "nothing to say: give --text, --input FILE or --input -")
    _check(options.output is None or options.raw or len(items) == 1,
           f"-o/--output takes exactly one item, got {len(items)}; use --output-dir")
    return items, options, Synthesizer(options, profile, log=log)


def run_synth(synth: Synthesizer, items: list[mio.Item]) -> Iterator[ItemResult]:
    """Run items into the output directory (locked) or to stdout / a single file."""
    o = synth.options
    synth.resolve()  # a missing checkpoint ends the run here, before any item (exit 3)
    sink = mio.RawPcmSink().write if o.raw else None
    if o.to_stdout or o.output:
        if o.output and not o.to_stdout and Path(o.output).exists() and not o.overwrite:
            raise OutputError(f"{o.output} exists; use --overwrite to replace it")
        yield from synth.run(items, None, sink)
        return
    with mio.OutputDir(o.output_dir, o.task, o.format) as out:
        yield from synth.run(items, out, sink)


def summary(results: list[ItemResult], synth: Synthesizer, elapsed: float) -> str:
    """One line: counts, load time, synthesis time, audio seconds and real-time factor."""
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "skipped", "error")}
    audio = sum(r.seconds for r in results if r.status == "ok")
    load = synth.timings.get("load_s")
    busy = elapsed - (load or 0.0)
    parts = [f"{counts['ok']} written, {counts['skipped']} skipped, {counts['error']} failed"]
    if load is not None:
        parts.append(f"load {load:.2f} s")
    if audio:
        parts.append(f"synthesis {busy:.2f} s for {audio:.2f} s of audio "
                     f"(RTF {busy / audio:.3f})")
    return " | ".join(parts)


def preflight(flags: Mapping[str, object], config: str | None) -> dict:
    profile = load_profile(config)
    options = build_options(_option_flags(flags), profile)
    return Synthesizer(options, profile).preflight()


def join_pieces(audios: list, pause_frames: int, samples_per_frame: int):
    """Pieces' audio [S_i] joined with `pause_frames` frames of silence: [S] float32 on CPU."""
    import torch

    pause = torch.zeros(pause_frames * samples_per_frame)
    parts = []
    for i, audio in enumerate(audios):
        if i:
            parts.append(pause)
        parts.append(audio.detach().float().cpu())
    return torch.cat(parts)


def decode_files(flags: Mapping[str, object], log) -> list:
    """`mimo-tts decode`: saved codes -> audio files, decoded on the tokenizer device."""
    from mimo_tts.codec import load_audio_tokenizer

    paths = list(flags["codes"])
    output, fmt = flags.get("output"), flags.get("format") or "wav"
    rate = flags.get("sample_rate") or mio.SAMPLE_RATE
    _check(fmt in mio.FORMATS, f"--format must be one of {', '.join(mio.FORMATS)}")
    _check(output is None or len(paths) == 1, "-o/--output takes exactly one codes file")
    loaded = [(Path(p), *mio.load_codes(p)) for p in paths]
    placement = resolve_placement(tokenizer_device=flags.get("tokenizer_device"),
                                  tokenizer_dtype=flags.get("tokenizer_dtype"),
                                  cuda_graph=flags.get("cuda_graph"))
    tok = _decode_tokenizer(flags.get("tokenizer"), loaded[0][2])
    log(f"decoding with {tok.path} on {placement.tokenizer_device.value}")
    codec = load_audio_tokenizer(tok.path, placement.tokenizer_device.value,
                                 placement.tokenizer_dtype.value,
                                 cuda_graph=bool(placement.cuda_graph.value))
    written = []
    for path, pieces, meta in loaded:
        audio = join_pieces(codec.decode_batch(pieces), int(meta.get("pause_frames", PAUSE_FRAMES)),
                            codec.samples_per_frame)
        check_audio(audio, path.name)
        samples = mio.resample(audio, mio.SAMPLE_RATE, rate)
        if output == "-":
            mio.write_stdout_audio(samples, rate, fmt)
            continue
        stem = path.name.removesuffix(".safetensors").removesuffix(".codes")
        target = Path(output) if output else path.with_name(stem + ".decoded" +
                                                              mio.FORMATS[fmt][2])
        written.append(mio.write_audio(target, samples, rate, fmt))
    return written


def _decode_tokenizer(flag: str | None, meta: dict):
    """flag > MIMO_AUDIO_TOKENIZER_PATH > the directory recorded in the codes > default."""
    (_, _), (name, source) = models.pick_names(None, flag)
    recorded = meta.get("tokenizer")
    if source == "default" and recorded and Path(recorded).is_dir():
        name, source = recorded, "codes metadata"
    return models.resolve(name, source, "tokenizer")


def selftest(lm_device: str | None, tokenizer_device: str | None, log) -> dict:
    """End-to-end on the tiny preset in a temp dir; checks rate, length, finiteness, level."""
    import tempfile

    import soundfile as sf

    with tempfile.TemporaryDirectory(prefix="mimo-tts-selftest-") as tmp:
        options = SynthOptions(model=models.TINY, lm_device=lm_device or "cpu",
                               tokenizer_device=tokenizer_device or "cpu", output_dir=tmp,
                               save_codes=True).validate()
        synth = Synthesizer(options, log=log)
        item = mio.Item(id="selftest", text="Hello from MiMo.", source="selftest")
        (result,) = list(run_synth(synth, [item]))
        if result.status != "ok":
            error = AudioCheckError(f"selftest failed: {result.error}")
            error.exit_code = result.exit_code
            raise error
        audio, rate = sf.read(str(result.path), dtype="float32")
        pieces, _ = mio.load_codes(result.codes_path)
        frames = sum(p.shape[1] for p in pieces) + PAUSE_FRAMES * (len(pieces) - 1)
        problems = _selftest_problems(audio, rate, frames)
        if problems:
            raise AudioCheckError("selftest failed: " + "; ".join(problems))
        peak = float(abs(audio).max())
        return {"status": "ok", "seconds": len(audio) / rate, "frames": frames, "peak": peak,
                "rtf": result.rtf, "load_s": synth.timings.get("load_s"),
                "path": "(temporary) " + result.path.name}


def _selftest_problems(audio, rate: int, frames: int) -> list[str]:
    import numpy as np

    problems = []
    if rate != mio.SAMPLE_RATE:
        problems.append(f"sample rate {rate} != {mio.SAMPLE_RATE}")
    if len(audio) != frames * 960:
        problems.append(f"{len(audio)} samples != 960 x {frames} frames")
    if not np.isfinite(audio).all():
        problems.append("non-finite samples")
    if float(np.abs(audio).max(initial=0.0)) < 1e-3:
        problems.append("silent output")
    if not 0.5 <= len(audio) / mio.SAMPLE_RATE <= 60:
        problems.append(f"implausible length {len(audio) / mio.SAMPLE_RATE:.2f} s")
    return problems
