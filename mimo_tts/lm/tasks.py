"""TTS tasks (spec §6.1, §6.2, §6.4): what each task takes, its samplers and stop set, templates.

`TaskSpec` is the one home of a task's facts: the inputs it accepts, its sampler defaults (spec
§4.6) and its stop tokens (spec §4.7). No torch here, so options validate tasks cheaply; the
prompts themselves are built in `mimo_tts.lm.prompts`.

Tasks (the official `tts_sft` forms, plus a documented voice-clone form):
- `tts_sft`: plain, `read_text_only=True` without instruct.
- `tts_sft_with_instruct`: a style instruction, `{template}: {text}({instruct})`.
- `tts_sft_with_audio`: a voice prompt; with an instruction the official instruct + prompt_speech
  layout, without one the official natural layout (`read_text_only=False`) with the voice prompt.
- `tts_sft_with_natural_instruction`: the style is part of the text (`read_text_only=False`),
  optionally with a voice prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from mimo_tts.errors import InputError
from mimo_tts.lm.config import TASK_STOP_TOKENS, SamplerConfig, task_samplers
from mimo_tts.lm.text import SpecialTokens

# Exact strings of the official templates.py (spec §6.4).
TTS_EN_TEMPLATES = (
    "Please convert this text to speech",
    "Turn this writing into audio",
    "Generate speech from this text",
    "Read this content out loud",
    "Convert these words to voice",
    "Create an audio version of this text",
    "Please vocalize this content",
    "Turn this text into audible format",
    "Help me convert this writing to speech",
    "Make this text into spoken audio",
)
TTS_ZH_TEMPLATES = (
    "请将这段文字转换为语音",
    "帮我把这个文本读出来",
    "将这些文字生成音频",
    "请朗读这段内容",
    "把这段话转换成语音文件",
    "生成这段文字的语音版本",
    "请用语音播报这些内容",
    "将文本转换为可听的音频",
    "帮我朗读这段文字",
    "把这些内容念出来",
)
SYS_ZH = "你需要根据指定的风格指令和文本内容来生成语音。"
SYS_ZH_CLONE = (
    "你需要根据指定的风格指令和文本内容来生成和语音prompt具有相同音色的语音。你的音色应该是："
)


@dataclass(frozen=True)
class TaskSpec:
    """What a task takes and how its output is sampled and stopped."""

    name: str
    instruct: str  # "required" | "optional" | "none"
    prompt_audio: str  # "required" | "optional" | "none"
    sampler: str = "tts"  # key of the per-task sampler defaults (spec §4.6)
    stop_tokens: tuple[str, ...] = TASK_STOP_TOKENS["tts"]  # SpecialTokens fields (spec §4.7)

    def samplers(self) -> tuple[SamplerConfig, SamplerConfig]:
        """The task's official (text, audio) sampler defaults (spec §4.6)."""
        return task_samplers(self.sampler)

    def stop_ids(self, special: SpecialTokens) -> tuple[int, ...]:
        """The stop set of this task as token ids (duplicates removed, order kept)."""
        return tuple(dict.fromkeys(getattr(special, name) for name in self.stop_tokens))


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("tts_sft", instruct="none", prompt_audio="none"),
        TaskSpec("tts_sft_with_instruct", instruct="required", prompt_audio="none"),
        TaskSpec("tts_sft_with_audio", instruct="optional", prompt_audio="required"),
        TaskSpec("tts_sft_with_natural_instruction", instruct="none", prompt_audio="optional"),
    )
}


def preprocess_text(text: str) -> str:
    """The official capitalisation rule: all-lower or all-upper text is capitalised (§6.1)."""
    return text.capitalize() if text.isupper() or text.islower() else text


def is_chinese(text: str) -> bool:
    """True when the text holds a CJK unified ideograph (U+4E00-U+9FFF): zh templates (§6.2)."""
    return any("\u4e00" <= ch <= "\u9fff" for ch in text)


def choose_template(
    text: str, template: int | str | None, seed: int | None
) -> tuple[int | None, str]:
    """Pick the instruction template: explicit index or string, else `random.Random(seed)`."""
    choices = TTS_ZH_TEMPLATES if is_chinese(text) else TTS_EN_TEMPLATES
    if isinstance(template, bool):
        raise InputError(f"template must be an index or a string, not {template!r}")
    if isinstance(template, int):
        if not 0 <= template < len(choices):
            raise InputError(f"template index {template} out of range 0..{len(choices) - 1}")
        return template, choices[template]
    if isinstance(template, str):
        if not template.strip():
            raise InputError("template string is empty")
        return (choices.index(template) if template in choices else None), template
    index = random.Random(seed).randrange(len(choices))
    return index, choices[index]


def validate_inputs(spec: TaskSpec, text, instruct, has_prompt_audio: bool) -> None:
    """The inputs one prompt of `spec` needs (InputError names the task and the fix)."""
    if not isinstance(text, str) or not text.strip():
        raise InputError("text is empty")
    if instruct is not None and (not isinstance(instruct, str) or not instruct.strip()):
        raise InputError("instruct is empty")
    if spec.instruct == "required" and instruct is None:
        raise InputError(f"task {spec.name} needs an instruct (style instruction)")
    if spec.instruct == "none" and instruct is not None:
        raise InputError(f"task {spec.name} takes no instruct; use tts_sft_with_instruct")
    if spec.prompt_audio == "required" and not has_prompt_audio:
        raise InputError(f"task {spec.name} needs prompt audio (voice prompt codes)")
    if spec.prompt_audio == "none" and has_prompt_audio:
        raise InputError(f"task {spec.name} takes no prompt audio; use tts_sft_with_audio")
