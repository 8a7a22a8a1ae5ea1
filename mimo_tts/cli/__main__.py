"""`python -m mimo_tts.cli` runs the CLI."""

from mimo_tts.cli.app import main

main()
