"""`mimo-tts wyoming`: the Wyoming TTS server for Home Assistant (`server/wyoming.py`)."""

from __future__ import annotations

from mimo_tts.cli.params import Debug, Verbose, takes
from mimo_tts.cli.tools import run_server
from mimo_tts.server.protocol import WYOMING_PORT
from mimo_tts.synthesis.settings import OptionValues


@takes("wyoming")
def wyoming(*, serving: dict, options: OptionValues, config: str | None, uri: str | None,
            verbose: Verbose = False, debug: Debug = False) -> None:
    """Serve Wyoming TTS for Home Assistant on TCP (needs the wyoming extra)."""
    run_server("mimo_tts.server.wyoming", {**serving, "uri": uri}, {},  # no key
               options, config, verbose, debug, port=WYOMING_PORT)
