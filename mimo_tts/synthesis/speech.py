"""Speech in memory: `Audio` and `AudioChunk`, and the library's calls that make them
(`SpeechCalls`: `synthesize`, `synthesize_batch`, `stream`, `decode`), each argument checked as
the CLI checks its flag. `MiMoTTS` (synthesizer.py) is the `SpeechCalls` over its loaded stages:
each call turns its text pieces into jobs of the speech worker (`MiMoTTS.worker`,
`synthesis/worker.py`) and finishes what they give (`prompts`, `describe`, `stage1`, `options`).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch

from mimo_tts.errors import InputError, OptionTypeError
from mimo_tts.runtime import runner_record
from mimo_tts.runtime.openmp import release_team
from mimo_tts.synthesis.audio import (
    PAUSE_FRAMES,
    SAMPLE_RATE,
    check_format_rate,
    output_format,
    to_numpy,
    write_audio,
)
from mimo_tts.synthesis.captions import cues, piece_samples
from mimo_tts.synthesis.markup import script
from mimo_tts.synthesis.options import DEFAULT_TASK, RunOptions, SynthesisOptions, task_for
from mimo_tts.synthesis.pieces import Piece
from mimo_tts.synthesis.stage1 import check_pause, codes_tensor
from mimo_tts.synthesis.text import clean_text
from mimo_tts.synthesis.worker import Chunk, Failed, SpeechJob

SYNTHESIS_FIELDS = frozenset(f.name for f in fields(SynthesisOptions))


@dataclass(frozen=True)
class Audio:
    """Synthesised speech, in memory: what `MiMoTTS.synthesize` and `decode` return."""

    samples: np.ndarray
    """Mono float32 samples [S] in [-1, 1]."""

    sample_rate: int
    """Samples per second: 24000, the audio tokenizer's rate."""

    provenance: dict
    """How it was made: checkpoints, placement, task, seed, samplers, text pieces (the CLI's
    sidecar record)."""

    cues: tuple = ()
    """`captions.Cue` per text piece when `captions=True`: exact sample spans of the joined
    audio, pauses between them."""

    @property
    def seconds(self) -> float:
        """The length in seconds."""
        return len(self.samples) / self.sample_rate

    def save(self, path: str | os.PathLike, format: str | None = None) -> Path:
        """Write the audio to `path` as the CLI's `-o` does (same writer, same bytes), atomically.

        `format` is one of `mimo_tts.synthesis.audio.FORMATS` (`wav`, `wav-float`, `flac`,
        `mp3`, `opus`, `ogg`); None takes it from the extension. A name and a format that
        disagree, or an unknown extension without `format`, is a `UsageError`; a file that
        cannot be written an `OutputError`. Returns the path written.
        """
        fmt = output_format(os.fspath(path), format)
        check_format_rate(fmt, self.sample_rate)
        return write_audio(path, self.samples, self.sample_rate, fmt)


@dataclass(frozen=True)
class AudioChunk:
    """A part of streamed speech, handed out as soon as Stage-1 decoded it (`MiMoTTS.stream`)."""

    samples: np.ndarray
    """Mono float32 samples [S_i] in [-1, 1]; the chunks of one call, joined, are its audio."""

    sample_rate: int
    """Samples per second: 24000."""

    index: int
    """The chunk's place in its `stream` call: 0, 1, ..."""


class SpeechCalls:
    """The library's calls: text -> `Audio` (numpy, 24 kHz), in memory only."""

    # -- the library face --
    def synthesize(self, text: str, *, task: str | None = None, instruct: str | None = None,
                   prompt_audio=None, seed: int | None = None,
                   options: SynthesisOptions | None = None, **overrides) -> Audio:
        """Speech for `text` (split on sentence ends past `max_chars`, pieces joined).

        `options` (default `self.options`) holds every sampling and task option; the keywords,
        and any other `SynthesisOptions` field given by name, override it for this call.
        `prompt_audio` is a file path or `(samples, sample_rate)` in memory.
        """
        o = self._options("synthesize", options, task=task, instruct=instruct,
                          prompt_audio=prompt_audio, seed=seed, **overrides)
        return self._synthesize([_text(text, "text")], o, 1)[0]

    def synthesize_batch(self, texts: Sequence[str], *, batch_size: int = 1,
                         **given) -> list[Audio]:
        """Speech for several texts with one seed, each text's audio its `synthesize` call's:
        the text pieces are jobs of one batch of `batch_size` rows on the speech worker, each
        sampling from its own generator (as `--batch-size` on the CLI)."""
        batch_size = RunOptions(batch_size=batch_size).batch_size  # typed, >= 1
        texts = _texts(texts)
        o = self._options("synthesize_batch", given.pop("options", None), **given)
        return self._synthesize(texts, o, batch_size)

    def stream(self, text: str, **given) -> Iterator[AudioChunk]:
        """Speech for `text` in chunks as Stage-1 decodes them (keywords as `synthesize`)."""
        o = self._options("stream", given.pop("options", None), **given)
        text = _text(text, "text")
        prompts = self.prompts(text, o, o.seed)
        options = o.generation_options(o.seed)
        jobs = [SpeechJob(p, options, o.seed, decode="stream", label="stream", order=(0, i),
                          key=i, speed=o.speed) for i, p in enumerate(prompts)]
        worker = self.worker(1, stream=True, schedule=(o.stream_mode, o.stream_chunk_groups,
                                                       o.stream_max_chunk_groups))
        pauses = script(text, o).pauses
        for index, chunk in enumerate(_background(stream_audio(worker.run(jobs), pauses))):
            yield AudioChunk(to_numpy(chunk), SAMPLE_RATE, index)

    def decode(self, codes, pause_frames: int = PAUSE_FRAMES) -> Audio:
        """Stage-1 alone: codes [8, T] (or one per text piece; torch or numpy integers) ->
        `Audio`, checked as `mimo-tts decode` checks a codes file (codes out of range:
        AudioCheckError)."""
        if isinstance(codes, torch.Tensor | np.ndarray):
            pieces = [codes_tensor(codes, "codes")]
        elif isinstance(codes, list | tuple) and codes:
            pieces = [codes_tensor(c, f"codes[{i}]") for i, c in enumerate(codes)]
        elif isinstance(codes, list | tuple):
            raise InputError("codes: no code tensors to decode")
        else:
            raise OptionTypeError(f"codes must be a tensor or a list of tensors, not "
                                  f"{type(codes).__name__}")
        pauses = self.stage1.frame_pauses(len(pieces), check_pause(pause_frames))
        audio = self.stage1.join(pieces, pauses, "codes")
        return Audio(to_numpy(audio), SAMPLE_RATE,
                     {"runner": runner_record(),
                      "tokenizer": self.tok_ref.describe() if self.tok_ref else None})

    def _synthesize(self, texts: list[str], o: SynthesisOptions, rows: int) -> list[Audio]:
        """Every text's pieces as jobs of one speech worker of `rows` rows, each text's pieces
        decoded together, then joined and checked per text."""
        options = o.generation_options(o.seed)
        groups: list[list[SpeechJob]] = []
        for n, text in enumerate(texts):
            group: list[SpeechJob] = []
            group += [SpeechJob(p, options, o.seed, group=group, label=f"text {n + 1}",
                                order=(n, i), speed=o.speed)
                      for i, p in enumerate(self.prompts(text, o, o.seed))]
            groups.append(group)
        jobs = [job for group in groups for job in group]
        if jobs:
            for event in self.worker(min(rows, len(jobs))).run(jobs):
                if isinstance(event, Failed):
                    raise event.error
        results = []
        for n, group in enumerate(groups):
            pieces = [job.piece for job in group]
            audio = self._audio(self.stage1.finish(pieces, f"text {n + 1}",
                                                   script(texts[n], o).pauses), o, pieces)
            if o.captions:
                audio = replace(audio, cues=tuple(self.cues(texts[n], o, pieces)))
            results.append(audio)
        return results

    def cues(self, text: str, o: SynthesisOptions, pieces: list[Piece]) -> list:
        """The captions of a text synthesised with `captions=True`: one cue per piece."""
        spf, found = self.stage1.samples_per_frame, script(text, o)
        return cues(list(found.texts), [piece_samples(p, spf) for p in pieces], SAMPLE_RATE,
                    found.pauses, found.voices)

    def _options(self, call: str, options, **given) -> SynthesisOptions:
        """`options` (default `self.options`) with this call's keywords; a keyword that is no
        `SynthesisOptions` field is a TypeError naming it. No task named (the options' is
        the default, which takes neither input): a prompt_audio or instruct picks its task,
        as on the CLI without --task."""
        unknown = sorted(set(given) - SYNTHESIS_FIELDS)
        if unknown:
            raise TypeError(f"{call}() got unexpected keyword argument(s) "
                            f"{', '.join(map(repr, unknown))} (not SynthesisOptions fields)")
        if options is None:
            options = self.options
        elif not isinstance(options, SynthesisOptions):
            raise OptionTypeError(f"options must be a SynthesisOptions, not "
                                  f"{type(options).__name__}")
        changes = {k: v for k, v in given.items() if v is not None}
        if "task" not in changes and options.task == DEFAULT_TASK:
            changes["task"] = task_for(changes.get("instruct", options.instruct),
                                       changes.get("prompt_audio", options.prompt_audio),
                                       changes.get("voice", options.voice))
        return replace(options, **changes)

    def _audio(self, audio: torch.Tensor, o: SynthesisOptions, pieces: list[Piece]) -> Audio:
        prompt_audio = getattr(o.prompt_audio, "describe", lambda: o.prompt_audio)()
        record = {"runner": runner_record(), **self.describe(o),
                  "task": o.task, "instruct": o.instruct, "prompt_audio": prompt_audio,
                  "voice": o.voice,
                  "seed": o.seed, "pieces": [p.record() for p in pieces]}
        return Audio(to_numpy(audio), SAMPLE_RATE, record)


def _text(text, where: str) -> str:
    """One text as the CLI takes it (`clean_text`: control characters refused, exit 9)."""
    if not isinstance(text, str):
        raise OptionTypeError(f"{where} must be a string, not {type(text).__name__}")
    return clean_text(text, where)


def _texts(texts) -> list[str]:
    if isinstance(texts, str | bytes):
        raise OptionTypeError(f"texts must be a list of strings, not one {type(texts).__name__}"
                              " (synthesize takes one text)")
    try:
        texts = list(texts)
    except TypeError:
        raise OptionTypeError(f"texts must be a list of strings, not "
                              f"{type(texts).__name__}") from None
    return [_text(t, f"texts[{i}]") for i, t in enumerate(texts)]


def stream_audio(events: Iterable, pauses) -> Iterator:
    """The audio [S_i] of streamed jobs' events, in order, with `pauses[i]` zero samples
    before piece i and `pauses[-1]` after the last (the pieces of one text, run one at a
    time); a failure is raised."""
    begun: set = set()
    for event in events:
        if isinstance(event, Failed):
            raise event.error
        job = event.job
        if job not in begun:  # the pause before a piece's audio
            begun.add(job)
            if pauses[job.order[1]]:
                yield torch.zeros(pauses[job.order[1]])
        if isinstance(event, Chunk):
            yield event.samples
    if pauses[-1]:
        yield torch.zeros(pauses[-1])


def _background(chunks: Iterator) -> Iterator:
    """`chunks` produced in a thread of their own (Stage-0 goes on while the caller plays
    what it has); an error there is raised here."""
    out: queue.Queue = queue.Queue()

    def run():
        try:
            for chunk in chunks:
                out.put(chunk)
            out.put(None)
        except BaseException as exc:  # re-raised in the caller's thread
            out.put(exc)

    release_team()  # this thread's OpenMP team would throttle the stream's (runtime/openmp.py)
    threading.Thread(target=run, name="mimo-tts-stream", daemon=True).start()
    while (chunk := out.get()) is not None:
        if isinstance(chunk, BaseException):
            raise chunk
        yield chunk
