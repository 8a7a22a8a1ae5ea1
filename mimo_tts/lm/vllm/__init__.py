"""Stage-0 on vLLM: MiMo-Audio as a vLLM model (`model.py`, with the per-request audio state of
`state.py`), an `lm.engine.Engine` over it (`engine.py`, its request loop in `run.py`) and the
`VLLMOptions` a run asks for (`launch.py`, no vLLM import; the import guard is
`lm.engine.EngineSpec.check_installed`).

`register()` is the `vllm.general_plugins` entry point: vLLM calls it in every process it starts
(engine core, workers), so the architecture is known there too. Design: docs/vllm-engine.md.
vLLM is optional: nothing here is imported by the rest of the package.
"""

from __future__ import annotations

from mimo_tts.lm.config import MAX_GROUPS

ARCHITECTURE = "MiMoTTSAudioForVLLM"  # registered name; the engine selects it via hf_overrides
# VLLMOptions defaults, readable without the engine module (the CLI's help shows them)
DEFAULT_MAX_NUM_SEQS = 32
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_TENSOR_PARALLEL_SIZE = 1
# EngineOptions fields that only vLLM reads (kv_cache_mib: profiles only).
VLLM_SETTINGS = ("gpu_memory_utilization", "max_num_seqs", "tensor_parallel_size", "max_model_len",
                 "kv_cache_mib")
# Bounds of the vLLM settings, checked where the options are built (EngineOptions: flags and
# profiles) and again by VLLMOptions: name -> (lowest, highest, inclusive low, words).
VLLM_BOUNDS = {
    "gpu_memory_utilization": (0.0, 1.0, False, "in (0, 1]"),
    "max_num_seqs": (1, None, True, ">= 1"),
    "tensor_parallel_size": (1, None, True, ">= 1"),
    "max_model_len": (2, MAX_GROUPS, True, f"in [2, {MAX_GROUPS}] groups"),
    "kv_cache_mib": (1, None, True, ">= 1"),
}
VLLM_INSTALL = "pip install 'mimo-tts[vllm]' (CPU: scripts/setup_vllm_venv.sh)"


def setting_problem(name: str, value) -> str | None:
    """What is wrong with a vLLM setting's value ("must be ..."), or None (None values pass)."""
    if value is None or name not in VLLM_BOUNDS:
        return None
    low, high, inclusive, words = VLLM_BOUNDS[name]
    above = value >= low if inclusive else value > low
    if above and (high is None or value <= high):
        return None
    return f"must be {words}"


def register() -> None:
    """Register the MiMo-Audio architecture with vLLM's model registry (idempotent)."""
    from vllm import ModelRegistry

    if ARCHITECTURE in ModelRegistry.get_supported_archs():
        return
    from mimo_tts.lm.vllm.model import MiMoAudioForVLLM

    ModelRegistry.register_model(ARCHITECTURE, MiMoAudioForVLLM)
