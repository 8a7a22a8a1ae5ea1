"""Write the full-size random preset once (mimo_tts.presets.write_full_size_preset); JSON out.

    .venv/bin/python scripts/make_full_size.py [DIR] [--seed 0]

DIR (default .bench/full-size, gitignored) gets `lm/` (8.0 B parameters, bfloat16, four shards +
index) and `tokenizer/` (1.3 B, float32, EMA buffers): about 21 GB, so never in CI and never
committed. Cached: when DIR/complete names this writer version and seed, nothing is written.
Otherwise the preset is written into a staging folder next to DIR and renamed into place (a
stale DIR is removed first: there is rarely room for two). The report gives parameters and
bytes per checkpoint (from the safetensors headers), seconds and the writer's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import struct
import sys
import time
from pathlib import Path

from mimo_tts.presets.write import WRITER_VERSION, write_full_size_preset

CODEBOOK = "._codebook."  # RVQ buffers (embed + EMA state): values, not parameters (spec §3.7)


def checkpoint_summary(folder: Path) -> dict:
    """Tensors, parameters (RVQ buffers apart), bytes and files of one checkpoint folder."""
    params = buffers = size = count = 0
    files = sorted(folder.glob("*.safetensors"))
    for path in files:
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        header.pop("__metadata__", None)
        for name, entry in header.items():
            n = 1
            for dim in entry["shape"]:
                n *= dim
            count += 1
            size += entry["data_offsets"][1] - entry["data_offsets"][0]
            if CODEBOOK in name:
                buffers += n
            else:
                params += n
    return {"files": [p.name for p in sorted(folder.iterdir())], "tensors": count,
            "parameters": params, "codebook_buffer_values": buffers, "tensor_bytes": size,
            "disk_bytes": sum(p.stat().st_size for p in folder.iterdir())}


def marker(seed: int) -> dict:
    return {"preset": "full-size", "writer_version": WRITER_VERSION, "seed": seed}


def is_complete(root: Path, seed: int) -> bool:
    try:
        return json.loads((root / "complete").read_text()) == marker(seed)
    except (OSError, ValueError):
        return False


def make(root: Path, seed: int) -> dict:
    """Write DIR unless it is complete; the report of what DIR now holds."""
    report = {"dir": str(root), "writer_version": WRITER_VERSION, "seed": seed}
    if is_complete(root, seed):
        return report | {"cached": True}
    if root.exists():
        shutil.rmtree(root)
    staging = root.with_name(f".{root.name}.tmp-{os.getpid()}")
    start = time.perf_counter()
    try:
        write_full_size_preset(staging, seed)
        (staging / "complete").write_text(json.dumps(marker(seed)) + "\n")
        os.replace(staging, root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return report | {"cached": False, "write_s": round(time.perf_counter() - start, 1),
                     "peak_rss_gib": round(peak_kib / 2**20, 2), "threads": _threads()}


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", nargs="?", default=".bench/full-size")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    root = Path(args.dir).resolve()
    root.parent.mkdir(parents=True, exist_ok=True)
    report = make(root, args.seed)
    report |= {part: checkpoint_summary(root / part) for part in ("lm", "tokenizer")}
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
