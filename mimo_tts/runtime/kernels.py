"""C sources of this package compiled once per machine with the system C compiler.

`-march=native` code goes into the user cache directory under a name keyed by the source,
the flags and the CPU's feature flags, and is loaded with ctypes: no PyTorch headers or build
toolchain at run time. Used by the LM's CPU kernel and the codec's float32 GEMM.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path

from mimo_tts.errors import UsageError

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def _cache_dir() -> Path:
    """`kernels/` in the project's cache root (MIMO_TTS_CACHE, else XDG_CACHE_HOME/mimo-tts)."""
    from mimo_tts.runtime.paths import cache_root

    return cache_root() / "kernels"


def _cpu_flags() -> str:
    """The CPU's feature flags: -march=native code is only reused on the same kind of CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.node())
    except OSError:
        return platform.node()


def build(source: Traversable, stem: str) -> tuple[ctypes.CDLL | None, str]:
    """(the compiled `source`, "") or (None, why not); compiled on first use into
    `<cache>/kernels/<stem>_<key>.so`, reused while source, flags and CPU are the same."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"needs Linux on x86-64, this is {sys.platform} on {platform.machine()}"
    try:
        source_text = source.read_text(encoding="utf-8")
    except OSError:
        return None, f"this install has no {source.name}"
    key = hashlib.sha256((source_text + " ".join(FLAGS) + _cpu_flags()).encode()).hexdigest()
    target = _cache_dir() / f"{stem}_{key[:16]}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / f"{stem}.c"
                path.write_text(source_text)
                built = Path(tmp) / target.name
                subprocess.run(["cc", *FLAGS, str(path), "-o", str(built), "-lm"],
                               check=True, capture_output=True, text=True, timeout=120)
                os.replace(built, target)  # atomic: concurrent builders never see half a file
        return ctypes.CDLL(str(target)), ""
    except subprocess.CalledProcessError as exc:
        lines = (exc.stderr or "").strip().splitlines()
        return None, f"cc failed: {lines[-1] if lines else f'exit {exc.returncode}'}"
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"cannot build or load it ({exc})"


MODES = ("auto", "on", "off")


def mode_from_env(name: str) -> str:
    """The kernel mode the environment variable `name` asks for: auto (unset), on or off."""
    value = os.environ.get(name, "auto").strip().lower()
    spellings = {"on": ("1", "on", "true", "yes"), "off": ("0", "off", "false", "no"),
                 "auto": ("", "auto")}
    for mode, words in spellings.items():
        if value in words:
            return mode
    raise UsageError(f"{name}={os.environ[name]!r}: use auto, 1 (on) or 0 (off)")


@dataclass(frozen=True)
class Choice:
    """Whether a kernel runs, and why (or why not), in words."""

    active: bool
    reason: str
