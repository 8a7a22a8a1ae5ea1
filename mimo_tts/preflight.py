"""The preflight (`mimo-tts devices`, `synth --dry-run`, and before loading), loading nothing.

Placement with the source of every value, CUDA facts, where each checkpoint would come from,
the memory each stage needs at the run dtype against what its device has (`mimo_tts.memory`,
from `config.json` and safetensors headers), the Stage-0 engine's settings and the shard. torch is
imported only when a GPU may be present (`devices.Probe`).
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.util import find_spec
from pathlib import Path

from mimo_tts import checkpoints, memory
from mimo_tts.devices import Probe
from mimo_tts.errors import CheckpointError, DeviceError, UsageError
from mimo_tts.lm.vllm.launch import vllm_options
from mimo_tts.options import Settings


def lengths_for(settings: Settings, texts: list[str], rows: int | None = None) -> memory.Lengths:
    """The run's sizes memory depends on: `rows` prompts at a time (default `batch_size`)."""
    o = settings.synthesis
    return memory.Lengths.for_run(texts, settings.run.batch_size if rows is None else rows,
                                  o.max_chars, o.max_new_groups)


def memory_needs(settings: Settings, lm_path: Path | None, tok_path: Path | None,
                 lengths: memory.Lengths) -> list[memory.StageNeed]:
    """Per-stage memory estimates for this run's placement and lengths (vLLM sizes its own)."""
    p, needs = settings.placement, []
    if lm_path is not None and settings.engine.engine == "native":
        needs.append(memory.lm_need(lm_path, p.lm_device.value, p.lm_dtype.value, lengths))
    if tok_path is not None:
        needs.append(memory.tokenizer_need(tok_path, p.tokenizer_device.value,
                                           p.tokenizer_dtype.value, lengths))
    return needs


def check_memory(settings: Settings, refs, lengths: memory.Lengths,
                 env: Mapping[str, str] | None = None, log=None) -> list[dict]:
    """The memory plan before loading; a run that cannot fit is refused (DeviceError, exit 4)
    unless `no_memory_check`."""
    lm, tok = refs
    try:
        needs = memory_needs(settings, lm.path, tok.path, lengths)
    except CheckpointError as exc:  # loading reports it, with the file at fault
        (log or (lambda message: None))(f"memory preflight skipped: {exc}")
        return []
    if settings.engine.no_memory_check:
        return memory.plan(needs, env)
    return memory.check(needs, lengths, env)


def engine_record(settings: Settings, loaded: dict | None = None) -> dict:
    """The Stage-0 engine and its settings (sidecar, preflight); no vLLM import."""
    if settings.engine.engine != "vllm":
        return loaded or {"name": "native"}
    record: dict = {"name": "vllm"}
    try:
        record["settings"] = vllm_options(settings.engine, settings.placement)
    except UsageError as exc:
        record["error"] = str(exc)
    return record


def preflight(settings: Settings, texts: list[str] = (), env: Mapping[str, str] | None = None
              ) -> dict:
    """Placement with sources, CUDA facts, checkpoint presence and the memory plan.

    `memory_error` is set when the run would be refused (the CLI then exits 4).
    """
    probe, placement = Probe.detect(), settings.placement
    report = {"placement": placement.describe(),
              "cuda": {"available": probe.cuda_count > 0, "device_count": probe.cuda_count,
                       "current": probe.cuda_current if probe.cuda_count else None},
              "mps": probe.mps, "checkpoints": {}}
    names = settings.checkpoints
    for role, (name, src) in (("model", names.lm), ("tokenizer", names.tokenizer)):
        path, status = checkpoints.locate(name, src, role, env)
        report["checkpoints"][role] = {"name": name, "source": src, "status": status,
                                       "path": str(path) if path else None}
    paths = [report["checkpoints"][r]["path"] for r in ("model", "tokenizer")]
    lengths = lengths_for(settings, list(texts))
    try:
        needs = memory_needs(settings, *(Path(x) if x else None for x in paths), lengths)
        report["memory"] = memory.plan(needs, env)
        memory.check(needs, lengths, env)
    except DeviceError as exc:  # the run would be refused
        report["memory_error"] = str(exc)
    except CheckpointError as exc:  # the checkpoint entries report the cause
        report["memory"] = {"error": str(exc)}
    report["engine"] = engine_record(settings)
    report["shard"] = (settings.shard.describe() if settings.shard else
                       {"shard": None, "source": "default: every item"})
    if settings.engine.engine == "vllm":
        report["engine"]["installed"] = find_spec("vllm") is not None
    return report
