"""Stage-1 as the library runs it: the audio tokenizer with its thread budget, out-of-memory
advice and voice-prompt cache."""

from __future__ import annotations

import numbers
import time
import weakref
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from mimo_tts.errors import CheckpointError, InputError, NoAudioError, OptionTypeError, UsageError
from mimo_tts.lm.config import AUDIO_CHANNELS
from mimo_tts.runtime.devices import torch_dtype
from mimo_tts.runtime.guards import oom_advice, thread_budget
from mimo_tts.synthesis.audio import (
    MAX_PAUSE_FRAMES,
    PAUSE_FRAMES,
    SAMPLE_RATE,
    PromptAudio,
    check_audio,
    join_pieces,
    read_audio,
)
from mimo_tts.synthesis.loader import check_fits, resolve_tokenizer
from mimo_tts.synthesis.markup import default_pauses
from mimo_tts.synthesis.pieces import Piece


@contextmanager
def _naming(path):
    """A checkpoint error always names the directory at fault."""
    try:
        yield
    except CheckpointError as exc:
        if str(path) in str(exc):
            raise
        raise CheckpointError(f"{exc} (in {path})") from None


def codes_tensor(codes, where: str = "codes") -> torch.Tensor:
    """Codes to decode, checked as `mimo-tts decode` checks a codes file: an integer
    [8, T] tensor (a numpy array is taken as one) with T >= 1 -> int64 [8, T]; a dtype or
    shape that is not codes is an InputError naming `where` (a code out of its codebook's
    range is the codec's AudioCheckError, when decoding)."""
    import numpy as np

    if isinstance(codes, np.ndarray):
        if not np.issubdtype(codes.dtype, np.integer):
            raise InputError(f"{where} holds {codes.dtype} values; codes are integers")
        codes = torch.from_numpy(codes)
    if not isinstance(codes, torch.Tensor):
        raise OptionTypeError(f"{where} must be a torch.Tensor (or a numpy array) of codes, "
                              f"not {type(codes).__name__}")
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise InputError(f"{where} holds {codes.dtype} values; codes are integers")
    if codes.dim() != 2 or codes.shape[0] != AUDIO_CHANNELS or codes.shape[1] < 1:
        raise InputError(f"{where} has shape {list(codes.shape)}; codes are "
                         f"[{AUDIO_CHANNELS}, T] with T >= 1")
    return codes.long()


def check_pause(pause_frames) -> int:
    """Frames of silence between decoded pieces: an integer in [0, MAX_PAUSE_FRAMES]."""
    if isinstance(pause_frames, bool) or not isinstance(pause_frames, numbers.Integral):
        raise OptionTypeError(f"pause_frames must be an integer, not "
                              f"{type(pause_frames).__name__}")
    if not 0 <= pause_frames <= MAX_PAUSE_FRAMES:
        raise UsageError(f"pause_frames must be in [0, {MAX_PAUSE_FRAMES}], got {pause_frames}")
    return int(pause_frames)


def check_pairing(lm_cfg, codec_cfg, lm_path, tok_path) -> None:
    """The LM's codes must index the tokenizer's codebooks (empty id = codebook size)."""
    empty = list(lm_cfg.speech_empty_ids)
    sizes = list(codec_cfg.codebook_size)[: len(empty)]
    if len(sizes) < len(empty) or any(e > s for e, s in zip(empty, sizes, strict=False)):
        raise CheckpointError(
            f"the LM {lm_path} emits codes for codebooks of {empty}, but the audio tokenizer "
            f"{tok_path} has codebooks of {sizes}: they are not a matching pair")


class Stage1:
    """The audio tokenizer with its safeguards: voice-prompt encode (once per file), decode."""

    def __init__(self, codec, threads: int | None = None):
        self.codec, self.threads = codec, threads
        self.gemm = None  # how float32 linears run (`codec.gemm.choose`) where that was decided
        self.attention = None  # the fused attention's choice (`codec.layers.prepack`), on the CPU
        self.samples_per_frame = codec.samples_per_frame
        if codec.config.sampling_rate != SAMPLE_RATE:  # the one rule: every face uses the constant
            raise CheckpointError(f"the audio tokenizer speaks {codec.config.sampling_rate} Hz; "
                                  f"mimo-tts runs MiMo-Audio's {SAMPLE_RATE} Hz tokenizer")
        self.sample_rate = SAMPLE_RATE
        self._prompt_codes: dict[str, torch.Tensor] = {}
        # A prompt in memory: its codes live as long as the PromptAudio (one per options).
        self._memory_codes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def from_settings(cls, settings, ref=None, log=None, env=None, lengths=None) -> Stage1:
        """The audio tokenizer alone (`mimo-tts decode`, the Ray decode actors), through the
        loader's checks: its directory (the tiny preset written on first use), the memory
        preflight of Stage-1 (`NotEnoughMemoryError`, exit 4) and its thread budget."""
        log = log or (lambda message: None)
        ref = ref or resolve_tokenizer(settings, env)
        check_fits(settings, (None, ref), lengths, env, log)
        return cls.load(ref.path, settings.placement, log, settings.engine.tokenizer_threads)

    @classmethod
    def load(cls, tok_path: Path, placement, log, threads: int | None = None,
             beside: int = 0) -> Stage1:
        """`beside`: bytes of LM weights on the CPU (the packing's memory rule, `gemm.choose`)."""
        from mimo_tts.codec import load_audio_tokenizer
        from mimo_tts.codec.layers import schedule_words

        device, dtype = placement.tokenizer_device.value, placement.tokenizer_dtype.value
        choice = None
        if str(device) == "cpu" and torch_dtype(str(dtype)) == torch.float32:
            from mimo_tts.codec.gemm import choose
            from mimo_tts.synthesis.preflight import weights_bytes

            choice = choose(beside, weights_bytes(tok_path, "float32") if beside else 0,
                            placement.codec_kernel.value)
        with _naming(tok_path), oom_advice("audio tokenizer loading", device):
            codec = load_audio_tokenizer(tok_path, device, dtype,
                                         cuda_graph=bool(placement.cuda_graph.value),
                                         packing=choice,
                                         codec_kernel=placement.codec_kernel.value)
        log(f"audio tokenizer loaded from {tok_path}")
        if choice is not None:
            log(f"tokenizer float32 linears: {choice.words}"
                f"{f' ({schedule_words(choice)})' if choice.active else ''}, {choice.reason}")
        stage1 = cls(codec, threads)
        stage1.gemm = choice
        stage1.attention = getattr(codec.model, "attention_choice", None)  # CPU layers only
        if stage1.attention is not None:
            log(f"tokenizer attention: {'fused kernel' if stage1.attention.active else 'PyTorch'}"
                f", {stage1.attention.reason}")
        return stage1

    def pack_decoder(self) -> float | None:
        """The tokenizer's float32 decoder packed now, where loading left it for later (a
        server: no stream waits for it later; `AudioTokenizer.pack_decoder`). -> the seconds
        it took, or None where nothing was left to pack."""
        start = time.perf_counter()
        with thread_budget(self.threads):
            packed = self.codec.pack_decoder()
        return time.perf_counter() - start if packed else None

    def prompt_codes(self, prompt: str | PromptAudio) -> torch.Tensor:
        """Voice-prompt codes [K, T] (encoded on the tokenizer device once per file or
        `PromptAudio`); the prompt builder cuts them to the LM's channels and pads them
        (`lm.prompts`)."""
        cache = self._memory_codes if isinstance(prompt, PromptAudio) else self._prompt_codes
        if prompt not in cache:
            if isinstance(prompt, PromptAudio):
                audio, rate = torch.tensor(prompt.samples), prompt.sample_rate  # [S] or [C, S]
            else:
                audio, rate = read_audio(prompt)
            with thread_budget(self.threads), \
                    oom_advice("prompt-audio encode", str(self.codec.device)):
                cache[prompt] = self.codec.encode_prompt(audio, rate).cpu()
        return cache[prompt]

    def decode(self, codes_list: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """[8, T] codes -> [960 T] float32 audio each, decoded together."""
        with thread_budget(self.threads), oom_advice("Stage-1 decode", str(self.codec.device)):
            return self.codec.decode_batch(list(codes_list))

    def finish(self, pieces: list[Piece], label: str, pauses=None) -> torch.Tensor:
        """The pieces' audio joined and checked [S] (24 kHz); no audio tokens is an error.
        `pauses`: samples of silence before each piece and after the last (None: plain
        text's, `PAUSE_FRAMES` between pieces)."""
        missing = [i for i, p in enumerate(pieces) if p.codes is None]
        if missing:
            where = f" (text piece {missing[0] + 1} of {len(pieces)})" if len(pieces) > 1 else ""
            raise NoAudioError(f"item {label!r}: the LM generated no audio tokens in "
                               f"{len(pieces[missing[0]].new_text_ids)} group(s){where}")
        audios = [p.audio for p in pieces]
        if pauses is None:
            pauses = default_pauses(len(pieces), PAUSE_FRAMES * self.samples_per_frame)
        return self.join([p.codes for p in pieces], pauses, label,
                         None if any(a is None for a in audios) else audios)

    def frame_pauses(self, count: int, pause_frames: int) -> tuple[int, ...]:
        """The pauses of `count` pieces `pause_frames` frames apart (a codes file's
        `pause_frames`), in samples."""
        return default_pauses(count, pause_frames * self.samples_per_frame)

    def join(self, codes_list: Sequence[torch.Tensor], pauses, label: str,
             audios: Sequence | None = None) -> torch.Tensor:
        """Pieces' audio (decoded here unless given) joined by pauses (samples before each
        piece and after the last) and checked: [S] float32."""
        audios = self.decode(codes_list) if audios is None else audios
        with oom_advice("joining and checking the audio", "cpu"):  # on the CPU, [S] float32
            audio = join_pieces(list(audios), pauses)
            check_audio(audio, label)
        return audio
