"""What `mimo-tts synth` and the Ray driver share: a `SynthRequest` (built once from the flags)
-> items, Settings and Shard, the one sink a run writes through, and the run itself through
the batch runner.

No torch at import: the CLI imports this inside its commands, and `--dry-run` reads its
settings without loading anything.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from mimo_tts.batch.items import Item, Naming, has_surrogates, piped, read_items
from mimo_tts.batch.results import ItemResult
from mimo_tts.batch.runner import BatchRunner
from mimo_tts.batch.shards import Shard, resolve_shard
from mimo_tts.batch.sinks import DirectorySink, FileSink, RawPcmSink, StdoutSink, TaskDirectories
from mimo_tts.errors import UsageError
from mimo_tts.lm.tasks import TASKS
from mimo_tts.synthesis.markup import (
    DEFAULT_SENTENCE_SILENCE,
    STORE_HINT,
    MarkupError,
    check_voices,
    has_markup,
    script,
)
from mimo_tts.synthesis.options import check
from mimo_tts.synthesis.profiles import load_profile
from mimo_tts.synthesis.settings import OptionValues, Settings, place, resolve_options
from mimo_tts.synthesis.voices import VoiceStore


def check_binary_stdout(to_stdout: bool, flag: str) -> None:
    """Audio bytes are never dumped on a terminal (like gzip): pipe or redirect stdout."""
    check(not (to_stdout and os.isatty(1)),
           f"{flag} writes audio bytes to stdout, which is a terminal; pipe it (| aplay) or "
           "redirect it (> file)")


def variant_of(o) -> tuple[str, ...]:
    """What a derived id adds for output settings off their default (`Naming.variant`): a
    `--speed 1.5` run of a text spoken at speed 1 before writes its own file."""
    return ((f"speed={o.speed:g}",) if o.speed != 1 else ()) + (
        (f"sentence_silence={o.sentence_silence:g}",)
        if o.sentence_silence != DEFAULT_SENTENCE_SILENCE else ())


def check_markup(items: list[Item], o) -> None:
    """Every item's pause and voice tags read before anything loads: a bad one is a one-line
    UsageError naming the item and the tag (exit 2)."""
    known = lru_cache(maxsize=1)(lambda: VoiceStore().names())  # the registry, read once
    for item in items:
        if item.error is None and has_markup(item.text):
            try:
                check_voices(script(item.text, o).named_voices, known, STORE_HINT)
            except MarkupError as exc:
                raise MarkupError(f"{item.source}: {exc}") from None


@dataclass(frozen=True)
class SynthRequest:
    """What one `mimo-tts synth` (or a Ray run, or a preflight) asks for: the texts and input
    files of its items, its shard, its profile, whether stdout takes JSON, and its options."""

    options: OptionValues = field(default_factory=OptionValues)
    texts: tuple[str, ...] = ()  # --text ('-': stdin)
    inputs: tuple[str, ...] = ()  # --input .txt / .jsonl files ('-': stdin)
    shard: str | None = None  # --shard K/N; None: from the env, or every item
    config: str | None = None  # --config: a profile's path or name
    as_json: bool = False


def check_unicode(request: SynthRequest) -> None:
    """Every option value is text that a sidecar, a manifest and a log can hold: bytes in argv
    that are not UTF-8 (Python keeps them as lone surrogates) are a usage error naming the
    flag. `--text` is an item's text and fails that item (exit 9) instead."""
    for name, value in request.options.given().items():
        if isinstance(value, str) and has_surrogates(value):
            flag = "-o/--output" if name == "output" else "--" + name.replace("_", "-")
            raise UsageError(f"{flag}: {os.fsencode(value)!r} is not valid UTF-8; give it "
                             "in UTF-8")


@dataclass(frozen=True)
class Plan:
    """A synth run, planned: its items (its shard's only), its settings and its shard."""

    items: list[Item]
    settings: Settings
    shard: Shard | None = None  # --shard K/N (or its env default); None: every item

    def sink(self):
        """The one sink this run writes through (a folder per task its lines name)."""
        return sink_for(self.settings, self.shard, [i.task for i in self.items if i.task])


def plan_synth(request: SynthRequest, stdin=None, log=None, make_items=None) -> Plan:
    """Settings, items and shard of a request; usage errors up front, then input errors, then
    device and checkpoint-name errors. `make_items(settings)` gives the run's items where a
    caller makes its own (a book's pieces), instead of the request's texts and inputs."""
    log = log or (lambda message: None)
    check_unicode(request)
    profile = load_profile(request.config)
    settings = resolve_options(request.options, profile)
    run = settings.run
    check(not (request.as_json and run.to_stdout),
           "--json prints to stdout, which -o - / --raw already use")
    check_binary_stdout(run.to_stdout, "--raw" if run.raw else "-o -")
    o = settings.synthesis
    inputs = request.inputs
    if not request.texts and not inputs and stdin is not None and piped(stdin):
        inputs = ("-",)  # `echo text | mimo-tts synth`: stdin as --input - reads it
    items = make_items(settings) if make_items is not None else read_items(
        request.texts, inputs, stdin,
        Naming(o.seed, o.instruct, o.prompt_audio, o.task, o.voice, o.captions, variant_of(o)))
    check_markup(items, o)
    check(bool(items), "nothing to say: give --text, --input FILE, or pipe text to stdin")
    check_task_inputs(o, items)
    check(run.output is None or run.raw or len(items) == 1,
           f"-o/--output takes exactly one item, got {len(items)}; use --output-dir")
    settings = place(settings, request.options, profile, os.environ)
    if run.output or run.raw:
        check(request.shard is None, "--shard splits an --output-dir run; drop -o/--raw")
    shard = shard_for(settings, request.shard)
    if shard is not None:  # shard K of N takes its part of the items
        items = [i for i in items if shard.owns(i.id)]
        log(f"shard {shard.label} ({shard.source}): {len(items)} items")
    return Plan(items, settings, shard)


def check_task_inputs(o, items: list[Item]) -> None:
    """What the run's task needs and neither a flag nor any of its items gives (a `--task
    tts_sft_with_audio` without a voice prompt): the flags alone decide it, so it is a usage
    error before anything is written. Items that may give it themselves fail one by one."""
    spec = TASKS[o.task]
    mine = [i for i in items if (i.task or o.task) == o.task and i.error is None]
    if not mine:
        return
    if spec.prompt_audio == "required" and not (o.prompt_audio or o.voice) and not any(
            i.prompt_audio for i in mine):
        raise UsageError(f"--task {spec.name} needs a voice prompt: give --prompt-audio FILE "
                         "or --voice NAME (or prompt_audio in JSONL items)")
    if spec.instruct == "required" and not o.instruct and not any(i.instruct for i in mine):
        raise UsageError(f"--task {spec.name} needs a style instruction: give --instruct TEXT "
                         "(or instruct in JSONL items)")


def shard_for(settings: Settings, flag: str | None,
              env: Mapping[str, str] | None = None) -> Shard | None:
    """The shard of a run (flag > Slurm array > Indexed Job, `shards.resolve_shard`); a run to
    one file or to stdout has none."""
    if settings.run.output or settings.run.raw:
        return None
    return resolve_shard(flag, env)


def sink_for(settings: Settings, shard: Shard | None = None, tasks=()):
    """The one sink a synth run writes through: raw PCM, stdout, one file or a directory (the
    shard's manifest and lock in it), or one for each of `tasks` (JSONL lines' own) too."""
    run = settings.run
    captions = tuple(run.caption_formats.split(",")) if run.caption_formats else ()
    if run.raw:
        return RawPcmSink(streamed=run.stream)
    if run.output == "-":
        return StdoutSink(run.format, run.sample_rate)
    if run.output:
        return FileSink(run.output, run.format, run.sample_rate, run.save_codes, run.overwrite,
                        captions=captions)
    task = settings.synthesis.task
    options = dict(fmt=run.format, sample_rate=run.sample_rate, save_codes=run.save_codes,
                   overwrite=run.overwrite, shard=shard, captions=captions)
    if set(tasks) - {task}:
        return TaskDirectories(run.output_dir, task, tasks, **options)
    return DirectorySink(run.output_dir, task, **options)


def run_synth(runner: BatchRunner, items: list[Item], sink) -> Iterator[ItemResult]:
    """Run items through the sink (`Plan.sink`, or `sink_for`)."""
    runner.resolve()  # a missing checkpoint ends the run here, before any item (exit 3)
    with sink as opened:
        yield from runner.run(items, opened)
