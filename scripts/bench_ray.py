"""The Ray Data pipeline against one `mimo-tts synth` process on the same items; JSON.

    .ray-venv/bin/python scripts/bench_ray.py [--model tiny|wide4] [--items 8] [--rounds 2]
        [--max-new-groups 8] [--out FILE]

Each round runs, back to back and alternating, a fresh `mimo-tts synth --input` child (one
process, torch's threads: `cli`), the same with OMP_NUM_THREADS=1 (`cli_1t`: what each Ray actor
gets) and a fresh `scripts/ray_synth.py` child (a local Ray instance on all cores: one Stage-0
actor, one Stage-1 actor: `ray`), each into an empty folder; wall seconds include
start-up, loading and Ray's actor start. Reports best-of-rounds wall time, items/s and audio
seconds/s of each, Ray's throughput over each CLI run's, whether every wav is byte-identical
between the runs, and how many cores other processes kept busy just before.
`wide4` is the full-width LM (hidden 4096, full local transformers) with 4 backbone layers in
bfloat16 and the tiny tokenizer (random weights, written once to .bench/wide4).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import busy_cores
from bench_e2e import machine

from mimo_tts.presets.lm import FULL_LM
from mimo_tts.presets.write import write_random_checkpoint

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def checkpoint(name: str) -> tuple[str, str | None]:
    """(--model, --tokenizer or None) of the benchmark's model."""
    if name == "tiny":
        return "tiny", None
    import torch

    lm, tok = write_random_checkpoint(REPO / ".bench" / "wide4",
                                      {**FULL_LM, "num_hidden_layers": 4},
                                      lm_dtype=torch.bfloat16)
    return str(lm), str(tok)


def timed(argv: list[str], env: dict) -> tuple[float, int, str]:
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    return time.perf_counter() - start, proc.returncode, proc.stderr[-500:]


def audio_seconds(folder: Path) -> float:
    return sum(json.loads(line)["seconds"] for line in
               (folder / "tts_sft" / "results.jsonl").read_text().splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny", choices=("tiny", "wide4"))
    ap.add_argument("--items", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-groups", type=int, default=8)
    ap.add_argument("--out")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        report = measure(a, Path(tmp))
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


def measure(a, work: Path) -> dict:
    lines = work / "lines.txt"
    lines.write_text("".join(f"Benchmark sentence number {i}, read aloud.\n"
                             for i in range(a.items)))
    lm, tok = checkpoint(a.model)
    model = ["--model", lm]
    env = {**os.environ, "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
    if tok:  # both runs find the tokenizer by its env variable (ray_synth.py has no flag)
        env["MIMO_AUDIO_TOKENIZER_PATH"] = tok
    groups = ["--max-new-groups", str(a.max_new_groups)]
    runs: dict[str, list] = {"cli": [], "cli_1t": [], "ray": []}
    others = busy_cores()
    for r in range(a.rounds):
        for kind in runs:
            out = work / f"{kind}-{r}"
            argv = ([sys.executable, str(REPO / "scripts" / "ray_synth.py"), str(lines),
                     "--output-dir", str(out), *model, *groups] if kind == "ray" else
                    [str(BIN / "mimo-tts"), "synth", "--input", str(lines), "--output-dir",
                     str(out), "-q", *model, *groups])
            wall, rc, err = timed(argv, {**env, "OMP_NUM_THREADS": "1"} if kind == "cli_1t"
                                  else env)
            runs[kind].append({"wall_s": round(wall, 2), "exit_code": rc,
                               **({"stderr": err} if rc else {})})
    wavs = {kind: {p.name: p.read_bytes() for p in (work / f"{kind}-0" / "tts_sft").glob("*.wav")}
            for kind in runs}
    audio = audio_seconds(work / "cli-0")
    best = {kind: min(x["wall_s"] for x in v) for kind, v in runs.items()}
    return {
        "machine": machine(), "model": a.model, "items": a.items,
        "max_new_groups": a.max_new_groups, "audio_s": round(audio, 2),
        "runs": runs, "best_wall_s": best,
        "items_per_s": {k: round(a.items / v, 3) for k, v in best.items()},
        "audio_s_per_s": {k: round(audio / v, 3) for k, v in best.items()},
        "ray_over_cli_throughput": round(best["cli"] / best["ray"], 3),
        "ray_over_cli_1t_throughput": round(best["cli_1t"] / best["ray"], 3),
        "byte_identical": {k: wavs[k] == wavs["ray"] and len(wavs[k]) == a.items
                           for k in ("cli", "cli_1t")},
        "other_busy_cores_before": round(others, 2),
        "ray_layout": "local Ray on all cores: 1 Stage-0 actor (1 CPU), 1 Stage-1 actor (1 CPU)",
        "cli_layout": "one mimo-tts synth process: torch's default threads (cli), one (cli_1t)",
    }


if __name__ == "__main__":
    main()
