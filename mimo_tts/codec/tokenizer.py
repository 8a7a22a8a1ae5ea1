"""`AudioTokenizer`: the public codec object (encode audio to codes, decode codes to audio).

Every input is moved to the tokenizer's device inside these methods, so callers never need to
know where the tokenizer lives (spec §8 item 3). Decode follows the official path (spec §7.1):
independent 1500-frame chunks, quantizer in float32, exactly 960 samples per frame.
Shapes: K codebooks, T code frames, C channels, S samples, M mel frames, d model width.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import threading

import torch
from torch import Tensor

from mimo_tts.codec.config import BATCH_FRAMES, DECODE_CHUNK_FRAMES, CodecConfig
from mimo_tts.codec.decoder import pad_hidden
from mimo_tts.codec.layers import pack_pending
from mimo_tts.codec.mel import LogMel, prepare_audio
from mimo_tts.errors import AudioCheckError, InputError


def device_scope(device: torch.device) -> contextlib.AbstractContextManager:
    """`device` as the default device inside: factory calls without an explicit device (ours
    or a library's, e.g. torchaudio's resampling kernel) land on it even inside a caller's
    `torch.device("meta")`. Where the default device already is `device` (a CPU tokenizer, as
    a rule) no device context is entered: it would send every torch call inside through a
    Python hook (about 13,500 calls a decode, a few microseconds each) to land where it lands
    anyway."""
    return contextlib.nullcontext() if torch.get_default_device() == device else device


def _on_device(method):
    """Run under inference mode with the tokenizer device as default device (`device_scope`)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with torch.inference_mode(), device_scope(self.device):
            return method(self, *args, **kwargs)

    return wrapper


class AudioTokenizer:
    """A loaded MiMo-Audio tokenizer on one device (build it with `load_audio_tokenizer`)."""

    def __init__(self, model, device: torch.device, dtype: torch.dtype, cuda_graph: bool = False):
        self.model = model
        self.config: CodecConfig = model.config
        self.device = torch.device(device)
        self.dtype = dtype
        self._mel = LogMel(self.config)
        self._graphs = None
        self._graph_lock = threading.Lock()
        self.cuda_graph = cuda_graph

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    @property
    def cuda_graph(self) -> bool:
        """Whether single-sequence decode replays CUDA graphs (always False off CUDA)."""
        return self._cuda_graph

    @cuda_graph.setter
    def cuda_graph(self, wanted: bool) -> None:
        self._cuda_graph = bool(wanted) and self.device.type == "cuda"

    # ---- decode -------------------------------------------------------------------------
    def check_codes(self, codes: Tensor) -> Tensor:
        """Validate codes [K, T] (1 <= K <= num_quantizers, integer, in range); int64 on device."""
        if not isinstance(codes, Tensor):
            raise InputError(f"codes must be a torch.Tensor, got {type(codes).__name__}")
        if codes.dtype == torch.bool or codes.is_floating_point() or codes.is_complex():
            raise InputError(f"codes must have an integer dtype, got {codes.dtype}")
        n_q = self.config.num_quantizers
        if codes.dim() != 2 or not 1 <= codes.shape[0] <= n_q:
            raise InputError(f"codes must be [K, T] with 1 <= K <= {n_q}, got {tuple(codes.shape)}")
        codes = codes.to(self.device, torch.long)
        if codes.numel():
            sizes = torch.tensor(self.config.codebook_size[: codes.shape[0]], device=self.device)
            bad = (codes < 0) | (codes >= sizes[:, None])
            if bool(bad.any()):
                row, col = (int(i) for i in bad.nonzero()[0])
                raise AudioCheckError(
                    f"code {int(codes[row, col])} at codebook {row}, frame {col} is out of range "
                    f"[0, {self.config.codebook_size[row]})"
                )
        return codes

    @_on_device
    def dequantize(self, codes: Tensor) -> Tensor:
        """codes [K, T] -> latent [T, d_model] float32: the sum of the K codebooks' rows."""
        codes = self.check_codes(codes)
        if codes.shape[1] == 0:
            return torch.zeros(0, self.config.d_model, device=self.device)
        return self.model.encoder.quantizer.decode(codes)

    @_on_device
    def decode_hidden(self, hidden: Tensor) -> Tensor:
        """One latent sequence [T, d_model] -> waveform [960*T] float32, decoded in one piece."""
        hidden = hidden.to(self.device)
        if hidden.shape[0] == 0:
            return torch.zeros(0, device=self.device)
        graphs = self._graph_decoder()
        if graphs is not None and graphs.supports(hidden.shape[0]):
            return graphs(hidden)
        return self.model.decoder(hidden[None])[0]

    def pack_decoder(self) -> bool:
        """Pack the decoder's float32 layers now where loading left them for later
        (`layers.pack_schedule`): for a process that will decode a lot (a server), so that no
        call later waits for the packing. -> whether anything was left to pack."""
        return pack_pending(self.model.decoder)

    @_on_device
    def decode(self, codes: Tensor) -> Tensor:
        """codes [K, T] -> waveform [960*T] float32 on `.device` (independent 1500-frame chunks)."""
        hidden = self.dequantize(codes)
        pieces = [
            self.decode_hidden(hidden[start:start + DECODE_CHUNK_FRAMES])
            for start in range(0, hidden.shape[0], DECODE_CHUNK_FRAMES)
        ]
        return torch.cat(pieces) if pieces else torch.zeros(0, device=self.device)

    @_on_device
    def decode_batch(self, batch: list[Tensor]) -> list[Tensor]:
        """Decode several [K, T_i] code tensors; each result equals `decode` of that item alone."""
        if len(batch) == 1:
            return [self.decode(batch[0])]
        chunks: list[tuple[int, Tensor]] = []  # (item index, latent chunk [t, d])
        for index, codes in enumerate(batch):
            hidden = self.dequantize(codes)
            for start in range(0, hidden.shape[0], DECODE_CHUNK_FRAMES):
                chunks.append((index, hidden[start:start + DECODE_CHUNK_FRAMES]))
        waves = self._decode_padded([chunk for _, chunk in chunks])
        out: list[list[Tensor]] = [[] for _ in batch]
        for (index, _), wave in zip(chunks, waves, strict=True):
            out[index].append(wave)
        return [torch.cat(parts) if parts else torch.zeros(0, device=self.device) for parts in out]

    def _decode_padded(self, items: list[Tensor]) -> list[Tensor]:
        """Decode latents [T_i, d] in right-padded batches of similar length."""
        order = sorted(range(len(items)), key=lambda i: items[i].shape[0])
        waves: list[Tensor | None] = [None] * len(items)
        group: list[int] = []
        for index in [*order, None]:
            full = index is None or (len(group) + 1) * items[index].shape[0] > BATCH_FRAMES
            if group and full:
                lengths = torch.tensor([items[i].shape[0] for i in group], device=self.device)
                wave = self.model.decoder(pad_hidden([items[i] for i in group]), lengths)
                for row, i in enumerate(group):
                    waves[i] = wave[row, : items[i].shape[0] * self.samples_per_frame]
                group = []
            if index is not None:
                group.append(index)
        return waves

    def _graph_decoder(self):
        if not self._cuda_graph:
            return None
        with self._graph_lock:
            if self._graphs is None:
                from mimo_tts.codec.cudagraph import GraphDecoder

                self._graphs = GraphDecoder(self.model.decoder, self.device)
            return self._graphs

    # ---- encode -------------------------------------------------------------------------
    def _check_audio(self, audio: Tensor, sample_rate: int) -> Tensor:
        if not isinstance(audio, Tensor):
            audio = torch.as_tensor(audio)
        if not audio.is_floating_point():
            raise InputError(f"audio must be floating point samples in [-1, 1], got {audio.dtype}")
        if audio.dim() not in (1, 2) or audio.shape[-1] == 0:
            raise InputError(f"audio must be [samples] or [channels, samples], got "
                             f"{tuple(audio.shape)}")
        if audio.dim() == 2 and audio.shape[0] > audio.shape[1]:
            raise InputError(f"audio of shape {tuple(audio.shape)} looks like [samples, channels]; "
                             "pass channels first")
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, numbers.Integral) \
                or sample_rate <= 0:
            raise InputError(f"sample_rate must be a positive integer, got {sample_rate!r}")
        audio = audio.to(self.device, torch.float32)
        if not bool(torch.isfinite(audio).all()):
            raise InputError("audio contains NaN or infinite samples")
        return audio

    @_on_device
    def log_mel(self, audio_24k: Tensor) -> Tensor:
        """Mono audio [S] at the codec rate -> log-magnitude mel [M, n_mels] float32 (spec §3.1)."""
        audio = self._check_audio(audio_24k, self.config.sampling_rate)
        if audio.dim() != 1:
            raise InputError(f"log_mel takes mono audio [samples], got {tuple(audio.shape)}")
        return self._mel(audio)

    @_on_device
    def encode(self, audio: Tensor, sample_rate: int) -> Tensor:
        """Audio [S] or [C, S] at `sample_rate` -> codes [num_quantizers, T] int64 on `.device`."""
        audio = self._check_audio(audio, sample_rate)
        mono = prepare_audio(audio, int(sample_rate), self.config.sampling_rate)
        return self.model.encoder.encode(self._mel(mono))

    @_on_device
    def encode_prompt(self, audio: Tensor, sample_rate: int) -> Tensor:
        """A voice prompt's codes [num_quantizers, T] (`encode`), as the codec gives them: the
        LM's prompt builder takes its channels and pads them to whole groups (`lm.prompts`).

        A prompt shorter than one code frame (40 ms) has no code to give: InputError (exit 9).
        """
        samples = audio.shape[-1]
        if samples * self.config.sampling_rate < self.samples_per_frame * sample_rate:
            need = 1000 * self.samples_per_frame / self.config.sampling_rate
            raise InputError(f"prompt audio is {1000 * samples / sample_rate:.1f} ms long "
                             f"({samples} samples at {sample_rate} Hz); a voice prompt needs "
                             f"at least {need:.0f} ms")
        return self.encode(audio, sample_rate)
