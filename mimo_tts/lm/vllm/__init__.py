"""Stage-0 on vLLM: MiMo-Audio as a vLLM model, plus an engine with the native engine's API.

- `model.py`: the vLLM model (vLLM's Qwen2 backbone + the native patch encoder/decoder).
- `state.py`: per-request audio state, the batch-row tracker (a vLLM logits processor) and the
  worker extension the engine reads codes through.
- `engine.py`: `VLLMEngine(model_dir, ...)` with `generate` / `stream` like `mimo_tts.lm.generate`.
- `launch.py`: the import guard and the `VLLMOptions` a run asks for (no vLLM import).

`register()` is the `vllm.general_plugins` entry point: vLLM calls it in every process it starts
(engine core, workers), so the architecture is known there too. Design: docs/vllm-engine.md.
vLLM is optional: nothing here is imported by the rest of the package.
"""

from __future__ import annotations

ARCHITECTURE = "MiMoTTSAudioForVLLM"  # registered name; the engine selects it via hf_overrides


def register() -> None:
    """Register the MiMo-Audio architecture with vLLM's model registry (idempotent)."""
    from vllm import ModelRegistry

    if ARCHITECTURE in ModelRegistry.get_supported_archs():
        return
    from mimo_tts.lm.vllm.model import MiMoAudioForVLLM

    ModelRegistry.register_model(ARCHITECTURE, MiMoAudioForVLLM)
