"""`python -m mimo_tts` runs the CLI."""

from mimo_tts.cli.app import main

main()
