"""The preflight report (`mimo-tts devices`, `synth --dry-run`): a run's plan, loading nothing.

Placement with the source of every value, CUDA facts, where each checkpoint would come from and
the memory it needs at the run dtype (from `config.json` and safetensors headers), and the
Stage-0 engine's settings. torch is imported only when a GPU may be present (`devices.Probe`).
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.util import find_spec
from pathlib import Path

from mimo_tts import checkpoints
from mimo_tts.batch import engine_record
from mimo_tts.devices import DTYPE_BYTES, Probe
from mimo_tts.errors import MimoTTSError
from mimo_tts.options import Settings


def preflight(settings: Settings, env: Mapping[str, str] | None = None) -> dict:
    """Placement with sources, CUDA facts, checkpoint presence and memory estimates."""
    probe, placement = Probe.detect(), settings.placement
    report = {"placement": placement.describe(),
              "cuda": {"available": probe.cuda_count > 0, "device_count": probe.cuda_count,
                       "current": probe.cuda_current if probe.cuda_count else None},
              "mps": probe.mps, "checkpoints": {}}
    names = settings.checkpoints
    for role, (name, src), dtype in (("model", names.lm, placement.lm_dtype.value),
                                     ("tokenizer", names.tokenizer,
                                      placement.tokenizer_dtype.value)):
        path, status = checkpoints.locate(name, src, role, env)
        entry = {"name": name, "source": src, "path": str(path) if path else None,
                 "status": status}
        if path is not None:
            entry["memory"] = _safe_estimate(path, dtype)
        report["checkpoints"][role] = entry
    report["engine"] = engine_record(settings)
    if settings.engine.engine == "vllm":
        report["engine"]["installed"] = find_spec("vllm") is not None
    return report


def _safe_estimate(path: Path, dtype: str) -> dict:
    try:
        return checkpoints.estimate_memory(path, DTYPE_BYTES[dtype])
    except (MimoTTSError, OSError, ValueError, KeyError) as exc:
        return {"error": str(exc)}
