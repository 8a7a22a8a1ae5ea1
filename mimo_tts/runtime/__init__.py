"""The machine and its files, knowing no model: devices, memory, checkpoints, safetensors,
C kernels, guards; and `runner_record`, who wrote a record."""

from __future__ import annotations

from mimo_tts._version import __version__

RUNNER_NAME = "mimo-tts"


def runner_record() -> dict[str, str]:
    """This program as the records it writes name it (sidecars, manifests, API metadata)."""
    return {"name": RUNNER_NAME, "version": __version__}
