"""How long an idle OpenMP thread spins before it sleeps, set before torch loads libgomp.

A `--stream` run keeps two thread teams on the same cores: Stage-0's and Stage-1's (the turns of
`synthesis.worker`, the C kernels' own teams). GNU OpenMP's idle threads spin some 300 000
times waiting for the next parallel region before they sleep; beside one other busy process on
a 2-core machine a spinning team holds a core that the other team's descheduled thread needs,
and each region's start and end barrier wait out a time slice: streamed group steps ran 7x
slower than plain ones there. With a short spin the waiting threads yield the core at once.

libgomp reads `GOMP_SPINCOUNT` once, when it is loaded (by `import torch`), so `configure` runs
at `import mimo_tts`, before any torch import of the package. A value the user set (or an
`OMP_WAIT_POLICY`, which chooses the spin itself) is left alone; where torch was loaded first,
the setting has no effect (`configure` says so).

The other half of the same trade: every thread that has run a parallel region keeps its own
team of worker threads, idle but counted, and once libgomp counts more of them than the
process has cores, every team spins only about 100 times before it sleeps, whatever
`GOMP_SPINCOUNT` says, so each region's start and barriers wait on a futex wake-up. A model
loaded in one thread and run in another (the server's Stage-0 thread, the library's stream)
had two teams on a 2-core machine: its group steps took 1.15-1.2x the time of the same run
in the loading thread. `release_team` gives the calling thread's team back before it hands
its work to another thread (`synthesis.worker.SpeechWorker.start`, the library's `stream`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import MutableMapping

SPINCOUNT = "10000"  # spins (~10 us) before an idle OpenMP thread sleeps; libgomp's is 300000
USER_KEYS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
RUNTIMES = ("libgomp", "libomp", "libiomp5")  # GNU's (torch's on Linux), LLVM's, Intel's
PAUSE_SOFT = 1  # omp_pause_soft (OpenMP 5.0): free the threads, keep the settings


def configure(environ: MutableMapping[str, str] | None = None) -> str:
    """Set GOMP_SPINCOUNT for this process unless the user chose a wait policy; -> what was
    done: "set", "user" (theirs kept) or "late" (torch already loaded: set, but for children
    only)."""
    environ = os.environ if environ is None else environ
    if any(key in environ for key in USER_KEYS):
        return "user"
    environ["GOMP_SPINCOUNT"] = SPINCOUNT
    return "late" if "torch" in sys.modules else "set"


@functools.cache
def _pause():
    """`omp_pause_resource_all` of the OpenMP runtime this process has loaded, or None (no
    runtime mapped yet, or one older than OpenMP 5.0)."""
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps
                     if os.path.basename(line.split()[-1]).startswith(RUNTIMES)]
    except OSError:  # no /proc: look in the symbols loaded so far
        pass
    for path in dict.fromkeys(paths) or [None]:
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause
    return None


def release_team() -> bool:
    """Give back the OpenMP worker threads of the calling thread's team (it makes a new one if
    it runs a parallel region again): call it before another thread takes over the work.
    -> whether a runtime released them. Never from inside a parallel region."""
    if "torch" not in sys.modules:  # nothing has loaded an OpenMP runtime through us
        return False
    pause = _pause()
    return pause is not None and pause(PAUSE_SOFT) == 0
