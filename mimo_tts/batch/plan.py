"""What `mimo-tts synth` and the Ray driver share: flags -> items, Settings and the one sink a
run writes through, and the run itself through the batch runner.

No torch at import: the CLI imports this inside its commands, and `--dry-run` reads its
settings without loading anything.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

from mimo_tts.batch.items import Item, read_items
from mimo_tts.batch.results import ItemResult
from mimo_tts.batch.runner import BatchRunner
from mimo_tts.batch.sinks import DirectorySink, FileSink, RawPcmSink, StdoutSink
from mimo_tts.errors import UsageError
from mimo_tts.synthesis.options import (
    Settings,
    place,
    resolve,
    resolve_options,
    with_shard,
)
from mimo_tts.synthesis.profiles import load_profile


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


def check_binary_stdout(to_stdout: bool, flag: str) -> None:
    """Audio bytes are never dumped on a terminal (like gzip): pipe or redirect stdout."""
    _check(not (to_stdout and os.isatty(1)),
           f"{flag} writes audio bytes to stdout, which is a terminal; pipe it (| aplay) or "
           "redirect it (> file)")


def settings_for(flags: Mapping[str, object], config: str | None) -> Settings:
    """The command's options, resolved once: flag > env > profile > default."""
    return resolve(flags, load_profile(config), os.environ)


def prepare_synth(flags: Mapping[str, object], config: str | None, stdin, log):
    """Settings, items and a BatchRunner; usage errors up front, then input errors, then
    device and checkpoint-name errors."""
    profile = load_profile(config)
    settings = resolve_options(flags, profile)
    run = settings.run
    _check(not (flags.get("as_json") and run.to_stdout),
           "--json prints to stdout, which -o - / --raw already use")
    check_binary_stdout(run.to_stdout, "--raw" if run.raw else "-o -")
    items = read_items(flags.get("text") or [], flags.get("input") or [], stdin)
    _check(bool(items), "nothing to say: give --text, --input FILE or --input -")
    _check(run.output is None or run.raw or len(items) == 1,
           f"-o/--output takes exactly one item, got {len(items)}; use --output-dir")
    settings = place(settings, flags, profile, os.environ)
    if run.output or run.raw:
        _check(flags.get("shard") is None, "--shard splits an --output-dir run; drop -o/--raw")
    else:  # shard K of N takes its part of the items (shards.py)
        settings = with_shard(settings, flags, os.environ)
    shard = settings.shard
    if shard is not None:
        items = [i for i in items if shard.owns(i.id)]
        log(f"shard {shard.label} ({shard.source}): {len(items)} items")
    return items, settings, BatchRunner(settings, log=log)


def sink_for(settings: Settings):
    """The one sink a synth run writes through: raw PCM, stdout, one file or a directory."""
    run = settings.run
    if run.raw:
        return RawPcmSink(streamed=run.stream)
    if run.output == "-":
        return StdoutSink(run.format, run.sample_rate)
    if run.output:
        return FileSink(run.output, run.format, run.sample_rate, run.save_codes, run.overwrite)
    return DirectorySink(run.output_dir, settings.synthesis.task, run.format, run.sample_rate,
                         run.save_codes, run.overwrite, settings.shard)


def run_synth(runner: BatchRunner, items: list[Item], sink=None) -> Iterator[ItemResult]:
    """Run items through the sink (default: the one the settings ask for)."""
    runner.resolve()  # a missing checkpoint ends the run here, before any item (exit 3)
    with sink or sink_for(runner.settings) as opened:
        yield from runner.run(items, opened)
