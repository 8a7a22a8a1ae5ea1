"""MiMo-Audio Stage-0 as a vLLM model (spec §4): vLLM's Qwen2 backbone (paged attention,
tensor parallelism) with the native patch encoder and patch decoder.

One vLLM token is one group. A text group is its token; an `<|empty|>` group is embedded from
its [F, K] codes by the patch encoder (spec §4.3). The codes of a generated `<|empty|>` group
are decided when that token comes back as input, i.e. from the token vLLM's sampler actually
drew (spec §11.1 is the divergence this avoids), by the patch decoder run on the previous
position's output, kept per request in `state.RequestAudio.pending`. Decided codes are stored
per request and reused when a preempted request is recomputed. Design: docs/vllm-engine.md.

The local stacks are the native modules (built on the meta device by `MiMoAudioLM` and adopted)
and their arithmetic is the native methods, so both engines share one implementation.
Shapes: N tokens (groups) in the pass, F frames per group, K codebooks, H hidden, D local dim.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen2 import Qwen2Model
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix

from mimo_tts.errors import CheckpointError
from mimo_tts.lm.generate import decode_patch
from mimo_tts.lm.load import load_config
from mimo_tts.lm.model import KVCache, MiMoAudioLM
from mimo_tts.lm.sampling import GREEDY
from mimo_tts.lm.step import EagerStep
from mimo_tts.lm.vllm.state import RequestAudio, batch_rows, row_of

IGNORED_PREFIXES = ("mel_transform.",)  # checkpoint tensors inference does not use (spec §4.9)
# Checkpoint modules of the patch encoder / decoder (spec §4.9), adopted from MiMoAudioLM.
LOCAL_MODULES = (
    "speech_embeddings", "input_local_transformer", "local_transformer",
    "local_transformer_lm_heads", "speech_group_downcast", "hidden_states_downcast",
    "speech_embeddings_to_local",
)


class MiMoAudioForVLLM(nn.Module):
    """Stage-0 LM for vLLM: forward embeds groups and runs the backbone; compute_logits gives
    the text logits vLLM samples from."""

    # The native arithmetic of the local stacks, on the same module names.
    encode_patches = MiMoAudioLM.encode_patches
    local_step = MiMoAudioLM.local_step
    channel_logits = MiMoAudioLM.channel_logits
    embed_codes = MiMoAudioLM.embed_codes

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        model_dir = vllm_config.model_config.model
        self.cfg = cfg = load_config(model_dir)
        _check_supported(vllm_config, cfg)
        hf = vllm_config.model_config.hf_config
        self.empty_token = int(getattr(hf, "mimo_empty_token_id", None) or _empty_token(model_dir))
        self.model = Qwen2Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.model.build_rope = _own_rope  # for MiMoAudioLM.build_buffers: vLLM's has its own
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(cfg.vocab_size)
        device = torch.get_default_device()
        with torch.device("meta"):
            native = MiMoAudioLM(cfg)
        for name in LOCAL_MODULES:
            module = getattr(native, name)
            setattr(self, name, None if module is None else module.to_empty(device=device))
        self.register_buffer("empty_ids", torch.empty(0, dtype=torch.long), persistent=False)
        self.local_positions: list[Tensor] = []
        self._local_cache: KVCache | None = None

    # -- vLLM model interface -----------------------------------------------------------------
    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        """Text embeddings only (the audio part needs the batch layout, see forward)."""
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: Tensor | None, positions: Tensor, intermediate_tensors=None,
                inputs_embeds: Tensor | None = None, **kwargs) -> Tensor:
        """input_ids / positions [N] -> normed backbone output [N, H]."""
        rows = batch_rows(positions.shape[0])
        if inputs_embeds is None:
            inputs_embeds = self.embed_groups(input_ids, positions, rows)
        hidden = self.model(None, positions, intermediate_tensors, inputs_embeds)
        self.remember(hidden, positions, rows)
        return hidden

    def compute_logits(self, hidden_states: Tensor) -> Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self, ignore_unexpected_prefixes=list(IGNORED_PREFIXES))
        loaded = loader.load_weights(weights)
        self.build_buffers()
        return loaded

    def build_buffers(self) -> None:
        """Derived tables (RoPE, empty ids, ...), built by the native code on the weights'
        device after loading; they are not in the checkpoint."""
        MiMoAudioLM.build_buffers(self, self.speech_group_downcast.weight.device)
        # The native fused fast path for the local stacks (the backbone is vLLM's own).
        for stack in (self.input_local_transformer, self.local_transformer):
            stack.fuse()
        self.local_transformer_lm_heads.fuse()

    # -- groups in, codes out -------------------------------------------------------------------
    def embed_groups(self, input_ids: Tensor, positions: Tensor, rows) -> Tensor:
        """Backbone input [N, H]: text embedding, zeroed on `<|empty|>`, plus patch-encoded
        codes there (spec §4.3). Undecided generated audio groups are decided first."""
        embeds = self.model.embed_input_ids(input_ids)
        is_audio = input_ids == self.empty_token
        embeds = embeds * (~is_audio).unsqueeze(-1).to(embeds.dtype)
        tokens = is_audio.nonzero().squeeze(1).tolist()
        if not tokens or not rows:
            return embeds
        found = self.gather_codes(tokens, positions, rows)
        index = [t for t, _ in found]
        codes = torch.stack([c for _, c in found]).to(input_ids.device)  # [M, F, K]
        embeds[index] = self.encode_patches(codes).to(embeds.dtype)
        return embeds

    def gather_codes(self, tokens: list[int], positions: Tensor, rows) -> list[tuple[int, Tensor]]:
        """(token index, codes [F, K]) of every tracked audio token; decides missing ones."""
        pos = positions.tolist()
        found, missing = [], []
        for t in tokens:
            state = row_of(rows, t)
            if state is None:
                continue  # padding or an untracked (dummy) row: text part zero, no audio
            codes = state.codes.get(pos[t])
            if codes is None:
                _check_decidable(state, pos[t])
                missing.append((state, pos[t]))
            found.append((t, state, pos[t]))
        if missing:
            self.decide([s for s, _ in missing], [p for _, p in missing])
        return [(t, state.codes[p]) for t, state, p in found]

    def remember(self, hidden: Tensor, positions: Tensor, rows) -> None:
        """Keep each row's newest patch-decoder input: hidden_states_downcast(h_last) [D]."""
        if not rows:
            return
        last = [end - 1 for _, _, end in rows]
        local_in = self.hidden_states_downcast(hidden[last])  # [R, D]
        for (state, _, _), p, x in zip(rows, positions[last].tolist(), local_in, strict=True):
            state.remember(p, x)

    def decide(self, states: list[RequestAudio], positions: list[int]) -> None:
        """Run the patch decoder (spec §4.4) for the groups at `positions`, one per state, from
        each state's pending input; greedy requests run together, sampled ones each with its
        own generator. The codes are stored in the states."""
        local_in = torch.stack([s.pending[1] for s in states])  # [n, D]
        greedy = [i for i, s in enumerate(states) if s.sampler.greedy]
        if greedy:
            cache = self.local_cache(len(greedy))
            codes = decode_patch(self, local_in[greedy], GREEDY, None,
                                 EagerStep(self, None, cache))
            for i, c in zip(greedy, codes.cpu(), strict=True):
                states[i].store(positions[i], c)
        for i, state in enumerate(states):
            if not state.sampler.greedy:
                generator = state.generator(local_in.device)
                codes = decode_patch(self, local_in[i : i + 1], state.sampler, generator,
                                     EagerStep(self, None, self.local_cache(1)))
                state.store(positions[i], codes[0].cpu())

    def local_cache(self, rows: int) -> KVCache:
        """The patch decoder's KV cache (fresh per group: every step overwrites it)."""
        if self._local_cache is None or self._local_cache.k.shape[1] < rows:
            weight = self.speech_group_downcast.weight
            self._local_cache = KVCache(self.cfg.patch_decoder, rows, self.cfg.local_steps,
                                        dtype=weight.dtype, device=weight.device)
        return self._local_cache


def _own_rope(device, dtype) -> None:
    """vLLM's backbone computes its rotary embedding itself."""


def _check_decidable(state: RequestAudio, position: int) -> None:
    """A group without codes must be the newest generated one, right after the pending input."""
    if position < state.prompt_len:
        raise RuntimeError(f"request {state.key}: prompt group {position} is <|empty|> "
                           "but carries no audio codes")
    if state.pending is None or state.pending[0] != position - 1:
        seen = None if state.pending is None else state.pending[0]
        raise RuntimeError(f"request {state.key}: no backbone output at group {position - 1} "
                           f"to decode group {position} from (newest: {seen})")


def _check_supported(vllm_config: VllmConfig, cfg) -> None:
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise CheckpointError("the MiMo-Audio vLLM model does not support pipeline parallelism")
    bb = cfg.backbone
    if bb.head_dim * bb.heads != bb.dim:
        raise CheckpointError(f"LM config.json: head_dim {bb.head_dim} x {bb.heads} heads != "
                              f"hidden_size {bb.dim}; vLLM's Qwen2 needs hidden/heads")


def _empty_token(model_dir) -> int:
    from mimo_tts.lm.text import TextTokenizer

    return TextTokenizer.from_dir(model_dir).special.empty
