"""The library face: `load(...)` -> `MiMoTTS`, which turns text into numpy `Audio` in memory.

`MiMoTTS` holds the loaded stages: the LM (native, or a `VLLMEngine` as `stage0`), its text
tokenizer and `Stage1`, the audio tokenizer with its safeguards. It builds task prompts,
generates pieces (batched), streams them with Stage-1 overlapped (`overlap.py`) and decodes
codes. It writes no files, no manifest and nothing to stdout: the batch runner (`batch.py`) and
the sinks (`outputs.py`) do that for the CLI.

    import mimo_tts
    tts = mimo_tts.load("tiny")
    audio = tts.synthesize("Hello from MiMo.")   # Audio: samples [S] float32, 24 kHz
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch

from mimo_tts.errors import InputError, OptionTypeError
from mimo_tts.lm.engine import DEFAULT_ENGINE, Engine, engine_spec
from mimo_tts.lm.extract import extract
from mimo_tts.lm.prompts import build_prompt
from mimo_tts.lm.tasks import TASKS
from mimo_tts.lm.text import TextTokenizer
from mimo_tts.runtime import runner_record
from mimo_tts.runtime.checkpoints import DEFAULT_MODEL
from mimo_tts.runtime.guards import oom_advice, thread_budget
from mimo_tts.synthesis.audio import (
    PAUSE_FRAMES,
    check_format_rate,
    output_format,
    to_numpy,
    write_audio,
)
from mimo_tts.synthesis.captions import cues, piece_samples, text_pieces
from mimo_tts.synthesis.loader import check_fits, resolve_checkpoints, thread_budgets
from mimo_tts.synthesis.options import (
    DEFAULT_TASK,
    EngineOptions,
    RunOptions,
    SynthesisOptions,
    task_for,
)
from mimo_tts.synthesis.pieces import Piece
from mimo_tts.synthesis.preflight import Lengths, weights_bytes
from mimo_tts.synthesis.settings import Settings, resolve
from mimo_tts.synthesis.stage1 import Stage1, _naming, check_pairing, check_pause, codes_tensor
from mimo_tts.synthesis.streaming import stream_chunks, stream_piece
from mimo_tts.synthesis.text import clean_text
from mimo_tts.synthesis.voices import VoiceStore, add_voice, file_sha256, tokenizer_record

SYNTHESIS_FIELDS = frozenset(f.name for f in fields(SynthesisOptions))


@dataclass(frozen=True)
class Audio:
    """Synthesised speech, in memory: what `MiMoTTS.synthesize` and `decode` return."""

    samples: np.ndarray
    """Mono float32 samples [S] in [-1, 1]."""

    sample_rate: int
    """Samples per second: 24000, the audio tokenizer's rate."""

    provenance: dict
    """How it was made: checkpoints, placement, task, seed, samplers, text pieces (the CLI's
    sidecar record)."""

    cues: tuple = ()
    """`captions.Cue` per text piece when `captions=True`: exact sample spans of the joined
    audio, pauses between them."""

    @property
    def seconds(self) -> float:
        """The length in seconds."""
        return len(self.samples) / self.sample_rate

    def save(self, path: str | os.PathLike, format: str | None = None) -> Path:
        """Write the audio to `path` as the CLI's `-o` does (same writer, same bytes), atomically.

        `format` is one of `mimo_tts.synthesis.audio.FORMATS` (`wav`, `wav-float`, `flac`,
        `mp3`, `opus`, `ogg`); None takes it from the extension. A name and a format that
        disagree, or an unknown extension without `format`, is a `UsageError`; a file that
        cannot be written an `OutputError`. Returns the path written.
        """
        fmt = output_format(os.fspath(path), format)
        check_format_rate(fmt, self.sample_rate)
        return write_audio(path, self.samples, self.sample_rate, fmt)


@dataclass(frozen=True)
class AudioChunk:
    """A part of streamed speech, handed out as soon as Stage-1 decoded it (`MiMoTTS.stream`)."""

    samples: np.ndarray
    """Mono float32 samples [S_i] in [-1, 1]; the chunks of one call, joined, are its audio."""

    sample_rate: int
    """Samples per second: 24000."""

    index: int
    """The chunk's place in its `stream` call: 0, 1, ..."""


def load(model: str = DEFAULT_MODEL, tokenizer: str | None = None, *,
         lm_device: str | None = None, tokenizer_device: str | None = None,
         dtype: str | None = None, tokenizer_dtype: str | None = None,
         cuda_graph: bool | None = None, allow_download: bool = False,
         engine: str = DEFAULT_ENGINE, log=None, **engine_options) -> MiMoTTS:
    """Load both stages: `model` is a checkpoint directory, a Hugging Face id (default: the
    published 7B LM, as on the CLI) or `tiny` (the random preset).

    Devices and dtypes default as on the CLI (environment variables included); extra keywords
    are `EngineOptions` fields (`lm_threads`, `no_memory_check`, vLLM settings). A run that
    cannot fit raises `mimo_tts.NotEnoughMemoryError` before anything is loaded.
    """
    unknown = sorted(set(engine_options) - {f.name for f in fields(EngineOptions)})
    if unknown:
        raise TypeError(f"load() got unexpected keyword argument(s): {', '.join(unknown)}")
    settings = resolve({"model": model, "tokenizer": tokenizer, "lm_device": lm_device,
                        "tokenizer_device": tokenizer_device, "dtype": dtype,
                        "tokenizer_dtype": tokenizer_dtype, "cuda_graph": cuda_graph,
                        "allow_download": allow_download, "engine": engine, **engine_options})
    return MiMoTTS.from_settings(settings, log=log)


class MiMoTTS:
    """Both stages, loaded once: text -> `Audio` (numpy, 24 kHz), in memory only."""

    def __init__(self, engine: Engine, text, stage1: Stage1, lm_device: str | None = None,
                 refs=(None, None), placement=None, lm_threads: int | None = None):
        self.engine, self.text, self.stage1 = engine, text, stage1
        self.codec = stage1.codec
        self.empty_ids = list(engine.cfg.speech_empty_ids)
        self.group_size = engine.cfg.group_size
        self.lm_device = lm_device
        self.lm_ref, self.tok_ref = refs
        self.placement = placement
        self.lm_threads, self.tokenizer_threads = lm_threads, stage1.threads
        self.options = SynthesisOptions()  # defaults of `synthesize` and `stream`
        self.timings: dict[str, float] = {}
        self.threads: dict = {}
        self.log = lambda message: None  # from_settings: the loader's log
        self.voices = VoiceStore()  # the registry (MIMO_TTS_VOICES_DIR, else the XDG data home)

    @classmethod
    def from_settings(cls, settings: Settings, lengths: Lengths | None = None, log=None,
                      env: Mapping[str, str] | None = None, refs=None) -> MiMoTTS:
        """The one loader of every face: checkpoint names -> directories (the tiny preset
        written on first use), the memory preflight (`NotEnoughMemoryError`, exit 4, unless
        `no_memory_check`), thread budgets, both stages, the pairing check and the load log."""
        log = log or (lambda message: None)
        refs = refs or resolve_checkpoints(settings, env)
        check_fits(settings, refs, lengths, env, log)
        threads, start = thread_budgets(settings), time.perf_counter()
        tts = cls.load(*refs, settings.placement, settings.engine, log, threads)
        tts.threads, tts.timings["load_s"] = threads, time.perf_counter() - start
        tts.log = log
        p = settings.placement
        log(f"loaded models in {tts.timings['load_s']:.2f} s (LM on {p.lm_device.value}, "
            f"tokenizer on {p.tokenizer_device.value}; threads {threads}; "
            f"engine {tts.engine.name})")
        return tts

    @classmethod
    def load(cls, lm_ref, tok_ref, placement, engine: EngineOptions | None = None, log=None,
             threads: dict | None = None) -> MiMoTTS:
        """Load both stages on `placement`, Stage-0 on the engine `engine.engine` names (no
        preflight: `from_settings` is the loader of every face)."""
        engine, log, threads = engine or EngineOptions(), log or (lambda m: None), threads or {}
        spec = engine_spec(engine.engine)
        spec.check_installed()  # fail before loading
        text = TextTokenizer.from_dir(lm_ref.path)
        with _naming(lm_ref.path), oom_advice("LM loading", placement.lm_device.value):
            stage0 = spec.load(lm_ref.path, placement, engine, text)
        settings = spec.settings(engine, placement)
        described = stage0.describe()
        log(f"LM loaded from {lm_ref.path}" + (f" into {spec.name} {settings}" if settings else "")
            + (f" ({described['lm_quant']} weights)" if described.get("lm_quant") else "")
            + (f" (CPU kernel: {stage0.kernel_words()})" if hasattr(stage0, "kernel_words")
               else ""))
        try:
            beside = 0
            if not spec.sizes_own_memory and placement.lm_device.value == "cpu":
                beside = weights_bytes(lm_ref.path, placement.lm_dtype.value)
            stage1 = Stage1.load(tok_ref.path, placement, log, threads.get("tokenizer"), beside)
            check_pairing(stage0.cfg, stage1.codec.config, lm_ref.path, tok_ref.path)
        except BaseException:
            stage0.close()
            raise
        return cls(stage0, text, stage1, placement.lm_device.value, (lm_ref, tok_ref),
                   placement, threads.get("lm"))

    def close(self) -> None:
        """Shut the Stage-0 engine down (vLLM frees its memory)."""
        self.engine.close()

    def __enter__(self) -> MiMoTTS:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def engine_record(self) -> dict:
        """The Stage-0 engine that ran (bfloat16 sums round differently in the CPU kernel)."""
        return self.engine.describe()

    # -- building blocks (the batch runner uses these too) --
    def prompts(self, text: str, o: SynthesisOptions, seed: int, instruct=None,
                prompt_audio=None) -> list:
        """The task prompts of one text, split into pieces (`text_pieces`). The voice prompt
        is the item's `prompt_audio`, else the options' prompt_audio or stored voice."""
        instruct, prompt_audio = instruct or o.instruct, prompt_audio or o.prompt_audio
        if prompt_audio and TASKS[o.task].prompt_audio == "none":  # refuse before reading it
            raise InputError(f"task {o.task} takes no prompt audio; use tts_sft_with_audio")
        o.check_item(instruct, prompt_audio)
        if prompt_audio:
            codes = self.stage1.prompt_codes(prompt_audio)
        else:
            codes = self.voice_codes(o.voice) if o.voice else None
        return [build_prompt(o.task, piece, self.text, self.empty_ids, instruct=instruct,
                             prompt_codes=codes, template=o.template, seed=seed,
                             group_size=self.group_size)
                for piece in text_pieces(text, o)]

    def voice_codes(self, name: str) -> torch.Tensor:
        """A stored voice's prompt codes [K, T]. Codes another audio tokenizer encoded are
        re-encoded from the voice's source file when it is still there unchanged (said in
        the log); otherwise refused (InputError)."""
        voice = self.voices.load(name)
        mine = tokenizer_record(self.tok_ref)
        if voice.record["tokenizer"].get("id") == mine["id"]:
            return voice.codes
        source = voice.record.get("source") or {}
        path = source.get("path")
        theirs = voice.record["tokenizer"].get("path") or voice.record["tokenizer"].get("id")
        if path and _same_file(path, source.get("sha256")):
            self.log(f"voice {name!r} was encoded by another audio tokenizer ({theirs}); "
                     f"re-encoded from its source {path}")
            return self.stage1.prompt_codes(path)
        raise InputError(f"voice {name!r} was encoded by another audio tokenizer ({theirs}, "
                         f"not {mine['path']}) and its source file is gone or changed; add it "
                         "again with this tokenizer")

    def add_voice(self, name: str, path, transcript: str | None = None,
                  overwrite: bool = False, label: str | None = None) -> dict:
        """Encode the recording at `path` once (as `prompt_audio=path` would be) and keep its
        codes in the registry (`self.voices`) as `name`; returns the voice's record."""
        return add_voice(self.voices, self.stage1, self.tok_ref, name, path, transcript,
                         overwrite, label)

    def list_voices(self) -> list[dict]:
        """The registry's voices (their records)."""
        return self.voices.list()

    def remove_voice(self, name: str) -> None:
        self.voices.remove(name)

    def generate(self, prompts: list, options, seed: int, batch_size: int = 1) -> list[Piece]:
        """Stage-0 for prompts, `batch_size` at a time (a static engine: all at once), then
        extraction."""
        pieces = []
        step = batch_size if self.engine.continuous else max(len(prompts), 1)
        for start in range(0, len(prompts), step):
            batch = prompts[start:start + step]
            with self.stage0_guard():
                outs = self.engine.generate([p.input_ids for p in batch], options)
            pieces += [self.piece(p, out, seed) for p, out in zip(batch, outs, strict=True)]
        return pieces

    def piece(self, prompt, generation, seed: int) -> Piece:
        """One prompt's generated groups (a lm.generate.Generation), text and codes extracted."""
        found = extract(generation.new_ids, self.text, self.empty_ids, self.group_size)
        timings = {} if generation.prefill_s is None else {"prefill_s": generation.prefill_s}
        return Piece(prompt, seed, list(found.text_tokens), found.text, found.codes,
                     timings=timings)

    @contextmanager
    def stage0_guard(self):
        """The context Stage-0 work runs in: the LM's thread budget, out-of-memory advice."""
        with thread_budget(self.lm_threads), oom_advice("Stage-0 generation", self.lm_device):
            yield

    def run_batch(self, source, rows: int):
        """A continuous batch of `rows` pulling `lm.batching.Job`s from `source`, each step
        under `stage0_guard` (`lm.batching.BatchRun`; continuous engines only)."""
        return self.engine.run_batch(source, rows, self.stage0_guard)

    def stream_steps(self, ids: list, options) -> Iterator:
        """Stage-0 StepOutputs as produced (vLLM: an audio group arrives one step late)."""
        return self.engine.stream(ids, options)

    def stream_piece(self, prompt, o: SynthesisOptions, seed: int, on_chunk, log) -> Piece:
        """One prompt with Stage-1 decoding its frames as they come (`on_chunk(samples)`)."""
        return stream_piece(self, prompt, o.generation_options(seed), seed, on_chunk,
                            o.stream_chunk_groups, log, o.stream_mode, o.stream_max_chunk_groups)

    def finish(self, pieces: list[Piece], label: str) -> torch.Tensor:
        """The pieces' audio joined and checked [S] (24 kHz): `Stage1.finish`."""
        return self.stage1.finish(pieces, label)

    def describe(self, o: SynthesisOptions) -> dict:
        """Checkpoints, placement, engine and effective samplers (provenance of every output)."""
        text, audio = o.samplers()
        return {"model": self.lm_ref.describe() if self.lm_ref else None,
                "tokenizer": self.tok_ref.describe() if self.tok_ref else None,
                "placement": self.placement.describe() if self.placement else None,
                "engine": self.engine_record(),
                "effective_sampler": {"text": asdict(text), "audio": asdict(audio)}}

    # -- the library face --
    def synthesize(self, text: str, *, task: str | None = None, instruct: str | None = None,
                   prompt_audio=None, seed: int | None = None,
                   options: SynthesisOptions | None = None, **overrides) -> Audio:
        """Speech for `text` (split on sentence ends past `max_chars`, pieces joined).

        `options` (default `self.options`) holds every sampling and task option; the keywords,
        and any other `SynthesisOptions` field given by name, override it for this call.
        `prompt_audio` is a file path or `(samples, sample_rate)` in memory.
        """
        o = self._options("synthesize", options, task=task, instruct=instruct,
                          prompt_audio=prompt_audio, seed=seed, **overrides)
        return self._synthesize([_text(text, "text")], o, 1)[0]

    def synthesize_batch(self, texts: Sequence[str], *, batch_size: int = 1,
                         **given) -> list[Audio]:
        """Speech for several texts with one seed, each text's audio its `synthesize` call's:
        on a continuous engine the text pieces are jobs of one continuous batch of
        `batch_size` rows, each sampling from its own generator (as `--batch-size` on the
        CLI); a static engine (vLLM) runs them together on one seed stream."""
        batch_size = RunOptions(batch_size=batch_size).batch_size  # typed, >= 1
        texts = _texts(texts)
        o = self._options("synthesize_batch", given.pop("options", None), **given)
        return self._synthesize(texts, o, batch_size)

    def stream(self, text: str, **given) -> Iterator[AudioChunk]:
        """Speech for `text` in chunks as Stage-1 decodes them (keywords as `synthesize`)."""
        o = self._options("stream", given.pop("options", None), **given)
        chunks = stream_chunks(self, self.prompts(_text(text, "text"), o, o.seed), o)
        for index, chunk in enumerate(chunks):
            yield AudioChunk(to_numpy(chunk), self.stage1.sample_rate, index)

    def decode(self, codes, pause_frames: int = PAUSE_FRAMES) -> Audio:
        """Stage-1 alone: codes [8, T] (or one per text piece; torch or numpy integers) ->
        `Audio`, checked as `mimo-tts decode` checks a codes file (codes out of range:
        AudioCheckError)."""
        if isinstance(codes, torch.Tensor | np.ndarray):
            pieces = [codes_tensor(codes, "codes")]
        elif isinstance(codes, list | tuple) and codes:
            pieces = [codes_tensor(c, f"codes[{i}]") for i, c in enumerate(codes)]
        elif isinstance(codes, list | tuple):
            raise InputError("codes: no code tensors to decode")
        else:
            raise OptionTypeError(f"codes must be a tensor or a list of tensors, not "
                                  f"{type(codes).__name__}")
        audio = self.stage1.join(pieces, check_pause(pause_frames), "codes")
        return Audio(to_numpy(audio), self.stage1.sample_rate,
                     {"runner": runner_record(),
                      "tokenizer": self.tok_ref.describe() if self.tok_ref else None})

    def _synthesize(self, texts: list[str], o: SynthesisOptions, rows: int) -> list[Audio]:
        prompts = [self.prompts(t, o, o.seed) for t in texts]
        flat = [p for ps in prompts for p in ps]
        if self.engine.continuous and rows > 1:
            made = self._run_jobs(flat, o, rows)
        else:
            made = self.generate(flat, o.generation_options(o.seed), o.seed, rows)
        results = []
        for n, ps in enumerate(prompts):
            pieces, made = made[:len(ps)], made[len(ps):]
            audio = self._audio(self.finish(pieces, f"text {n + 1}"), o, pieces)
            if o.captions:
                audio = replace(audio, cues=tuple(self.cues(texts[n], o, pieces)))
            results.append(audio)
        return results

    def cues(self, text: str, o: SynthesisOptions, pieces: list[Piece]) -> list:
        """The captions of a text synthesised with `captions=True`: one cue per piece."""
        spf = self.stage1.samples_per_frame
        return cues(text_pieces(text, o), [piece_samples(p, spf) for p in pieces],
                    self.stage1.sample_rate, spf)

    def _run_jobs(self, prompts: list, o: SynthesisOptions, rows: int) -> list[Piece]:
        """Each prompt a job of one continuous batch (`run_batch`), sampling from its own
        generator seeded with `o.seed`: its codes are its single run's."""
        from mimo_tts.lm.batching import Job, JobDone, Jobs, StepFailed

        if not prompts:
            return []
        options = o.generation_options(o.seed)
        made: list[Piece | None] = [None] * len(prompts)
        jobs = Jobs(Job(p.input_ids, options, key=i) for i, p in enumerate(prompts))
        for event in self.run_batch(jobs, min(rows, len(prompts))):
            if isinstance(event, StepFailed):
                raise event.error
            if isinstance(event, JobDone):
                if event.error is not None:
                    raise event.error
                index = event.job.key
                made[index] = self.piece(prompts[index], event.generation, o.seed)
        return made

    def _options(self, call: str, options, **given) -> SynthesisOptions:
        """`options` (default `self.options`) with this call's keywords; a keyword that is no
        `SynthesisOptions` field is a TypeError naming it. No task named (the options' is
        the default, which takes neither input): a prompt_audio or instruct picks its task,
        as on the CLI without --task."""
        unknown = sorted(set(given) - SYNTHESIS_FIELDS)
        if unknown:
            raise TypeError(f"{call}() got unexpected keyword argument(s) "
                            f"{', '.join(map(repr, unknown))} (not SynthesisOptions fields)")
        if options is None:
            options = self.options
        elif not isinstance(options, SynthesisOptions):
            raise OptionTypeError(f"options must be a SynthesisOptions, not "
                                  f"{type(options).__name__}")
        changes = {k: v for k, v in given.items() if v is not None}
        if "task" not in changes and options.task == DEFAULT_TASK:
            changes["task"] = task_for(changes.get("instruct", options.instruct),
                                       changes.get("prompt_audio", options.prompt_audio),
                                       changes.get("voice", options.voice))
        return replace(options, **changes)

    def _audio(self, audio: torch.Tensor, o: SynthesisOptions, pieces: list[Piece]) -> Audio:
        prompt_audio = getattr(o.prompt_audio, "describe", lambda: o.prompt_audio)()
        record = {"runner": runner_record(), **self.describe(o),
                  "task": o.task, "instruct": o.instruct, "prompt_audio": prompt_audio,
                  "voice": o.voice,
                  "seed": o.seed, "pieces": [p.record() for p in pieces]}
        return Audio(to_numpy(audio), self.stage1.sample_rate, record)


def _same_file(path: str, sha256: str | None) -> bool:
    try:
        return sha256 is not None and file_sha256(path) == sha256
    except OSError:
        return False


def _text(text, where: str) -> str:
    """One text as the CLI takes it (`clean_text`: control characters refused, exit 9)."""
    if not isinstance(text, str):
        raise OptionTypeError(f"{where} must be a string, not {type(text).__name__}")
    return clean_text(text, where)


def _texts(texts) -> list[str]:
    if isinstance(texts, str | bytes):
        raise OptionTypeError(f"texts must be a list of strings, not one {type(texts).__name__}"
                              " (synthesize takes one text)")
    try:
        texts = list(texts)
    except TypeError:
        raise OptionTypeError(f"texts must be a list of strings, not "
                              f"{type(texts).__name__}") from None
    return [_text(t, f"texts[{i}]") for i, t in enumerate(texts)]
