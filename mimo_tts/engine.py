"""The loaded models and the glue between Stage-0 and Stage-1, with per-stage safeguards.

`Engine` holds the LM, its text tokenizer and the audio tokenizer (prompt building, sampler
settings, batched generation + extraction, Stage-1 decode). Each stage runs under its own CPU
thread budget (`thread_budget`) and turns an allocation failure into a `DeviceError` with
advice (`oom_advice`). `check_pairing` refuses an LM and a tokenizer whose codebooks differ.

Stage-0 runs on the native LM (`mimo_tts.lm`) or, with `--engine vllm`, on a `VLLMEngine`
(`mimo_tts.lm.vllm`, imported only then). vLLM missing or unimportable is a UsageError (exit 2)
naming the install command; Stage-1 stays on the tokenizer device either way.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mimo_tts import io as mio
from mimo_tts.errors import CheckpointError, DeviceError, InputError, UsageError


@dataclass
class Piece:
    """One generated text piece: its prompt record, generated ids, codes and audio."""

    prompt: object  # mimo_tts.tasks.Prompt
    seed: int
    new_text_ids: list[int]
    text: str
    codes: object | None  # [8, T] int64, None when no audio was generated
    audio: object | None = None  # [960 T] float32 once decoded
    note: str | None = None
    timings: dict = field(default_factory=dict)  # prefill_s; streaming: per-stage seconds


# Messages of allocation failures: CUDA ("CUDA out of memory"), the CPU allocator ("can't
# allocate memory", "not enough memory"), MPS ("MPS backend out of memory").
_OOM_MARKS = ("out of memory", "can't allocate memory", "not enough memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether an exception from torch is an allocation failure on some device."""
    torch = sys.modules.get("torch")
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if isinstance(exc, MemoryError) or (oom_type is not None and isinstance(exc, oom_type)):
        return True
    return isinstance(exc, RuntimeError) and any(mark in str(exc).lower() for mark in _OOM_MARKS)


@contextmanager
def oom_advice(stage: str, device: str):
    """Turn an out-of-memory error into a DeviceError (exit 4) with what to try instead."""
    try:
        yield
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(exc):
            raise
        _release_cached_memory(device)
        raise DeviceError(f"out of memory on {device} during {stage}; try --tokenizer-device "
                          "cpu, a smaller --batch-size or a smaller --max-chars") from None


def _release_cached_memory(device: str) -> None:
    """Give a CUDA allocator's cached blocks back, so the next item starts from a clean slate."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


@contextmanager
def thread_budget(threads: int | None):
    """Run the block with `threads` torch intra-op CPU threads in the calling thread only.

    On this torch build (OpenMP + MKL) `torch.set_num_threads` is per thread (the OpenMP ICV and
    MKL's local setting), with one catch: a thread's first parallel op lazily re-applies the
    process-wide value last set by *any* thread. `get_num_threads()` forces that lazy
    initialisation first, so the budget set next is the one this thread keeps.
    """
    if not threads:
        yield
        return
    import torch

    before = torch.get_num_threads()  # also initialises this thread's pool state
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _naming(path):
    """A checkpoint error always names the directory at fault."""
    try:
        yield
    except CheckpointError as exc:
        if str(path) in str(exc):
            raise
        raise CheckpointError(f"{exc} (in {path})") from None


def check_pairing(lm_cfg, codec_cfg, lm_path, tok_path) -> None:
    """The LM's codes must index the tokenizer's codebooks (empty id = codebook size)."""
    empty = list(lm_cfg.speech_empty_ids)
    sizes = list(codec_cfg.codebook_size)[: len(empty)]
    if len(sizes) < len(empty) or any(e > s for e, s in zip(empty, sizes, strict=False)):
        raise CheckpointError(
            f"the LM {lm_path} emits codes for codebooks of {empty}, but the audio tokenizer "
            f"{tok_path} has codebooks of {sizes}: they are not a matching pair")


VLLM_INSTALL = "pip install 'mimo-tts[vllm]' (CPU: scripts/setup_vllm_venv.sh)"
CPU_KV_CACHE_MIB = 64  # vLLM on CPU: a small KV cache starts in seconds (default: most of RAM)


def import_vllm_engine():
    """The vLLM engine module; vLLM missing or broken is one UsageError line (exit 2)."""
    try:  # the engine module first: it sets vLLM's env defaults (logs to stderr) before import
        from mimo_tts.lm.vllm import engine

        importlib.import_module("vllm")  # the engine module imports it only when starting
    except ImportError as exc:
        if getattr(exc, "name", None) == "vllm":
            raise UsageError(f"--engine vllm needs vLLM, which is not installed: "
                             f"{VLLM_INSTALL}") from None
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"--engine vllm: vLLM fails to import ({first}); reinstall it: "
                         f"{VLLM_INSTALL}") from None
    return engine


def vllm_options(o, placement) -> dict:
    """VLLMOptions keywords from the run options and placement (CPU: small KV cache)."""
    device = placement.lm_device.value
    if device == "mps":
        raise UsageError("--engine vllm runs on CUDA or CPU, not mps; use --engine native")
    if device.startswith("cuda:") and device != "cuda:0":
        raise UsageError(f"--engine vllm places Stage-0 itself: pick its GPU with "
                         f"CUDA_VISIBLE_DEVICES instead of --lm-device {device}")
    kv_mib = o.kv_cache_mib if o.kv_cache_mib is not None else (
        CPU_KV_CACHE_MIB if device == "cpu" else None)
    given = {name: getattr(o, name) for name in ("gpu_memory_utilization", "max_num_seqs",
                                                 "tensor_parallel_size", "max_model_len")}
    return {"dtype": placement.lm_dtype.value, "in_process": True,
            "kv_cache_memory_bytes": None if kv_mib is None else kv_mib << 20,
            **{k: v for k, v in given.items() if v is not None}}


def _kernel_words(lm) -> str:
    """Whether the LM's decode steps run in the fused CPU kernel, and why (not)."""
    from mimo_tts.lm.cpu_kernel import choose

    choice = choose(lm)
    return ("on, " if choice.active else "off, ") + choice.reason


class Engine:
    """The loaded LM (native, or a `VLLMEngine` as `stage0`), text tokenizer and audio
    tokenizer, with the glue between them."""

    def __init__(self, lm, text, codec, stage0=None, lm_device: str | None = None):
        self.lm, self.text, self.codec, self.stage0 = lm, text, codec, stage0
        cfg = lm.cfg if stage0 is None else stage0.cfg
        self.empty_ids = list(cfg.speech_empty_ids)
        self.group_size = cfg.group_size
        self.samples_per_frame = codec.samples_per_frame
        self.lm_device = lm_device or str(lm.lm_head.weight.device)
        self._prompt_codes: dict[str, object] = {}
        self.lm_threads: int | None = None  # CPU threads per stage (None: torch's default)
        self.tokenizer_threads: int | None = None

    @classmethod
    def load(cls, lm_path: Path, tok_path: Path, placement, log,
             vllm: dict | None = None, quant: str | None = None) -> Engine:
        """Load both stages; `vllm` (VLLMOptions keywords) runs Stage-0 on vLLM instead;
        `quant`: the LM's opt-in weight quantization (load_lm)."""
        from mimo_tts.lm.load import load_lm
        from mimo_tts.lm.text import TextTokenizer

        module = import_vllm_engine() if vllm is not None else None  # fail before loading
        text = TextTokenizer.from_dir(lm_path)
        lm = stage0 = None
        with _naming(lm_path), oom_advice("LM loading", placement.lm_device.value):
            if module is None:
                lm = load_lm(lm_path, placement.lm_device.value, placement.lm_dtype.value,
                             quant=quant)
            else:
                stage0 = module.VLLMEngine(lm_path, module.VLLMOptions(**vllm))
        log(f"LM loaded from {lm_path}" + ("" if stage0 is None else f" into vLLM {vllm}")
            + ("" if lm is None or lm.quant is None else f" ({lm.quant} weights)")
            + ("" if lm is None else f" (CPU kernel: {_kernel_words(lm)})"))
        try:
            codec = cls._load_codec(tok_path, placement, log)
            check_pairing((lm or stage0).cfg, codec.config, lm_path, tok_path)
        except BaseException:
            if stage0 is not None:
                stage0.close()
            raise
        return cls(lm, text, codec, stage0, placement.lm_device.value)

    @staticmethod
    def _load_codec(tok_path: Path, placement, log):
        from mimo_tts.codec import load_audio_tokenizer

        with _naming(tok_path), \
                oom_advice("audio tokenizer loading", placement.tokenizer_device.value):
            codec = load_audio_tokenizer(tok_path, placement.tokenizer_device.value,
                                         placement.tokenizer_dtype.value,
                                         cuda_graph=bool(placement.cuda_graph.value))
        log(f"audio tokenizer loaded from {tok_path}")
        return codec

    def close(self) -> None:
        """Shut the vLLM engine down (frees its memory); the native LM needs nothing."""
        stage0, self.stage0 = self.stage0, None
        if stage0 is not None:
            stage0.close()

    def prompt(self, task, text, instruct, prompt_audio, template, seed):
        """The task prompt (mimo_tts.tasks.Prompt); a voice prompt is encoded on first use."""
        from mimo_tts.tasks import TASKS, build_prompt

        if task not in TASKS:
            raise UsageError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
        if prompt_audio and TASKS[task].prompt_audio == "none":  # refuse before reading it
            raise InputError(f"task {task} takes no prompt audio; use tts_sft_with_audio")
        codes = self.prompt_codes(prompt_audio) if prompt_audio else None
        return build_prompt(task, text, self.text, self.empty_ids, instruct=instruct,
                            prompt_codes=codes, template=template, seed=seed)

    def prompt_codes(self, path: str):
        """Voice-prompt codes [8, T'] (encoded on the tokenizer device once per file)."""
        if path not in self._prompt_codes:
            audio, rate = mio.read_audio(path)
            with thread_budget(self.tokenizer_threads), \
                    oom_advice("prompt-audio encode", str(self.codec.device)):
                self._prompt_codes[path] = self.codec.encode_prompt(audio, rate).cpu()
        return self._prompt_codes[path]

    def samplers(self, o):
        """(text, audio) SamplerConfig: the task's official defaults with option overrides."""
        from mimo_tts.lm.sampling import SamplerConfig, task_samplers
        from mimo_tts.tasks import TASKS

        text, audio = task_samplers(TASKS[o.task].sampler if o.task in TASKS else "tts")

        def pick(base, temperature, top_k, top_p):
            return SamplerConfig(base.temperature if temperature is None else temperature,
                                 base.top_k if top_k is None else (top_k or None),
                                 base.top_p if top_p is None else top_p)

        return (pick(text, o.temperature, o.top_k, o.top_p),
                pick(audio, o.audio_temperature, o.audio_top_k, o.audio_top_p))

    def sampler_record(self, o) -> dict:
        text, audio = self.samplers(o)
        return {"text": asdict(text), "audio": asdict(audio)}

    def generation_options(self, o, seed: int):
        """GenerationOptions for a run: samplers, seed, group cap and the task's stop set."""
        from mimo_tts.lm.config import MAX_GROUPS
        from mimo_tts.lm.generate import GenerationOptions
        from mimo_tts.tasks import TASKS

        text, audio = self.samplers(o)
        stops = TASKS[o.task].stop_tokens if o.task in TASKS else ("eos", "eostm", "im_end")
        return GenerationOptions(text_sampler=text, audio_sampler=audio, seed=seed,
                                 max_new_groups=o.max_new_groups or MAX_GROUPS,
                                 stop_tokens=stops)

    def generate_pieces(self, prompts, options, seed: int, batch_size: int) -> list[Piece]:
        """Stage-0 for prompts, `batch_size` at a time, then extraction (spec §4.8).

        vLLM takes all prompts at once: it batches up to its max_num_seqs itself."""
        from mimo_tts.lm.extract import extract

        pieces = []
        step = batch_size if self.stage0 is None else max(len(prompts), 1)
        for start in range(0, len(prompts), step):
            batch = prompts[start:start + step]
            with thread_budget(self.lm_threads), \
                    oom_advice("Stage-0 generation", self.lm_device):
                outs = self._generate([p.input_ids for p in batch], options)
            for prompt, out in zip(batch, outs, strict=True):
                found = extract(out.new_ids, self.text, self.empty_ids, self.group_size)
                timings = {} if out.prefill_s is None else {"prefill_s": out.prefill_s}
                pieces.append(Piece(prompt, seed, list(found.text_tokens), found.text,
                                    found.codes, timings=timings))
        return pieces

    def _generate(self, ids: list, options) -> list:
        if self.stage0 is not None:
            return self.stage0.generate(ids, options)
        from mimo_tts.lm.generate import generate

        return generate(self.lm, ids, options, self.text.special)

    def stream_steps(self, ids: list, options) -> Iterator:
        """Stage-0 StepOutputs as produced (vLLM: an audio group arrives one step late)."""
        if self.stage0 is not None:
            return self.stage0.stream(ids, options)
        from mimo_tts.lm.generate import stream

        return stream(self.lm, ids, options, self.text.special)

    def decode(self, codes_list: list) -> list:
        """Stage-1 on the tokenizer device: [8, T] codes -> [960 T] float32 audio each."""
        with thread_budget(self.tokenizer_threads), \
                oom_advice("Stage-1 decode", str(self.codec.device)):
            return self.codec.decode_batch(list(codes_list))
