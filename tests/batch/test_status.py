"""`mimo-tts status` against folders that lie: names of manifests held by other kinds of files,
outputs whose inputs changed since, and audio that is cut or gone (issue 22, A)."""

from __future__ import annotations

import os

import pytest

from mimo_tts.batch import status
from mimo_tts.errors import EXIT_IO, OutputError


@pytest.mark.parametrize("name", ["results.jsonl", "results.shard-1-of-2.jsonl"])
@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a7_a_manifest_name_on_a_directory_or_fifo_is_one_line_exit_5(mimo, tmp_path, name,
                                                                       kind):
    folder = tmp_path / "out" / "tts_sft"
    folder.mkdir(parents=True)
    if kind == "directory":
        (folder / name).mkdir()
    else:
        os.mkfifo(folder / name)
    run = mimo("status", "out", timeout=60)  # a FIFO that is opened blocks: the test fails
    assert run.returncode == EXIT_IO, run.stderr
    assert run.stderr.decode() == (f"Error: out/tts_sft/{name} is a "
                                   f"{'directory' if kind == 'directory' else 'FIFO'}, not a "
                                   "manifest file; remove it or give another folder\n")
    assert run.stdout == b""


def test_a7_a_fifo_swapped_in_after_the_listing_is_never_read(tmp_path):
    fifo = tmp_path / "results.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="is a FIFO"):
        list(status._records(fifo))  # opened non-blocking, refused by its fstat
