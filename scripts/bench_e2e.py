"""End to end on the full-size preset: the user's own `mimo-tts synth`, as subprocesses; JSON.

    flock /work/notes/bigmem.lock .venv/bin/python scripts/bench_e2e.py [--preset DIR]
        [--quick] [--dtype D] [--tokenizer-dtype D] [--out FILE]

The preset is scripts/make_full_size.py's (default .bench/full-size: 8.0 B LM in bfloat16, 1.3 B
tokenizer in float32; random weights whose control circuit speaks a few seconds and stops).
Three runs, each a fresh `mimo-tts synth --model DIR/lm --tokenizer DIR/tokenizer` child:

- `batch1`: one item (--text): load s, prefill s, s per group, Stage-0 / Stage-1 shares, RTF;
- `stream`: the same item with --stream: time to first audio (first_audio_s) beside its own
  prefill_s and s_per_group, the issue-24 target `first_audio_s <= prefill_s + 2 * s_per_group
  + 1` (`first_audio_target_s`, `meets_first_audio_target`) and the floor of an exact stream,
  `prefill_s + lead_groups * s_per_group` (no audio before the decoder's look-ahead is generated);
- `stream_before`: the same stream as before issue 24, back to back with `stream`: Stage-0 and
  Stage-1 on one thread each, side by side, and a first push of 5 groups past the look-ahead
  (the first audio after 15 groups, as the old 5-then-10 schedule); `stream_vs_before` holds the
  ratios before / after;
- `instruct`: the same item as tts_sft_with_instruct ("calm and slow"): the circuit's other
  layout (three `<|im_start|>`), which speaks longer;
- `batch8`: eight items (--input file, --batch-size 8): RTF over the batch.

Per run: the child's peak RSS (os.wait4 ru_maxrss) and its ratio to the weights in the run
dtypes (safetensors headers, mimo_tts.synthesis.preflight.weights_bytes), with the issue-11 target
peak <= 1.05 x weights + 0.8 GiB, and beside the peak the memory preflight's estimate for the
same command (`synth --dry-run`; `estimate_over_peak`, the rule is 1.0 to 1.1). Timings come
from the sidecar JSON the CLI writes next to each wav: `rtf` = synthesis seconds (prompt +
generate + decode) / audio seconds, `e2e_rtf` = the child's whole wall time (start-up and load
included) / audio seconds; `s_per_group` = (Stage-0 seconds - prefill) / the batch's steps (one
group for every row). --quick caps each item at 8 groups and runs a batch of 2 (`batch2`). Run
it alone (20 GB): under the lock above, on a quiet machine. `--preset tiny` runs the tiny
preset instead (seconds, any machine), and `--preset mid --max-new-groups 40`
bench_overlap.py's mid-size pair (LM hidden 1024, codec 10 decoder layers; it never stops by
itself).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import checkout_env, emit

GIB = 2**30
RUNS = ("batch1", "stream", "stream_split", "stream_before", "instruct", "batch")
TEXT = "Hello! This is the full-size model, speaking on this machine."
TEXTS = (TEXT, "The quick brown fox jumps over the lazy dog near the river bank.",
         "Welcome to the MiMo audio demo, it is nice to meet you.",
         "今天天气真好，我们一起去公园散步吧。", "Please speak slowly and clearly.",
         "One, two, three, four, five, six, seven, eight, nine, ten.",
         "我很高兴认识你，欢迎来到这里。", "Offline speech synthesis on a small CPU machine.")


def machine() -> dict:
    """CPU model, the ISA flags that decide bf16 speed, cores, memory and load."""
    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        fields = dict(line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        info["cpu"] = fields.get("model name", info["cpu"])
        flags = set(fields.get("flags", "").split())
        info["isa"] = sorted(flags & {"amx_bf16", "amx_tile", "amx_int8", "avx512_bf16",
                                      "avx512f", "avx2"})
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text()
                       .splitlines())
        for key, name in (("MemTotal", "ram_gib"), ("MemAvailable", "available_gib")):
            info[name] = round(int(meminfo[key].split()[0]) * 1024 / GIB, 1)
    except (OSError, ValueError, KeyError):
        pass
    info["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    return info


def checkout_envs(spec: str | None) -> dict:
    """`--checkouts NAME=DIR,...` -> {name: the child's environment (DIR's package first on
    PYTHONPATH)}; none given: {"": None} (this checkout)."""
    if not spec:
        return {"": None}
    envs = {}
    for part in spec.split(","):
        name, _, folder = part.partition("=")
        envs[name] = checkout_env(folder)
    return envs


def estimate(argv: list[str], env: dict | None = None) -> dict:
    """The memory preflight's estimate for the same command (`synth --dry-run --json`), GiB
    per device; the run itself checks the same estimate before it loads."""
    cmd = [sys.executable, "-m", "mimo_tts.cli", "synth", *argv, "--dry-run", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"error": (proc.stderr or proc.stdout)[-500:]}
    return {e["device"]: e["need_gib"] for e in report.get("memory") or []
            if isinstance(e, dict)}


def run_synth(argv: list[str], out_dir: Path, env: dict | None = None) -> dict:
    """One `mimo-tts synth` child: exit code, wall s, peak RSS, the preflight's estimate for
    it, and its items' sidecars."""
    need = estimate(argv, env)
    cmd = [sys.executable, "-m", "mimo_tts.cli", "synth", *argv, "--output-dir", str(out_dir),
           "--overwrite", "--json", "-q"]
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        lines, errors = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    run = {"command": shlex.join(["mimo-tts", "synth", *argv]), "exit_code": proc.returncode,
           "wall_s": round(wall, 2), "peak_rss_gib": round(usage.ru_maxrss * 1024 / GIB, 2),
           "estimate_gib": need.get("cpu"), "estimate": need}
    if run["estimate_gib"]:  # issue-22 rule: never below the peak, at most 10 % above it
        run["estimate_over_peak"] = round(run["estimate_gib"] / run["peak_rss_gib"], 3)
    items = [json.loads(line) for line in lines.splitlines() if line.startswith("{")]
    sidecars = [json.loads(Path(i["path"]).with_suffix(".json").read_text())
                for i in items if i.get("path")]
    if proc.returncode or not sidecars:
        run["stderr_tail"] = errors[-2000:]
    return run | {"sidecars": sidecars}


def summarise(run: dict, weights: dict) -> dict:
    """The figures of one run from its sidecars (timings are per item; load is per process)."""
    sidecars = run.pop("sidecars")
    if not sidecars:
        return run
    first = sidecars[0]
    dtypes = {part: first["placement"][f"{part}_dtype"]["value"] for part in ("lm", "tokenizer")}
    weight_bytes = weights["lm"][dtypes["lm"]] + weights["tokenizer"][dtypes["tokenizer"]]
    timings = [s["timings"] for s in sidecars]
    audio = sum(s["audio"]["seconds"] for s in sidecars)
    groups = [len(p["generated_text_ids"]) for s in sidecars for p in s["pieces"]]
    synth = sum(t.get("prompt_s", 0) + t.get("generate_s", 0) + t.get("decode_s", 0)
                for t in timings)
    stage0, stage1 = sum(t.get("generate_s", 0) for t in timings), sum(
        t.get("decode_s", 0) for t in timings)
    prefill = [p["timings"]["prefill_s"] for s in sidecars for p in s["pieces"]
               if "prefill_s" in p["timings"]]
    peak = run["peak_rss_gib"] * GIB
    out = run | {
        "items": len(sidecars), "dtypes": dtypes, "weights_gib": round(weight_bytes / GIB, 2),
        "peak_over_weights": round(peak / weight_bytes, 3),
        "peak_target_gib": round((1.05 * weight_bytes + 0.8 * GIB) / GIB, 2),
        "load_s": first["timings"].get("load_s"), "audio_s": round(audio, 2),
        "groups": groups, "rtf": round(synth / audio, 3) if audio else None,
        "e2e_rtf": round(run["wall_s"] / audio, 3) if audio else None,
    }
    if prefill:  # each item is prefilled alone, then the batch steps once per group: an
        # item's generate_s is its own prefill plus its share of each step (the runner's
        # busy time), so the steps' time is the sum less every prefill, not the first alone
        out["prefill_s"] = round(prefill[0], 3)
        out["prefills_s"] = round(sum(prefill), 3)
        out["s_per_group"] = round((stage0 - sum(prefill)) / max(groups), 3)
    if stage0 + stage1 and "first_audio_s" not in first["timings"]:
        out["stage0_share"] = round(stage0 / (stage0 + stage1), 3)
        out["stage1_share"] = round(stage1 / (stage0 + stage1), 3)
    if "first_audio_s" in first["timings"]:
        out |= stream_figures(first, max(groups))
    return out


def stream_figures(sidecar: dict, groups: int) -> dict:
    """A --stream item's first audio against its own prefill and group step (the issue-24
    target), and the floor any exact stream has: the decoder's look-ahead must be generated."""
    t, piece = sidecar["timings"], sidecar["pieces"][0]["timings"]
    out = {k: round(t[k], 3) for k in ("first_audio_s", "stage0_s", "stage1_s",
                                       "stage1_wait_s") if k in t}
    out["threads"] = sidecar.get("threads")
    if "prefill_s" not in piece:
        return out
    prefill, lead = piece["prefill_s"], piece.get("lead_groups", 0)
    step = (t["stage0_s"] - prefill) / max(groups - 1, 1)  # group 0 comes from the prefill
    target = prefill + 2 * step + 1
    out |= {"prefill_s": round(prefill, 3), "s_per_group": round(step, 3),
            "lead_groups": int(lead), "first_audio_target_s": round(target, 3),
            "meets_first_audio_target": t["first_audio_s"] <= target,
            "first_audio_floor_s": round(prefill + lead * step, 3)}
    return out


def weights_by_dtype(dirs: dict) -> dict:
    from mimo_tts.synthesis.preflight import weights_bytes

    return {part: {d: weights_bytes(folder, d) for d in ("bfloat16", "float32")}
            for part, folder in dirs.items()}


def checkpoint_dirs(preset: str) -> dict:
    """{"lm": dir, "tokenizer": dir} of the preset (`tiny`: the built-in one, written once)."""
    if preset == "tiny":
        from mimo_tts.presets import ensure_tiny_preset

        lm, tok = ensure_tiny_preset()
        return {"lm": Path(lm), "tokenizer": Path(tok)}
    if preset == "mid":  # bench_overlap.py's balanced pair; it never stops: --max-new-groups
        from bench_overlap import CODEC_DIMS, LM_DIMS, write_model

        lm, tok = write_model(Path(tempfile.gettempdir()) / "mimo-tts-bench", LM_DIMS, CODEC_DIMS)
        return {"lm": lm, "tokenizer": tok}
    root = Path(preset).resolve()
    if not (root / "complete").is_file():
        sys.exit(f"bench_e2e: no complete preset at {root}: run scripts/make_full_size.py")
    return {"lm": root / "lm", "tokenizer": root / "tokenizer"}


def before_profile(folder: Path) -> Path:
    """The profile of `stream_before`: a first push of 5 groups past the look-ahead."""
    path = folder / "stream-before.toml"
    path.write_text("stream_chunk_groups = 5\n", encoding="utf-8")
    return path


def compare_streams(runs: dict) -> dict | None:
    """Before / after ratios of the stream runs, paired round by round (`stream#2` with
    `stream_before#2`, ...), and their median (> 1: the new one is faster)."""
    out = {}
    for name in ("stream", "stream_split"):
        rows = []
        for key, before in runs.items():
            if key.split("#")[0] != "stream_before" or before.get("exit_code"):
                continue
            after = runs.get(key.replace("stream_before", name))
            if after and not after.get("exit_code"):
                rows.append({k: before[k] / after[k] for k in ("first_audio_s", "stage0_s",
                                                              "wall_s")
                             if after.get(k) and before.get(k)})
        if rows:
            out[name] = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
            out[name]["rounds"] = len(rows)
    return out or None


COMPARED = ("first_audio_s", "s_per_group", "rtf", "e2e_rtf", "prefill_s")


def compare_checkouts(runs: dict, names: list[str]) -> dict | None:
    """Per run, the first checkout's figure over each other's, paired round by round, and
    their median (> 1: the other checkout is faster, as every figure compared is a time)."""
    out = {}
    keys = [k for k in runs if "@" in k]
    if not keys:
        return None
    for key in keys:
        run, _, rest = key.partition("@")
        checkout, _, round_ = rest.partition("#")
        if checkout == names[0] or runs[key].get("exit_code"):
            continue
        base = runs.get(f"{run}@{names[0]}" + (f"#{round_}" if round_ else ""))
        if not base or base.get("exit_code"):
            continue
        row = {k: base[k] / runs[key][k] for k in COMPARED
               if isinstance(base.get(k), int | float) and runs[key].get(k)}
        out.setdefault(f"{run}: {names[0]} / {checkout}", []).append(row)
    return {name: {k: round(statistics.median(r[k] for r in rows if k in r), 3)
                   for k in COMPARED if any(k in r for r in rows)} | {"rounds": len(rows)}
            for name, rows in out.items()} or None


def compare_quant(runs: dict, quant: str) -> dict:
    """Per run with a `~quant` twin: the twin's figure over the unquantized one's (rtf,
    s_per_group, first audio, peak RSS)."""
    out = {}
    for key, run in runs.items():
        twin = runs.get(key.replace("#", f"~{quant}#", 1) if "#" in key else f"{key}~{quant}")
        if "~" in key or twin is None:
            continue
        out[key] = {k: round(twin[k] / run[k], 3) for k in ("rtf", "s_per_group",
                                                            "first_audio_s", "peak_rss_gib")
                    if isinstance(run.get(k), int | float) and run.get(k)
                    and isinstance(twin.get(k), int | float)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=".bench/full-size")
    ap.add_argument("--quick", action="store_true", help="8 groups per item, a batch of 2")
    ap.add_argument("--max-new-groups", type=int, default=None, help="pass it to synth")
    ap.add_argument("--dtype", default=None, help="pass --dtype to synth (default: its own)")
    ap.add_argument("--tokenizer-dtype", default=None, help="pass --tokenizer-dtype to synth")
    ap.add_argument("--runs", default=",".join(RUNS),
                    help="comma-separated: batch1, stream, stream_split, stream_before, "
                         "instruct, batch")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the runs this many times, every other round reversed")
    ap.add_argument("--checkouts", default=None, metavar="NAME=DIR,...",
                    help="run every run under each checkout (its package first on the child's "
                         "PYTHONPATH), back to back, order alternating by round; "
                         "`vs_checkouts` holds the first's times over each other's")
    ap.add_argument("--lm-quant", default=None, help="pass --lm-quant to synth")
    ap.add_argument("--also-unquantized", action="store_true",
                    help="with --lm-quant: run each run also without it, back to back (keys "
                         "without and with `~QUANT`); `quant_vs_unquantized` holds the ratios")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    unknown = sorted(set(args.runs.split(",")) - set(RUNS))
    if unknown:  # before a 20 GB model loads, not after the first runs
        ap.error(f"unknown --runs {', '.join(unknown)}; the runs are {', '.join(RUNS)}")
    dirs = checkpoint_dirs(args.preset)
    preset = dirs["lm"].parent
    common = ["--model", str(dirs["lm"]), "--tokenizer", str(dirs["tokenizer"])]
    common += ["--dtype", args.dtype] if args.dtype else []
    common += ["--tokenizer-dtype", args.tokenizer_dtype] if args.tokenizer_dtype else []
    groups = 8 if args.quick else args.max_new_groups
    common += ["--max-new-groups", str(groups)] if groups else []
    batch = 2 if args.quick else 8
    weights = weights_by_dtype(dirs)
    report = {"machine": machine(), "preset": str(preset), "quick": args.quick,
              "weights_gib": {part: {d: round(b / GIB, 2) for d, b in by.items()}
                              for part, by in weights.items()},
              "runs": {}}
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        items = Path(tmp) / "items.txt"
        items.write_text("\n".join(TEXTS[:batch]) + "\n", encoding="utf-8")
        argv = {"batch1": ["--text", TEXT], "stream": ["--text", TEXT, "--stream"],
                "stream_split": ["--text", TEXT, "--stream", "--lm-threads", "1",
                                 "--tokenizer-threads", "1"],
                "stream_before": ["--text", TEXT, "--stream", "--lm-threads", "1",
                                  "--tokenizer-threads", "1", "--config",
                                  str(before_profile(Path(tmp)))],
                "instruct": ["--text", TEXT, "--task", "tts_sft_with_instruct",
                             "--instruct", "calm and slow"],
                "batch": ["--input", str(items), "--batch-size", str(batch)]}
        names = args.runs.split(",")
        envs = checkout_envs(args.checkouts)
        quant = ["--lm-quant", args.lm_quant] if args.lm_quant else []
        variants = ({"": [], f"~{args.lm_quant}": quant} if quant and args.also_unquantized
                    else {"": quant})
        for round_ in range(args.rounds):  # every other round in the reverse order
            order = list(envs) if round_ % 2 == 0 else list(envs)[::-1]
            for name in names if round_ % 2 == 0 else names[::-1]:
                for checkout in order:
                    for variant, flags in variants.items():
                        key = f"batch{batch}" if name == "batch" else name
                        key += variant + (f"@{checkout}" if checkout else "")
                        key += f"#{round_ + 1}" if round_ else ""
                        print(f"bench_e2e: {key} ...", file=sys.stderr, flush=True)
                        run = run_synth(common + flags + argv[name],
                                        Path(tmp) / (name + variant), envs[checkout])
                        report["runs"][key] = summarise(run, weights)
    report["stream_vs_before"] = compare_streams(report["runs"])
    report["vs_checkouts"] = compare_checkouts(report["runs"], list(envs))
    if len(variants) > 1:
        report["quant_vs_unquantized"] = compare_quant(report["runs"], args.lm_quant)
    report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    emit(report, args.out)


if __name__ == "__main__":
    main()
