"""Check the CUDA-graph decode step of the LM against eager decoding on a GPU; prints JSON.

1. Exactness (tiny-a fixtures, float32): every generation case and a left-padded batch of
   three prompts, decoded with captured graphs and eagerly: greedy ids identical to the
   reference, step logits within the fixture tolerance, graph vs eager logits close.
2. Speed (the real width with random weights, bfloat16, as scripts/bench_lm.py builds it):
   ms per generated group, eager vs graphs, batch 1 and 8, and how often the greedy codes
   of the two agree (random bf16 weights sit near ties, so this is reported, not asserted).

Without CUDA it says so and exits 0. `--device cpu --mode static` runs the same script with
the graphs' fixed-shape step uncaptured (a dry run of everything but the capture).

    .venv/bin/python scripts/check_lm_cuda_graph.py [--layers 36] [--groups 24]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from _common import TINY_A

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-4
PADDED = ("gen_tts_en_forced", "gen_tts_zh_forced_interleaved", "gen_tts_instruct_forced")


def _cases():
    cases = json.loads((TINY_A / "cases" / "cases.json").read_text())
    for group, grp in cases["groups"].items():
        for case in grp["cases"]:
            if case["task"] == "lm_generate":
                yield group, case


def _forcing(scripts):
    def hook(step, logits):
        forced = torch.full_like(logits, float("-inf"))
        for row, script in enumerate(scripts):
            forced[row, script[min(step, len(script) - 1)]] = 0.0
        return forced

    return hook


def exactness(device: str, mode: str) -> dict:
    """Graph (or `mode`) vs eager vs the reference on every tiny-a generation case."""
    from safetensors.torch import load_file

    from mimo_tts.lm.generate import GenerationOptions, generate
    from mimo_tts.lm.load import load_lm
    from mimo_tts.lm.sampling import GREEDY
    from mimo_tts.lm.text import TextTokenizer

    lm_dir, case_dir = TINY_A / "lm", TINY_A / "cases"
    model = load_lm(lm_dir, device=device, dtype=torch.float32)
    special = TextTokenizer.from_dir(lm_dir).special
    tensors = {}
    rows, ok = [], True
    runs = [(case["name"], [group], [case]) for group, case in _cases()]
    by_name = {case["name"]: (group, case) for group, case in _cases()}
    runs.append(("padded_batch", [by_name[n][0] for n in PADDED], [by_name[n][1] for n in PADDED]))
    for label, groups, cases in runs:
        for group in groups:
            if group not in tensors:
                tensors[group] = load_file(str(case_dir / f"{group}.safetensors"))
        prompts = [tensors[g][f"{c['name']}.input_ids"] for g, c in zip(groups, cases, strict=True)]
        scripts = [c["params"]["forced_script_ids"] for c in cases]
        hook = _forcing(scripts) if all(scripts) else None
        limit = min(c["params"]["max_new_groups"] for c in cases)
        out = {}
        for step in ("eager", mode):
            options = GenerationOptions(text_sampler=GREEDY, audio_sampler=GREEDY,
                                        max_new_groups=limit, keep_logits=True,
                                        text_logits_processor=hook, decode_step=step)
            out[step] = generate(model, prompts, options, special)
        row = {"case": label, "ids_equal_reference": True, "logits_vs_reference": 0.0,
               "logits_graph_vs_eager": 0.0}
        for g, c, e, r in zip(groups, cases, out["eager"], out[mode], strict=True):
            ref = tensors[g]
            row["ids_equal_reference"] &= torch.equal(r.new_ids, ref[f"{c['name']}.new_ids"].long())
            row["ids_equal_reference"] &= torch.equal(e.new_ids, r.new_ids)
            row["logits_vs_reference"] = max(row["logits_vs_reference"], (
                r.step_logits - ref[f"{c['name']}.step_text_logits"]).abs().max().item())
            row["logits_graph_vs_eager"] = max(row["logits_graph_vs_eager"], (
                r.step_logits - e.step_logits).abs().max().item())
        row["ok"] = row["ids_equal_reference"] and row["logits_vs_reference"] <= TOL
        ok &= row["ok"]
        rows.append(row)
    return {"cases": rows, "ok": ok}


def speed(device: str, mode: str, layers: int, groups: int) -> dict:
    """ms per group, eager vs `mode`, at the real width (random bf16 weights)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_lm import SPECIAL, audio_prompt, build_model

    from mimo_tts.lm.generate import GenerationOptions, stream
    from mimo_tts.lm.sampling import GREEDY

    model = build_model(layers, device, torch.bfloat16)

    def force_empty(step, logits):
        logits = logits.clone()
        logits[:, SPECIAL.empty] = 1e4
        return logits

    result = {"backbone_layers": layers}
    for batch in (1, 8):
        prompts = [audio_prompt(model, 48, seed) for seed in range(batch)]
        codes, times = {}, {}
        for step in ("eager", mode):
            options = GenerationOptions(text_sampler=GREEDY, audio_sampler=GREEDY,
                                        max_new_groups=groups, decode_step=step,
                                        text_logits_processor=force_empty)
            marks, got = [], []
            for out in stream(model, prompts, options, SPECIAL):
                got.append(out.codes)
                if out.index == 0:
                    if device.startswith("cuda"):
                        torch.cuda.synchronize()
                    marks.append(time.perf_counter())
            gaps = sorted(b - a for a, b in zip(marks[4:], marks[5:], strict=False))
            times[step] = round(1e3 * gaps[len(gaps) // 2], 2)  # after capture and warm-up
            codes[step] = torch.stack(got)
        same = (codes["eager"] == codes[mode]).all(-1).all(-1).float().mean().item()
        result[f"batch{batch}"] = {"ms_per_group": times,
                                   "speedup": round(times["eager"] / times[mode], 2),
                                   "groups_with_equal_codes": round(same, 3)}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--mode", default="graph", choices=["graph", "static"],
                        help="static: the fixed-shape step without capture (dry run)")
    parser.add_argument("--layers", type=int, default=36, help="backbone layers for timing")
    parser.add_argument("--groups", type=int, default=24, help="groups per timed generation")
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "ok": True,
                          "message": "no CUDA device here: nothing to check"}))
        return 0
    torch.manual_seed(0)
    report = {"device": args.device, "mode": args.mode, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    report["exactness"] = exactness(args.device, args.mode)
    if not args.skip_speed:
        report["speed"] = speed(args.device, args.mode, args.layers, args.groups)
    report["ok"] = report["exactness"]["ok"]
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
