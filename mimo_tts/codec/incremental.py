"""Incremental streaming decode: every code frame is decoded once, with bounded state.

The official scheme (`streaming.py`, spec §7.2) re-decodes up to 250 frames per call. Here each
stage keeps just the state it needs to continue where it stopped:

- dconv1's GroupNorm and dconv2's GroupNorm (spec §3.5) span the whole sequence, which a stream
  never has. `RunningNorm` normalises frame t with the statistics of frames
  [t - window + 1, max(t, warmup - 1)]: the first `warmup` frames share the statistics of the
  first `warmup` frames, later frames use a trailing window. A stream no longer than `warmup`
  frames therefore gets exactly the one-shot statistics.
- The causal decoder layers keep a KV cache of the last `context` frames (a sliding window; the
  official scheme gives the decoder at most `left_overlap` = 250 frames of history, one-shot
  decode at most its 1500-frame chunk). Keys are stored after RoPE at absolute positions whose
  angles are computed in float64, so precision does not degrade with the stream's length.
- The vocoder's window (40 left, 10 right at 100 Hz) and the ISTFT overlap-add are computed
  exactly: each layer holds back `right` frames until their look-ahead has arrived, so audio lags
  the codes by 16 * 10 vocoder frames + 1.5 hops (~40.4 code frames, the official right_overlap).

Every frame's result depends only on the frames before it (plus the fixed look-ahead), never on
how the stream is cut into chunks. Shapes: K codebooks, n new code frames, C channels,
L latent frames (50 Hz), N vocoder frames (100 Hz), S samples, H heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mimo_tts.codec.attention import Keys
from mimo_tts.codec.layers import (
    KV_ALIGN,
    apply_rotary,
    attention_mask,
    layer_norm_fp32,
    pending_use,
    sdpa,
)
from mimo_tts.codec.tokenizer import device_scope
from mimo_tts.codec.vocoder import MIN_ENVELOPE
from mimo_tts.errors import UsageError

# Defaults in code frames. Decoder history: 20 s, twice the official left_overlap (one-shot
# decode sees up to its 60 s chunk, spec §7.1; 1500 gets closer to it at 3x the KV memory and,
# on CPU in bfloat16, ~1.5x the compute). GroupNorm statistics window: one-shot's 60 s chunk.
# Warm-up: the vocoder's look-ahead, so waiting for it never delays the first audio.
CONTEXT_FRAMES = 500
NORM_WINDOW_FRAMES = 1500
WARMUP_FRAMES = 40
# Extra KV slots beyond the window (latent frames): the cache shifts once per SLACK_LIMIT frames.
SLACK_LIMIT = 512


class RunningNorm:
    """GroupNorm(1, C) over a stream, with per-frame statistics (see the module docstring)."""

    def __init__(self, norm: nn.GroupNorm, window: int, warmup: int):
        self.norm, self.window, self.warmup = norm, window, warmup
        self.pending: Tensor | None = None  # [1, C, p] raw frames waiting for the warm-up
        self.sums: Tensor | None = None  # [h, 2] float64 (sum, sum of squares) of recent frames
        self.seen = 0
        self.released = 0

    def push(self, x: Tensor, final: bool, extra: Tensor | None = None) -> Tensor:
        """Raw frames x [1, C, n] -> normalised frames [1, C, m] (m may be 0).

        `extra` frames (dconv2's surplus frame, spec §3.5) only enter the statistics of frames
        whose window reaches the end of the stream, as in one-shot decode.
        """
        self.seen += x.shape[-1]
        if self.pending is not None:
            x, self.pending = torch.cat([self.pending, x], dim=-1), None
        if x.shape[-1] and self.seen < self.warmup and not final:
            self.pending = x
            return x[..., :0]
        return self._release(x, extra if final else None) if x.shape[-1] else x

    def _release(self, x: Tensor, extra: Tensor | None) -> Tensor:
        xf = x.float()
        sums = _frame_sums(xf)  # [m, 2]
        past = 0 if self.sums is None else self.sums.shape[0]
        history = sums if self.sums is None else torch.cat([self.sums, sums])
        cum = F.pad(history.cumsum(0), (0, 0, 1, 0))  # cum[i] = sum of history[:i]
        first, m = self.released, x.shape[-1]
        t = torch.arange(first, first + m, device=x.device)
        hi = torch.clamp(t, min=self.warmup - 1).clamp(max=first + m - 1)  # inclusive
        lo = torch.clamp(t - self.window + 1, min=0)
        base = first - past  # stream index of history[0]
        total = cum[hi - base + 1] - cum[lo - base]  # [m, 2]
        count = (hi - lo + 1).double()
        if extra is not None and extra.shape[-1]:
            at_end = (hi == first + m - 1).double()[:, None]
            total = total + at_end * _frame_sums(extra.float()).sum(0)
            count = count + at_end[:, 0] * extra.shape[-1]
        y = _normalise(self.norm, xf, total / (count[:, None] * x.shape[1]))
        self.sums = (history[-(self.window - 1):] if self.window > 1 else history[:0]).clone()
        self.released += m
        return y.to(x.dtype)


def _frame_sums(x: Tensor) -> Tensor:
    """x [1, C, m] float32 -> per-frame (sum, sum of squares) [m, 2] in float64."""
    xd = x[0].double()
    return torch.stack([xd.sum(0), (xd * xd).sum(0)], dim=-1)


def _normalise(norm: nn.GroupNorm, x: Tensor, moments: Tensor) -> Tensor:
    """x [1, C, m] float32 with per-frame (mean, mean square) [m, 2] -> GroupNorm output."""
    mean = moments[:, 0]
    var = (moments[:, 1] - mean * mean).clamp(min=0)
    rstd = torch.rsqrt(var + norm.eps).float()
    y = (x - mean.float()) * rstd
    return y * norm.weight.float()[:, None] + norm.bias.float()[:, None]


class DecoderCache:
    """The causal decoder stack with a sliding-window KV cache of `window` latent frames.

    Keys are stored after RoPE at their absolute positions (angles in float64, so precision does
    not depend on the stream length). The buffers hold `window` frames plus some slack; when they
    fill up, the last `window` frames move to the front (amortised O(1) per frame, no re-rotation).
    """

    def __init__(self, decoder, window: int, slack: int | None = None):
        self.decoder, self.window = decoder, window
        self.slack = max(1, min(window // 4, SLACK_LIMIT) if slack is None else slack)
        self.keys: list[Tensor] = []  # per layer [1, H, capacity, D]
        self.values: list[Tensor] = []
        self.used = 0  # filled slots
        self.position = 0  # absolute latent index of the next frame
        self._span, self._frame_mask = 0, None  # of the push in progress (set by layer 0)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def _make_room(self, n: int, like: Tensor) -> None:
        """Ensure used + n slots exist, keeping the last `window` frames."""
        if self.used + n <= self.capacity:
            return
        keep = min(self.used, self.window)
        size = max(keep + n, min(self.window + self.slack, 2 * self.capacity))  # grow lazily
        size += -size % KV_ALIGN  # whole key blocks; unused slots stay finite (zeros) and masked
        heads, dim = like.shape[1], like.shape[3]
        for store in (self.keys, self.values):
            for index in range(len(self.decoder.layers)):
                fresh = like.new_zeros(1, heads, size, dim)
                if keep:
                    fresh[:, :, :keep] = store[index][:, :, self.used - keep:self.used]
                if index < len(store):
                    store[index] = fresh
                else:
                    store.append(fresh)
        self.used = keep

    def _mask(self, n: int, span: int, device) -> Tensor | None:
        """[n, span] bool: new frame r sees the `window` frames before it and itself."""
        if self.used == 0 and n <= self.window + 1:
            return None  # plain (top-left) causal attention never reaches the unused slots
        r = torch.arange(n, device=device)[:, None] + self.used
        j = torch.arange(span, device=device)[None, :]
        return (j <= r) & (j >= r - self.window)

    def attend(self, index: int, q: Tensor, k: Tensor, v: Tensor, rope) -> Tensor:
        """Layer `index`'s attention for this stream's new frames: q, k, v [1, H, n, D] before
        RoPE -> [1, H, n, D]; the keys and values join the cache (`step_streams` moves on)."""
        n = q.shape[2]
        if index == 0:
            self._make_room(n, k)  # may shift the cache: `used` changes
            end = self.used + n
            self._span = min(self.capacity, end + -end % KV_ALIGN)  # keys in whole blocks
            self._frame_mask = self._mask(n, self._span, q.device)
        end, span, mask = self.used + n, self._span, self._frame_mask
        self.keys[index][:, :, self.used:end] = apply_rotary(k, *rope)
        self.values[index][:, :, self.used:end] = v
        keys = Keys(mask, causal=mask is None, offset=self.used, left=self.window, right=0)
        return sdpa(apply_rotary(q, *rope), self.keys[index][:, :, :span],
                    self.values[index][:, :, :span], keys,
                    fused=self.decoder.layers[index].self_attn.fused)

    def step(self, x: Tensor) -> Tensor:
        """New latent frames x [1, n, d] (after GroupNorm) -> decoder outputs [1, n, d]."""
        return step_streams([self], [x])[0]


def step_streams(caches: list[DecoderCache], xs: list[Tensor]) -> list[Tensor]:
    """Several streams' new latent frames xs[i] [1, n_i, d] (n_i >= 1) through their own
    caches at once -> decoder outputs [1, n_i, d] each.

    The layer norms, projections and feed-forward layers run once over every stream's rows
    (one weight pass for all); attention runs per stream over its own cache. A row's products
    do not depend on the rows beside it on the CPU (tests/codec/test_codec_batched.py), so
    each stream gets what it gets alone.
    """
    decoder = caches[0].decoder
    sizes = [x.shape[1] for x in xs]
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    ropes = [decoder.rotary.at(c.position, n, x.device, x.dtype)
             for c, n, x in zip(caches, sizes, xs, strict=True)]
    # One contiguous [1, N, d] whatever the streams: the first layer's residual is then fused
    # into out_proj as in every later layer (a strided one is added apart, rounding twice).
    x = xs[0].contiguous() if len(xs) == 1 else torch.cat(xs, dim=1)  # [1, N, d]
    with pending_use(decoder, decoder.seconds(x.shape[1])):  # packed once enough ran
        for index, layer in enumerate(decoder.layers):
            attn = layer.self_attn
            q, k, v = attn.project(layer_norm_fp32(layer.self_attn_layer_norm, x))  # [1,H,N,D]
            outs = [cache.attend(index, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], rope)
                    for cache, lo, hi, rope in zip(caches, bounds[:-1], bounds[1:], ropes,
                                                     strict=True)]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
            x = layer.feed_forward(attn.merge(out, residual=x))
    for cache, n in zip(caches, sizes, strict=True):
        cache.used += n
        cache.position += n
    return [x] if len(xs) == 1 else list(x.split(sizes, dim=1))


class OverlapAdd:
    """The ISTFT's overlap-add and envelope division for a stream (exact, spec §3.6)."""

    def __init__(self, istft):
        self.istft = istft
        self.acc = torch.zeros(0)  # overlap-added samples from stream index `origin` on
        self.env = torch.zeros(0)  # the squared-window envelope, likewise
        self.origin = 0  # stream index (untrimmed) of acc[0]
        self.emitted = istft.pad  # next index to emit: the first `pad` samples are trimmed
        self.frames = 0

    def push(self, frames: Tensor, final: bool) -> Tensor:
        """Windowed frames [n, nfft] -> the samples [S] that no later frame can change."""
        if frames.shape[0]:
            self._add(frames)
        # Frame f covers [f*hop, f*hop + nfft): indices below frames*hop are complete.
        limit = self.frames * self.istft.hop + (self.istft.pad if final else 0)
        if limit <= self.emitted:
            return self.acc[:0]
        lo, hi = self.emitted - self.origin, limit - self.origin
        out = self.acc[lo:hi] / self.env[lo:hi].clamp(min=MIN_ENVELOPE)
        self.acc, self.env = self.acc[hi:].clone(), self.env[hi:].clone()  # drop the emitted
        self.origin = self.emitted = limit
        return out

    def _add(self, frames: Tensor) -> None:
        hop, nfft = self.istft.hop, self.istft.nfft
        start = self.frames * hop - self.origin
        end = start + (frames.shape[0] - 1) * hop + nfft
        if self.acc.numel() < end:
            self.acc = F.pad(self.acc.to(frames.device), (0, end - self.acc.numel()))
            self.env = F.pad(self.env.to(frames.device), (0, end - self.env.numel()))
        window = self.istft.window.float()
        squared = (window * window).expand(1, frames.shape[0], nfft)
        self.acc[start:end] += self.istft._overlap_add(frames[None], trim=False)[0]
        self.env[start:end] += self.istft._overlap_add(squared, trim=False)[0]
        self.frames += frames.shape[0]


class VocoderStream:
    """The windowed vocoder layers, head and ISTFT over a stream, exactly (spec §3.6)."""

    def __init__(self, vocoder):
        left, right = vocoder.spec.left, vocoder.spec.right
        if left < 0 or right < 0:
            raise UsageError("incremental decode needs a bounded vocoder attention window")
        self.vocoder, self.left, self.right = vocoder, left, right
        count = len(vocoder.layers)
        self.inputs: list[Tensor | None] = [None] * count  # [1, b, dim] layer inputs
        self.first = [0] * count  # stream index of inputs[l][:, 0]
        self.done = [0] * count  # frames whose layer output has been computed
        self.ola = OverlapAdd(vocoder.head.istft)

    def push(self, features: Tensor, final: bool) -> Tensor:
        """Normalised features [1, N, n_mels] -> new waveform samples [S] float32."""
        x = self.vocoder.embeddings(features)
        for index, layer in enumerate(self.vocoder.layers):
            x = self._layer(index, layer, x, final)
        frames = x.new_zeros(0, self.ola.istft.nfft, dtype=torch.float32)
        if x.shape[1]:
            x = layer_norm_fp32(self.vocoder.layer_norm, x)
            frames = self.ola.istft.frames(self.vocoder.head.spectrum(x))[0]  # [N, nfft]
        return self.ola.push(frames, final)

    def _layer(self, index: int, layer, x: Tensor, final: bool) -> Tensor:
        """Append inputs x [1, n, dim]; return the outputs whose look-ahead is now complete."""
        if self.inputs[index] is not None:
            x = torch.cat([self.inputs[index], x], dim=1)
        first, start = self.first[index], self.done[index]
        available = first + x.shape[1]
        end = available if final else max(start, available - self.right)
        self.inputs[index] = x
        if end <= start:
            return x[:, :0]
        keys = x[:, : min(available, end + self.right) - first]  # queries' keys from `first`
        size = keys.shape[1]
        rope = self.vocoder.rotary.tables(size, x.device, x.dtype)
        mask = attention_mask(self.vocoder.spec, 1, size, None, x.device)
        h = layer.self_attn(layer_norm_fp32(layer.self_attn_layer_norm, keys), rope,
                            self.vocoder.spec, mask)
        rows = slice(start - first, end - first)
        out = layer.feed_forward(h[:, rows] + keys[:, rows])
        keep = max(0, end - self.left)
        self.inputs[index] = x[:, keep - first:].clone()  # only what later queries need
        self.first[index], self.done[index] = keep, end
        return out

    def sizes(self) -> list[int]:
        return [0 if x is None else x.shape[1] for x in self.inputs]


class IncrementalDecoder:
    """One stream: push code chunks in order; each push returns the audio now final, or None."""

    def __init__(self, tokenizer, context: int = CONTEXT_FRAMES,
                 norm_window: int = NORM_WINDOW_FRAMES, warmup: int = WARMUP_FRAMES):
        if not (context >= 1 and 1 <= warmup <= norm_window):
            raise UsageError("incremental streaming needs context >= 1 and "
                             f"1 <= warmup <= norm_window, got context={context}, "
                             f"warmup={warmup}, norm_window={norm_window}")
        self.tokenizer, self.decoder = tokenizer, tokenizer.model.decoder
        self.context, self.norm_window, self.warmup = int(context), int(norm_window), int(warmup)
        conv2 = self.decoder.dconv2
        self.conv2_context = -(-conv2.kernel // conv2.stride) - 1  # latent frames of left context
        self.reset()

    def reset(self) -> None:
        """Start a new stream."""
        up1, up2 = self.decoder.dconv1.stride, self.decoder.dconv2.stride
        self.norm1 = RunningNorm(self.decoder.dconv1.norm, self.norm_window * up1,
                                 self.warmup * up1)
        self.norm2 = RunningNorm(self.decoder.dconv2.norm, self.norm_window * up1 * up2,
                                 self.warmup * up1 * up2)
        self.cache = DecoderCache(self.decoder, self.context * up1)
        self.vocoder = VocoderStream(self.decoder.vocoder)
        self._previous: Tensor | None = None  # [1, d, <=conv2_context] latent left context
        self._surplus: Tensor | None = None  # [1, n_mels, k - s] dconv2 frames still open
        self.finished = False

    @property
    def first_audio_frames(self) -> int:
        """The fewest code frames after which a push (not the last) returns audio: the norm
        warm-up, or the vocoder's exact look-ahead plus the ISTFT overlap (40.4 frames at full
        size), whichever is longer. How the frames were cut into pushes does not matter."""
        istft = self.decoder.vocoder.head.istft
        held = len(self.decoder.vocoder.layers) * self.vocoder.right * istft.hop + istft.pad
        return max(self.warmup, held // self.tokenizer.samples_per_frame + 1)

    def push(self, codes: Tensor, last: bool = False) -> Tensor | None:
        """codes [K, n] -> new waveform samples [S] float32 on the tokenizer device, or None."""
        return push_streams([self], [codes], [last])[0]

    def _latent(self, codes: Tensor, last: bool) -> Tensor:
        """codes [K, n] -> the latent frames [1, L, d] released by dconv1's GroupNorm."""
        if self.finished:
            raise UsageError("this stream has ended (last=True); call reset() to start another")
        hidden = self.tokenizer.dequantize(codes)  # [n, d] float32
        conv = self.decoder.dconv1.conv
        y = hidden.to(conv.weight.dtype).t()[None]  # [1, d, n]
        if y.shape[-1]:  # kernel == stride: frames never overlap
            y = F.conv_transpose1d(y, conv.weight, conv.bias, stride=conv.stride)
        else:
            y = y.new_zeros(1, conv.out_channels, 0)
        return self.norm1.push(y, final=last).transpose(1, 2)  # [1, L, d]

    def _audio(self, x: Tensor, last: bool) -> Tensor | None:
        """Decoder outputs x [1, L, d] -> the new samples [S] now final, or None."""
        if x.shape[1]:
            x = layer_norm_fp32(self.decoder.layer_norm, x)
        wave = self.vocoder.push(self._features(x, last), last)
        self.finished = last
        return wave if wave.numel() else None

    def _features(self, x: Tensor, last: bool) -> Tensor:
        """Decoder outputs x [1, L, d] -> normalised dconv2 features [1, N, n_mels]."""
        conv = self.decoder.dconv2.conv
        stride, ctx = conv.stride[0], self.conv2_context
        xt = x.transpose(1, 2)  # [1, d, L]
        new = x.new_zeros(1, conv.out_channels, 0)
        if xt.shape[-1]:
            joined = xt if self._previous is None else torch.cat([self._previous, xt], dim=-1)
            lead = (joined.shape[-1] - xt.shape[-1]) * stride  # outputs already emitted
            cut = lead + xt.shape[-1] * stride  # later outputs still miss the next frame
            y = F.conv_transpose1d(joined, conv.weight, conv.bias, stride=stride)
            new, self._surplus = y[..., lead:cut], y[..., cut:].clone()
            self._previous = joined[..., max(0, joined.shape[-1] - ctx):].clone() if ctx else None
        extra = self._surplus if last else None
        return self.norm2.push(new, final=last, extra=extra).transpose(1, 2)

    def cache_sizes(self) -> dict:
        """Frames held by each piece of state (bounded whatever the stream length)."""
        sums = [n.sums.shape[0] if n.sums is not None else 0 for n in (self.norm1, self.norm2)]
        return {"kv_latent_frames": self.cache.capacity, "norm1_history": sums[0],
                "norm2_history": sums[1], "vocoder_inputs": max(self.vocoder.sizes()),
                "overlap_add_samples": self.vocoder.ola.acc.numel()}

    def state_bytes(self) -> int:
        """Bytes of tensors the stream keeps between pushes (flat once the context is full)."""
        tensors = [*self.cache.keys, *self.cache.values, self.vocoder.ola.acc, self.vocoder.ola.env,
                   self._previous, self._surplus]
        tensors += [t for t in self.vocoder.inputs]
        tensors += [t for n in (self.norm1, self.norm2) for t in (n.pending, n.sums)]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def push_streams(decoders: list[IncrementalDecoder], codes: list[Tensor],
                 lasts: list[bool]) -> list[Tensor | None]:
    """One push for each of several streams (distinct decoders on one tokenizer): codes[i]
    [K, n_i] -> its new samples [S_i] or None, as `decoders[i].push(codes[i], lasts[i])`
    gives them alone. The decoder stack runs once over every stream's new frames
    (`step_streams`); the convolutions, norms and vocoder run per stream."""
    tokenizer = decoders[0].tokenizer
    with torch.inference_mode(), device_scope(tokenizer.device):
        latents = [d._latent(c, last) for d, c, last in zip(decoders, codes, lasts, strict=True)]
        busy = [i for i, x in enumerate(latents) if x.shape[1]]
        if busy:
            outs = step_streams([decoders[i].cache for i in busy], [latents[i] for i in busy])
            for i, out in zip(busy, outs, strict=True):
                latents[i] = out
        return [d._audio(x, last) for d, x, last in zip(decoders, latents, lasts, strict=True)]
