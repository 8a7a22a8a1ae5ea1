"""Bytes that are not UTF-8 in argv or in a JSONL file (Python keeps them as lone surrogates)
never end a run as a bug (exit 1): an option is a usage error, an item's value fails that item,
and what is recorded about the run is written escaped (issue 22, C)."""

from __future__ import annotations

import json

import pytest

from mimo_tts.errors import EXIT_INPUT, EXIT_PARTIAL, EXIT_USAGE
from tests.helpers import read_manifest


@pytest.mark.parametrize(("flag", "value"), [
    ("--instruct", "calm \udcff"), ("--prompt-audio", "v\udcff.wav"),
    ("--output-dir", "o\udcff"), ("-o", "o\udcff.wav"),
])
@pytest.mark.parametrize("dry", [False, True])
def test_c_an_option_of_bytes_that_are_not_utf8_is_a_usage_error(invoke, flag, value, dry):
    task = ("--task", "tts_sft_with_instruct") if flag == "--instruct" else (
        ("--task", "tts_sft_with_audio") if flag == "--prompt-audio" else ())
    run = invoke("synth", "--model", "tiny", "--text", "Hi.", *task, flag, value,
                 *(("--dry-run",) if dry else ()))
    assert run.exit_code == EXIT_USAGE, run.stderr
    assert "is not valid UTF-8" in run.stderr and "unexpected" not in run.stderr


def test_c_jsonl_values_with_lone_surrogates_fail_their_item_or_are_written_escaped(invoke,
                                                                                     tmp_path):
    batch = tmp_path / "u.jsonl"
    batch.write_text("\n".join([
        '{"id": "a\\ud800", "text": "Fine text."}',  # the id is sanitised, the raw id escaped
        '{"id": "p", "text": "Fine.", "prompt_audio": "v\\udc80.wav"}',  # b"v\x80.wav"
    ]) + "\n", encoding="utf-8")
    run = invoke("synth", "--model", "tiny", "--input", batch, "--max-new-groups", "2",
                 "--task", "tts_sft_with_natural_instruction")
    assert run.exit_code == EXIT_PARTIAL, run.stderr
    assert "unexpected" not in run.stderr
    lines = {r["id"]: r for r in read_manifest(tmp_path / "output_audio"
                                                / "tts_sft_with_natural_instruction")}
    assert lines["a"]["status"] == "ok" and lines["a"]["source_id"] == "a\\ud800"
    assert lines["p"]["exit_code"] == EXIT_INPUT
    assert "prompt_audio: the path is not valid Unicode" in lines["p"]["error"]


def test_c_argv_and_a_file_name_of_such_bytes_are_recorded_escaped(mimo, tmp_path):
    batch = tmp_path / "b\udcff.jsonl"  # the file b"b\xff.jsonl"
    batch.write_text('{"id": "one", "text": "Fine text."}\n', encoding="utf-8")
    run = mimo("synth", "--model", "tiny", "--input", batch, "--text", "bad \udcff",
               "--max-new-groups", "2")
    assert run.returncode == EXIT_PARTIAL, run.stderr  # the --text item fails alone
    assert b"unexpected" not in run.stderr
    sidecar = json.loads((tmp_path / "output_audio" / "tts_sft" / "one.json").read_bytes())
    assert "bad \\udcff" in sidecar["runner"]["argv"]
    assert sidecar["source"] == "b\\udcff.jsonl:1"
