"""A group step with `--stream` against the same step without it, in one process; JSON.

Issue 31 item 6 asks that a streamed group step cost at most 1.1x the same step without
streaming, idle and beside one busy process. `bench_e2e.py --runs batch1,stream` measures it
across two `mimo-tts synth` children, each paying its own load; on a VM whose memory bandwidth
moves by 30% from one minute to the next, those two children's steps differ by more than the
target. Here both kinds run in ONE process on ONE loaded model, alternating (whole, stream),
(stream, whole), ..., with the same text and seed, so both make the same groups:

- `whole`: the speech worker without streaming; Stage-1 decodes once the item's codes are done;
- `stream`: the worker as `--stream` and `MiMoTTS.stream` run it: Stage-1 decodes the growing
  pushes between Stage-0 steps (in turns on up to 8 cores).

A run's step time is its Stage-0 busy time less its prefill (the worker's own timings, which
leave Stage-1's turns out). `stream_over_whole` is each round's pair, and the sum over all
rounds. `--busy` starts `python -c 'while True: pass'` beside the runs (one busy process on
the same cores) and stops it at the end.

    .venv/bin/python scripts/bench_stream_steps.py [--preset .bench/full-size] [--rounds 4]
        [--busy] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from _common import emit
from bench_e2e import TEXT, machine

TARGET = 1.1


def one_run(tts, options, stream: bool) -> dict:
    """One item through the speech worker, streamed or whole: its timings."""
    from mimo_tts.synthesis.worker import SpeechJob

    prompts = tts.prompts(TEXT, options, options.seed)
    generation = options.generation_options(options.seed)
    jobs = [SpeechJob(p, generation, options.seed, decode="stream" if stream else "whole",
                      label="bench", order=(0, i), key=i) for i, p in enumerate(prompts)]
    worker = tts.worker(1, stream=stream, schedule=(
        options.stream_mode, options.stream_chunk_groups, options.stream_max_chunk_groups))
    start = time.perf_counter()
    for _ in worker.run(jobs):
        pass
    wall = time.perf_counter() - start
    t = jobs[0].timings
    steps = t["stage0_s"] - t["prefill_s"]
    return {"stream": stream, "prefill_s": round(t["prefill_s"], 3),
            "stage0_s": round(t["stage0_s"], 3), "steps_s": round(steps, 3),
            "stage1_s": round(t.get("stage1_s", 0.0), 3), "wall_s": round(wall, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default=".bench/full-size",
                        help="a folder with lm/ and tokenizer/ (scripts/make_full_size.py's)")
    parser.add_argument("--rounds", type=int, default=4, help="pairs of runs, order alternating")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-new-groups", type=int, default=None, help="cap each item")
    parser.add_argument("--busy", action="store_true",
                        help="run beside one busy process (a Python loop) on the same cores")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    root = Path(args.preset)
    if not (root / "lm").is_dir() or not (root / "tokenizer").is_dir():
        sys.exit(f"bench_stream_steps: no lm/ and tokenizer/ in {root}: run "
                 "scripts/make_full_size.py (or name a preset with --preset)")

    import mimo_tts

    report = {"machine": machine(), "preset": str(root), "busy": args.busy, "target": TARGET}
    start = time.perf_counter()
    tts = mimo_tts.load(str(root / "lm"), str(root / "tokenizer"))
    report["load_s"] = round(time.perf_counter() - start, 2)
    options = replace(tts.options, seed=args.seed, **(
        {} if args.max_new_groups is None else {"max_new_groups": args.max_new_groups}))
    one_run(tts, options, stream=False)  # warm-up: first calls, page faults
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    runs = []
    try:
        for r in range(args.rounds):
            pair = {}
            for stream in (False, True) if r % 2 == 0 else (True, False):
                run = one_run(tts, options, stream) | {"round": r}
                runs.append(run)
                pair[stream] = run["steps_s"]
                print(f"bench_stream_steps: round {r} {'stream' if stream else 'whole'} "
                      f"{run['steps_s']} s of steps", file=sys.stderr)
            runs[-1]["stream_over_whole"] = round(pair[True] / pair[False], 3)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    pairs = [r["stream_over_whole"] for r in runs if "stream_over_whole" in r]
    total = {s: sum(r["steps_s"] for r in runs if r["stream"] == s) for s in (False, True)}
    report |= {"runs": runs, "stream_over_whole_by_round": pairs,
               "stream_over_whole_median": statistics.median(pairs),
               "stream_over_whole_total": round(total[True] / total[False], 3),
               "meets_target": total[True] / total[False] <= TARGET}
    report["machine"]["loadavg_end"] = machine()["loadavg"]
    emit(report, args.out)


if __name__ == "__main__":
    main()
