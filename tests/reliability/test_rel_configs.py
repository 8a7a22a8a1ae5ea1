"""Issue 13, root cause Q: a checkpoint config with an impossible value exits 3 naming the
field (zero heads, NaN rope theta, hop length 0, wrong types, a malformed index), never 1.
"""

from __future__ import annotations

import json

import pytest

from mimo_tts.errors import EXIT_CHECKPOINT
from tests.helpers import error_line


def _edit(**changes):
    def build(d):
        config = json.loads((d / "config.json").read_text())
        config.update(changes)
        (d / "config.json").write_text(json.dumps(config))
    return build


def _index(weight_map):
    def build(d):
        (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return build


CASES = {
    "lm-zero-heads": ("lm", _edit(num_attention_heads=0), "'num_attention_heads' = 0"),
    "lm-zero-kv-heads": ("lm", _edit(num_key_value_heads=0), "'num_key_value_heads' = 0"),
    "lm-kv-heads-do-not-divide": ("lm", _edit(num_key_value_heads=3), "num_key_value_heads 3"),
    "lm-nan-theta": ("lm", _edit(rope_theta=float("nan")), "'rope_theta' = nan"),
    "lm-huge-layers": ("lm", _edit(num_hidden_layers=1e400), "'num_hidden_layers'"),
    "lm-list-hidden": ("lm", _edit(hidden_size=[64]), "'hidden_size' = [64]"),
    "lm-empty-id-out-of-range": ("lm", _edit(speech_zeroemb_idx="5000"), "speech_zeroemb_idx"),
    "tok-hop-zero": ("tokenizer", _edit(hop_length=0), "'hop_length' = 0"),
    "tok-string-layers": ("tokenizer", _edit(decoder_layers="two"), "'decoder_layers' = 'two'"),
    "tok-bool-dim": ("tokenizer", _edit(d_model=True), "'d_model' = True"),
    "tok-zero-heads": ("tokenizer", _edit(decoder_attention_heads=0),
                       "'decoder_attention_heads' = 0"),
    "tok-nan-theta": ("tokenizer", _edit(rope_theta=float("nan")), "'rope_theta' = nan"),
    "tok-bad-window": ("tokenizer", _edit(vocoder_attn_window_size=[40]),
                       "'vocoder_attn_window_size'"),
    "tok-causal-string": ("tokenizer", _edit(decoder_causal="yes"), "'decoder_causal'"),
    "index-list": ("lm", _index(["model-00001-of-00001.safetensors"]), "malformed index"),
    "index-escapes-directory": ("lm", _index({"lm_head.weight": "../x.safetensors"}),
                                "malformed index"),
    "index-number": ("lm", _index({"lm_head.weight": 3}), "malformed index"),
}


@pytest.mark.parametrize("case", CASES)
def test_impossible_config_exits_3_naming_the_field(synth_broken, case):
    kind, build, message = CASES[case]
    result, _ = synth_broken(kind, build)
    assert result.exit_code == EXIT_CHECKPOINT, result.stderr
    line = error_line(result.stderr)
    assert message in line, line
    assert "Traceback" not in result.stderr
