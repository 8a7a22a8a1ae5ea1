"""`mimo-tts voices`: the voice registry (`synthesis/voices.py`) on the command line.

`add` encodes a recording once with the audio tokenizer (Stage-1 alone) and keeps its codes by
name; `synth --voice NAME` then clones it without reading the recording again. `list`, `show`
and `rm` touch no model and never import torch.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from mimo_tts.cli.params import Debug, Verbose, VoiceAddJson, VoicesListJson, takes
from mimo_tts.cli.report import Reporter, run_command
from mimo_tts.errors import EXIT_OK
from mimo_tts.synthesis.settings import OptionValues, resolve

HELP = "Voices kept by name: add, list, show, rm."
Name = Annotated[str, typer.Argument(metavar="NAME", help="The voice's name.", show_default=False)]


def _store():
    from mimo_tts.synthesis.voices import VoiceStore

    return VoiceStore()


@takes("voices-add")
def add(
    name: Name,
    file: Annotated[str, typer.Argument(metavar="FILE", help="The voice recording (any rate).",
                                        show_default=False)],
    transcript: Annotated[str | None, typer.Option(metavar="TEXT",
        help="What the recording says (kept in the record).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite",
        help="Replace a voice of the same name.")] = False,
    *, options: OptionValues, as_json: VoiceAddJson = False, verbose: Verbose = False,
    debug: Debug = False,
) -> None:
    """Encode FILE once and keep its voice-prompt codes as NAME."""
    reporter = Reporter(verbose=verbose, as_json=as_json, debug=debug)

    def body() -> int:
        from mimo_tts.synthesis.loader import resolve_tokenizer
        from mimo_tts.synthesis.stage1 import Stage1
        from mimo_tts.synthesis.voices import add_voice, check_name, source_record

        check_name(name)
        source_record(file)  # an unreadable recording fails before the tokenizer loads
        settings = resolve(options)
        ref = resolve_tokenizer(settings)
        stage1 = Stage1.from_settings(settings, ref, reporter.log)
        store = _store()
        record = add_voice(store, stage1, ref, name, file, transcript, overwrite)
        reporter.data(record if as_json else str(store.paths(name)[1]))
        reporter.info(f"voice {name!r}: {record['codes']['shape'][1]} frames from "
                      f"{record['source']['seconds']:.2f} s of {file}")
        return EXIT_OK

    run_command(reporter, body)


def list_(as_json: VoicesListJson = False, debug: Debug = False) -> None:
    """The stored voices: name, seconds, tokenizer, created-at (one JSON line each with --json)."""
    reporter = Reporter(as_json=as_json, debug=debug)

    def body() -> int:
        records = _store().list()
        for record in records:
            if as_json:
                reporter.data(record)
            elif "error" in record:
                reporter.data(f"{record['name']}\tbroken: {record['error']}")
            else:
                reporter.data(f"{record['name']}\t{record['source']['seconds']:.2f} s\t"
                              f"{record['tokenizer'].get('name')}\t{record['created_at']}")
        if not records:
            reporter.info(f"no voices in {_store().root}")
        return EXIT_OK

    run_command(reporter, body)


def show(name: Name, debug: Debug = False) -> None:
    """A voice's record as JSON (its source, tokenizer, codes, transcript)."""
    reporter = Reporter(debug=debug)

    def body() -> int:
        reporter.data(json.dumps(_store().record(name), ensure_ascii=False, indent=2))
        return EXIT_OK

    run_command(reporter, body)


def rm(name: Name, debug: Debug = False) -> None:
    """Remove a voice (its codes and record)."""
    reporter = Reporter(debug=debug)

    def body() -> int:
        _store().remove(name)
        reporter.info(f"removed voice {name!r}")
        return EXIT_OK

    run_command(reporter, body)


COMMANDS = {"add": add, "list": list_, "show": show, "rm": rm}  # registered by `app.py`
