"""Typed errors, each carrying the process exit code the CLI reports for it."""

from __future__ import annotations

# Exit codes (documented in README "Exit codes"); 0 is success, 1 an unexpected bug.
EXIT_OK = 0
EXIT_BUG = 1
EXIT_USAGE = 2
EXIT_CHECKPOINT = 3
EXIT_DEVICE = 4
EXIT_IO = 5
EXIT_AUDIO_CHECK = 6
EXIT_NO_AUDIO = 7
EXIT_PARTIAL = 8
EXIT_INPUT = 9
EXIT_INCOMPLETE = 10  # `mimo-tts status`: some items are failed or missing
EXIT_INTERRUPTED = 130


class MimoTTSError(Exception):
    """Base of every error mimo-tts reports as a one-line `Error:` message."""

    exit_code = EXIT_BUG


class UsageError(MimoTTSError):
    """Bad option values or option combinations."""

    exit_code = EXIT_USAGE


class OptionTypeError(UsageError, TypeError):
    """An option or parameter of the wrong type (a str seed, a bool batch size): a UsageError
    (exit 2) as every bad option is, and a TypeError as Python's convention has it."""


class CheckpointError(MimoTTSError):
    """A model or tokenizer checkpoint is missing, incomplete or inconsistent."""

    exit_code = EXIT_CHECKPOINT


class DeviceError(MimoTTSError):
    """An invalid or unavailable device, or out of memory on one."""

    exit_code = EXIT_DEVICE


class NotEnoughMemoryError(DeviceError):
    """The memory preflight's refusal: the run would not fit, found before anything loads."""


class OutputError(MimoTTSError):
    """Reading an input file or writing an output failed."""

    exit_code = EXIT_IO


class AudioCheckError(MimoTTSError):
    """Generated audio failed a sanity check (NaN/inf, silent, codes out of range)."""

    exit_code = EXIT_AUDIO_CHECK


class NoAudioError(AudioCheckError):
    """The LM generated no audio tokens for an item."""

    exit_code = EXIT_NO_AUDIO


class InputError(MimoTTSError):
    """A bad input item (empty text, malformed line, unusable prompt audio)."""

    exit_code = EXIT_INPUT


def short_repr(value, limit: int = 40) -> str:
    """A value's repr for an error message, cut at `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
