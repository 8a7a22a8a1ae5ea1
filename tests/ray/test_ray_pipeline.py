"""The Ray Data pipeline (`mimo_tts.ray`) on a local Ray instance (2 CPUs, the tiny preset):
its wavs are byte-identical to `mimo-tts synth`'s for the same items and seeds, it writes the
CLI's layout and manifest, and a re-run filters done items out before Stage-0 (issue 15).

Runs in its own venv (`.ci/run-ray`); without Ray installed the module skips itself.
"""

from __future__ import annotations

import json
import pickle

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed here (pip install '.[ray]')")

from mimo_tts.batch import ray as mray  # noqa: E402
from mimo_tts.batch.plan import SynthRequest  # noqa: E402
from mimo_tts.synthesis.settings import OptionValues  # noqa: E402

ITEMS = [{"id": f"item-{i}", "text": f"Ray sentence number {i}, spoken once."} for i in range(8)]
ITEMS[2]["seed"], ITEMS[5]["seed"] = 7, 11  # per-item seeds beside the run's --seed
OPTIONS = {"model": "tiny", "max_new_groups": 6, "seed": 3}


def _batch(tmp_path, items):
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(i) + "\n" for i in items), encoding="utf-8")
    return str(path)


def _request(batch, output_dir) -> SynthRequest:
    return SynthRequest(OptionValues(**OPTIONS, output_dir=str(output_dir)), inputs=(batch,))


def _ray(tmp_path, batch, out):
    return list(mray.run(_request(batch, tmp_path / out), stage0_actors=1, stage1_actors=1))


def test_ray_wavs_are_byte_identical_to_the_cli(local_ray, mimo, tmp_path, manifest):
    batch = _batch(tmp_path, ITEMS)
    cli = mimo("synth", "--input", batch, "--output-dir", "cli", "--model", "tiny",
               "--max-new-groups", "6", "--seed", "3")
    assert cli.returncode == 0, cli.stderr.decode()
    results = _ray(tmp_path, batch, "ray")
    assert sorted((r.item.id, r.status) for r in results) == [(i["id"], "ok") for i in ITEMS]
    cli_dir, ray_dir = tmp_path / "cli" / "tts_sft", tmp_path / "ray" / "tts_sft"
    for item in ITEMS:
        wav = f"{item['id']}.wav"
        assert (ray_dir / wav).read_bytes() == (cli_dir / wav).read_bytes(), wav
        ours, theirs = (json.loads((d / f"{item['id']}.json").read_text()) for d in
                        (ray_dir, cli_dir))
        assert ours["seed"] == theirs["seed"] == item.get("seed", 3)
        assert ours["result"]["key"] == theirs["result"]["key"]  # the same resume key
        assert ours["placement"] == theirs["placement"] and ours["model"] == theirs["model"]
    by_id = {r["id"]: r for r in manifest(ray_dir)}
    assert set(by_id) == {i["id"] for i in ITEMS}
    for line in manifest(cli_dir):
        assert {k: by_id[line["id"]][k] for k in ("status", "key", "seed", "seconds",
                                                  "generated_text_ids")} == {
            k: line[k] for k in ("status", "key", "seed", "seconds", "generated_text_ids")}


def test_ray_resumes_done_items_before_stage0_and_records_bad_ones(local_ray, tmp_path,
                                                                   manifest):
    batch = _batch(tmp_path, [*ITEMS[:3], {"id": "bad", "text": ""}])
    first = {r.item.id: (r.status, r.exit_code) for r in _ray(tmp_path, batch, "out")}
    assert first == {**{i["id"]: ("ok", 0) for i in ITEMS[:3]}, "bad": ("error", 9)}
    folder = tmp_path / "out" / "tts_sft"
    kept = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.wav")}
    (folder / "item-1.wav").unlink()
    again = {r.item.id: r.status for r in _ray(tmp_path, batch, "out")}
    assert again == {"item-0": "skipped", "item-1": "ok", "item-2": "skipped", "bad": "error"}
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("*.wav")
            if p.name != "item-1.wav"} == {k: v for k, v in kept.items() if k != "item-1.wav"}
    lines = manifest(folder)
    assert sorted(r["id"] for r in lines) == ["bad", "item-0", "item-1", "item-2"]
    assert {r["id"]: r["exit_code"] for r in lines}["bad"] == 9
    # everything done: no Ray work at all
    assert {r.status for r in _ray(tmp_path, _batch(tmp_path, ITEMS[:3]), "out")} == {"skipped"}


def test_writer_as_a_third_stage_writes_the_same_folder(local_ray, tmp_path, manifest):
    """The classes compose by hand: `WriteResults` mapped on one actor (every node sees the
    folder)."""
    batch = _batch(tmp_path, ITEMS[:2])
    with mray.planned(_request(batch, tmp_path / "a")) as (plan, _, pending, _):
        pass  # the driver lets go of the folder: the writer actor takes it
    rows = mray.pipeline(plan.settings, pending).map_batches(
        mray.WriteResults, fn_constructor_kwargs={"settings": plan.settings, "shard": plan.shard},
        num_cpus=0,
        compute=ray.data.ActorPoolStrategy(size=1)).take_all()
    written = sorted(pickle.loads(r["payload"]).item.id for r in rows)
    assert written == ["item-0", "item-1"]
    by_hand, by_run = tmp_path / "a" / "tts_sft", tmp_path / "b" / "tts_sft"
    _ray(tmp_path, batch, "b")
    for name in ("item-0.wav", "item-1.wav"):
        assert (by_hand / name).read_bytes() == (by_run / name).read_bytes()
    assert sorted(r["id"] for r in manifest(by_hand)) == written


def test_ray_equals_the_cli_at_any_thread_counts(local_ray, mimo, tmp_path):
    """The same seed gives the same bytes whatever threads the CLI's stages use, and the Ray
    pipeline (one thread a worker) gives those bytes too."""
    items = ITEMS[:3]
    batch = _batch(tmp_path, items)
    _ray(tmp_path, batch, "ray")
    runs = {"lm1": ("--lm-threads", "1"),
            "lm2-tok2": ("--lm-threads", "2", "--tokenizer-threads", "2"),
            "lm3-tok1": ("--lm-threads", "3", "--tokenizer-threads", "1")}
    for out, flags in runs.items():
        cli = mimo("synth", "--input", batch, "--output-dir", out, "--model", "tiny",
                   "--max-new-groups", "6", "--seed", "3", *flags, env={"OMP_NUM_THREADS": "2"})
        assert cli.returncode == 0, cli.stderr.decode()
        for item in items:
            wav = f"tts_sft/{item['id']}.wav"
            assert (tmp_path / out / wav).read_bytes() == (tmp_path / "ray" / wav).read_bytes(), \
                (out, wav)
