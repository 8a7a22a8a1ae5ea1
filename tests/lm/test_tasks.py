"""TTS prompts against the reference prompt builder (fixtures README §4, §5.3; spec §6)."""

from __future__ import annotations

import pytest
import torch

from mimo_tts.errors import InputError
from mimo_tts.lm.prompts import IGNORE_ID, build_prompt
from mimo_tts.lm.tasks import (
    SYS_ZH,
    SYS_ZH_CLONE,
    TASKS,
    TTS_EN_TEMPLATES,
    TTS_ZH_TEMPLATES,
    choose_template,
    is_chinese,
    preprocess_text,
)
from mimo_tts.lm.text import TextTokenizer
from tests.helpers import find_case

PREFILL = [
    ("lm_forward", "prefill_tts_en"),
    ("lm_forward", "prefill_tts_zh"),
    ("lm_forward", "prefill_tts_instruct"),
    ("voice_prompt", "prefill_tts_voice"),
]


@pytest.fixture(scope="module")
def tok(tiny_a) -> TextTokenizer:
    return TextTokenizer.from_dir(tiny_a / "lm")


@pytest.fixture(scope="module")
def empty_ids(cases) -> list[int]:
    return cases["speech_empty_ids"]


@pytest.fixture(scope="module")
def chirp_codes(case_tensors) -> dict:
    t = case_tensors("codec_encode")
    return {
        "raw": t["encode_chirp_1p3s.codes_8"],
        "padded": t["encode_chirp_1p3s.codes_group_padded"],
    }


def _task_of(meta) -> str:
    if meta["instruct"] is None:
        return "tts_sft"
    return "tts_sft_with_audio" if meta["prompt_speech"] else "tts_sft_with_instruct"


def _build(meta, tok, empty_ids, codes, **kw):
    return build_prompt(
        _task_of(meta), meta["text"], tok, empty_ids, instruct=meta["instruct"],
        prompt_codes=codes if meta["prompt_speech"] else None, **kw,
    )


@pytest.mark.parametrize("group,name", PREFILL)
def test_prompt_matches_reference(group, name, cases, case_tensors, tok, empty_ids, chirp_codes):
    meta = find_case(cases, name)["prompt"]
    choice = meta["template_choice"]
    prompt = _build(meta, tok, empty_ids, chirp_codes["padded"], template=choice["index"])
    ref = case_tensors(group)[f"{name}.input_ids"].long()
    assert prompt.input_ids.dtype == torch.int64
    assert prompt.input_ids.shape == ref.shape
    assert torch.equal(prompt.input_ids, ref)
    assert prompt.rendered == meta["rendered_prompt"]
    assert prompt.n_groups == meta["n_groups"] == ref.shape[1] // 4
    assert (prompt.template_index, prompt.template) == (choice["index"], choice["template"])
    assert prompt.text == meta["preprocessed_text"]
    assert len(prompt.segments) == len(meta["segments"])
    for seg, want in zip(prompt.segments, meta["segments"], strict=True):
        assert (seg.kind, seg.text) == (want["kind"], want["text"])
        if want["kind"] == "text":
            assert list(seg.token_ids) == want["token_ids"]
        else:
            assert seg.audio_frames == want["audio_frames"]
            assert seg.audio_groups == want["audio_groups"]


@pytest.mark.parametrize("group,name", PREFILL)
def test_template_by_string_equals_index(group, name, cases, tok, empty_ids, chirp_codes):
    meta = find_case(cases, name)["prompt"]
    choice = meta["template_choice"]
    by_index = _build(meta, tok, empty_ids, chirp_codes["padded"], template=choice["index"])
    by_string = _build(meta, tok, empty_ids, chirp_codes["padded"], template=choice["template"])
    assert torch.equal(by_index.input_ids, by_string.input_ids)
    assert by_string.template_index == choice["index"]
    assert choice["n_choices"] == len(TTS_EN_TEMPLATES) == len(TTS_ZH_TEMPLATES)


def test_voice_prompt_pads_by_repeating_last_frame(
    cases, case_tensors, tok, empty_ids, chirp_codes
):
    meta = find_case(cases, "prefill_tts_voice")["prompt"]
    raw = chirp_codes["raw"]
    assert raw.shape[1] % 4 != 0  # the case exercises the padding
    prompt = _build(meta, tok, empty_ids, raw, template=meta["template_choice"]["index"])
    ref = case_tensors("voice_prompt")["prefill_tts_voice.input_ids"].long()
    assert torch.equal(prompt.input_ids, ref)
    # 20 rows (all quantizers) keep the first 8
    full = case_tensors("codec_encode")["encode_chirp_1p3s.codes_all"]
    again = _build(meta, tok, empty_ids, full, template=meta["template_choice"]["index"])
    assert torch.equal(again.input_ids, prompt.input_ids)


def test_group_layout_invariants(tok, empty_ids, chirp_codes):
    prompt = build_prompt(
        "tts_sft_with_audio", "hello", tok, empty_ids, prompt_codes=chirp_codes["raw"], seed=1
    )
    ids = prompt.input_ids
    assert ids.shape == (9, 4 * prompt.n_groups)
    text = ids[0].view(-1, 4)
    assert (text[:, 1:] == IGNORE_ID).all()
    audio = text[:, 0] == tok.special.empty
    assert int(audio.sum()) == 9
    channels = ids[1:].view(8, -1, 4)  # [K, G, 4]
    empty = torch.tensor(empty_ids).view(8, 1, 1)
    assert (channels[:, ~audio] == empty).all()
    assert (channels[:, audio] < empty).all()
    first = int(audio.nonzero()[0])
    assert text[first - 1, 0] == tok.special.sosp and text[first + 9, 0] == tok.special.eosp


def test_natural_layouts(tok, empty_ids, chirp_codes):
    text = "用气喘吁吁的年轻男性声音说：我跑不动了。"
    natural = build_prompt("tts_sft_with_natural_instruction", text, tok, empty_ids, seed=3)
    assert natural.template is None and natural.template_index is None
    assert [s.text for s in natural.segments] == [
        "<|im_start|>system\n", SYS_ZH, "<|im_end|>\n",
        f"<|im_start|>user\n{text}<|im_end|>\n", "<|im_start|>assistant\n<think>\n",
    ]
    clone = build_prompt(
        "tts_sft_with_audio", text, tok, empty_ids, prompt_codes=chirp_codes["padded"]
    )
    assert clone.template is None
    assert [s.kind for s in clone.segments] == ["text", "text", "audio", "text", "text", "text"]
    assert clone.segments[1].text == SYS_ZH_CLONE
    tail = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert clone.rendered.endswith(tail)


def test_instruct_layout_without_audio(tok, empty_ids):
    prompt = build_prompt(
        "tts_sft_with_instruct", "HELLO THERE", tok, empty_ids, instruct="whisper", template=2
    )
    assert prompt.segments[1].text == SYS_ZH
    assert prompt.segments[3].text == (
        "<|im_start|>user\nGenerate speech from this text: Hello there(whisper)<|im_end|>\n"
    )


def test_capitalisation_rule():
    assert preprocess_text("hello world") == "Hello world"
    assert preprocess_text("HELLO WORLD") == "Hello world"
    assert preprocess_text("hello World") == "hello World"
    assert preprocess_text("今天天气真好") == "今天天气真好"
    assert preprocess_text("hello 世界") == "Hello 世界"  # cased chars all lower
    assert preprocess_text("123") == "123"


def test_template_language():
    assert is_chinese("一") and is_chinese("abc\u9fffdef")
    assert not is_chinese("\u4dff\ua000") and not is_chinese("こんにちは") and not is_chinese("hi")
    for seed in range(5):
        assert choose_template("你好 world", None, seed)[1] in TTS_ZH_TEMPLATES
        assert choose_template("hello", None, seed)[1] in TTS_EN_TEMPLATES
        assert choose_template("カタカナ", None, seed)[1] in TTS_EN_TEMPLATES


def test_seed_reproducibility(tok, empty_ids):
    def make(seed):
        return build_prompt("tts_sft", "A test sentence.", tok, empty_ids, seed=seed)

    a, b = make(7), make(7)
    assert (a.template_index, a.template) == (b.template_index, b.template)
    assert torch.equal(a.input_ids, b.input_ids)
    picks = {make(seed).template_index for seed in range(40)}
    assert len(picks) > 3  # the seed really selects
    assert TTS_EN_TEMPLATES[a.template_index] == a.template
    assert a.rendered.startswith(f"<|im_start|>user\n{a.template}: A test sentence.")


def test_explicit_templates(tok, empty_ids):
    custom = build_prompt("tts_sft", "hi", tok, empty_ids, template="Say it")
    assert (custom.template_index, custom.template) == (None, "Say it")
    assert custom.segments[0].text == "<|im_start|>user\nSay it: Hi<|im_end|>\n"
    for bad in (10, -1, True, " "):
        with pytest.raises(InputError):
            build_prompt("tts_sft", "hi", tok, empty_ids, template=bad)


def test_task_metadata(tok, cases):
    assert set(TASKS) == {
        "tts_sft", "tts_sft_with_instruct", "tts_sft_with_audio", "tts_sft_with_natural_instruction"
    }
    want = tuple(dict.fromkeys(cases["tts_stop_token_ids"]))
    for spec in TASKS.values():
        assert spec.sampler == "tts"
        assert spec.stop_ids(tok.special) == want


@pytest.mark.parametrize(
    "task,text,kw,match",
    [
        ("tts_sft", "", {}, "text is empty"),
        ("tts_sft", " \n\t", {}, "text is empty"),
        ("tts_sft", "hi", {"instruct": "calm"}, "takes no instruct"),
        ("tts_sft_with_instruct", "hi", {}, "needs an instruct"),
        ("tts_sft_with_instruct", "hi", {"instruct": "  "}, "instruct is empty"),
        ("tts_sft_with_audio", "hi", {}, "needs prompt audio"),
        ("tts_sft", "hi", {"prompt_codes": torch.zeros(8, 4, dtype=torch.long)}, "no prompt audio"),
        ("tts_sft_with_natural_instruction", "hi", {"instruct": "x"}, "takes no instruct"),
        ("tts_dialogue", "hi", {}, "unknown task"),
    ],
)
def test_validation_errors(task, text, kw, match, tok, empty_ids):
    with pytest.raises(InputError, match=match):
        build_prompt(task, text, tok, empty_ids, **kw)


@pytest.mark.parametrize(
    "codes,match",
    [
        (torch.zeros(8, 0, dtype=torch.long), "no codec frames"),
        (torch.zeros(8, dtype=torch.long), "2-D"),
        (torch.zeros(7, 4, dtype=torch.long), "7 rows"),
        (torch.zeros(8, 4), "integers"),
        (torch.full((8, 4), 128, dtype=torch.long), "channel 2"),
        (torch.full((8, 4), -1, dtype=torch.long), "channel 0"),
    ],
)
def test_bad_prompt_codes(codes, match, tok, empty_ids):
    with pytest.raises(InputError, match=match):
        build_prompt("tts_sft_with_audio", "hi", tok, empty_ids, prompt_codes=codes)
