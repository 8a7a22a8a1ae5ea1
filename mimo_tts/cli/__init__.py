"""`mimo-tts`: the Typer app, one module per command."""

from mimo_tts.cli.app import main

__all__ = ["main"]
