#!/usr/bin/env bash
# Every CUDA check of the project in one run (<= 8 minutes on one H100/H200-class GPU), one JSON.
#
# Sections (each under its own time limit; a failing one records its exit code and output tail,
# and the rest go on):
#   codec_graphs  scripts/check_codec_cuda_graph.py --full-size: codec CUDA graphs, exactness + speed
#   lm_graphs     scripts/check_lm_cuda_graph.py: LM decode graphs on the tiny-a fixtures (exact),
#                 and eager vs graphs at the full width with random weights (36 layers)
#   vllm          scripts/check_vllm_gpu.py --wide: vLLM equality with the native engine, throughput
#   cli_split     mimo-tts synth with the LM on cuda:0 and the tokenizer on cpu (the seed's split)
#   full_width    scripts/bench_lm.py --device cuda --layers 36: the full-width model, ms per group
#   stream        scripts/check_stream_cuda.py: the growing stream schedule against the old pushes,
#                 and the server's pushed-together Stage-1 against each stream alone (tiny-a)
# Without CUDA every section says "no CUDA" and the script exits 0 (a dry run; a test runs it).
#
#   bash scripts/gpu_check.sh [--out gpu_check.json]      (PYTHON=... picks the interpreter)
set -u
cd "$(dirname "$0")/.."
OUT=.bench/gpu_check.json  # under the ignored .bench/
if [ "${1:-}" = "--out" ] && [ -n "${2:-}" ]; then OUT=$2; fi
PY=${PYTHON:-python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)

CUDA=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)

# section NAME LIMIT_S COMMAND...: run it (stdout -> NAME.out, stderr -> NAME.err, rc -> NAME.rc)
section() {
    local name=$1 limit=$2
    shift 2
    echo "$limit" > "$WORK/$name.limit"
    if [ "$CUDA" != 1 ]; then
        echo skipped > "$WORK/$name.rc"
        return
    fi
    local t0
    t0=$(date +%s)
    timeout "$limit" "$@" > "$WORK/$name.out" 2> "$WORK/$name.err"
    echo $? > "$WORK/$name.rc"
    echo $(( $(date +%s) - t0 )) > "$WORK/$name.wall"
}

section codec_graphs 75 "$PY" scripts/check_codec_cuda_graph.py --full-size
section lm_graphs 150 "$PY" scripts/check_lm_cuda_graph.py --layers 36 --groups 24
section vllm 150 "$PY" scripts/check_vllm_gpu.py --wide --out "$WORK/vllm.json"
section cli_split 45 "$PY" -m mimo_tts.cli synth --model tiny --text "GPU split check." \
    --lm-device cuda:0 --tokenizer-device cpu --max-new-groups 8 -o "$WORK/split.wav" --json
section full_width 45 "$PY" scripts/bench_lm.py --device cuda --layers 36 --batch 1,8 \
    --quiet-wait 0 --kernel off --rounds 1
section stream 15 "$PY" scripts/check_stream_cuda.py

"$PY" - "$WORK" "$OUT" "$CUDA" "$START" <<'PYEOF'
import json, sys, time
from pathlib import Path

work, out, cuda, start = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
NAMES = ("codec_graphs", "lm_graphs", "vllm", "cli_split", "full_width", "stream")


def text(name: str, suffix: str) -> str:
    path = work / f"{name}{suffix}"
    return path.read_text(errors="replace") if path.exists() else ""


def result(name: str):
    """The section's JSON report (its file for vllm, else its stdout), or None."""
    raw = text(name, ".json") or text(name, ".out")
    start = raw.find("{")
    try:
        return json.loads(raw[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        return None


report = {"cuda": cuda, "sections": {}}
if cuda:
    import torch

    report["device"] = torch.cuda.get_device_name(0)
for name in NAMES:
    rc = text(name, ".rc").strip()
    entry = {"limit_s": int(text(name, ".limit") or 0)}
    if rc == "skipped":
        entry["status"] = "no CUDA"
    else:
        entry["wall_s"] = int(text(name, ".wall") or 0)
        entry["exit"] = int(rc)
        entry["status"] = {"0": "ok", "124": "timeout"}.get(rc, "failed")
        if name == "vllm" and rc == "3":  # check_vllm_gpu.NO_VLLM: nothing was checked
            entry["status"] = "vllm not installed"
        entry["result"] = result(name)
        if entry["status"] != "ok":
            entry["stderr_tail"] = text(name, ".err")[-2000:]
    report["sections"][name] = entry
report["wall_s"] = int(time.time()) - start
# A section that could not run (no CUDA, no vllm) is listed as untested, never as a pass.
report["untested"] = [n for n, s in report["sections"].items()
                      if s["status"] in ("no CUDA", "vllm not installed")]
report["ok"] = all(s["status"] in ("ok", "no CUDA", "vllm not installed")
                   for s in report["sections"].values())
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(report, indent=2) + "\n")
print(json.dumps(report, indent=2))
sys.exit(0 if report["ok"] else 1)
PYEOF
