"""vLLM engine test fixtures: the tiny preset (backbone head_dim 32, which vLLM's CPU attention
accepts; tiny-a's 16 it rejects), the native engine as the reference, and prompt builders.
The preset's fixtures are named `preset_*` (`preset_lm_dir`, `preset_special`): tests/lm's
`lm_dir` and `special` are tiny-a's. `greedy_options` comes from tests/conftest.py.

Nothing here imports vLLM: each test module skips itself when vLLM is not installed (the main
venv); `scripts/setup_vllm_venv.sh` makes the venv these tests run in (`.ci/run-vllm`).
"""

from __future__ import annotations

import pytest
import torch

from mimo_tts.lm.load import load_lm
from mimo_tts.lm.prompts import build_prompt
from mimo_tts.lm.text import TextTokenizer
from mimo_tts.presets.write import write_tiny_preset

KV_BYTES = 64 << 20  # a small KV cache: the engine starts in seconds (issue 7)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models on a shared 2-core machine: one intra-op thread (tests/conftest.py)."""


@pytest.fixture(scope="session")
def preset_lm_dir(tmp_path_factory):
    lm, _ = write_tiny_preset(tmp_path_factory.mktemp("tiny-preset"), seed=0)
    return lm


@pytest.fixture(scope="session")
def preset_text_tokenizer(preset_lm_dir):
    return TextTokenizer.from_dir(preset_lm_dir)


@pytest.fixture(scope="session")
def preset_special(preset_text_tokenizer):
    return preset_text_tokenizer.special


@pytest.fixture(scope="session")
def native(preset_lm_dir):
    """The native engine's LM in float32: the reference the vLLM engine must equal."""
    return load_lm(preset_lm_dir, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def voice_codes(case_tensors):
    """Real voice-prompt codes [8, 33]: the tiny-a codec's encoding of a 1.3 s chirp."""
    return case_tensors("codec_encode")["encode_chirp_1p3s.codes_8"].long()


@pytest.fixture(scope="session")
def prompts(preset_text_tokenizer, native, voice_codes):
    """Prompts of several lengths and layouts: plain EN / ZH, instruct, voice prompt."""
    empty = native.cfg.speech_empty_ids

    def build(task, text, **kw):
        return build_prompt(task, text, preset_text_tokenizer, empty, template=0, **kw).input_ids

    return {
        "short": build("tts_sft", "hello world"),
        "long": build("tts_sft", "The quick brown fox jumps over the lazy dog near the river "
                      "bank, and then it runs all the way home before the rain."),
        "zh": build("tts_sft", "今天天气真好，我们一起去公园散步吧。"),
        "instruct": build("tts_sft_with_instruct", "Welcome to the MiMo audio demo.",
                          instruct="speak slowly in a warm and gentle female voice"),
        "voice": build("tts_sft_with_audio", "我很高兴认识你，欢迎来到这里。",
                       instruct="开心，语速稍快", prompt_codes=voice_codes),
    }
