"""`mimo-tts status` against folders that lie: names of manifests held by other kinds of files,
outputs whose inputs changed since, and audio that is cut or gone (issue 22, A)."""

from __future__ import annotations

import json
import os

import pytest

from mimo_tts.batch import status
from mimo_tts.batch.items import text_id
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


def _statuses(invoke, *args) -> tuple[int, dict]:
    run = invoke("status", "out", *args, "--json")
    return run.exit_code, json.loads(run.stdout)


def test_a8_cut_empty_or_sidecarless_audio_is_not_done_and_synth_redoes_it(invoke, tmp_path):
    batch = tmp_path / "b.jsonl"
    batch.write_text("".join(json.dumps({"id": i, "text": f"Item {i}."}) + "\n"
                             for i in "abcd"))
    synth = ("synth", "--model", "tiny", "--input", batch, "--output-dir", "out",
             "--max-new-groups", "2")
    assert invoke(*synth).exit_code == 0
    folder = tmp_path / "out" / "tts_sft"
    sizes = {i: (folder / f"{i}.wav").stat().st_size for i in "abcd"}
    assert all(json.loads((folder / f"{i}.json").read_text())["audio"]["bytes"] == sizes[i]
               for i in "abcd")
    with open(folder / "a.wav", "r+b") as f:
        f.truncate(sizes["a"] // 2)  # cut: a full disk, a copy stopped half-way
    (folder / "b.wav").write_bytes(b"")
    old = json.loads((folder / "c.json").read_text())
    del old["audio"]["bytes"]  # a sidecar from before sizes were recorded: the RIFF header
    (folder / "c.json").write_text(json.dumps(old))
    with open(folder / "c.wav", "r+b") as f:
        f.truncate(sizes["c"] - 100)
    (folder / "d.json").unlink()

    code, report = _statuses(invoke)
    assert code == 10 and report["done"] == 0
    assert {e["id"]: e["reason"] for e in report["missing"]} == {
        "a": f"audio file cut ({sizes['a'] // 2} of {sizes['a']} bytes)",
        "b": f"audio file cut (0 of {sizes['b']} bytes)",
        "c": f"audio file cut ({sizes['c'] - 100} of {sizes['c']} bytes)",
        "d": "sidecar gone or unreadable"}

    again = invoke(*synth)  # a, b, c are redone; d's audio has no sidecar: kept, refused
    assert again.exit_code == 8, again.stderr
    assert "3 written, 0 skipped, 1 failed" in again.stderr
    assert "d.wav exists from other inputs" in again.stderr
    assert {i: (folder / f"{i}.wav").stat().st_size for i in "abc"} == {
        i: sizes[i] for i in "abc"}
    code, report = _statuses(invoke)
    assert report["done"] == 3 and [e["id"] for e in report["missing"]] == ["d"]


def test_a8_a_line_changed_since_its_output_was_made_is_not_done(invoke, tmp_path):
    batch = tmp_path / "b.jsonl"
    batch.write_text('{"id": "a", "text": "One.", "seed": 1}\n{"id": "b", "text": "Two."}\n')
    synth = ("synth", "--model", "tiny", "--input", batch, "--output-dir", "out",
             "--max-new-groups", "2")
    assert invoke(*synth).exit_code == 0
    code, report = _statuses(invoke, "--input", batch)
    assert (code, report["done"]) == (0, 2)
    batch.write_text('{"id": "a", "text": "One.", "seed": 2}\n{"id": "b", "text": "Two."}\n')
    code, report = _statuses(invoke, "--input", batch)
    assert code == 10 and report["done"] == 1  # was: 2 done, exit 0
    assert report["missing"] == [{"id": "a", "shard": None, "reason": "other inputs (another "
                                  "seed, instruct, prompt audio or task)"}]
    rerun = invoke(*synth)  # synth agrees: a is not done (its file is another seed's)
    assert "0 skipped" not in rerun.stderr and "1 skipped" in rerun.stderr
    assert _statuses(invoke)[0] == 0  # without --input: every line's output is whole


def test_a8_status_names_and_keys_items_with_synths_seed(invoke, tmp_path):
    lines = tmp_path / "lines.txt"
    lines.write_text("First line.\nSecond line.\n")
    assert invoke("synth", "--model", "tiny", "--input", lines, "--output-dir", "out",
                  "--max-new-groups", "2", "--seed", "3").exit_code == 0
    code, report = _statuses(invoke, "--input", lines, "--seed", "3")
    assert (code, report["done"]) == (0, 2)
    code, report = _statuses(invoke, "--input", lines)  # seed 0: other items, none done
    assert (code, report["done"], len(report["missing"])) == (10, 0, 2)
    folder = tmp_path / "out" / "tts_sft"
    new, legacy = text_id("First line.", seed=3), text_id("First line.")
    for suffix in (".wav", ".json"):  # as an earlier version named it: by the text alone
        (folder / f"{new}{suffix}").rename(folder / f"{legacy}{suffix}")
    manifest = folder / "results.jsonl"
    manifest.write_text(manifest.read_text().replace(new, legacy))
    code, report = _statuses(invoke, "--input", lines, "--seed", "3")
    assert (code, report["done"]) == (0, 2), report


def test_status_names_items_with_synths_speed_and_sentence_silence(invoke, tmp_path):
    """Items of a `--speed 1.5` run and of a `--sentence-silence 0.5` run (their ids carry
    what differs): status given the same flags finds them done, without them (or with another
    value) missing; a value out of range is a one-line usage error."""
    from mimo_tts.errors import EXIT_USAGE

    lines = tmp_path / "lines.txt"
    lines.write_text("First line. And more.\nSecond line.\n")
    for flags in (["--speed", "1.5"], ["--sentence-silence", "0.5"]):
        done = invoke("synth", "--model", "tiny", "--input", lines, "--output-dir", "out",
                      "--max-new-groups", "2", *flags)
        assert done.exit_code == 0, done.stderr
        code, report = _statuses(invoke, "--input", lines, *flags)
        assert (code, report["done"], report["missing"]) == (0, 2, []), report
    for flags in ([], ["--speed", "2"], ["--speed", "1.5", "--sentence-silence", "0.5"]):
        code, report = _statuses(invoke, "--input", lines, *flags)
        assert (code, report["done"], len(report["missing"])) == (10, 0, 2), flags
    for flags in (["--speed", "5"], ["--sentence-silence", "-1"]):
        bad = invoke("status", "out", "--input", lines, *flags)
        assert bad.exit_code == EXIT_USAGE and flags[0] in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1
