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

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from mimo_tts import __version__
from mimo_tts.errors import InputError, UsageError
from mimo_tts.lm.tasks import TASKS
from mimo_tts.lm.vllm.launch import import_vllm_engine, vllm_options
from mimo_tts.runtime import checkpoints
from mimo_tts.runtime.guards import oom_advice, thread_budget
from mimo_tts.synthesis.audio import PAUSE_FRAMES, SAMPLE_RATE, to_numpy
from mimo_tts.synthesis.options import EngineOptions, SynthesisOptions, resolve
from mimo_tts.synthesis.pieces import Piece
from mimo_tts.synthesis.stage1 import Stage1, _naming, check_pairing
from mimo_tts.synthesis.streaming import stream_chunks, stream_piece
from mimo_tts.synthesis.text import split_text


@dataclass(frozen=True)
class Audio:
    """Synthesised speech, in memory."""

    samples: np.ndarray  # [S] float32 in [-1, 1]
    sample_rate: int  # 24000
    provenance: dict  # checkpoints, placement, task, seed, samplers, pieces

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate


@dataclass(frozen=True)
class AudioChunk:
    """A part of streamed speech, as soon as Stage-1 decoded it."""

    samples: np.ndarray  # [S_i] float32
    sample_rate: int  # 24000
    index: int  # 0, 1, ... within one `stream` call


def load(model: str = checkpoints.TINY, tokenizer: str | None = None, *,
         lm_device: str | None = None, tokenizer_device: str | None = None,
         dtype: str | None = None, tokenizer_dtype: str | None = None,
         cuda_graph: bool | None = None, allow_download: bool = False, engine: str = "native",
         log=None, **engine_options) -> MiMoTTS:
    """Load both stages: `model` is `tiny`, a checkpoint directory or a Hugging Face id.

    Devices and dtypes default as on the CLI (environment variables included); extra keywords
    are `EngineOptions` fields (`lm_threads`, vLLM settings).
    """
    settings = resolve({"model": model, "tokenizer": tokenizer, "lm_device": lm_device,
                        "tokenizer_device": tokenizer_device, "dtype": dtype,
                        "tokenizer_dtype": tokenizer_dtype, "cuda_graph": cuda_graph,
                        "allow_download": allow_download, "engine": engine, **engine_options})
    lm_ref, tok_ref = checkpoints.resolve_names(settings.checkpoints)
    return MiMoTTS.load(lm_ref, tok_ref, settings.placement, settings.engine, log)








def _kernel_words(lm) -> str:
    """Whether the LM's decode steps run in the fused CPU kernel, and why (not)."""
    from mimo_tts.lm.cpu_kernel import choose

    choice = choose(lm)
    return ("on, " if choice.active else "off, ") + choice.reason


class MiMoTTS:
    """Both stages, loaded once: text -> `Audio` (numpy, 24 kHz), in memory only."""

    def __init__(self, lm, text, stage1: Stage1, stage0=None, lm_device: str | None = None,
                 refs=(None, None), placement=None, lm_threads: int | None = None):
        self.lm, self.text, self.stage1, self.stage0 = lm, text, stage1, stage0
        self.codec = stage1.codec
        cfg = lm.cfg if stage0 is None else stage0.cfg
        self.empty_ids = list(cfg.speech_empty_ids)
        self.group_size = cfg.group_size
        self.lm_device = lm_device or str(lm.lm_head.weight.device)
        self.lm_ref, self.tok_ref = refs
        self.placement = placement
        self.lm_threads, self.tokenizer_threads = lm_threads, stage1.threads
        self.options = SynthesisOptions()  # defaults of `synthesize` and `stream`

    @classmethod
    def load(cls, lm_ref, tok_ref, placement, engine: EngineOptions | None = None, log=None,
             threads: dict | None = None) -> MiMoTTS:
        """Load both stages; `engine.engine == "vllm"` runs Stage-0 on vLLM."""
        from mimo_tts.lm.load import load_lm
        from mimo_tts.lm.text import TextTokenizer

        engine, log, threads = engine or EngineOptions(), log or (lambda m: None), threads or {}
        vllm = vllm_options(engine, placement) if engine.engine == "vllm" else None
        module = import_vllm_engine() if vllm is not None else None  # fail before loading
        text = TextTokenizer.from_dir(lm_ref.path)
        lm = stage0 = None
        with _naming(lm_ref.path), oom_advice("LM loading", placement.lm_device.value):
            if module is None:
                lm = load_lm(lm_ref.path, placement.lm_device.value, placement.lm_dtype.value,
                             quant=engine.lm_quant)
            else:
                stage0 = module.VLLMEngine(lm_ref.path, module.VLLMOptions(**vllm))
        log(f"LM loaded from {lm_ref.path}" + ("" if stage0 is None else f" into vLLM {vllm}")
            + ("" if lm is None or lm.quant is None else f" ({lm.quant} weights)")
            + ("" if lm is None else f" (CPU kernel: {_kernel_words(lm)})"))
        try:
            beside = 0
            if lm is not None and lm.lm_head.weight.device.type == "cpu":
                from mimo_tts.synthesis.preflight import weights_bytes

                beside = weights_bytes(lm_ref.path, placement.lm_dtype.value)
            stage1 = Stage1.load(tok_ref.path, placement, log, threads.get("tokenizer"), beside)
            check_pairing((lm or stage0).cfg, stage1.codec.config, lm_ref.path, tok_ref.path)
        except BaseException:
            if stage0 is not None:
                stage0.close()
            raise
        return cls(lm, text, stage1, stage0, placement.lm_device.value, (lm_ref, tok_ref),
                   placement, threads.get("lm"))

    def close(self) -> None:
        """Shut the vLLM engine down (frees its memory); the native LM needs nothing."""
        stage0, self.stage0 = self.stage0, None
        if stage0 is not None:
            stage0.close()

    def __enter__(self) -> MiMoTTS:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def engine_record(self) -> dict:
        """The Stage-0 engine that ran (bfloat16 sums round differently in the CPU kernel)."""
        if self.lm is None:
            return {"name": "vllm"}
        from mimo_tts.lm.cpu_kernel import choose

        choice = choose(self.lm)
        return {"name": "native", "cpu_kernel": choice.active, "cpu_kernel_reason": choice.reason,
                **({} if self.lm.quant is None else {"lm_quant": self.lm.quant})}

    # -- building blocks (the batch runner uses these too) --
    def prompts(self, text: str, o: SynthesisOptions, seed: int, instruct=None,
                prompt_audio=None) -> list:
        """The task prompts of one text, split into pieces of at most `o.max_chars`."""
        from mimo_tts.lm.prompts import build_prompt

        instruct, prompt_audio = instruct or o.instruct, prompt_audio or o.prompt_audio
        if prompt_audio and TASKS[o.task].prompt_audio == "none":  # refuse before reading it
            raise InputError(f"task {o.task} takes no prompt audio; use tts_sft_with_audio")
        codes = self.stage1.prompt_codes(prompt_audio) if prompt_audio else None
        return [build_prompt(o.task, piece, self.text, self.empty_ids, instruct=instruct,
                             prompt_codes=codes, template=o.template, seed=seed)
                for piece in split_text(text, o.max_chars)]

    def generate(self, prompts: list, options, seed: int, batch_size: int = 1) -> list[Piece]:
        """Stage-0 for prompts, `batch_size` at a time (vLLM: all at once), then extraction."""
        from mimo_tts.lm.generate import generate

        pieces = []
        step = batch_size if self.stage0 is None else max(len(prompts), 1)
        for start in range(0, len(prompts), step):
            batch = prompts[start:start + step]
            ids = [p.input_ids for p in batch]
            with self.stage0_guard():
                outs = (self.stage0.generate(ids, options) if self.stage0 is not None
                        else generate(self.lm, ids, options, self.text.special))
            pieces += [self.piece(p, out, seed) for p, out in zip(batch, outs, strict=True)]
        return pieces

    def piece(self, prompt, generation, seed: int) -> Piece:
        """One prompt's generated groups (a lm.generate.Generation), text and codes extracted."""
        from mimo_tts.lm.extract import extract

        found = extract(generation.new_ids, self.text, self.empty_ids, self.group_size)
        timings = {} if generation.prefill_s is None else {"prefill_s": generation.prefill_s}
        return Piece(prompt, seed, list(found.text_tokens), found.text, found.codes,
                     timings=timings)

    @contextmanager
    def stage0_guard(self):
        """The context Stage-0 work runs in: the LM's thread budget, out-of-memory advice."""
        with thread_budget(self.lm_threads), oom_advice("Stage-0 generation", self.lm_device):
            yield

    def batcher(self, source, rows: int):
        """A continuous batch of `rows` over the native LM, pulling jobs (lm.batching.Job:
        prompt ids, GenerationOptions, key) from `source`; step it under `stage0_guard`."""
        from mimo_tts.lm.batching import ContinuousBatcher

        if self.lm is None:
            raise UsageError("continuous batching runs on the native engine, not vLLM")
        return ContinuousBatcher(self.lm, self.text.special, rows, source)

    def stream_steps(self, ids: list, options) -> Iterator:
        """Stage-0 StepOutputs as produced (vLLM: an audio group arrives one step late)."""
        if self.stage0 is not None:
            return self.stage0.stream(ids, options)
        from mimo_tts.lm.generate import stream

        return stream(self.lm, ids, options, self.text.special)

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
                   prompt_audio: str | None = None, seed: int | None = None,
                   options: SynthesisOptions | None = None, **overrides) -> Audio:
        """Speech for `text` (split on sentence ends past `max_chars`, pieces joined).

        `options` (default `self.options`) holds every sampling and task option; the keywords,
        and any other `SynthesisOptions` field given by name, override it for this call.
        """
        return self.synthesize_batch([text], task=task, instruct=instruct,
                                     prompt_audio=prompt_audio, seed=seed, options=options,
                                     **overrides)[0]

    def synthesize_batch(self, texts: Sequence[str], *, batch_size: int = 1,
                         **given) -> list[Audio]:
        """Speech for several texts with one seed; their prompts run `batch_size` at a time."""
        o = self._options(given)
        prompts = [self.prompts(t, o, o.seed) for t in texts]
        made = self.generate([p for ps in prompts for p in ps], o.generation_options(o.seed),
                             o.seed, batch_size)
        results = []
        for n, ps in enumerate(prompts):
            pieces, made = made[:len(ps)], made[len(ps):]
            results.append(self._audio(self.finish(pieces, f"text {n + 1}"), o, pieces))
        return results

    def stream(self, text: str, **given) -> Iterator[AudioChunk]:
        """Speech for `text` in chunks as Stage-1 decodes them (keywords as `synthesize`)."""
        o = self._options(given)
        chunks = stream_chunks(self, self.prompts(text, o, o.seed), o)
        for index, chunk in enumerate(chunks):
            yield AudioChunk(to_numpy(chunk), SAMPLE_RATE, index)

    def decode(self, codes: torch.Tensor | Sequence[torch.Tensor],
               pause_frames: int = PAUSE_FRAMES) -> Audio:
        """Stage-1 alone: codes [8, T] (or one per text piece) -> `Audio`."""
        pieces = [codes] if isinstance(codes, torch.Tensor) else list(codes)
        audio = self.stage1.join([c.long() for c in pieces], pause_frames, "codes")
        return Audio(to_numpy(audio), SAMPLE_RATE,
                     {"runner": {"name": "mimo-tts", "version": __version__},
                      "tokenizer": self.tok_ref.describe() if self.tok_ref else None})

    def _options(self, given: dict) -> SynthesisOptions:
        o = given.pop("options", None) or self.options
        return replace(o, **{k: v for k, v in given.items() if v is not None})

    def _audio(self, audio: torch.Tensor, o: SynthesisOptions, pieces: list[Piece]) -> Audio:
        record = {"runner": {"name": "mimo-tts", "version": __version__}, **self.describe(o),
                  "task": o.task, "instruct": o.instruct, "prompt_audio": o.prompt_audio,
                  "seed": o.seed, "pieces": [p.record() for p in pieces]}
        return Audio(to_numpy(audio), SAMPLE_RATE, record)

