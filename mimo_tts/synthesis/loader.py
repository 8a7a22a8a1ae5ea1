"""What every face does before it loads a model, in one place: checkpoint names -> directories
(the tiny preset written on first use), the memory preflight (a run that cannot fit is refused
with `NotEnoughMemoryError`, exit 4, unless `no_memory_check`), per-stage thread budgets and the
load log. `MiMoTTS.from_settings` and `Stage1.from_settings` are the loaders built on it; the
CLI, the library, the server and both Ray actor kinds all load through them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from mimo_tts import presets
from mimo_tts.lm.engine import engine_spec
from mimo_tts.runtime.checkpoints import ModelRef
from mimo_tts.synthesis.preflight import Lengths, check_memory, lengths_for
from mimo_tts.synthesis.settings import Settings


def resolve_checkpoints(settings: Settings, env: Mapping[str, str] | None = None
                        ) -> tuple[ModelRef, ModelRef]:
    """Both checkpoints as local directories; an engine that is not installed fails first
    (exit 2), a missing checkpoint next (exit 3), before anything is loaded."""
    engine_spec(settings.engine.engine).check_installed()
    name, source = settings.checkpoints.lm
    return (presets.resolve(name, source, "model", settings.checkpoints.allow_download,
                            os.environ if env is None else env), resolve_tokenizer(settings, env))


def resolve_tokenizer(settings: Settings, env: Mapping[str, str] | None = None) -> ModelRef:
    """The audio tokenizer's directory alone (Stage-1 without an LM)."""
    name, source = settings.checkpoints.tokenizer
    return presets.resolve(name, source, "tokenizer", settings.checkpoints.allow_download,
                           os.environ if env is None else env)


def check_fits(settings: Settings, refs, lengths: Lengths | None = None,
               env: Mapping[str, str] | None = None, log=None) -> list[dict]:
    """The memory preflight with its log lines: the plan, or `NotEnoughMemoryError` (exit 4)."""
    log = log or (lambda message: None)
    lengths = lengths or lengths_for(settings, [])
    plan = check_memory(settings, refs, lengths, os.environ if env is None else env, log)
    p = settings.placement
    log(f"LM dtype {p.lm_dtype.value} ({p.lm_dtype.source}); tokenizer dtype "
        f"{p.tokenizer_dtype.value} ({p.tokenizer_dtype.source})")
    for entry in plan:
        log(f"memory on {entry['device']}: need ~{entry['need_gib']} GiB, "
            f"available {entry['available_gib']} GiB ({entry['available_source']})")
    return plan


# Up to this many cores, streaming on the CPU runs the stages in turns (see thread_budgets).
TURN_CORES = 8


def thread_budgets(settings: Settings) -> dict:
    """Per-stage CPU threads: the options'; else, when streaming with both stages on the CPU,
    Stage-0 keeps the threads it needs. On up to TURN_CORES cores the stages take turns, each
    with every thread (`interleave`: Stage-1 decodes its pushes between Stage-0 steps). A
    batch-1 Stage-0 step then runs as fast as without Stage-1, and the decodes, about a tenth
    of Stage-0's compute at full size, add their own time (docs/performance.md). On more
    cores Stage-1 decodes beside Stage-0 with an eighth of them."""
    e, p = settings.engine, settings.placement
    both_cpu = p.lm_device.value == p.tokenizer_device.value == "cpu"
    if e.lm_threads is None and e.tokenizer_threads is None and settings.run.stream and both_cpu:
        import torch

        n = torch.get_num_threads()
        if n <= TURN_CORES:
            return {"lm": n, "tokenizer": n, "interleave": True,
                    "source": "auto (--stream, cpu: the stages take turns)"}
        return {"lm": n - n // TURN_CORES, "tokenizer": n // TURN_CORES,
                "source": "auto (--stream, cpu)"}
    return {"lm": e.lm_threads, "tokenizer": e.tokenizer_threads, "source": "options"}


def stage1_mode(threads: dict, placement, stream: bool) -> str:
    """Where Stage-1 runs beside Stage-0 (`synthesis.worker`): "turns" (in the Stage-0 thread
    between steps, each stage with every thread) when both stages share the CPU and no thread
    split is set: the budgets say so for `--stream` on up to TURN_CORES cores, and work that
    is not streamed needs no overlap; else "thread" (another device, or split CPU budgets)."""
    if placement is None:
        return "turns"
    if placement.lm_device.value != "cpu" or placement.tokenizer_device.value != "cpu":
        return "thread"
    if threads.get("interleave") or not stream:
        return "turns"
    split = threads.get("lm") is not None or threads.get("tokenizer") is not None
    if not split:
        import torch

        if torch.get_num_threads() <= TURN_CORES:
            return "turns"
    return "thread"
