"""The library face: `load(...)` -> `MiMoTTS`, the loaded stages, which turn text into numpy
`Audio` in memory (the calls themselves are `speech.SpeechCalls`).

`MiMoTTS` holds the Stage-0 engine (`lm.engine.Engine`), the LM's text tokenizer and `Stage1`
(the audio tokenizer with its safeguards); `from_settings` is the one loader of every face. Its
building blocks (task prompts, pieces, joining) and its speech worker (`worker()`, where every
synthesis runs) are what the batch runner and the servers use too. It writes no files, no
manifest and nothing to stdout: the batch runner and its sinks (`mimo_tts.batch`) do that.

    import mimo_tts
    tts = mimo_tts.load("tiny")
    audio = tts.synthesize("Hello from MiMo.")   # Audio: samples [S] float32, 24 kHz"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, fields

import torch

from mimo_tts.errors import InputError
from mimo_tts.lm.engine import DEFAULT_ENGINE, Engine, engine_spec
from mimo_tts.lm.extract import extract
from mimo_tts.lm.prompts import build_prompt
from mimo_tts.lm.tasks import TASKS
from mimo_tts.lm.text import TextTokenizer
from mimo_tts.runtime.checkpoints import DEFAULT_MODEL
from mimo_tts.runtime.guards import oom_advice
from mimo_tts.synthesis.loader import check_fits, resolve_checkpoints, stage1_mode, thread_budgets
from mimo_tts.synthesis.markup import STORE_HINT, check_voices, script
from mimo_tts.synthesis.options import EngineOptions, SynthesisOptions
from mimo_tts.synthesis.pieces import Piece
from mimo_tts.synthesis.preflight import Lengths, weights_bytes
from mimo_tts.synthesis.settings import Settings, resolve
from mimo_tts.synthesis.speech import SpeechCalls
from mimo_tts.synthesis.stage1 import Stage1, _naming, check_pairing
from mimo_tts.synthesis.voices import (
    BUILT_IN,
    VoiceStore,
    add_voice,
    file_sha256,
    served_voices,
    tokenizer_record,
)
from mimo_tts.synthesis.worker import STAGE1_BATCH, SpeechWorker


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


class MiMoTTS(SpeechCalls):
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
        self.startup_voices: dict = {}  # a server's `--voice NAME=FILE`: name -> prompt audio

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
        tts = cls._load_stages(*refs, settings.placement, settings.engine, log, threads)
        tts.threads, tts.timings["load_s"] = threads, time.perf_counter() - start
        tts.log = log
        p = settings.placement
        log(f"loaded models in {tts.timings['load_s']:.2f} s (LM on {p.lm_device.value}, "
            f"tokenizer on {p.tokenizer_device.value}; threads {threads}; "
            f"engine {tts.engine.name})")
        return tts

    @classmethod
    def _load_stages(cls, lm_ref, tok_ref, placement, engine: EngineOptions | None = None,
                     log=None, threads: dict | None = None) -> MiMoTTS:
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
            + (f" (CPU kernel: {_kernel_words(described)})" if "cpu_kernel" in described
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
        """The Stage-0 engine that ran (bfloat16 sums round differently in the CPU kernel) and,
        for a float32 tokenizer on the CPU, whether and how its linears were packed; for a
        tokenizer on the CPU, whether its attention ran through the fused kernel."""
        record = self.engine.describe()
        gemm = getattr(self.stage1, "gemm", None)
        if gemm is not None:
            record = {**record, "tokenizer_gemm": gemm.active, "tokenizer_gemm_engine": gemm.engine,
                      "tokenizer_gemm_reason": gemm.reason}
        fused = getattr(self.stage1, "attention", None)
        if fused is not None:
            record = {**record, "tokenizer_attention_fused": fused.active,
                      "tokenizer_attention_reason": fused.reason}
        return record

    # -- building blocks (the batch runner uses these too) --
    def prompts(self, text: str, o: SynthesisOptions, seed: int, instruct=None,
                prompt_audio=None) -> list:
        """The task prompts of one text, split into pieces (`text_pieces`). The voice prompt
        is the item's `prompt_audio`, else the options' prompt_audio or stored voice."""
        instruct, prompt_audio = instruct or o.instruct, prompt_audio or o.prompt_audio
        if prompt_audio and TASKS[o.task].prompt_audio == "none":  # refuse before reading it
            raise InputError(f"task {o.task} takes no prompt audio; use tts_sft_with_audio")
        o.check_item(instruct, prompt_audio)
        found = script(text, o)
        check_voices(found.named_voices, self.served_voices, STORE_HINT)  # before any codes
        if prompt_audio:
            codes = self.stage1.prompt_codes(prompt_audio)
        else:
            codes = self.voice_codes(o.voice) if o.voice else None
        run = (o.task, instruct, codes)
        return [build_prompt(task, piece, self.text, self.empty_ids, instruct=given,
                             prompt_codes=voiced, template=o.template, seed=seed,
                             group_size=self.group_size)
                for piece, (task, given, voiced) in zip(
                    found.texts, (run if v is None else self.tagged(v, instruct)
                                  for v in found.voices), strict=True)]

    def tagged(self, voice: str, instruct=None) -> tuple:
        """(task, instruct, prompt codes) of a piece a `[voice:NAME]` tag gives its voice: a
        built-in voice speaks in its task; a stored one is cloned (with the run's instruction,
        which that task takes); a server's start-up voice clones its prompt audio."""
        if voice in BUILT_IN:
            return BUILT_IN[voice][0], None, None
        if voice in self.startup_voices:
            return "tts_sft_with_audio", instruct, self.stage1.prompt_codes(
                self.startup_voices[voice])
        return "tts_sft_with_audio", instruct, self.voice_codes(voice)

    def served_voices(self) -> list[str]:
        """The names a `[voice:]` tag may give: built-in, a server's start-up voices, stored
        (`voices.served_voices`, the list every face shows)."""
        return [name for name, _ in served_voices(self.startup_voices, self.voices)]

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

    def piece(self, prompt, generation, seed: int) -> Piece:
        """One prompt's generated groups (a lm.generate.Generation), text and codes extracted."""
        found = extract(generation.new_ids, self.text, self.empty_ids, self.group_size)
        timings = {} if generation.prefill_s is None else {"prefill_s": generation.prefill_s}
        return Piece(prompt, seed, list(found.text_tokens), found.text, found.codes,
                     timings=timings)

    def worker(self, rows: int, *, stream: bool = False, schedule=None,
               stage1_batch: int | None = None, meter=None, log=None) -> SpeechWorker:
        """The speech worker over these stages with `rows` Stage-0 rows (`synthesis.worker`):
        Stage-1 in turns or in its own thread as `loader.stage1_mode` says for this placement
        (`stream`: the jobs decode while they generate); `schedule` (stream mode, first push,
        largest push) defaults to `self.options`'."""
        mode = stage1_mode(self.threads, self.placement, stream)
        return SpeechWorker(self, rows, stage1=mode, schedule=schedule,
                            stage1_batch=stage1_batch or STAGE1_BATCH, meter=meter,
                            log=log or self.log)

    def describe(self, o: SynthesisOptions) -> dict:
        """Checkpoints, placement, engine and effective samplers (provenance of every output)."""
        text, audio = o.samplers()
        return {"model": self.lm_ref.describe() if self.lm_ref else None,
                "tokenizer": self.tok_ref.describe() if self.tok_ref else None,
                "placement": self.placement.describe() if self.placement else None,
                "engine": self.engine_record(),
                "effective_sampler": {"text": asdict(text), "audio": asdict(audio)}}


def _kernel_words(described: dict) -> str:
    """Whether the decode steps run in the fused CPU kernel, and why (not): the load log."""
    return (("on, " if described["cpu_kernel"] else "off, ") + described["cpu_kernel_reason"]
            + "; prefill: " + described["prefill_products"])


def _same_file(path: str, sha256: str | None) -> bool:
    try:
        return sha256 is not None and file_sha256(path) == sha256
    except OSError:
        return False
