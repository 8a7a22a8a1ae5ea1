"""The `vllm.general_plugins` entry point: vLLM processes that import nothing of ours (a
spawned engine core) still know the MiMo-Audio architecture."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup_vllm_venv.sh)")

from mimo_tts.lm.batching import generate_all
from mimo_tts.lm.generate import generate
from mimo_tts.lm.vllm import ARCHITECTURE

from .conftest import KV_BYTES  # noqa: E402


def test_entry_point_registers_the_architecture():
    from vllm import ModelRegistry

    found = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
    assert found["mimo_tts"].value == "mimo_tts.lm.vllm:register"
    found["mimo_tts"].load()()
    assert ARCHITECTURE in ModelRegistry.get_supported_archs()


def test_spawned_engine_core_generates_like_native(preset_lm_dir, native, preset_special, prompts,
                                                   greedy_options):
    from mimo_tts.lm.vllm.engine import VLLMEngine, VLLMOptions

    batch = [prompts["voice"], prompts["zh"]]
    options = greedy_options()
    with VLLMEngine(preset_lm_dir, VLLMOptions(dtype="float32", kv_cache_memory_bytes=KV_BYTES,
                                               max_num_seqs=4, in_process=False)) as engine:
        got = generate_all(engine, batch, options)
    for want, result in zip(generate(native, batch, options, preset_special), got, strict=True):
        assert result.text_tokens == want.text_tokens
        assert torch.equal(result.new_ids, want.new_ids)
