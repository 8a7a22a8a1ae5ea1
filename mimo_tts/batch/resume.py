"""What makes an item's output what it is: its resume key and its sidecar record.

`item_key` hashes every input that determines an item's output bytes: the run's part
(`run_inputs`, recorded in every sidecar, so `status` keys an item from its input line as `synth`
does) and the item's own (`item_inputs`). A folder holding an item done with the same key skips
it on the next run (`batch.manifest`). `sidecar_record` is everything needed to reproduce one
output. No torch here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path

from mimo_tts.batch.items import Item
from mimo_tts.batch.results import ItemResult
from mimo_tts.errors import InputError, MimoTTSError, UsageError
from mimo_tts.lm.engine import DEFAULT_ENGINE
from mimo_tts.runtime import runner_record
from mimo_tts.synthesis.audio import PAUSE_FRAMES
from mimo_tts.synthesis.markup import DEFAULT_SENTENCE_SILENCE, has_markup, script
from mimo_tts.synthesis.options import SynthesisOptions
from mimo_tts.synthesis.pieces import Piece
from mimo_tts.synthesis.preflight import engine_record
from mimo_tts.synthesis.settings import Settings
from mimo_tts.synthesis.streaming import chunk_cap
from mimo_tts.synthesis.voices import BUILT_IN, VoiceStore


def sidecar_record(settings: Settings, context: dict, result: ItemResult,
                   pieces: list[Piece]) -> dict:
    """Everything needed to reproduce one output; the sink adds `result` last."""
    s, item = settings, result.item
    o, described = item_options(s.synthesis, item), context["described"]
    text, audio = o.samplers()  # the item's task's (the run's are described)
    return {
        "runner": {**runner_record(), "argv": context["argv"]},
        "id": item.id, "source": item.source, "text": item.text, "task": o.task,
        "instruct": item.instruct or o.instruct,
        "prompt_audio": item.prompt_audio or o.prompt_audio,
        **_voice_fields(o.voice, item),
        "model": described["model"], "tokenizer": described["tokenizer"],
        "placement": described["placement"], "threads": context["threads"],
        "engine": engine_record(s, described["engine"]),
        "sampler": o.sampler_settings(),
        "effective_sampler": {"text": asdict(text), "audio": asdict(audio)},
        "seed": result.seed, "max_new_groups": o.max_new_groups,
        "batch_size": s.run.batch_size, "stream": s.run.stream, "stream_mode": o.stream_mode,
        "max_chars": o.max_chars, **({"speed": o.speed} if o.speed != 1 else {}),
        **({"sentence_silence": o.sentence_silence}
           if o.sentence_silence != DEFAULT_SENTENCE_SILENCE else {}),
        "audio": {"format": s.run.format, "sample_rate": s.run.sample_rate,
                  "seconds": round(result.seconds, 4), "pause_frames": PAUSE_FRAMES},
        "pieces": [p.record() for p in pieces],
        "timings": {**{k: round(v, 4) for k, v in context["timings"].items()},
                    **{k: round(v, 4) for k, v in result.timings.items()}},
        "resume": context.get("resume"),  # the run's part of the key (`run_inputs`)
    }


def _voice_fields(voice: str | None, item: Item) -> dict:
    """The stored voice of an item cloned from one (its record: source, tokenizer, codes)."""
    if not voice or item.prompt_audio:
        return {}
    try:
        return {"voice": VoiceStore().record(voice)}
    except MimoTTSError:
        return {"voice": {"name": voice}}


def item_options(o: SynthesisOptions, item: Item) -> SynthesisOptions:
    """The run's synthesis options in the task an item's line names; a run's --instruct or
    --prompt-audio that this task takes none of fails the item (InputError, exit 9)."""
    if item.task is None or item.task == o.task:
        return o
    try:
        return replace(o, task=item.task)
    except UsageError as exc:
        raise InputError(f"{item.source}: task {item.task}: {exc}") from None


def item_key(settings: Settings, refs, item: Item, seed: int) -> str:
    """The resume key: a hash of every input that determines an item's output bytes."""
    o = item_options(settings.synthesis, item)
    inputs = {**run_inputs(settings, refs),
              **item_inputs(item.text, item.instruct or o.instruct, seed,
                            item.prompt_audio or o.prompt_audio, o.task)}
    return resume_key({**inputs, **tagged_inputs(item.text, o)})


def tagged_inputs(text: str, o) -> dict:
    """The key's inputs of the stored voices a text's `[voice:]` tags name, by their codes'
    hash (none: nothing, so texts without such tags keep their keys)."""
    if not has_markup(text):
        return {}
    named = [v for v in script(text, o).named_voices if v not in BUILT_IN]
    return {"tagged_voices": {name: _voice_stamp(name) for name in named}} if named else {}


def run_inputs(settings: Settings, refs) -> dict:
    """The resume key's inputs that one run gives all its items (JSON values): every sidecar
    records them, so `status` keys an item from its input line as `synth` does."""
    o, run, p, (lm, tok) = settings.synthesis, settings.run, settings.placement, refs
    inputs = {
        "template": o.template, "model": [str(lm.path), lm.revision],
        "tokenizer": [str(tok.path), tok.revision], "sampler": o.sampler_settings(),
        "max_new_groups": o.max_new_groups, "batch_size": run.batch_size,
        "max_chars": o.max_chars, "format": run.format, "sample_rate": run.sample_rate,
        "stream": run.stream, "dtypes": [p.lm_dtype.value, p.tokenizer_dtype.value],
    }
    if run.stream and o.stream_mode != "official":  # keeps the keys of earlier outputs
        inputs["stream_mode"] = o.stream_mode
    if run.stream and o.stream_mode == "official":  # its audio depends on the chunks
        inputs["stream_chunk_groups"] = [
            o.stream_chunk_groups,
            chunk_cap(o.stream_mode, o.stream_chunk_groups, o.stream_max_chunk_groups),
            "past the look-ahead"]  # the first push's groups count after it (issue 24)
    if settings.engine.engine != DEFAULT_ENGINE:  # likewise
        inputs["engine"] = settings.engine.engine
    if settings.engine.lm_quant:  # other products, other codes: unquantized keeps its keys
        inputs["lm_quant"] = settings.engine.lm_quant
    if o.voice:  # the stored voice's codes, by their hash
        inputs["voice"] = _voice_stamp(o.voice)
    if o.captions:  # a piece per sentence: other audio
        inputs["captions"] = True
    if o.speed != 1:  # the same codes, stretched: speed 1 keeps its keys
        inputs["speed"] = o.speed
    if o.sentence_silence != DEFAULT_SENTENCE_SILENCE:  # other pauses: the default keeps its keys
        inputs["sentence_silence"] = o.sentence_silence
    return inputs


def item_inputs(text: str, instruct: str | None, seed: int, prompt_audio: str | None,
                task: str) -> dict:
    """The resume key's inputs of one item: its text and the values it runs with."""
    return {"text": text, "instruct": instruct, "seed": seed,
            "prompt_audio": _file_stamp(prompt_audio), "task": task}


def resume_key(inputs: dict) -> str:
    """The hash of a key's inputs (`run_inputs` with `item_inputs`)."""
    blob = json.dumps(inputs, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def _voice_stamp(name: str) -> dict:
    try:
        record = VoiceStore().record(name)
    except MimoTTSError:
        return {"name": name}
    return {"name": name, "codes": record["codes"].get("sha256"),
            "tokenizer": record["tokenizer"].get("id")}


def _file_stamp(path: str | None) -> dict | None:
    if not path:
        return None
    try:
        stat = Path(path).stat()
    except OSError:
        return {"path": path}
    return {"path": str(Path(path).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
