"""Stage-0 generation: prefill, then one backbone step and one patch decode per group.

A batch of prompts of different lengths runs together: prompts are left-padded, each row
keeps its own RoPE positions (groups counted from its own start) and a key mask hides the
padding, so a row's greedy output equals its single-prompt output. Rows stop independently
(spec §4.5, §4.7). Each group runs through one `DecodeStep` (mimo_tts/lm/step.py) that
`decode_step` picks for the generation: eager, fixed-shape / CUDA graphs, or the CPU kernel.
Shapes: B batch, G groups, F frames per group, K codebooks, H hidden.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mimo_tts.errors import InputError, UsageError
from mimo_tts.lm import cpu_kernel
from mimo_tts.lm.config import MAX_GROUPS, TASK_STOP_TOKENS
from mimo_tts.lm.graph import GraphStep
from mimo_tts.lm.model import KVCache, MiMoAudioLM
from mimo_tts.lm.sampling import TASK_SAMPLERS, Rng, SamplerConfig, sample, task_samplers
from mimo_tts.lm.step import DecodeStep, EagerStep

LogitsHook = Callable[[int, Tensor], Tensor]
# How decode steps run (GenerationOptions.decode_step); see `decode_step` below.
DECODE_STEPS = ("auto", "eager", "graph", "static")
# Backbone cache slots a prefill allocates past the prompt (~41 s of audio); more on demand.
FIRST_NEW_SLOTS = 256


@dataclass(frozen=True)
class GenerationOptions:
    """Run options of one generation; validated here, in one place."""

    text_sampler: SamplerConfig = TASK_SAMPLERS["tts"][0]
    audio_sampler: SamplerConfig = TASK_SAMPLERS["tts"][1]
    seed: int | None = None
    min_new_groups: int = 0
    max_new_groups: int = MAX_GROUPS
    stop_tokens: tuple[str, ...] = TASK_STOP_TOKENS["tts"]
    # hook(step, logits [B, V]) -> logits [B, V], applied to the raw text logits before the
    # min-length rule and the sampler (tests force a token script with it).
    text_logits_processor: LogitsHook | None = None
    keep_logits: bool = False  # return each step's raw text logits
    # "auto": CUDA graphs on CUDA devices (eager if a capture fails), on CPU the fused
    # kernel where cpu_kernel.choose(model) agrees, else eager; "eager": the modules at
    # dynamic shapes; "graph": CUDA graphs, CUDA only; "static": the graphs' fixed-shape
    # step run without capture, on any device (debugging, tests).
    decode_step: str = "auto"

    def __post_init__(self):
        if self.max_new_groups < 1:
            raise UsageError(f"max_new_groups must be >= 1, got {self.max_new_groups}")
        if self.min_new_groups < 0:
            raise UsageError(f"min_new_groups must be >= 0, got {self.min_new_groups}")
        if not self.stop_tokens:
            raise UsageError("stop_tokens must name at least one special token")
        if self.decode_step not in DECODE_STEPS:
            raise UsageError(f"decode_step must be one of {', '.join(DECODE_STEPS)}, "
                             f"got {self.decode_step!r}")

    @classmethod
    def for_task(cls, task: str, **overrides) -> GenerationOptions:
        """Per-task samplers and stop set (spec §4.6, §4.7), with explicit overrides."""
        text, audio = task_samplers(task)
        stops = TASK_STOP_TOKENS.get(task, TASK_STOP_TOKENS["tts"])
        return cls(**{"text_sampler": text, "audio_sampler": audio, "stop_tokens": stops,
                      **overrides})


@dataclass(frozen=True)
class StepOutput:
    """One generated group of one batch row."""

    index: int  # batch row
    step: int  # 0 for the group sampled from the prefill
    text_token: int
    codes: Tensor | None  # [F, K] int64 on CPU when text_token is <|empty|>, else None
    finished: bool  # this row stops after this group (the group is kept)
    logits: Tensor | None = None  # [V] raw text logits when options.keep_logits
    prefill_s: float | None = None  # on step 0: seconds the batch's prefill took


@dataclass
class Generation:
    """All groups generated for one prompt."""

    new_ids: Tensor  # [1 + K, F * N]: row 0 repeats the text token in all F slots
    text_tokens: list[int]
    step_logits: Tensor | None = None  # [N, V]
    prefill_s: float | None = None  # seconds of the prefill (shared by the batch)


@dataclass
class BatchState:
    """Prefilled state of a batch; `hidden` is each row's newest backbone output [B, H]."""

    hidden: Tensor
    lengths: Tensor  # [B, 1] prompt groups per row (position of the first new group)
    budgets: list[int]  # new groups allowed per row
    cache: KVCache
    local_cache: KVCache
    prompt_len: int  # padded prompt groups = first free cache slot
    valid: Tensor | None = None  # [B, limit] key mask, only when rows are padded
    stop_ids: list[int] = field(default_factory=list)

    @property
    def limit(self) -> int:
        """Cache slots the longest row can ever need: the prompt plus its budget."""
        return self.prompt_len + max(self.budgets)

    def reserve(self, slots: int) -> None:
        """Grow the backbone cache to hold `slots` positions (the key mask spans the limit)."""
        self.cache.reserve(slots, self.limit)


def split_prompt(model: MiMoAudioLM, ids: Tensor, empty_token: int) -> tuple[Tensor, Tensor]:
    """Prompt ids [1 + K, F * G] -> text ids [G] and codes [G, F, K] (spec §4.2), checked."""
    cfg = model.cfg
    frames, channels = cfg.group_size, cfg.audio_channels
    if ids.dim() != 2 or ids.shape[0] != 1 + channels or ids.shape[1] % frames or not ids.shape[1]:
        raise InputError(f"prompt ids must be [{1 + channels}, {frames}*G], got {list(ids.shape)}")
    ids = ids.long()
    text = ids[0, ::frames]
    codes = ids[1:].reshape(channels, -1, frames).permute(1, 2, 0)  # [G, F, K]
    if text.min() < 0 or text.max() >= cfg.vocab_size:
        raise InputError(f"prompt text id out of range [0, {cfg.vocab_size})")
    audio = codes[text == empty_token]
    if audio.numel():
        limits = torch.tensor(cfg.speech_vocab_sizes, device=audio.device)
        if (audio < 0).any() or (audio >= limits).any():
            raise InputError(f"prompt audio code out of range (sizes {cfg.speech_vocab_sizes})")
    return text, codes


def resolve_stop_ids(special, names: Sequence[str]) -> list[int]:
    """Stop token ids from SpecialTokens field names."""
    try:
        return sorted({int(getattr(special, name)) for name in names})
    except AttributeError as exc:
        raise UsageError(f"unknown stop token name: {exc.name}") from None


@torch.inference_mode()
def prefill(model: MiMoAudioLM, prompts: Sequence[Tensor], options: GenerationOptions,
            special) -> BatchState:
    """Embed, left-pad and run every prompt; allocate the caches for the whole generation.
    Its products are `cpu_kernel.prefill_products`' (PyTorch's, or float32 blocks on CPUs
    whose bfloat16 GEMM is slow)."""
    device = model.lm_head.weight.device
    parts = [split_prompt(model, p.to(device), special.empty) for p in prompts]
    if not parts:
        raise InputError("no prompts to generate from")
    matmul = cpu_kernel.prefill_products(model)[0]
    embeds = [model.embed_groups(t[None], c[None], special.empty, matmul)[0] for t, c in parts]
    sizes = [e.shape[0] for e in embeds]
    if max(sizes) >= MAX_GROUPS:
        raise InputError(f"prompt of {max(sizes)} groups leaves no room under {MAX_GROUPS}")
    budgets = [min(options.max_new_groups, MAX_GROUPS - g) for g in sizes]
    width, b = max(sizes), len(sizes)
    padded = embeds[0].new_zeros(b, width, embeds[0].shape[-1])  # [B, G, H]
    for row, e in enumerate(embeds):
        padded[row, width - e.shape[0]:] = e
    lengths = torch.tensor(sizes, device=device).unsqueeze(1)
    positions = (torch.arange(width, device=device) - (width - lengths)).clamp(min=0)  # [B, G]
    # The cache holds the prompt and the first new groups; `BatchState.reserve` grows it.
    dtype, span = padded.dtype, width + min(max(budgets), FIRST_NEW_SLOTS)
    cache = KVCache(model.cfg.backbone, b, span, dtype=dtype, device=device)
    local = KVCache(model.cfg.patch_decoder, b, model.cfg.local_steps, dtype=dtype, device=device)
    valid, mask = None, None
    if min(sizes) != width:
        limit = width + max(budgets)  # one byte a slot: allocated in full, never regrown
        valid = torch.arange(limit, device=device) >= (width - lengths)  # [B, limit]
        valid[:, width:] = False
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        eye = torch.eye(width, dtype=torch.bool, device=device)  # pad rows see themselves
        mask = ((causal & valid[:, None, :width]) | eye).unsqueeze(1)  # [B, 1, G, G]
    hidden = model.backbone(padded, positions, cache, 0, width, mask, matmul)[:, -1]
    return BatchState(hidden, lengths, budgets, cache, local, width, valid,
                  resolve_stop_ids(special, options.stop_tokens))


def decode_patch(model: MiMoAudioLM, local_in: Tensor,
                 sampler: SamplerConfig | Sequence[SamplerConfig],
                 generator: Rng | Sequence[Rng], step: DecodeStep,
                 record: list[list[Tensor]] | None = None) -> Tensor:
    """Patch decoder (spec §4.4): local_in [n, local_dim] -> codes [n, F, K], de-delayed,
    its positions run by `step.local_logits`; one sampler and generator, or one per row
    (`sampling.sample`).

    `record[c]` collects channel c's raw logits per frame (before the empty id is masked).
    """
    cfg = model.cfg
    n, frames = local_in.shape[0], cfg.group_size
    codes = torch.empty(n, frames, cfg.audio_channels, dtype=torch.long, device=local_in.device)
    x = local_in.unsqueeze(1)  # [n, 1, local_dim]
    for t, channels in enumerate(_schedule(cfg.delay_pattern, frames)):
        tokens = []
        for c, logits in zip(channels, step.local_logits(x, t, channels), strict=True):
            if record is not None:
                record[c].append(logits.clone())
            logits[:, cfg.speech_empty_ids[c]] = float("-inf")
            tokens.append(sample(logits, sampler, generator))
            codes[:, t - cfg.delay_pattern[c], c] = tokens[-1]
        if t + 1 < cfg.local_steps:
            x = model.embed_codes(channels, tokens)
    return codes


def _schedule(delays: Sequence[int], frames: int) -> list[list[int]]:
    """Channels sampled at each patch-decoder step: D[c] <= t < D[c] + F."""
    steps = frames + max(delays)
    return [[c for c, d in enumerate(delays) if d <= t < d + frames] for t in range(steps)]


def _sample_group(model, state: BatchState, step: int, options, special, generator,
                  decoder: DecodeStep):
    """Sample each row's text token and, for <|empty|> rows, its codes -> ([B], [B, F, K])."""
    logits = decoder.text_logits(state.hidden)  # [B, V]
    raw = logits.detach().to("cpu", copy=True) if options.keep_logits else None
    if options.text_logits_processor is not None:
        logits = options.text_logits_processor(step, logits)
    if step < options.min_new_groups:
        logits = logits.clone()
        logits[:, state.stop_ids] = float("-inf")
    tokens = sample(logits, options.text_sampler, generator)
    cfg = model.cfg
    codes = model.empty_ids.expand(tokens.shape[0], cfg.group_size, -1).clone()
    rows = (tokens == special.empty).nonzero().squeeze(1)
    if rows.numel():
        local_in = model.hidden_states_downcast(state.hidden[rows])
        codes[rows] = decode_patch(model, local_in, options.audio_sampler, generator, decoder)
    return tokens, codes, raw


def _advance(state: BatchState, step: int, tokens: Tensor, codes: Tensor, special,
             decoder: DecodeStep) -> None:
    """Feed the new group of every row through one backbone step."""
    embeds = decoder.embed(tokens, codes, special.empty)  # [B, 1, H]
    slot = state.prompt_len + step
    state.reserve(slot + 1)  # the cache grows with the run (a GraphStep reserved it in full)
    state.hidden = decoder.backbone(embeds, state.lengths + step, slot)


def step_kind(model: MiMoAudioLM, mode: str) -> str:
    """The decode step a `decode_step` mode picks on the model's device (the one place that
    picks): "graph" (captured), "static" (its shapes, uncaptured), "kernel" or "eager"."""
    device = model.lm_head.weight.device
    cuda = device.type == "cuda"
    if mode == "graph" and not cuda:
        raise UsageError(f"decode_step 'graph' needs a CUDA device, the LM is on {device}")
    if mode in ("graph", "static"):
        return mode
    if mode == "auto" and cuda:
        return "graph"
    if mode == "auto" and cpu_kernel.choose(model).active:
        return "kernel"
    return "eager"


def build_step(model: MiMoAudioLM, kind: str, cache: KVCache, local_cache: KVCache,
               valid: Tensor | None, prompt_len: int, strict: bool) -> DecodeStep:
    """A decode step of `step_kind` over the generation's caches and key mask (a graph step
    fixes the backbone cache's length: reserve it first)."""
    if kind in ("graph", "static"):
        return GraphStep(model, cache, local_cache, valid, prompt_len, capture=kind == "graph",
                         strict=strict)
    if kind == "kernel":
        return cpu_kernel.CpuKernelStep(model, cache, local_cache, valid)
    return EagerStep(model, cache, local_cache, valid)


def decode_step(model: MiMoAudioLM, state: BatchState, options: GenerationOptions) -> DecodeStep:
    """The decode step the options ask for, over the state's caches."""
    kind = step_kind(model, options.decode_step)
    if kind in ("graph", "static"):
        state.reserve(state.limit)  # static shapes: the whole generation's cache, once
    return build_step(model, kind, state.cache, state.local_cache, state.valid,
                      state.prompt_len, strict=options.decode_step == "graph")


def generator_for(options: GenerationOptions, device) -> torch.Generator | None:
    """The generator one generation samples from (None when both samplers are greedy)."""
    if options.text_sampler.greedy and options.audio_sampler.greedy:
        return None
    gen = torch.Generator(device=device)
    if options.seed is None:
        gen.seed()
    else:
        gen.manual_seed(options.seed)
    return gen


@torch.inference_mode()
def stream(model: MiMoAudioLM, prompts: Sequence[Tensor], options: GenerationOptions,
           special) -> Iterator[StepOutput]:
    """Yield each row's group as soon as it is sampled, until every row has stopped."""
    start = time.perf_counter()
    state = prefill(model, prompts, options, special)
    if state.hidden.is_cuda:
        torch.cuda.synchronize(state.hidden.device)
    prefill_s = time.perf_counter() - start
    generator = generator_for(options, state.hidden.device)
    decoder = decode_step(model, state, options)
    done = [False] * len(state.budgets)
    stops = set(state.stop_ids)
    for step in range(max(state.budgets)):
        tokens, codes, raw = _sample_group(model, state, step, options, special, generator,
                                           decoder)
        token_list, codes_cpu = tokens.tolist(), codes.cpu()
        for row, token in enumerate(token_list):
            if done[row]:
                continue
            stop = token in stops and step + 1 >= options.min_new_groups
            done[row] = stop or step + 1 >= state.budgets[row]
            yield StepOutput(row, step, token, codes_cpu[row] if token == special.empty else None,
                             done[row], None if raw is None else raw[row],
                             prefill_s if step == 0 else None)
        if all(done):
            return
        _advance(state, step, tokens, codes, special, decoder)


class Collector:
    """One prompt's StepOutputs, in order, gathered into its `Generation`."""

    def __init__(self, cfg):
        self.frames = cfg.group_size
        self.empty_codes = torch.tensor(cfg.speech_empty_ids).unsqueeze(0).expand(self.frames, -1)
        self.tokens: list[int] = []
        self.blocks: list[Tensor] = []
        self.logits: list[Tensor] = []
        self.prefill_s: float | None = None

    def add(self, out: StepOutput) -> None:
        self.tokens.append(out.text_token)
        codes = self.empty_codes if out.codes is None else out.codes  # [F, K]
        text = torch.full((1, self.frames), out.text_token, dtype=torch.long)
        self.blocks.append(torch.cat((text, codes.T.long()), dim=0))  # [1 + K, F]
        if out.logits is not None:
            self.logits.append(out.logits)
        if out.prefill_s is not None:
            self.prefill_s = out.prefill_s

    def generation(self) -> Generation:
        return Generation(torch.cat(self.blocks, dim=1), self.tokens,
                          torch.stack(self.logits) if self.logits else None, self.prefill_s)


def generate(model: MiMoAudioLM, prompts: Sequence[Tensor], options: GenerationOptions,
             special) -> list[Generation]:
    """Run `stream` to the end; per prompt the new groups as ids [1 + K, F * N]."""
    collectors = [Collector(model.cfg) for _ in prompts]
    for out in stream(model, prompts, options, special):
        collectors[out.index].add(out)
    return [c.generation() for c in collectors]
