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
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SPINCOUNT = "10000"  # spins (~10 us) before an idle OpenMP thread sleeps; libgomp's is 300000
USER_KEYS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def configure(environ: MutableMapping[str, str] | None = None) -> str:
    """Set GOMP_SPINCOUNT for this process unless the user chose a wait policy; -> what was
    done: "set", "user" (theirs kept) or "late" (torch already loaded: set, but for children
    only)."""
    environ = os.environ if environ is None else environ
    if any(key in environ for key in USER_KEYS):
        return "user"
    environ["GOMP_SPINCOUNT"] = SPINCOUNT
    return "late" if "torch" in sys.modules else "set"
