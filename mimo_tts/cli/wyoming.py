"""`mimo-tts wyoming`: the Wyoming TTS server for Home Assistant (`server/wyoming.py`)."""

from __future__ import annotations

from typing import Annotated

import typer

from mimo_tts.cli.params import (
    GEN,
    SERVE,
    Config,
    Debug,
    Dtype,
    Graph,
    LmDevice,
    LmThreads,
    Model,
    NoMemoryCheck,
    TokDevice,
    TokDtype,
    Tokenizer,
    TokThreads,
    Verbose,
)
from mimo_tts.cli.tools import run_server
from mimo_tts.synthesis.settings import OptionValues


def wyoming(
    host: Annotated[str | None, typer.Option(rich_help_panel=SERVE, metavar="HOST",
        help="Address to bind (default 127.0.0.1: this machine only).")] = None,
    port: Annotated[int | None, typer.Option(rich_help_panel=SERVE, metavar="PORT",
                                             help="TCP port (default 10200).")] = None,
    voice: Annotated[list[str] | None, typer.Option(rich_help_panel=SERVE, metavar="VOICE",
        help="Register a voice-clone voice: NAME=PROMPT.wav (repeatable).")] = None,
    batch_size: Annotated[int | None, typer.Option(rich_help_panel=SERVE, metavar="N",
        help="Texts generated together in one Stage-0 batch (default 8).")] = None,
    max_concurrent: Annotated[int | None, typer.Option(rich_help_panel=SERVE, metavar="N",
        help="Texts in progress at once (default 16).")] = None,
    max_queue: Annotated[int | None, typer.Option(rich_help_panel=SERVE, metavar="N",
        help="Texts waiting beyond those; more get a busy error (default 32).")] = None,
    max_input_chars: Annotated[int | None, typer.Option(rich_help_panel=SERVE, metavar="N",
        help="Longest text (default 4096).")] = None,
    timeout: Annotated[float | None, typer.Option(rich_help_panel=SERVE, metavar="SECONDS",
        help="Seconds a text may take (default 300).")] = None,
    max_new_groups: Annotated[int | None, typer.Option(rich_help_panel=GEN, metavar="N",
        help="Cap on generated groups per text piece (one group = 160 ms).")] = None,
    model: Model = None, tokenizer: Tokenizer = None, lm_device: LmDevice = None,
    tokenizer_device: TokDevice = None, dtype: Dtype = None, tokenizer_dtype: TokDtype = None,
    cuda_graph: Graph = None, no_memory_check: NoMemoryCheck = None,
    lm_threads: LmThreads = None, tokenizer_threads: TokThreads = None, config: Config = None,
    verbose: Verbose = False, debug: Debug = False,
) -> None:
    """Serve Wyoming TTS for Home Assistant on TCP (needs the wyoming extra)."""
    serving = {"host": host, "port": port, "voice": voice, "batch_size": batch_size,
               "max_concurrent": max_concurrent, "max_queue": max_queue,
               "max_input_chars": max_input_chars, "timeout": timeout}
    options = OptionValues(
        max_new_groups=max_new_groups, model=model, tokenizer=tokenizer, lm_device=lm_device,
        tokenizer_device=tokenizer_device, dtype=dtype, tokenizer_dtype=tokenizer_dtype,
        cuda_graph=cuda_graph, no_memory_check=no_memory_check, lm_threads=lm_threads,
        tokenizer_threads=tokenizer_threads)
    run_server("mimo_tts.server.wyoming", serving, options, config, verbose, debug)
