"""Random checkpoints in the official layout that speak: the tiny preset (written on first use)
and the full-size one."""

from __future__ import annotations

import os
from pathlib import Path

from mimo_tts.errors import CheckpointError
from mimo_tts.runtime.paths import cache_root

TINY_PRESET_VERSION = 1


def tiny_preset_dir(env=None, seed: int = 0) -> Path:
    return cache_root(env) / "presets" / f"tiny-v{TINY_PRESET_VERSION}-seed{seed}"


def ensure_tiny_preset(env=None, seed: int = 0) -> tuple[Path, Path]:
    """The tiny preset's (lm, tokenizer) directories, written once (atomically) when missing."""
    final = tiny_preset_dir(env, seed)
    _remove_stale_staging(final)
    if (final / "complete").is_file():
        return final / "lm", final / "tokenizer"
    from mimo_tts.presets.write import write_tiny_preset

    staging = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    try:
        staging.mkdir(parents=True, exist_ok=True)
        write_tiny_preset(staging, seed=seed)
        (staging / "complete").write_text("ok\n")
        if final.exists():  # an incomplete earlier attempt
            _remove_tree(final)
        os.replace(staging, final)
    except OSError as exc:
        if not (final / "complete").is_file():  # another process may have won the race
            raise CheckpointError(f"cannot write the tiny preset to {final}: {exc}") from None
    finally:
        _remove_tree(staging)
    return final / "lm", final / "tokenizer"


def _remove_stale_staging(final: Path) -> None:
    """Remove the half-built `<preset>.tmp-<pid>` folders of builds killed before their rename
    (a live pid's folder is another build in progress and is left alone)."""
    from mimo_tts.runtime.paths import pid_alive

    for staging in final.parent.glob(f"{final.name}.tmp-*"):
        pid = staging.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            _remove_tree(staging)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
