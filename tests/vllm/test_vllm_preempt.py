"""Continuous batching under pressure: a KV cache too small for the batch makes vLLM preempt
running requests and recompute them later, and a small token budget splits every prefill into
chunks. The per-request audio state must survive both: output equal to the native engine."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup_vllm_venv.sh)")

from mimo_tts.lm.batching import generate_all
from mimo_tts.lm.generate import generate

MAX_LEN = 256  # groups per request
BLOCK = 32  # the CPU attention backend's block multiple
KV_BLOCKS = 9  # 288 groups for eight requests of ~45-110 groups each
CHUNK = 16  # prefill tokens per step: every prompt here is longer


@pytest.fixture(scope="module")
def tight_engine(preset_lm_dir, native):
    from mimo_tts.lm.vllm.engine import VLLMEngine, VLLMOptions

    backbone = native.cfg.backbone
    per_group = 2 * backbone.layers * backbone.kv_heads * backbone.head_dim * 4  # K+V, float32
    eng = VLLMEngine(preset_lm_dir, VLLMOptions(
        dtype="float32", max_num_seqs=8, max_model_len=MAX_LEN, block_size=BLOCK,
        kv_cache_memory_bytes=KV_BLOCKS * BLOCK * per_group, max_num_batched_tokens=CHUNK))
    yield eng
    eng.close()


def test_preempted_and_chunked_requests_equal_native(tight_engine, native, preset_special, prompts,
                                                     greedy_options):
    batch = [prompts[k] for k in ("voice", "long", "instruct", "zh", "short", "voice", "long",
                                  "zh")]
    assert min(p.shape[1] // 4 for p in batch) > CHUNK  # every prefill is chunked
    options = greedy_options()
    got = generate_all(tight_engine, batch, options)
    # Requests were preempted (left the batch and joined again), mid-speech.
    assert max(tight_engine.last_joins.values()) > 1
    want = generate(native, batch, options, preset_special)
    for w, g in zip(want, got, strict=True):
        assert g.text_tokens == w.text_tokens
        assert torch.equal(g.new_ids, w.new_ids)
