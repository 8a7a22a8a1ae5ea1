"""Stage-0 on vLLM: MiMo-Audio as a vLLM model, plus an engine with the native engine's API.

- `model.py`: the vLLM model (vLLM's Qwen2 backbone + the native patch encoder/decoder).
- `state.py`: per-request audio state, the batch-row tracker (a vLLM logits processor) and the
  worker extension the engine reads codes through.
- `engine.py`: `VLLMEngine(model_dir, ...)` with `generate` / `stream` like `mimo_tts.lm.generate`.
- `launch.py`: the `VLLMOptions` a run asks for (no vLLM import); the import guard is
  `lm.engine.EngineSpec.check_installed`.

`register()` is the `vllm.general_plugins` entry point: vLLM calls it in every process it starts
(engine core, workers), so the architecture is known there too. Design: docs/vllm-engine.md.
vLLM is optional: nothing here is imported by the rest of the package.
"""

from __future__ import annotations

ARCHITECTURE = "MiMoTTSAudioForVLLM"  # registered name; the engine selects it via hf_overrides
# VLLMOptions defaults, readable without the engine module (the CLI's help shows them)
DEFAULT_MAX_NUM_SEQS = 32
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_TENSOR_PARALLEL_SIZE = 1
# EngineOptions fields that only vLLM reads (kv_cache_mib: profiles only).
VLLM_SETTINGS = ("gpu_memory_utilization", "max_num_seqs", "tensor_parallel_size", "max_model_len",
                 "kv_cache_mib")
VLLM_INSTALL = "pip install 'mimo-tts[vllm]' (CPU: scripts/setup_vllm_venv.sh)"


def register() -> None:
    """Register the MiMo-Audio architecture with vLLM's model registry (idempotent)."""
    from vllm import ModelRegistry

    if ARCHITECTURE in ModelRegistry.get_supported_archs():
        return
    from mimo_tts.lm.vllm.model import MiMoAudioForVLLM

    ModelRegistry.register_model(ARCHITECTURE, MiMoAudioForVLLM)
