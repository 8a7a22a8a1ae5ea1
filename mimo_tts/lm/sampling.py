"""MiMoSampler (spec §4.6): temperature, top-k, HF-style top-p, then sample or argmax."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

# The sampler settings and the per-task defaults are torch-free (the CLI's help reads them):
# they live in lm/config.py and are used, and re-exported, here.
from mimo_tts.lm.config import GREEDY, TASK_SAMPLERS, SamplerConfig, task_samplers  # noqa: F401


def filter_logits(logits: Tensor, cfg: SamplerConfig) -> Tensor:
    """Temperature, top-k (clipped to the vocab, ties kept) and top-p; dropped -> -inf."""
    # the best logit shifted to 0 first: a tiny temperature then sends the others to -inf,
    # never the best to inf (inf - inf in the softmax is NaN)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / cfg.temperature
    if cfg.top_k:
        k = min(cfg.top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - cfg.top_p)
        drop[..., -1:] = False  # always keep the best token
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


Rng = torch.Generator | None  # a sampled row's generator (None: greedy, or torch's default)


def sample(logits: Tensor, cfg: SamplerConfig | Sequence[SamplerConfig],
           generator: Rng | Sequence[Rng]) -> Tensor:
    """logits [B, V] -> token ids [B] (int64).

    One sampler and generator for all rows, or one of each per row (a continuous batch):
    row i then draws from generator i exactly what it would draw sampled alone.
    """
    if isinstance(cfg, SamplerConfig):
        if cfg.greedy:
            return logits.argmax(dim=-1)
        probs = filter_logits(logits.float(), cfg).softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    tokens = logits.argmax(dim=-1)
    rows_of: dict[SamplerConfig, list[int]] = {}
    for row, one in enumerate(cfg):
        if not one.greedy:
            rows_of.setdefault(one, []).append(row)
    for one, rows in rows_of.items():  # the filters are row-wise: rows of one sampler at once
        probs = filter_logits(logits[rows].float(), one).softmax(dim=-1)
        tokens[rows] = draw_rows(probs, [generator[row] for row in rows])
    return tokens


def draw_rows(probs: Tensor, generators: Sequence[Rng]) -> Tensor:
    """One draw per row of probs [n, V], row i from generators[i] -> ids [n].

    Row i gets what `torch.multinomial(probs[i:i + 1], 1, generator=generators[i])` gives (its
    one-sample form: argmax of p / q with q ~ Exp(1) drawn from the generator, checked equal in
    tests/lm/test_lm_sampling.py), without its per-call checks: one row costs one exponential
    draw, so a large batch does not pay a full multinomial call per row and channel.
    """
    if not bool(torch.isfinite(probs).all()):
        raise RuntimeError("probability tensor contains either `inf` or `nan`")
    noise = torch.empty_like(probs)
    inference = torch.is_inference_mode_enabled()  # thread-local: carried to the pool

    def draw(row: int) -> None:
        with torch.inference_mode(inference):
            noise[row].exponential_(1, generator=generators[row])

    pool = _draw_pool(probs.shape[-1]) if len(generators) > 1 and None not in generators else None
    if pool is None:
        for row in range(len(generators)):
            draw(row)
    else:  # each row has its own generator: the rows' draws are independent
        for future in [pool.submit(draw, row) for row in range(len(generators))]:
            future.result()
    return (probs / noise).argmax(dim=-1)


PARALLEL_DRAW_VOCAB = 16384  # from this many ids a row's draw outweighs a thread hand-off
_pools: dict[int, ThreadPoolExecutor] = {}  # by thread count


def _draw_pool(vocab: int) -> ThreadPoolExecutor | None:
    """Threads for the rows' exponential draws of a large vocab (the text head's 151680 ids:
    ~4 ms a row, serial inside torch, GIL released), one per torch thread; None when a
    row's draw is cheap or torch runs on one thread."""
    threads = torch.get_num_threads()
    if vocab < PARALLEL_DRAW_VOCAB or threads < 2:
        return None
    if threads not in _pools:
        _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="mimo-draw")
    return _pools[threads]
