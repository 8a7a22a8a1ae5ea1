"""`mimo-tts synth` and `mimo-tts devices`: a run, or its preflight (devices, checkpoints,
memory, shard) without loading anything. The batch code is imported inside the commands."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from mimo_tts.cli.params import IN, RUN, AsJson, Debug, DevicesJson, Quiet, Verbose, takes
from mimo_tts.cli.report import Reporter, quiet_libraries, run_command
from mimo_tts.errors import EXIT_CHECKPOINT, EXIT_DEVICE, EXIT_OK
from mimo_tts.synthesis.settings import OptionValues, resolve

if TYPE_CHECKING:
    from mimo_tts.batch.plan import SynthRequest


@takes("synth")
def synth(
    text: Annotated[list[str] | None, typer.Option(
        "--text", "-t", rich_help_panel=IN, metavar="TEXT",
        help="Text to speak (repeatable; '-' reads stdin).")] = None,
    input: Annotated[list[str] | None, typer.Option(
        "--input", "-i", rich_help_panel=IN, metavar="FILE",
        help=".txt (one item per line) or .jsonl (id, text, instruct, prompt_audio, seed, "
             "task); '-' reads stdin, as does text piped in without --text/--input.")] = None,
    *, options: OptionValues, config: str | None, shard: str | None,
    dry_run: Annotated[bool, typer.Option("--dry-run", rich_help_panel=RUN,
        help="Preflight only (devices, checkpoints, memory); load nothing.")] = False,
    as_json: AsJson = False,
    quiet: Quiet = False,
    verbose: Verbose = False,
    debug: Debug = False,
) -> None:
    """Synthesise speech: text -> [b]output_audio/<task>/<id>.wav[/b] (+ sidecar, manifest)."""
    from mimo_tts.batch.plan import SynthRequest

    request = SynthRequest(options, texts=tuple(text or ()), inputs=tuple(input or ()),
                           shard=shard, config=config, as_json=as_json)
    reporter = Reporter(quiet, verbose, as_json, debug,
                        stdout_data=not (options.raw or options.output == "-"))

    def body() -> int:
        from mimo_tts.batch.files import stdout_stream

        stdout_stream()  # a run reports on stdout: a closed one ends it before any work
        if dry_run:
            return _preflight(reporter, request)
        if quiet:
            quiet_libraries()
        from mimo_tts.batch.plan import plan_synth, run_synth
        from mimo_tts.batch.results import exit_code_for
        from mimo_tts.batch.runner import BatchRunner

        plan = plan_synth(request, sys.stdin, reporter.log)
        check_voice(plan)
        runner = BatchRunner(plan.settings, log=reporter.log)
        start = time.perf_counter()
        # the bar counts text pieces, so one long text shows its progress too
        left = {id(item): runner.piece_count(item) for item in plan.items}
        with runner, reporter.bar(sum(left.values()), "pieces") as advance:
            runner.on_piece = lambda r: advance(steps=_one_less(left, id(r.item)))
            results = []
            for result in run_synth(runner, plan.items, plan.sink()):  # closes the engine
                results.append(result)
                reporter.item(result, plan.settings.synthesis.task)
                advance(steps=left.pop(id(result.item), 0))  # skipped, failed: all at once
        reporter.info(summary(results, runner, time.perf_counter() - start))
        return exit_code_for(results)

    run_command(reporter, body)


def check_voice(plan) -> None:
    """A stored voice is loaded before anything runs (an unknown one: exit 2 or 9)."""
    if plan.settings.synthesis.voice:
        from mimo_tts.synthesis.voices import VoiceStore

        VoiceStore().load(plan.settings.synthesis.voice)


def _one_less(left: dict, key: int) -> int:
    """One of an item's pieces done: 1 to show, if the item still counts it."""
    if left.get(key, 0) < 1:
        return 0
    left[key] -= 1
    return 1


def _preflight(reporter: Reporter, request: SynthRequest) -> int:
    from mimo_tts.batch.files import stdout_stream

    report = preflight_report(request)
    if reporter.as_json:
        reporter.data(report)
    elif stdout_stream().isatty():  # a person: the short view
        _print_table(preflight_rows(report))
    else:  # the report is the command's data: pretty JSON on stdout
        reporter.data(json.dumps(report, indent=2, ensure_ascii=False))
    missing = [c for c in report["checkpoints"].values()
               if c["status"].startswith(("missing", "broken"))]
    for entry in missing:
        reporter.error(entry["status"].split(": ", 1)[-1])
    if missing:
        return EXIT_CHECKPOINT
    if report.get("memory_error") and not request.options.no_memory_check:
        reporter.error(report["memory_error"])
        return EXIT_DEVICE
    return EXIT_OK


LABELS = {"lm_device": "LM device", "tokenizer_device": "tokenizer device",
          "lm_dtype": "LM dtype", "tokenizer_dtype": "tokenizer dtype",
          "cuda_graph": "CUDA graphs", "cpu_kernel": "CPU kernel", "codec_kernel": "codec kernel"}


def preflight_rows(report: dict) -> list[tuple[str, str, str]]:
    """The preflight report as (setting, value, where it came from) rows: a terminal's view
    (`--json` and pipes get the whole report)."""
    rows = [(LABELS.get(name, name.replace("_", " ")), _shown(e["value"]), e["source"])
            for name, e in report["placement"].items()]
    cuda = report["cuda"]
    rows.append(("CUDA", f"{cuda['device_count']} device(s), current cuda:{cuda['current']}"
                 if cuda["available"] else "not available", ""))
    for role, c in report["checkpoints"].items():
        status = c["status"].split(":", 1)[0]  # a missing one's fix is in its error line
        rows.append((role, c["path"] or c["name"], f"{status} ({c['source']})"))
    memory = report.get("memory")
    for need in memory if isinstance(memory, list) else []:
        rows.append((f"memory {need['device']}", f"{need['need_gib']} GiB of "
                     f"{need['available_gib']} GiB", ("fits" if need["fits"] else "does not fit")
                     + f" ({need['available_source']})"))
    if isinstance(memory, dict) and memory.get("error"):
        rows.append(("memory", "unknown", memory["error"]))
    if report.get("memory_error"):
        rows.append(("memory", "does not fit", "the error below"))
    engine = report["engine"]
    rows.append(("engine", engine["name"], engine.get("error") or (
        "" if "installed" not in engine else "installed" if engine["installed"]
        else "not installed")))
    shard = report["shard"]
    rows.append(("shard", shard["shard"] or "every item", shard["source"]))
    if "inputs" in report:
        inputs = report["inputs"]
        rows.append(("inputs", f"{inputs['items']} items, {inputs['bad_items']} bad",
                     ", ".join(inputs["files"])))
    return rows


def _shown(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def _print_table(rows: list[tuple[str, str, str]]) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from mimo_tts.batch.files import stdout_stream

    table = Table("", "value", "from", box=box.SIMPLE_HEAD, caption="--json: the whole report")
    table.columns[1].overflow = "fold"  # a whole path, over lines
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))  # paths and sources are not markup
    Console(file=stdout_stream(), highlight=False).print(table)


@takes("devices")
def devices(*, options: OptionValues, config: str | None, as_json: DevicesJson = False,
            debug: Debug = False) -> None:
    """Preflight: devices (and why), CUDA, graph policy, checkpoints, memory, Stage-0 engine.

    Loads no weights. Exits 3 when a checkpoint is missing, 4 on a bad device or when the
    default run would not fit in memory.
    """
    from mimo_tts.batch.plan import SynthRequest

    request = SynthRequest(options, config=config, as_json=as_json)
    reporter = Reporter(as_json=as_json, debug=debug)
    run_command(reporter, lambda: _preflight(reporter, request))


def preflight_report(request: SynthRequest) -> dict:
    """The preflight of the run a `SynthRequest` describes: the `--input` files are read and
    checked as a run reads them (stdin is left alone), and their texts with `--text` size the
    memory plan; the shard is the one the run would take."""
    from mimo_tts.batch.items import read_items
    from mimo_tts.batch.plan import check_unicode, shard_for
    from mimo_tts.synthesis.preflight import preflight
    from mimo_tts.synthesis.profiles import load_profile

    check_unicode(request)
    texts = [t for t in request.texts if t != "-"]
    files = [f for f in request.inputs if f != "-"]
    settings = resolve(request.options, load_profile(request.config), os.environ)
    items = read_items([], files) if files else []
    shard = shard_for(settings, request.shard)
    encodes = bool(settings.synthesis.prompt_audio or any(i.prompt_audio for i in items)
                   or settings.synthesis.voice)  # a voice may be re-encoded: sized as if
    report = preflight(settings, texts + [i.text for i in items if isinstance(i.text, str)],
                       encodes=encodes)
    report["shard"] = (shard.describe() if shard else
                       {"shard": None, "source": "default: every item"})
    if files:
        report["inputs"] = {"files": files, "items": len(items),
                            "bad_items": sum(i.error is not None for i in items)}
    return report


def summary(results: list, runner, elapsed: float) -> str:
    """One line: counts, load time, synthesis time, audio seconds and real-time factor."""
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "skipped", "error")}
    audio = sum(r.seconds for r in results if r.status == "ok")
    load = runner.timings.get("load_s")
    busy = elapsed - (load or 0.0)
    parts = [f"{counts['ok']} written, {counts['skipped']} skipped, {counts['error']} failed"]
    if load is not None:
        parts.append(f"load {load:.2f} s")
    if audio:
        parts.append(f"synthesis {busy:.2f} s for {audio:.2f} s of audio "
                     f"(RTF {busy / audio:.3f})")
    return " | ".join(parts)
