"""Per-request audio state of the vLLM engine, and who is in which batch row (docs/vllm-engine.md).

vLLM hands a model only token ids and positions. MiMo-Audio also needs, per request, the codes
of every `<|empty|>` group it feeds (prompt audio and generated audio) and the newest backbone
output (the patch decoder's input for the next group). That state lives here, in the worker
process, keyed by a request key the engine puts in `SamplingParams.extra_args`:

- `RequestTracker`, a vLLM logits processor that never changes the logits, is told before each
  forward pass which request sits in which batch row (rows join, leave, move, are preempted);
- the model reads the row boundaries from the attention metadata of the forward context;
- `AudioWorkerExtension` (mixed into vLLM's worker) lets the engine take the decided codes and
  release a request's state once it has finished.

A state outlives preemption (a preempted request leaves the batch and later re-joins; its
decided codes are reused while it is recomputed) and is dropped only by the engine.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch
from torch import Tensor
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.v1.sample.logits_processor import LogitsProcessor, MoveDirectionality

from mimo_tts.lm.sampling import SamplerConfig

EXTRA_KEY = "mimo_tts"  # SamplingParams.extra_args[EXTRA_KEY] = request_args(...)


def request_args(key: str, audio: dict[int, list[list[int]]], sampler: SamplerConfig,
                 seed: int | None) -> dict:
    """What a request carries to the worker: its key, prompt-audio codes by group position
    ([F][K] ints), and the patch decoder's sampler and seed."""
    return {"key": key, "audio": {str(p): c for p, c in audio.items()},
            "sampler": [sampler.temperature, sampler.top_k, sampler.top_p], "seed": seed}


@dataclass
class RequestAudio:
    """One request's audio state. Positions count groups from the start of the prompt."""

    key: str
    prompt_len: int
    sampler: SamplerConfig
    seed: int | None
    codes: dict[int, Tensor] = field(default_factory=dict)  # position -> [F, K] int64, CPU
    decided: list[int] = field(default_factory=list)  # generated positions not yet taken
    pending: tuple[int, Tensor] | None = None  # newest (position, patch-decoder input [D])
    joins: int = 0  # times the request joined a batch: > 1 after preemption
    _generator: torch.Generator | None = None

    @classmethod
    def from_args(cls, args: dict, prompt_len: int) -> RequestAudio:
        temperature, top_k, top_p = args["sampler"]
        state = cls(args["key"], prompt_len, SamplerConfig(temperature, top_k, top_p),
                    args["seed"])
        for position, codes in args["audio"].items():
            state.codes[int(position)] = torch.tensor(codes, dtype=torch.long)  # [F, K]
        return state

    def generator(self, device) -> torch.Generator | None:
        """The request's own generator for audio sampling, so that a seeded request draws the
        same codes whatever else shares its batch."""
        if self.sampler.greedy:
            return None
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            if self.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(self.seed)
        return self._generator

    def remember(self, position: int, local_in: Tensor) -> None:
        """Keep the newest position's patch-decoder input. A recompute after preemption walks
        older positions again; it must not replace the input of the newest one."""
        if self.pending is None or position > self.pending[0]:
            self.pending = (position, local_in)

    def store(self, position: int, codes: Tensor) -> None:
        self.codes[position] = codes
        self.decided.append(position)

    def take(self) -> list[tuple[int, list[list[int]]]]:
        """Codes decided since the last take, as (position, [F][K] ints)."""
        out = [(p, self.codes[p].tolist()) for p in self.decided]
        self.decided.clear()
        return out


# Worker-process registries: request key -> state, and batch row -> request key.
STATES: dict[str, RequestAudio] = {}
ROWS: list[str | None] = []


def _apply_batch_update(update) -> None:
    """Follow vLLM's persistent batch: removed, then added, then moved (BatchUpdate order)."""
    for index in update.removed:
        if index < len(ROWS):
            ROWS[index] = None
    if len(ROWS) < update.batch_size:
        ROWS.extend([None] * (update.batch_size - len(ROWS)))
    for index, params, prompt_ids, _ in update.added:
        args = (params.extra_args or {}).get(EXTRA_KEY) if params is not None else None
        if len(ROWS) <= index:
            ROWS.extend([None] * (index + 1 - len(ROWS)))
        ROWS[index] = None if args is None else args["key"]
        if args is None:
            continue
        state = STATES.get(args["key"])
        if state is None:
            state = RequestAudio.from_args(args, len(prompt_ids or ()))
            STATES[state.key] = state
        state.joins += 1
    for a, b, direction in update.moved:
        if direction == MoveDirectionality.SWAP:
            ROWS[a], ROWS[b] = ROWS[b], ROWS[a]
        else:
            ROWS[b], ROWS[a] = ROWS[a], None
    del ROWS[update.batch_size:]


def batch_rows(num_tokens: int) -> list[tuple[RequestAudio, int, int]]:
    """(state, first token, end token) of every tracked row of the running forward pass.

    Row boundaries come from the attention metadata's query_start_loc (rows in the persistent
    batch order the tracker follows). Empty outside a real forward pass (profiling, dummy runs).
    """
    if not is_forward_context_available():
        return []
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):  # micro-batching: not used by this engine
        return []
    starts = None
    for layer in (metadata or {}).values():
        starts = getattr(layer, "query_start_loc", None)
        if starts is not None:
            break
    if starts is None:
        return []
    bounds = [min(int(s), num_tokens) for s in starts.tolist()]
    rows = []
    for row, key in enumerate(ROWS[: len(bounds) - 1]):
        state = STATES.get(key) if key is not None else None
        if state is not None and bounds[row] < bounds[row + 1]:
            rows.append((state, bounds[row], bounds[row + 1]))
    return rows


def row_of(rows: list[tuple[RequestAudio, int, int]], token: int):
    """The row holding token index `token`, or None (padding, untracked rows)."""
    i = bisect.bisect_right([start for _, start, _ in rows], token) - 1
    if i >= 0 and rows[i][1] <= token < rows[i][2]:
        return rows[i][0]
    return None


class RequestTracker(LogitsProcessor):
    """A vLLM logits processor that only follows the batch rows; the logits pass unchanged.

    vLLM calls `update_state` before every forward pass, after the batch has been condensed
    and reordered, so ROWS matches the token order of that pass.
    """

    def __init__(self, vllm_config, device, is_pin_memory):
        ROWS.clear()  # a new engine in this process starts with an empty batch

    def is_argmax_invariant(self) -> bool:
        return True  # never changes the logits

    def update_state(self, batch_update) -> None:
        if batch_update is not None:
            _apply_batch_update(batch_update)

    def apply(self, logits: Tensor) -> Tensor:
        return logits


class AudioWorkerExtension:
    """Methods mixed into vLLM's worker class (`worker_extension_cls`), called by the engine
    through `collective_rpc`; every tensor-parallel rank answers, rank 0's answer is used."""

    def mimo_audio_take(self, keys: list[str]) -> dict[str, list]:
        """Newly decided codes of each request: {key: [(position, [F][K]), ...]}."""
        return {k: STATES[k].take() for k in keys if k in STATES}

    def mimo_audio_finish(self, key: str, last_token: int, last_position: int):
        """Decide the codes of a finished request's last group if that group is audio (a
        request capped by max_tokens has no next forward pass to do it), drop the state and
        return (codes not taken yet, times the request joined a batch)."""
        state = STATES.pop(key, None)
        if state is None:
            return [], 0
        model = self.model_runner.get_model()
        if last_token == model.empty_token and last_position not in state.codes:
            with torch.inference_mode():
                model.decide([state], [last_position])
        return state.take(), state.joins

    def mimo_audio_release(self, keys: list[str]) -> None:
        """Drop states (aborted requests, engine shutdown)."""
        for key in keys:
            STATES.pop(key, None)
