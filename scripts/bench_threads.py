"""The LM's group step on the library's two threads, in one process; prints JSON.

    flock /work/notes/bigmem.lock .venv/bin/python scripts/bench_threads.py [--preset DIR]
        [--lm-quant w4a8] [--tokenizer-dtype bfloat16] [--rounds 4] [--out FILE]

`MiMoTTS.synthesize` runs Stage-0 in the caller's thread; `MiMoTTS.stream` runs it in a thread
of its own (Stage-1 in turns between its steps), as the servers' Stage-0 thread does. Each
thread that runs a parallel region keeps an OpenMP team, and with more teams' threads than
cores libgomp spins only briefly before it sleeps (`mimo_tts/runtime/openmp.py`), so the
stream gives the caller's team back first (`release_team`). Three runs of the same text and
seed, in turns, every other round reversed, one model loaded once:

- `synthesize`: the caller's thread;
- `stream`: the library's stream as it is;
- `stream_team_kept`: the same stream with `release_team` made a no-op here, as before it.

Before each run the caller's thread runs one parallel op, so its team is there as a load or a
synthesize in that thread leaves it.

Per run: the median time of a group (the batch's `step` plus the backbone's `_feed` before
it, timed around the calls; the first two groups left out), its groups, its wall time and
the process's system CPU seconds. `over_synthesize` holds each stream's median over the
synthesize run of its round. The preset is scripts/make_full_size.py's; `--preset tiny`
runs the tiny one (seconds, any machine).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path

from _common import emit
from bench_e2e import machine

REPO = Path(__file__).resolve().parents[1]
TEXT = "Hello! This is the full-size model, speaking on this machine."
RUNS = ("synthesize", "stream", "stream_team_kept")


class GroupClock:
    """Times every batch step and backbone feed of this process (both stages' own code
    unchanged: the calls are wrapped)."""

    def __init__(self):
        from mimo_tts.lm import batching

        self.events: list[tuple[str, float]] = []
        for name in ("step", "_feed"):
            inner = getattr(batching.ContinuousBatcher, name)
            setattr(batching.ContinuousBatcher, name, self._timed(name, inner))

    def _timed(self, name, inner):
        def call(batcher, *args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(batcher, *args, **kwargs)
            finally:
                self.events.append((name, time.perf_counter() - start))
        return call

    def groups(self) -> list[float]:
        """Seconds per group: a step and the feed before it (the first two groups left out:
        the prefill's and the first feed's)."""
        out, feed = [], 0.0
        for name, seconds in self.events:
            if name == "_feed":
                feed = seconds
            else:
                out.append(feed + seconds)
                feed = 0.0
        return [g for g in out if g > 0][2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default=str(REPO / ".bench" / "full-size"),
                        help="a make_full_size.py directory (lm/, tokenizer/), or tiny")
    parser.add_argument("--lm-quant", default=None, help="pass lm_quant to mimo_tts.load")
    parser.add_argument("--tokenizer-dtype", default=None)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()

    import torch

    import mimo_tts
    from mimo_tts.synthesis import speech

    clock = GroupClock()
    if args.preset == "tiny":
        tts = mimo_tts.load("tiny", lm_device="cpu", tokenizer_device="cpu",
                            tokenizer_dtype=args.tokenizer_dtype, lm_quant=args.lm_quant)
    else:
        tts = mimo_tts.load(f"{args.preset}/lm", f"{args.preset}/tokenizer",
                            lm_device="cpu", tokenizer_device="cpu",
                            tokenizer_dtype=args.tokenizer_dtype, lm_quant=args.lm_quant)
    release = speech.release_team

    def run(kind: str) -> dict:
        speech.release_team = release if kind != "stream_team_kept" else (lambda: False)
        torch.ones(1 << 22).exp_()  # the caller's team, as a load or a synthesize leaves it
        clock.events.clear()
        sys_before, start = resource.getrusage(resource.RUSAGE_SELF).ru_stime, time.time()
        if kind == "synthesize":
            tts.synthesize(args.text, seed=1)
        else:
            for _ in tts.stream(args.text, seed=1):
                pass
        groups = clock.groups()
        return {"s_per_group": round(statistics.median(groups), 4), "groups": len(groups) + 2,
                "wall_s": round(time.time() - start, 2),
                "sys_s": round(resource.getrusage(resource.RUSAGE_SELF).ru_stime - sys_before,
                               2)}

    run("synthesize")  # warm: first-touch pages, kernels built, caches
    rounds = []
    for index in range(args.rounds):
        order = RUNS if index % 2 == 0 else RUNS[::-1]
        rounds.append({kind: run(kind) for kind in order})
    speech.release_team = release
    for r in rounds:
        r["over_synthesize"] = {kind: round(r[kind]["s_per_group"]
                                            / r["synthesize"]["s_per_group"], 3)
                                for kind in RUNS[1:]}
    ratios = {kind: [r["over_synthesize"][kind] for r in rounds] for kind in RUNS[1:]}
    report = {"machine": machine(), "preset": args.preset, "lm_quant": args.lm_quant,
              "tokenizer_dtype": args.tokenizer_dtype, "threads": torch.get_num_threads(),
              "rounds": rounds,
              "median_over_synthesize": {k: round(statistics.median(v), 3)
                                         for k, v in ratios.items()}}
    emit(report, args.out)


if __name__ == "__main__":
    main()
