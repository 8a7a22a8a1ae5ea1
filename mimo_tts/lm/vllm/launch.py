"""How a run starts Stage-0 on vLLM: the import guard and VLLMOptions from the run's settings.

No vLLM or torch import at module level: preflights and sidecars describe the vLLM settings
without starting anything. vLLM missing or unimportable is a UsageError (exit 2) naming the
install command.
"""

from __future__ import annotations

import importlib

from mimo_tts.errors import UsageError

VLLM_INSTALL = "pip install 'mimo-tts[vllm]' (CPU: scripts/setup_vllm_venv.sh)"
CPU_KV_CACHE_MIB = 64  # vLLM on CPU: a small KV cache starts in seconds (default: most of RAM)
DEFAULT_MAX_NUM_SEQS = 32  # VLLMOptions.max_num_seqs (readable without the engine module)
SETTINGS = ("gpu_memory_utilization", "max_num_seqs", "tensor_parallel_size", "max_model_len")


def import_vllm_engine():
    """The vLLM engine module; vLLM missing or broken is one UsageError line (exit 2)."""
    try:  # the engine module first: it sets vLLM's env defaults (logs to stderr) before import
        from mimo_tts.lm.vllm import engine

        importlib.import_module("vllm")  # the engine module imports it only when starting
    except ImportError as exc:
        if getattr(exc, "name", None) == "vllm":
            raise UsageError(f"--engine vllm needs vLLM, which is not installed: "
                             f"{VLLM_INSTALL}") from None
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"--engine vllm: vLLM fails to import ({first}); reinstall it: "
                         f"{VLLM_INSTALL}") from None
    return engine


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
