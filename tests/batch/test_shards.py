"""Shards (`--shard K/N`, issue 15): the id split, the env defaults, and the per-shard locks and
manifests of a shared output folder (real flocks on real files)."""

from __future__ import annotations

import json
import os

import pytest

from mimo_tts.batch.shards import Shard, parse, resolve_shard, shard_of
from mimo_tts.batch.sinks import DirectorySink
from mimo_tts.errors import EXIT_USAGE, OutputError, UsageError


def test_the_split_is_a_stable_hash_of_the_id_and_a_partition():
    # sha256, not Python's salted hash(): these hold in every process and on every machine
    assert [shard_of(f"item-{i}", 3) for i in range(8)] == [
        shard_of(f"item-{i}", 3) for i in reversed(range(8))][::-1]
    assert shard_of("hello", 3) == int.from_bytes(
        __import__("hashlib").sha256(b"hello").digest()[:8], "big") % 3 + 1
    ids = [f"line-{i:05d}" for i in range(300)]
    owners = {k: [i for i in ids if Shard(k, 3).owns(i)] for k in (1, 2, 3)}
    assert sorted(sum(owners.values(), [])) == sorted(ids)  # each id in exactly one shard
    assert all(70 <= len(v) <= 130 for v in owners.values()), {k: len(v) for k, v in owners.items()}


@pytest.mark.parametrize("spec", ["0/3", "4/3", "1/0", "a/b", "3", "-1/3", "1/3/5", ""])
def test_bad_shard_specs_are_usage_errors(spec):
    with pytest.raises(UsageError) as info:
        parse(spec)
    assert info.value.exit_code == EXIT_USAGE and "--shard" in str(info.value)


@pytest.mark.parametrize(("env", "label"), [
    ({"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "4"}, "1/4"),
    ({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "3"},
     "3/3"),
    ({"SLURM_ARRAY_TASK_ID": "14", "SLURM_ARRAY_TASK_MIN": "10", "SLURM_ARRAY_TASK_STEP": "2",
      "SLURM_ARRAY_TASK_COUNT": "3"}, "3/3"),
    ({"JOB_COMPLETION_INDEX": "0", "MIMO_TTS_SHARD_COUNT": "5"}, "1/5"),
    ({"JOB_COMPLETION_INDEX": "4", "MIMO_TTS_SHARD_COUNT": "5"}, "5/5"),
])
def test_array_schedulers_pick_the_shard(env, label):
    shard = resolve_shard(None, env)
    assert shard.label == label and shard.source.startswith("env ")
    assert resolve_shard("2/7", env).label == "2/7"  # the flag wins


@pytest.mark.parametrize("env", [
    {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "3"},
    {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_STEP": "2", "SLURM_ARRAY_TASK_COUNT": "3"},
    {"SLURM_ARRAY_TASK_ID": "2"},
    {"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_COUNT": "3"},
    {"JOB_COMPLETION_INDEX": "1"},
    {"JOB_COMPLETION_INDEX": "3", "MIMO_TTS_SHARD_COUNT": "3"},
])
def test_env_that_names_no_shard_is_a_usage_error(env):
    with pytest.raises(UsageError):
        resolve_shard(None, env)


def test_one_shard_and_no_env_mean_every_item():
    assert resolve_shard(None, {}) is None
    assert resolve_shard("1/1", {"JOB_COMPLETION_INDEX": "1"}) is None


def _sink(root, shard=None):
    return DirectorySink(root, "tts_sft", shard=None if shard is None else parse(shard))


def test_shards_share_a_folder_and_an_unsharded_run_is_refused_beside_them(tmp_path):
    with _sink(tmp_path, "1/3") as one, _sink(tmp_path, "2/3") as two:
        assert one.manifest.path.name == "results.shard-1-of-3.jsonl"
        assert two.manifest.path.name == "results.shard-2-of-3.jsonl"
        with pytest.raises(OutputError, match="unsharded|is writing to"):
            _sink(tmp_path).open()
        with pytest.raises(OutputError, match="shard 1/3"):
            _sink(tmp_path, "1/3").open()
    with _sink(tmp_path) as alone:  # every shard closed: the folder is free again
        assert alone.manifest.path.name == "results.jsonl"
        with pytest.raises(OutputError, match="is writing to"):
            _sink(tmp_path, "3/3").open()


def test_temp_files_are_cleaned_only_by_a_run_alone_in_the_folder(tmp_path):
    left = tmp_path / "tts_sft" / ".mimo-tmp-123-x.wav.part"
    with _sink(tmp_path, "1/2"):
        left.write_bytes(b"half")  # shard 1's temp file, mid-write
        with _sink(tmp_path, "2/2"):
            assert left.exists()  # shard 1 may be writing it
        assert left.exists()
    with _sink(tmp_path, "2/2"):
        assert not left.exists()


def test_dry_run_and_devices_show_the_shard_and_its_source(invoke):
    env = {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_MIN": "1",
           "SLURM_ARRAY_TASK_COUNT": "4"}
    shown = json.loads(invoke("devices", "--model", "tiny", "--json", env=env).stdout)["shard"]
    assert shown["shard"] == "2/4" and "SLURM_ARRAY_TASK_ID=2" in shown["source"]
    dry = invoke("synth", "--model", "tiny", "--text", "Hi.", "--shard", "3/5", "--dry-run",
                 "--json", env=env)
    assert dry.exit_code == 0
    assert json.loads(dry.stdout)["shard"] == {"shard": "3/5", "index": 3, "count": 5,
                                               "source": "flag"}
    plain = json.loads(invoke("devices", "--model", "tiny", "--json").stdout)["shard"]
    assert plain["shard"] is None
    bad = invoke("synth", "--model", "tiny", "--text", "Hi.", "--dry-run",
                 env={"JOB_COMPLETION_INDEX": "1"})
    assert bad.exit_code == EXIT_USAGE and "MIMO_TTS_SHARD_COUNT" in bad.stderr


def test_shard_with_one_output_file_is_a_usage_error(invoke):
    result = invoke("synth", "--model", "tiny", "--text", "Hi.", "-o", "x.wav", "--shard", "1/2")
    assert result.exit_code == EXIT_USAGE and "--shard" in result.stderr


@pytest.mark.parametrize(("env", "named"), [
    ({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "0"}, "SLURM_ARRAY_TASK_COUNT=0"),
    ({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "2000000"},
     "SLURM_ARRAY_TASK_COUNT=2000000"),
    ({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "3"},
     "SLURM_ARRAY_TASK_COUNT=3"),
    ({"JOB_COMPLETION_INDEX": "3", "MIMO_TTS_SHARD_COUNT": "3"}, "JOB_COMPLETION_INDEX=3"),
    ({"JOB_COMPLETION_INDEX": "0", "MIMO_TTS_SHARD_COUNT": "0"}, "MIMO_TTS_SHARD_COUNT=0"),
])
def test_a13_an_env_shard_out_of_range_names_the_variable_not_a_flag(env, named):
    with pytest.raises(UsageError) as info:
        resolve_shard(None, env)
    message = str(info.value)
    assert named in message and message.endswith("pass --shard K/N")
    assert "--shard " not in message.removesuffix("pass --shard K/N")  # no flag was given


def test_a13_an_unsharded_run_refused_beside_shards_names_their_pids(tmp_path):
    with _sink(tmp_path, "2/3"), _sink(tmp_path, "1/3"):
        with pytest.raises(OutputError) as info:
            _sink(tmp_path).open()
    pid = os.getpid()
    assert str(info.value) == (f"shard(s) 1/3 (pid {pid}), 2/3 (pid {pid}) are writing to "
                               f"{tmp_path / 'tts_sft'}; an unsharded run waits for them (or "
                               "use another --output-dir)")
    assert "pid ?" not in str(info.value)


def test_status_merge_beside_running_shards_says_what_waits(invoke, tmp_path):
    """`status --merge` while shards write: one line naming them and that the merge waits
    (before: "an unsharded run waits for them (or use another --output-dir)")."""
    with _sink(tmp_path / "out", "1/2"):
        merged = invoke("status", tmp_path / "out", "--merge")
    pid = os.getpid()
    assert merged.exit_code == 5, merged.output
    assert merged.stderr.strip() == (
        f"Error: shard(s) 1/2 (pid {pid}) are writing to {tmp_path / 'out' / 'tts_sft'}; "
        "status --merge waits until they are done")
