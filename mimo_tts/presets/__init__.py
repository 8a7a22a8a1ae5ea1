"""Random checkpoints in the official layout that speak: the tiny preset (written on first use)
and the full-size one; checkpoint names resolved with the preset's name among them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mimo_tts.codec.config import CodecConfig
from mimo_tts.errors import CheckpointError, OutputError
from mimo_tts.lm.config import LMConfig
from mimo_tts.runtime import checkpoints
from mimo_tts.runtime.checkpoints import ModelRef
from mimo_tts.runtime.paths import cache_root, pid_alive, publish

TINY = "tiny"  # the preset's name, where a checkpoint name or directory is asked for
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
            shutil.rmtree(final, ignore_errors=True)
        publish(staging, final)
    except (OSError, OutputError) as exc:
        if not (final / "complete").is_file():  # another process may have won the race
            raise CheckpointError(f"cannot write the tiny preset to {final}: {exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final / "lm", final / "tokenizer"


def _remove_stale_staging(final: Path) -> None:
    """Remove the half-built `<preset>.tmp-<pid>` folders of builds killed before their rename
    (a live pid's folder is another build in progress and is left alone)."""
    for staging in final.parent.glob(f"{final.name}.tmp-*"):
        pid = staging.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)


def resolve(name: str, source: str, role: str, allow_download: bool = False, env=None,
            seed: int = 0) -> ModelRef:
    """One checkpoint name (`tiny`, a directory, or an HF repo id) -> its local directory (the
    tiny preset is written on first use)."""
    if name == TINY:
        lm_dir, tok_dir = ensure_tiny_preset(env, seed)
        return ModelRef(TINY, source, "preset", lm_dir if role == "model" else tok_dir)
    return checkpoints.resolve(name, source, role, allow_download)


def locate(name: str, source: str, role: str, env=None) -> tuple[Path | None, str]:
    """Where a checkpoint would be found, writing and downloading nothing: (path, status)."""
    if name == TINY:
        root = tiny_preset_dir(env)
        sub = root / ("lm" if role == "model" else "tokenizer")
        ok = (root / "complete").is_file()
        return (sub, "present (tiny preset)") if ok else (None, "tiny preset, built on first use")
    return checkpoints.locate(name, source, role,
                              LMConfig.from_json if role == "model" else CodecConfig.from_json)


def checkpoint_dtype(name: str, source: str, role: str, env=None) -> str | None:
    """The `torch_dtype` a checkpoint declares (the tiny preset: float32), or None."""
    if name == TINY:
        return "float32"
    return checkpoints.checkpoint_dtype(locate(name, source, role, env)[0])
