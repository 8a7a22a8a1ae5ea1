"""Benchmark the backbone's attention of one query: the CPU kernel's against PyTorch's; JSON.

Two measurements, both with the two attentions alternated in one process (best of --rounds):

- alone: `cpu_kernel.Attention` and `attend_one` (PyTorch's bfloat16 attention) on the
  backbone's head layout (32 query heads over 8 kv heads of 128 at full size, read from the
  model config) for rows x keys in --shapes; with each one's largest error against a float64
  softmax;
- in a step: the kernel step's backbone (`--layers` layers and lm_head, random weights at the
  real width, packed as a load packs them) at batch 1 and 8 after prompts of --groups groups,
  with its `attend` set to each in turn.

Example: python scripts/bench_attention.py --layers 36 --groups 48,200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_lm  # noqa: E402

from mimo_tts.lm import cpu_kernel  # noqa: E402
from mimo_tts.lm.generate import GenerationOptions, prefill  # noqa: E402
from mimo_tts.lm.model import KVCache  # noqa: E402
from mimo_tts.runtime.fixed_order import attend_one  # noqa: E402
from mimo_tts.runtime.measured import alternating_best  # noqa: E402


def alone(kernel, heads: int, kv: int, dim: int, shapes, rounds: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for rows, keys in shapes:
        q = torch.randn(rows, heads, 1, dim, generator=gen).bfloat16()
        k, v = (torch.randn(rows, kv, keys, dim, generator=gen).bfloat16() for _ in range(2))
        out.append({"rows": rows, "keys": keys} | _pair(kernel, q, k, v, rounds))
        print(f"alone {rows} x {keys}: {out[-1]['ms']}", file=sys.stderr, flush=True)
    return out


def _pair(kernel, q, k, v, rounds: int) -> dict:
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                          enable_gqa=q.shape[1] != k.shape[1])
    calls = 50
    best = dict(zip(("kernel", "torch"), (t / calls for t in alternating_best(
        lambda: [kernel(q, k, v) for _ in range(calls)],
        lambda: [attend_one(q, k, v) for _ in range(calls)], rounds)), strict=True))
    return {"ms": {n: round(t * 1e3, 3) for n, t in best.items()},
            "torch_over_kernel": round(best["torch"] / best["kernel"], 2),
            "error_vs_float64": {
                "kernel": float((kernel(q, k, v).double() - want).abs().max()),
                "torch": float((attend_one(q, k, v).double() - want).abs().max())}}


def in_step(model, kernel, batches, groups, rounds: int) -> list[dict]:
    out = []
    for batch in batches:
        for g in groups:
            out.append(_step_pair(model, kernel, batch, g, rounds))
            print(f"in a step, batch {batch}, {out[-1]['keys']} keys: "
                  f"{out[-1]['backbone_ms']}", file=sys.stderr, flush=True)
    return out


@torch.inference_mode()
def _step_pair(model, kernel, batch: int, groups: int, rounds: int) -> dict:
    prompts = [bench_lm.audio_prompt(model, groups, seed) for seed in range(batch)]
    options = GenerationOptions(text_sampler=bench_lm.GREEDY, audio_sampler=bench_lm.GREEDY,
                                max_new_groups=64)
    state = prefill(model, prompts, options, bench_lm.SPECIAL)
    local = KVCache(model.cfg.patch_decoder, batch, model.cfg.local_steps,
                    dtype=state.hidden.dtype, device="cpu")
    step = cpu_kernel.CpuKernelStep(model, state.cache, local, state.valid)
    embeds, slot = state.hidden.unsqueeze(1), state.prompt_len

    def backbone(attend):
        step.attend = attend
        return step.backbone(embeds, state.lengths, slot)

    best = dict(zip(("kernel", "torch"), alternating_best(
        lambda: backbone(kernel), lambda: backbone(attend_one), rounds), strict=True))
    return {"batch": batch, "keys": slot + 1,
            "backbone_ms": {n: round(t * 1e3, 1) for n, t in best.items()},
            "saved_ms": round((best["torch"] - best["kernel"]) * 1e3, 1)}


def _numbers(text: str) -> list[int]:
    """ "1,8" -> [1, 8]: positive whole numbers, or argparse's one-line error."""
    try:
        values = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not numbers separated by commas") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every number must be 1 or more")
    return values


def _shapes(text: str) -> list[tuple[int, int]]:
    """ "1x64,8x256" -> [(1, 64), (8, 256)], or argparse's one-line error."""
    try:
        shapes = [tuple(_numbers(part.replace("x", ","))) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        shapes = []
    if not shapes or any(len(shape) != 2 for shape in shapes):
        raise argparse.ArgumentTypeError(f"{text!r} is not ROWSxKEYS separated by commas")
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="backbone layers in the step (0: "
                    "the attention alone only)")
    ap.add_argument("--groups", type=_numbers, default="48,200",
                    help="prompt groups before the step")
    ap.add_argument("--batch", type=_numbers, default="1,8", help="batch sizes of the step")
    ap.add_argument("--shapes", type=_shapes, default="1x64,8x64,8x256,1x700",
                    help="rows x keys of the attention alone")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.layers < 0 or args.rounds < 1 or (args.threads is not None and args.threads < 1):
        ap.error("--layers must be 0 or more, --rounds and --threads 1 or more")
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = cpu_kernel.library()
    if lib is None:
        print(f"bench_attention: the CPU kernel cannot run here: {cpu_kernel._build()[1]}",
              file=sys.stderr)
        sys.exit(1)
    kernel = cpu_kernel.Attention(lib)
    model = bench_lm.build_model(max(args.layers, 1), "cpu", torch.bfloat16)
    cfg = model.cfg.backbone
    report = {"cpu": bench_lm._cpu_name(), "threads": torch.get_num_threads(),
              "heads": cfg.heads, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
              "alone": alone(kernel, cfg.heads, cfg.kv_heads, cfg.head_dim, args.shapes,
                             args.rounds)}
    if args.layers:
        cpu_kernel.prepare(model)
        report["backbone_layers"] = args.layers
        report["in_step"] = in_step(model, kernel, args.batch, args.groups, args.rounds)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
