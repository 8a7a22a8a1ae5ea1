"""How a run starts Stage-0 on vLLM: VLLMOptions from the run's settings.

No vLLM or torch import: preflights and sidecars describe the vLLM settings without starting
anything.
"""

from __future__ import annotations

from mimo_tts.errors import UsageError
from mimo_tts.lm.vllm import VLLM_SETTINGS

CPU_KV_CACHE_MIB = 64  # vLLM on CPU: a small KV cache starts in seconds (default: most of RAM)
# VLLMOptions' own settings: every vLLM setting but the profile-only kv_cache_mib (read below)
SETTINGS = tuple(name for name in VLLM_SETTINGS if name != "kv_cache_mib")


def vllm_options(o, placement) -> dict:
    """VLLMOptions keywords from `EngineOptions` and the placement (CPU: small KV cache)."""
    device = placement.lm_device.value
    if device == "mps":
        raise UsageError("--engine vllm runs on CUDA or CPU, not mps; use --engine native")
    if device.startswith("cuda:") and device != "cuda:0":
        raise UsageError(f"--engine vllm places Stage-0 itself: pick its GPU with "
                         f"CUDA_VISIBLE_DEVICES instead of --lm-device {device}")
    kv_mib = o.kv_cache_mib if o.kv_cache_mib is not None else (
        CPU_KV_CACHE_MIB if device == "cpu" else None)
    given = {name: getattr(o, name) for name in SETTINGS}
    return {"dtype": placement.lm_dtype.value, "in_process": True,
            "kv_cache_memory_bytes": None if kv_mib is None else kv_mib << 20,
            **{k: v for k, v in given.items() if v is not None}}


engine_settings = vllm_options  # lm.engine.EngineSpec.settings reads it by this name
