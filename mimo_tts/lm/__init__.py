"""Stage-0: the MiMo-Audio LM (Qwen2 backbone + patch encoder + patch decoder) and generation.

Exports resolve lazily so that `mimo_tts.lm.text` (no torch) stays cheap to import.
"""

from __future__ import annotations

from mimo_tts._lazy import lazy_exports

_EXPORTS = {
    "LMConfig": "mimo_tts.lm.config",
    "MAX_GROUPS": "mimo_tts.lm.config",
    "MiMoAudioLM": "mimo_tts.lm.model",
    "KVCache": "mimo_tts.lm.model",
    "load_lm": "mimo_tts.lm.load",
    "SamplerConfig": "mimo_tts.lm.sampling",
    "task_samplers": "mimo_tts.lm.sampling",
    "GenerationOptions": "mimo_tts.lm.generate",
    "Generation": "mimo_tts.lm.generate",
    "StepOutput": "mimo_tts.lm.generate",
    "generate": "mimo_tts.lm.generate",
    "stream": "mimo_tts.lm.generate",
    "Extracted": "mimo_tts.lm.extract",
    "extract": "mimo_tts.lm.extract",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports("mimo_tts.lm", _EXPORTS)
