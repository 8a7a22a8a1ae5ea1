"""Broken checkpoints end the run with exit 3 and one line naming the file or tensor at fault;
only safetensors and JSON are ever read (no pickle, no remote code)."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

from mimo_tts.errors import EXIT_CHECKPOINT
from tests.helpers import error_line


def _drop(name):
    def build(d):
        (d / name).unlink()
    return build


def _corrupt_header(d):
    (d / "model.safetensors").write_bytes(b"\xff" * 8 + b"not a header")


def _truncate(d):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 3])


def _shards_one_missing(d):
    tensors = load_file(str(d / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / shard))
    index = {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "model.safetensors").unlink()
    (d / "model-00002-of-00002.safetensors").unlink()


def _edit_tensors(edit):
    def build(d):
        tensors = load_file(str(d / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(d / "model.safetensors"))
    return build


def _wrong_shape(t):
    t["decoder.vocoder.head.out.bias"] = t["decoder.vocoder.head.out.bias"][:-1].clone()


def _wrong_dtype(t):
    t["lm_head.weight"] = t["lm_head.weight"].to(torch.int32)


def _no_sostm(d):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        path = d / name
        if path.is_file():
            path.write_text(path.read_text(encoding="utf-8").replace("<|sostm|>", "<|nostm|>"),
                            encoding="utf-8")


def _config_without(field):
    def build(d):
        config = json.loads((d / "config.json").read_text())
        del config[field]
        (d / "config.json").write_text(json.dumps(config))
    return build


def _smaller_codebooks(d):
    """A tokenizer whose codebooks 2.. hold 16 entries: the tiny LM emits codes up to 127."""
    tensors = load_file(str(d / "model.safetensors"))
    for name in list(tensors):
        layer = name.split(".")[4] if name.startswith("encoder.quantizer.vq.layers.") else None
        if layer is not None and int(layer) >= 2 and not name.endswith("inited"):
            tensors[name] = tensors[name][:16].clone()
    save_file(tensors, str(d / "model.safetensors"))
    config = json.loads((d / "config.json").read_text())
    config["codebook_size"] = config["codebook_size"][:2] + [16] * 18
    (d / "config.json").write_text(json.dumps(config))


CASES = {
    "lm-missing-config": ("lm", _drop("config.json"), "missing config.json in"),
    "tokenizer-missing-config": ("tokenizer", _drop("config.json"), "missing config.json in"),
    "lm-missing-tokenizer-json": ("lm", _drop("tokenizer.json"), "missing tokenizer.json in"),
    "tokenizer-config-lacks-field": ("tokenizer", _config_without("d_model"),
                                     "lacks field(s): d_model"),
    "corrupt-header": ("lm", _corrupt_header, "corrupt or truncated safetensors file"),
    "truncated-tokenizer": ("tokenizer", _truncate, "corrupt or truncated safetensors file"),
    "missing-shard": ("lm", _shards_one_missing,
                      "names missing shard(s): model-00002-of-00002.safetensors"),
    "wrong-shape": ("tokenizer", _edit_tensors(_wrong_shape),
                    "wrong tensor shape(s): decoder.vocoder.head.out.bias (961,) != (962,)"),
    "wrong-dtype": ("lm", _edit_tensors(_wrong_dtype), "non-float dtype for tensor(s): lm_head"),
    "no-special-tokens": ("lm", _no_sostm, "lacks MiMo special token(s): <|sostm|>"),
    "codebooks-do-not-match": ("tokenizer", _smaller_codebooks, "not a matching pair"),
}


@pytest.mark.parametrize("case", CASES)
def test_broken_checkpoint_exit_3(synth_broken, case):
    kind, build, message = CASES[case]
    result, broken = synth_broken(kind, build)
    assert result.exit_code == EXIT_CHECKPOINT, result.stderr
    line = error_line(result.stderr)
    assert message in line and str(broken) in line, line


def test_missing_tokenizer_directory(invoke, tmp_path):
    result = invoke("synth", "--model", "tiny", "--tokenizer", tmp_path / "gone", "--text", "x")
    assert result.exit_code == EXIT_CHECKPOINT
    assert "tokenizer checkpoint directory not found" in error_line(result.stderr)


class _Payload:
    """Unpickling this runs a shell command: proof that a file was (never) unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant_traps(directory, marker):
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker / "pickle")))
    (directory / "modeling_mimo.py").write_text(
        f"import pathlib\npathlib.Path({str(marker / 'code')!r}).touch()\n")
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_mimo.MiMo"}
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("with_safetensors", [True, False], ids=["loads", "refuses"])
def test_only_safetensors_and_json_are_read(invoke, preset_copy, tmp_path, with_safetensors):
    marker = tmp_path / "markers"
    marker.mkdir()
    lm, tok = preset_copy("lm"), preset_copy("tokenizer")
    for directory in (lm, tok):
        _plant_traps(directory, marker)
    if not with_safetensors:
        (lm / "model.safetensors").unlink()
    result = invoke("synth", "--model", lm, "--tokenizer", tok, "--text", "Hello.",
                    "--max-new-groups", "1")
    if with_safetensors:
        assert result.exit_code == 0, result.stderr
    else:
        assert result.exit_code == EXIT_CHECKPOINT
        assert "no model.safetensors or *.safetensors.index.json" in result.stderr
    assert list(marker.iterdir()) == []  # nothing was unpickled, no checkpoint code ran
