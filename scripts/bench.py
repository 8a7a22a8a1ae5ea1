"""Run every issue-5 benchmark as a subprocess and write one JSON report (and print it).

Sub-benchmarks: codec decode/encode in float32 and bfloat16 with the fraction of the measured
matmul peak and the streaming decode (`bench_codec.py`), the LM group step at batch 1/4/8 against
the memory-bandwidth floor (`bench_lm.py`), Stage-0/Stage-1 overlap with `--stream`
(`bench_overlap.py`), CLI start-up and tokenizer-loading RSS (`bench_startup.py`), and the vLLM
engine when its venv exists (`bench_vllm.py`). A failing sub-benchmark is recorded with its exit
code and stderr tail; the others still run. `summary` holds the headline numbers beside their
targets, and `--table` prints them as the Markdown table of README "Benchmarks".

    .venv/bin/python scripts/bench.py [--quick] [--out .bench/report.json] [--only codec,lm]
    .venv/bin/python scripts/bench.py --table --from .bench/report.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from _common import busy_cores

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
VLLM_PYTHON = REPO / ".vllm-venv" / "bin" / "python"
DEFAULT_OUT = REPO / ".bench" / "report.json"


# --- what to run ---------------------------------------------------------------------------------


# name: (script, interpreter, argv of each run, argv added by --quick, timeout s (full, quick))
BENCHMARKS = {
    "codec": ("bench_codec.py", sys.executable, [[]], ["--quick"], (3600, 1200)),
    "lm": ("bench_lm.py", sys.executable, [["--batch", "1,4,8"]], ["--quick"], (2400, 900)),
    # --stream's default decoder and the official scheme, each against the stages alone
    "overlap": ("bench_overlap.py", sys.executable,
                [["--stream-mode", "official"], ["--stream-mode", "incremental"]], ["--quick"],
                (1800, 900)),
    "startup": ("bench_startup.py", sys.executable, [[]], ["--quick"], (1800, 900)),
    "vllm": ("bench_vllm.py", str(VLLM_PYTHON), [[]], ["--groups", "8", "--repeat", "1"],
             (2400, 900)),
}


# --- running -------------------------------------------------------------------------------------


def last_json(text: str):
    """The last JSON object that starts a line (scripts may log JSON lines before the report)."""
    decoder, found = json.JSONDecoder(), None
    for match in re.finditer(r"(?m)^\{", text):
        try:
            found = decoder.raw_decode(text, match.start())[0]
        except json.JSONDecodeError:
            continue
    return found


def run_one(script: str, python: str, argv: list[str], timeout: int) -> dict:
    """One subprocess: status, exit code, seconds, the parsed JSON (or the stderr tail)."""
    cmd = [python, str(SCRIPTS / script), *argv]
    start = time.perf_counter()
    record = {"argv": [script, *argv], "load_average_before": os.getloadavg()[0]}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-2000:]
        return record | {"status": "failed", "error": f"timed out after {timeout} s",
                         "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes)
                         else tail, "seconds": round(time.perf_counter() - start, 1)}
    record |= {"seconds": round(time.perf_counter() - start, 1), "exit_code": done.returncode,
               "load_average_after": os.getloadavg()[0]}
    output = last_json(done.stdout) if done.returncode == 0 else None
    if output is None:
        reason = (f"exit code {done.returncode}" if done.returncode
                  else "no JSON report on stdout")
        return record | {"status": "failed", "error": reason,
                         "stderr_tail": done.stderr.strip()[-3000:]}
    return record | {"status": "ok", "output": output}


def wait_quiet(max_busy: float | None, patience_s: float) -> dict:
    """Wait until other work keeps at most `max_busy` cores busy (or patience runs out)."""
    if max_busy is None:
        return {}
    start = time.perf_counter()
    while True:
        cores = busy_cores()
        waited = time.perf_counter() - start
        if cores <= max_busy or waited >= patience_s:
            return {"busy_cores_at_start": round(cores, 2), "waited_s": round(waited),
                    "quiet": cores <= max_busy}
        print(f"[bench] machine busy ({cores:.2f} cores); waiting", file=sys.stderr, flush=True)


def run_benchmark(name: str, quick: bool) -> dict:
    script, python, runs, quick_argv, timeouts = BENCHMARKS[name]
    if not (SCRIPTS / script).is_file():
        return {"status": "skipped", "reason": f"scripts/{script} does not exist"}
    if name == "vllm":
        if not Path(python).is_file():
            return {"status": "skipped", "reason": f"no vLLM venv at {VLLM_PYTHON.parent.parent}"
                    " (scripts/setup_vllm_venv.sh)"}
    timeout = timeouts[1] if quick else timeouts[0]
    extra = quick_argv if quick else []
    results = [run_one(script, python, extra + argv, timeout) for argv in runs]
    if len(results) == 1:
        return results[0]
    status = "ok" if all(r["status"] == "ok" for r in results) else "failed"
    return {"status": status, "runs": results}


# --- the machine and the headline numbers ---------------------------------------------------------


def machine() -> dict:
    """CPU model, cores, ISA features of note, memory, torch version, load at the start."""
    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), "platform": platform.platform()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        info["cpu"] = fields.get("Model name", info["cpu"])
        flags = set(fields.get("Flags", "").split())
        info["isa"] = sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni",
                                      "avx_vnni", "amx_bf16", "amx_int8", "amx_tile"})
    except (OSError, subprocess.TimeoutExpired, ValueError):
        pass
    for package in ("torch", "torchaudio"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory_gb"] = round(pages * size / 1e9, 1)
    except (ValueError, OSError):
        pass
    info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return info


def _get(obj, *path):
    """obj[path[0]][path[1]]...; None where any step is missing (schemas evolve)."""
    for key in path:
        if isinstance(obj, dict) and key in obj:
            obj = obj[key]
        elif isinstance(obj, dict) and str(key) in obj:
            obj = obj[str(key)]
        else:
            return None
    return obj


def _row(metric: str, value, target: str, ok, note: str = "") -> dict:
    return {"metric": metric, "value": value, "target": target,
            "meets": None if value is None else ok, "note": note}


def _outputs(result: dict) -> list[dict]:
    runs = result.get("runs", [result])
    return [r["output"] for r in runs if r.get("status") == "ok"]


# RTF targets. The comparison with vllm-omni is a same-run ratio: scripts/bench_peer.py.
CODEC_TARGETS = {("decode", "float32"): 0.40, ("decode", "bfloat16"): 0.21,
                 ("encode", "float32"): 0.36, ("encode", "bfloat16"): 0.18}


def codec_rows(result: dict) -> list[dict]:
    rows, outputs = [], _outputs(result)
    found = {(r.get("op"), r.get("dtype")): r for o in outputs for r in o.get("results", [])}
    for (op, dtype), target in CODEC_TARGETS.items():
        r = found.get((op, dtype), {})
        rtf, frac = r.get("rtf"), r.get("fraction_of_peak")
        note = f"{frac:.0%} of matmul peak" if frac is not None else ""
        rows.append(_row(f"CPU {op} RTF, {dtype} ({r.get('audio_s', '?')} s, full-size)", rtf,
                         f"<= {target}",
                         rtf is not None and rtf <= target, note))
    return rows + stream_rows(outputs) + int8_rows(outputs)


def _stream_scheme(stream: dict | None) -> tuple[str | None, dict]:
    """Our scheme's entry in the codec report's stream section (not the official baseline)."""
    if not isinstance(stream, dict):
        return None, {}
    names = [k for k, v in stream.items() if isinstance(v, dict) and "compute_vs_one_shot" in v
             and not k.startswith("official") and "context_" not in k]
    return (names[0], stream[names[0]]) if names else (None, {})


def stream_rows(outputs: list[dict]) -> list[dict]:
    """Streaming compute vs one-shot (60 s) and the distance to one-shot vs the official scheme."""
    stream = next((o["stream"] for o in outputs if "stream" in o), None)
    name, ours = _stream_scheme(stream)
    official = next((v for k, v in (stream or {}).items() if k.startswith("official")), {})
    ratio = ours.get("compute_vs_one_shot")
    note = (f"{name}; official 250/40 scheme {official.get('compute_vs_one_shot')}x; first "
            f"audio {ours.get('first_audio_s')} s; state {ours.get('state_mib')} MiB"
            if name else "")
    rows = [_row(f"streaming decode compute / one-shot ({_get(stream, 'stream_s')} s stream)",
                 ratio, "<= 1.5", ratio is not None and ratio <= 1.5, note)]
    pipe = (stream or {}).get("pipeline_chunks") or {}
    if pipe:
        inc, off = pipe.get("incremental", {}), pipe.get("official_250_40", {})
        ratio = inc.get("compute_vs_one_shot")
        rows.append(_row("streaming decode compute / one-shot, `--stream`'s chunks "
                         "(5 groups, then 10)", ratio, "<= 1.5",
                         ratio is not None and ratio <= 1.5,
                         f"incremental; official scheme {off.get('compute_vs_one_shot')}x; RMS "
                         f"{inc.get('rms')} vs official {off.get('rms')}; first audio "
                         f"{inc.get('first_audio_s')} s"))
    for label, key in (("random full-size", "stream"), ("tiny-a weights", "stream_tiny_a")):
        section = next((o[key] for o in outputs if key in o), None)
        _, mine = _stream_scheme(section)
        base = next((v for k, v in (section or {}).items() if k.startswith("official")), {})
        rms, ref = mine.get("rms"), base.get("rms")
        target = "<= official" + ("" if ref is None else f" ({ref})")
        note = f"max abs {mine.get('max_abs')} vs official {base.get('max_abs')}" if mine else ""
        rows.append(_row(f"streaming RMS distance to one-shot audio ({label})", rms, target,
                         rms is not None and ref is not None and rms <= ref, note))
    return rows


def int8_rows(outputs: list[dict]) -> list[dict]:
    int8 = next((o["int8"] for o in outputs if "int8" in o), None)
    if not isinstance(int8, dict):
        return []
    note = (f"{int8.get('speedup_vs_float32')}x float32; max abs error "
            f"{int8.get('error_max_abs')}, RMS {int8.get('error_rms')}")
    return [_row("CPU decode RTF, int8 weights (opt-in)", int8.get("rtf"), "(opt-in)", None,
                 note)]


def lm_rows(result: dict) -> list[dict]:
    outputs = _outputs(result)
    gps: dict[str, float] = {}
    for o in outputs:
        gps |= {str(k): v for k, v in (o.get("groups_per_s") or {}).items()}
    floor = next((o.get("batch1_over_floor") for o in outputs
                  if o.get("batch1_over_floor") is not None), None)
    scale = gps["8"] / gps["1"] if "8" in gps and gps.get("1") else None
    layers = next((o.get("backbone_layers") for o in outputs), None)
    note = f"bf16 CPU, {layers} backbone layers" if layers else ""
    return [_row("LM batch-1 group step / memory-bandwidth floor", floor, "<= 1.3",
                 floor is not None and floor <= 1.3, note),
            _row("LM groups/s, batch 8 / batch 1", None if scale is None else round(scale, 2),
                 ">= 5", scale is not None and scale >= 5,
                 ", ".join(f"b{k}: {v}/s" for k, v in sorted(gps.items(), key=lambda x: int(x[0])))
                 )]


def overlap_rows(result: dict) -> list[dict]:
    rows = []
    for o in _outputs(result) or [{}]:
        ratio = o.get("stream_over_slower_stage")
        note = ""
        if ratio is not None:
            note = (f"Stage-0 {_get(o, 'stage0', 'seconds')} s, Stage-1 "
                    f"{_get(o, 'stage1', 'seconds')} s, stream {_get(o, 'stream', 'seconds')} s; "
                    f"{o.get('lm_threads')} + {o.get('tokenizer_threads')} threads; other "
                    f"processes used up to {o.get('other_processes_cores_max')} cores")
        mode = f", {o['stream_mode']} decode" if o.get("stream_mode") else ""
        rows.append(_row(f"`--stream` wall / slower stage alone{mode}", ratio, "<= 1.15",
                         ratio is not None and ratio <= 1.15, note))
    return rows


def startup_rows(result: dict) -> list[dict]:
    o = (_outputs(result) or [{}])[0]
    rows = []
    for name in ("help", "devices"):
        best, torch_in = _get(o, "cli", name, "best_s"), _get(o, "cli", name, "torch_imported")
        note = "" if torch_in is None else ("imports torch" if torch_in else "no torch import")
        rows.append(_row(f"`mimo-tts {'--help' if name == 'help' else name}` seconds", best,
                         "< 0.5", best is not None and best < 0.5 and not torch_in, note))
    ratio = _get(o, "load", "peak_rss_over_weights")
    note = (f"{_get(o, 'load', 'peak_rss_gb')} GB peak for {_get(o, 'load', 'weights_gb')} GB "
            "of float32 weights" if ratio is not None else "")
    rows.append(_row("peak RSS loading the full tokenizer / weights", ratio, "<= 1.2",
                     ratio is not None and ratio <= 1.2, note))
    return rows


def vllm_rows(result: dict) -> list[dict]:
    """Per config: vLLM's groups/s over the native engine's, at each batch size."""
    o = (_outputs(result) or [{}])[0]
    rows = []
    for config, engines in (o.get("configs") or {}).items():
        native, vllm = engines.get("native") or {}, engines.get("vllm") or {}
        batches = [k for k in vllm if k.startswith("batch_") and native.get(k)]
        rates = ", ".join(f"b{k[6:]}: {vllm[k]} vs {native[k]}/s" for k in batches)
        best = max(batches, key=lambda k: vllm[k] / native[k], default=None)
        value = round(vllm[best] / native[best], 2) if best else None
        rows.append(_row(f"vLLM / native Stage-0 groups/s ({config} model, CPU)", value,
                         "(reported)", None, rates))
    if not rows:
        note = result.get("reason", "") if result.get("status") == "skipped" else ""
        rows.append(_row("vLLM / native Stage-0 groups/s", None, "(reported)", None, note))
    return rows


ROWS = {"codec": codec_rows, "lm": lm_rows, "overlap": overlap_rows, "startup": startup_rows,
        "vllm": vllm_rows}


def summarize(results: dict) -> list[dict]:
    rows = []
    for name in (n for n in BENCHMARKS if n in results):  # a fixed order, merged or not
        result = results[name]
        for row in ROWS[name](result):
            if result.get("status") != "ok" and row["value"] is None:
                row["note"] = (row["note"] or result.get("error") or result.get("reason")
                               or result.get("status", ""))
            rows.append({"benchmark": name, **row})
    return rows


def table(report: dict) -> str:
    """README's Markdown table of the summary, with the machine it came from."""
    m = report["machine"]
    lines = ["| metric | measured | target | met | notes |", "|---|---|---|---|---|"]
    for r in report["summary"]:
        value = "n/a" if r["value"] is None else r["value"]
        met = {True: "yes", False: "**no**", None: "-"}[r["meets"]]
        lines.append(f"| {r['metric']} | {value} | {r['target']} | {met} | {r['note']} |")
    mode = "--quick" if report.get("quick") else "full"
    isa = ", ".join(m.get("isa") or []) or "no ISA flags read"
    busy = {name: r.get("busy_cores_at_start") for name, r in report["results"].items()
            if r.get("busy_cores_at_start") is not None}
    lines.append("")
    lines.append(f"Measured {report['finished'][:10]} by `scripts/bench.py` ({mode} run) on "
                 f"{m.get('cpu')} ({isa}), {m.get('cores')} cores, {m.get('memory_gb')} GB, "
                 f"torch {m.get('torch')}, Python {m.get('python')}.")
    if busy:
        lines.append("Cores other jobs kept busy as each benchmark started: "
                     + ", ".join(f"{name} {cores}" for name, cores in busy.items()) + ".")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs of every benchmark")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    parser.add_argument("--only", default=",".join(BENCHMARKS),
                        help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    parser.add_argument("--wait-quiet", type=float, default=None, metavar="CORES",
                        help="before each benchmark, wait until the machine's other work "
                             "keeps at most CORES cores busy (a shared machine)")
    parser.add_argument("--patience", type=float, default=1800,
                        help="seconds --wait-quiet waits at most per benchmark")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other benchmarks' results already in --out")
    parser.add_argument("--table", action="store_true",
                        help="print the README Markdown table instead of the JSON")
    parser.add_argument("--from", dest="source", type=Path,
                        help="with --table: render an existing report instead of running")
    args = parser.parse_args()
    if args.source:
        report = json.loads(args.source.read_text(encoding="utf-8"))
        print(table(report) if args.table else json.dumps(report, indent=2))
        return
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {list(BENCHMARKS)}")
    report = run_all(names, args.quick, args.out, args.wait_quiet, args.patience, args.merge)
    print(table(report) if args.table else json.dumps(report, indent=2))


def run_all(names: list[str], quick: bool, out: Path, max_busy: float | None = None,
            patience_s: float = 1800, merge: bool = False) -> dict:
    """Each benchmark in turn; the report is rewritten after each, so a crash keeps the rest.

    With `merge`, the other benchmarks' results already in `out` are kept (a re-run of a few).
    """
    report = {"benchmark": "all", "quick": quick, "started": _now(), "machine": machine(),
              "results": {}, "summary": []}
    if merge and out.is_file():
        previous = json.loads(out.read_text(encoding="utf-8"))
        report["results"] = {k: v for k, v in previous.get("results", {}).items()
                             if k not in names}
        report["merged_from"] = previous.get("started")
    for name in names:
        quiet = wait_quiet(max_busy, patience_s)
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        report["results"][name] = run_benchmark(name, quick) | quiet | {"finished": _now()}
        status = report["results"][name]["status"]
        print(f"[bench] {name}: {status}", file=sys.stderr, flush=True)
        report["summary"] = summarize(report["results"])
        report["finished"] = _now()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, out)
    return report


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


if __name__ == "__main__":
    main()
