"""Benchmark continuous batching against static windows on the native engine; prints JSON.

The same items run two ways, back to back and alternating, best of --rounds:
- "static": today's windows of --batch items, each window one `generate` call whose rows
  all wait for its longest one (what BatchRunner did before continuous batching);
- "continuous": one `ContinuousBatcher` of --batch rows; a row that stops takes the next
  item at once (mimo_tts/lm/batching.py).
Then the first --check items, each with its own seed, run once more in a continuous batch of
3 rows and alone: the report says how many came out identical (codes and text tokens).
Every item has its own prompt length and its own number of groups (its text forced to
<|empty|> for n - 1 groups, then <|eostm|>), spread widely, so windows waste rows; audio is
sampled with the tts sampler. Throughput is the items' groups / wall seconds (prefills
included). Models: "full" is the real width with --layers backbone layers and random bfloat16
weights (bench_lm.build_model); "tiny" the tiny-a fixture LM in float32.

    .venv/bin/python scripts/bench_batching.py [--quick] [--model full,tiny] [--layers 1]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from _common import TINY_A
from bench_lm import QUIET, SPECIAL, _cpu_name, audio_prompt, build_model

from mimo_tts.lm.batching import ContinuousBatcher, Job, JobDone, Jobs
from mimo_tts.lm.generate import GenerationOptions, generate
from mimo_tts.lm.load import load_lm
from mimo_tts.lm.text import TextTokenizer


def forced(scripts: list[list[int]]):
    """A text-logits hook making row b's step-k token scripts[b][k] (its last one after)."""
    def hook(step: int, logits: torch.Tensor) -> torch.Tensor:
        out = logits.new_full(logits.shape, float("-inf"))
        for row, script in enumerate(scripts):
            out[row, script[min(step, len(script) - 1)]] = 0.0
        return out

    return hook


def make_items(model, special, count: int, groups: tuple[int, int], prompt: tuple[int, int],
               seed: int = 0) -> list[tuple[torch.Tensor, list[int]]]:
    """`count` (prompt ids, forced script) pairs: prompt and output lengths drawn uniformly
    from the `prompt` and `groups` ranges."""
    gen = torch.Generator().manual_seed(seed)
    items = []
    for n in range(count):
        size = int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=gen))
        length = int(torch.randint(groups[0], groups[1] + 1, (1,), generator=gen))
        items.append((audio_prompt(model, size, seed + n, special.empty),
                      [special.empty] * (length - 1) + [special.eostm]))
    return items


def options(hook) -> GenerationOptions:
    return GenerationOptions.for_task("tts", seed=1, text_logits_processor=hook)


def run_static(model, special, items, batch: int) -> tuple[int, int]:
    """Windows of `batch` items through `generate` -> (groups made, steps run)."""
    groups = steps = 0
    for start in range(0, len(items), batch):
        window = items[start:start + batch]
        outs = generate(model, [p for p, _ in window], options(forced([s for _, s in window])),
                        special)
        groups += sum(len(o.text_tokens) for o in outs)
        steps += max(len(o.text_tokens) for o in outs)
    return groups, steps


def run_continuous(model, special, items, batch: int) -> tuple[int, int]:
    """One continuous batch of `batch` rows over all items -> (groups made, steps run)."""
    jobs = [Job(p, options(forced([s]))) for p, s in items]
    batcher = ContinuousBatcher(model, special, batch, Jobs(jobs))
    groups = steps = 0
    while not (batcher.idle and batcher.source.exhausted):
        events = batcher.step()
        groups += sum(1 for e in events if hasattr(e, "output"))
        steps += 1
    return groups, steps - 1  # the last call found every row free


def identical_to_single_runs(model, special, items, rows: int) -> str:
    """Each item (its own seed) in one continuous batch of `rows` rows against its single
    run: "k of n" whose codes and text tokens are identical."""
    jobs = [Job(p, GenerationOptions(**{**options(forced([s])).__dict__, "seed": 11 + n}),
                key=n) for n, (p, s) in enumerate(items)]
    batcher = ContinuousBatcher(model, special, rows, Jobs(jobs))
    done = {e.job.key: e.generation for e in batcher.run() if isinstance(e, JobDone)}
    same = 0
    for job in jobs:
        alone = generate(model, [job.ids], job.options, special)[0]
        same += (done[job.key].text_tokens == alone.text_tokens
                 and torch.equal(done[job.key].new_ids, alone.new_ids))
    return f"{same} of {len(jobs)}"


def bench(name: str, model, special, args, groups: tuple[int, int],
          prompt: tuple[int, int]) -> dict:
    items = make_items(model, special, args.items, groups, prompt)
    kinds = {"static": run_static, "continuous": run_continuous}
    for fn in kinds.values():  # warm-up: kernel build, allocator, caches
        fn(model, special, items[:2], 2)
    seconds = {k: [] for k in kinds}
    counts = {}
    for _ in range(args.rounds):
        for kind, fn in kinds.items():
            QUIET()
            start = time.perf_counter()
            counts[kind] = fn(model, special, items, args.batch)
            seconds[kind].append(time.perf_counter() - start)
    made = {k: c[0] for k, c in counts.items()}
    assert made["static"] == made["continuous"] == sum(len(s) for _, s in items), made
    best = {k: min(v) for k, v in seconds.items()}
    rate = {k: round(made[k] / s, 2) for k, s in best.items()}
    lengths = [len(s) for _, s in items]
    check = items[:args.check] if args.check else []
    return {
        "identical_to_single_runs": identical_to_single_runs(model, special, check, 3)
        if check else "not checked",
        "model": name, "items": len(items), "batch": args.batch,
        "groups_per_item": {"min": min(lengths), "max": max(lengths),
                            "total": sum(lengths)},
        "prompt_groups": list(prompt),
        "steps": {k: c[1] for k, c in counts.items()},
        "seconds": {k: [round(x, 2) for x in v] for k, v in seconds.items()},
        "groups_per_s": rate,
        "continuous_over_static": round(rate["continuous"] / rate["static"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 8 items at batch 4, short outputs, one round")
    parser.add_argument("--model", default="full,tiny", help="full and/or tiny, comma-separated")
    parser.add_argument("--layers", type=int, default=1,
                        help="backbone layers of 'full' (1 keeps it under 3.2 GB)")
    parser.add_argument("--items", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (best of)")
    parser.add_argument("--groups", default=None,
                        help="MIN,MAX groups per item (default 4,48 for full, 8,160 for tiny)")
    parser.add_argument("--check", type=int, default=4,
                        help="items (own seeds, 3 rows) checked equal to their single runs")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--quiet-wait", type=float, default=3.0,
                        help="seconds to wait before each timed run for a quiet CPU (0: never)")
    args = parser.parse_args()
    if args.quick:
        args.items, args.batch, args.rounds = 8, 4, 1
    torch.set_num_threads(args.threads)
    QUIET.wait, QUIET.busy = args.quiet_wait, 0.1
    scale = 4 if args.quick else 1
    given = tuple(int(x) for x in args.groups.split(",")) if args.groups else None
    report = {"cpu": _cpu_name(), "cpu_count": os.cpu_count(),
              "threads": torch.get_num_threads(), "load_average_start": os.getloadavg()[0],
              "runs": []}
    for name in args.model.split(","):
        if name == "full":
            model = build_model(args.layers, "cpu", torch.bfloat16)
            report["runs"].append(bench(f"full width, {args.layers} backbone layers, bf16",
                                        model, SPECIAL, args, given or (4, 48 // scale), (16, 96)))
        elif name == "tiny":
            model = load_lm(TINY_A / "lm", device="cpu", dtype=torch.float32)
            special = TextTokenizer.from_dir(TINY_A / "lm").special
            report["runs"].append(bench("tiny-a, float32", model, special, args,
                                        given or (8, 160 // scale), (16, 96)))
        else:
            parser.error(f"unknown model {name!r}: full or tiny")
        del model
    report["load_average_end"] = os.getloadavg()[0]
    report["timed_runs_without_quiet_cpu"] = f"{QUIET.noisy} of {QUIET.calls}"
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
