"""Text tokenizer: special ids by name, per-segment encoding and decoding against the fixtures."""

from __future__ import annotations

import json
import shutil

import pytest

from mimo_tts.errors import CheckpointError
from mimo_tts.lm.text import SPECIAL_TOKEN_NAMES, TextTokenizer


@pytest.fixture(scope="module")
def tok(tiny_a) -> TextTokenizer:
    return TextTokenizer.from_dir(tiny_a / "lm")


def _prompt_cases(cases):
    for group in ("lm_forward", "voice_prompt"):
        for case in cases["groups"][group]["cases"]:
            if case["name"].startswith("prefill"):
                yield case


def _generate_cases(cases):
    for group in ("lm_generate", "voice_prompt"):
        for case in cases["groups"][group]["cases"]:
            if "generated_text_tokens" in case:
                yield case


def test_special_ids_resolved_by_name(tok, cases):
    ids = cases["special_token_ids"]
    for field, token in SPECIAL_TOKEN_NAMES.items():
        assert getattr(tok.special, field) == ids[token], token
    assert tok.special.eos == cases["eos_token_id"]
    assert tok.special.pad == cases["pad_token_id"]
    assert len(tok) == cases["tokenizer_len"]


def test_segments_encode_like_reference(tok, cases):
    n = 0
    for case in _prompt_cases(cases):
        for seg in case["prompt"]["segments"]:
            if seg["kind"] == "text":
                assert tok.encode(seg["text"]) == seg["token_ids"], seg["text"]
                n += 1
    assert n >= 10


def test_per_segment_tokenisation_differs_from_joined(tok):
    # Spec §6.1: "." then a separate "\n\n" segment is not the joined string's tokenisation.
    parts = ["Hello world.", "\n\n"]
    joined = tok.encode("".join(parts))
    split = [i for p in parts for i in tok.encode(p)]
    assert tok.decode(joined) == tok.decode(split) == "Hello world.\n\n"


def test_decode_round_trips_segments(tok, cases):
    for case in _prompt_cases(cases):
        for seg in case["prompt"]["segments"]:
            if seg["kind"] == "text":
                assert tok.decode(seg["token_ids"]) == seg["text"]


def test_decode_matches_reference_extracted_text(tok, cases):
    """Spec §4.8: decode all but the last token, keep specials, strip, drop three markers."""
    for case in _generate_cases(cases):
        text = tok.decode(case["generated_text_tokens"][:-1], skip_special_tokens=False).strip()
        for marker in ("<|empty|>", "<|eot|>", "<|eostm|>"):
            text = text.replace(marker, "")
        assert text == case["extracted_text"], case["name"]
        strings = [tok.token_string(i) for i in case["generated_text_tokens"]]
        assert strings == case["generated_text_token_strings"]


def test_decode_drops_ids_outside_tokenizer(tok):
    s = tok.special
    ids = tok.encode("<|sostm|>Hi") + [len(tok), len(tok) + 100, -100]
    assert tok.decode(ids) == "<|sostm|>Hi"
    assert tok.decode([s.sostm, *tok.encode("Hi"), s.eostm], skip_special_tokens=True) == "Hi"
    assert tok.token_string(len(tok)) is None


def test_token_id_unknown_raises(tok):
    assert tok.token_id("<|empty|>") == tok.special.empty
    with pytest.raises(CheckpointError, match="no-such-token"):
        tok.token_id("<no-such-token>")


def _copy_lm_tokenizer(tiny_a, tmp_path):
    dst = tmp_path / "tok"
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny_a / "lm" / name, dst / name)
    return dst


def test_missing_directory_or_file(tiny_a, tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        TextTokenizer.from_dir(tmp_path / "absent")
    dst = _copy_lm_tokenizer(tiny_a, tmp_path)
    (dst / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        TextTokenizer.from_dir(dst)


def test_corrupt_tokenizer_json(tiny_a, tmp_path):
    dst = _copy_lm_tokenizer(tiny_a, tmp_path)
    (dst / "tokenizer.json").write_text('{"version": "1.0", "model": ', encoding="utf-8")
    with pytest.raises(CheckpointError, match="unreadable"):
        TextTokenizer.from_dir(dst)


def test_tokenizer_without_mimo_tokens(tiny_a, tmp_path):
    dst = _copy_lm_tokenizer(tiny_a, tmp_path)
    path = dst / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    for added in data["added_tokens"]:
        if added["content"] == "<|empty|>":
            added["content"] = "<|renamed|>"
    data["model"]["vocab"]["<|renamed|>"] = data["model"]["vocab"].pop("<|empty|>")
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"<\|empty\|>"):
        TextTokenizer.from_dir(dst)


def test_eos_from_config_or_error(tiny_a, tmp_path):
    dst = _copy_lm_tokenizer(tiny_a, tmp_path)
    cfg = json.loads((dst / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg["eos_token"] = {"content": "<|endoftext|>"}  # AddedToken form, overriding the map
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    assert TextTokenizer.from_dir(dst).special.eos == TextTokenizer.from_dir(dst).special.endoftext
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (dst / name).unlink()
    with pytest.raises(CheckpointError, match="eos_token"):
        TextTokenizer.from_dir(dst)
