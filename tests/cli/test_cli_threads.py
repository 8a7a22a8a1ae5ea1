"""The same seed gives the same bytes on any thread count (on one CPU kind): `mimo-tts synth`
on the tiny preset at the default threads, `--lm-threads 1, 2, 3` and `--tokenizer-threads
1, 2`, in float32 (the preset's dtype) and in bfloat16 (the LM's CPU kernel where the CPU has
it). The tiny models' ops are too small for PyTorch to split; tests/runtime/test_fixed_order.py
checks the same property at sizes where it does."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

TEXT = "The boats came in at dawn. Gulls followed them and cried over the harbour."
RUN = ("--model", "tiny", "--max-new-groups", "12", "--save-codes", "--seed", "7", "-t", TEXT)


def _digests(folder: Path) -> dict[str, str]:
    """Every audio and codes file under `folder` -> its sha256."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.suffix in (".wav", ".safetensors")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_synth_bytes_do_not_depend_on_the_thread_counts(mimo, tmp_path, dtype):
    runs = {"default": (), "lm 1, tokenizer 2": ("--lm-threads", "1", "--tokenizer-threads", "2"),
            "lm 2, tokenizer 1": ("--lm-threads", "2", "--tokenizer-threads", "1"),
            "lm 3": ("--lm-threads", "3")}
    if dtype == "bfloat16":  # the kernel path: fewer runs, the same property
        runs.pop("lm 2, tokenizer 1")
    digests = {}
    for name, flags in runs.items():
        out = tmp_path / name.replace(" ", "").replace(",", "-")
        done = mimo("synth", *RUN, "--dtype", dtype, "--output-dir", out, *flags,
                    env={"OMP_NUM_THREADS": "2"})
        assert done.returncode == 0, done.stderr
        digests[name] = _digests(out)
    assert len(digests["default"]) == 2  # the audio and its codes
    assert all(d == digests["default"] for d in digests.values()), digests
