"""C sources of this package compiled once per machine with the system C compiler.

`-march=native` code goes into the user cache directory under a name keyed by the source,
the flags and the CPU's feature flags, and is loaded with ctypes: no PyTorch headers or build
toolchain at run time. Used by the LM's CPU kernel and the codec's float32 GEMM and fused
attention; whether each runs is their own decision (a `devices.Choice`), under the mode
`devices.Placement` resolves (`settled` says what a mode decides without measuring).
"""

from __future__ import annotations

import ctypes
import hashlib
import platform
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from importlib.resources.abc import Traversable
from pathlib import Path

from mimo_tts.runtime.devices import Choice, check_kernel_mode, cpu_flags
from mimo_tts.runtime.paths import cache_root, publish, temp_beside

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
# One build at a time in this process: the compiler's output is a temp file named by the pid.
_BUILDING = threading.Lock()


def build(source: Traversable, stem: str) -> tuple[ctypes.CDLL | None, str]:
    """(the compiled `source`, "") or (None, why not); compiled on first use into
    `<cache>/kernels/<stem>_<key>.so`, reused while source, flags and CPU are the same."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"needs Linux on x86-64, this is {sys.platform} on {platform.machine()}"
    try:
        source_text = source.read_text(encoding="utf-8")
    except OSError:
        return None, f"this install has no {source.name}"
    machine = " ".join(cpu_flags()) or platform.node()  # -march=native: the same kind of CPU
    key = hashlib.sha256((source_text + " ".join(FLAGS) + machine).encode()).hexdigest()
    target = cache_root() / "kernels" / f"{stem}_{key[:16]}.so"  # MIMO_TTS_CACHE, else XDG's
    try:
        with _BUILDING:
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                _compile(source_text, stem, target)
        return ctypes.CDLL(str(target)), ""
    except subprocess.CalledProcessError as exc:
        lines = (exc.stderr or "").strip().splitlines()
        return None, f"cc failed: {lines[-1] if lines else f'exit {exc.returncode}'}"
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"cannot build or load it ({exc})"


Signature = tuple[Sequence[type], type | None]  # ctypes argument types, result type (None: void)


def bind(source: Traversable, stem: str,
         functions: Mapping[str, Signature]) -> tuple[ctypes.CDLL | None, str]:
    """`build`, then each named function's ctypes `Signature`."""
    lib, why = build(source, stem)
    for name, (arguments, result) in functions.items() if lib is not None else ():
        function = getattr(lib, name)
        function.argtypes, function.restype = list(arguments), result
    return lib, why


def settled(mode: str, kernel: str, env_name: str, unavailable: Callable[[], str],
            runs: str) -> Choice | None:
    """What the mode of `kernel` (set by `env_name`) decides without measuring: "off" never;
    not where `unavailable()` gives a reason ("" where the kernel can run); "on" wherever it
    can (`runs` says what then runs); None for "auto", which measures."""
    if check_kernel_mode(mode, kernel) == "off":
        return Choice(False, f"off ({env_name}=0)")
    why = unavailable()
    if why:
        return Choice(False, why)
    return Choice(True, f"on ({env_name}=1): {runs}") if mode == "on" else None


def _compile(source_text: str, stem: str, target: Path) -> None:
    """`cc` into a temp file beside `target`, then renamed into place (`paths.publish`):
    concurrent builders never see half a file."""
    built = temp_beside(target)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{stem}.c"
        path.write_text(source_text)
        try:
            subprocess.run(["cc", *FLAGS, str(path), "-o", str(built), "-lm"],
                           check=True, capture_output=True, text=True, timeout=120)
            publish(built, target)
        finally:
            built.unlink(missing_ok=True)
