"""A JSONL line may name its own `task` (validated as `--task` is): its output goes to that
task's folder with that task's prompt and samplers, and a re-run and `status` find it there
(issue 22, B)."""

from __future__ import annotations

import json
from dataclasses import asdict

from mimo_tts.batch.items import read_items
from mimo_tts.errors import EXIT_INPUT, EXIT_PARTIAL
from mimo_tts.synthesis.options import SynthesisOptions
from tests.helpers import read_manifest

LINES = [
    {"id": "a", "text": "Plain one."},
    {"id": "b", "text": "Styled one.", "task": "tts_sft_with_instruct", "instruct": "calm"},
    {"id": "c", "text": "Natural one.", "task": "tts_sft_with_natural_instruction"},
    {"id": "d", "text": "Bad one.", "task": "tts_sfx"},
    {"id": "e", "text": "Needs a style.", "task": "tts_sft_with_instruct"},
    {"id": "a", "text": "Same id, other folder.", "task": "tts_sft_with_natural_instruction"},
]


def _batch(tmp_path, lines=LINES):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_b_a_line_task_is_validated_like_the_flag(tmp_path):
    a, b, c, d, e, other = read_items([], [str(_batch(tmp_path))])
    assert (a.task, b.task, c.task, other.task) == (
        None, "tts_sft_with_instruct", "tts_sft_with_natural_instruction",
        "tts_sft_with_natural_instruction")
    assert "tasks.jsonl:4: unknown task 'tts_sfx'; choose one of tts_sft," in str(d.error)
    assert e.error is None  # its missing instruct is the run's to judge (--instruct)
    assert other.error is None and other.id == "a"  # one id per task folder


def test_b_each_line_runs_in_its_own_task_and_folder(invoke, tmp_path):
    batch = _batch(tmp_path)
    args = ("synth", "--model", "tiny", "--input", batch, "--output-dir", "out",
            "--max-new-groups", "2")
    first = invoke(*args)
    assert first.exit_code == EXIT_PARTIAL, first.stderr  # was: every line refused, exit 9
    assert "4 written, 0 skipped, 2 failed" in first.stderr
    out = tmp_path / "out"
    lines = {task: {r["id"]: r for r in read_manifest(out / task)} for task in (
        "tts_sft", "tts_sft_with_instruct", "tts_sft_with_natural_instruction")}
    assert lines["tts_sft"]["a"]["status"] == "ok" and lines["tts_sft"]["d"]["exit_code"] == 9
    assert lines["tts_sft_with_instruct"]["b"]["status"] == "ok"
    assert "needs a style instruction: give --instruct" in \
        lines["tts_sft_with_instruct"]["e"]["error"]
    assert lines["tts_sft_with_instruct"]["e"]["exit_code"] == EXIT_INPUT
    assert {i: r["status"] for i, r in lines["tts_sft_with_natural_instruction"].items()} == {
        "c": "ok", "a": "ok"}
    sidecar = json.loads((out / "tts_sft_with_instruct" / "b.json").read_text())
    assert (sidecar["task"], sidecar["instruct"], sidecar["result"]["task"]) == (
        "tts_sft_with_instruct", "calm", "tts_sft_with_instruct")
    text, audio = SynthesisOptions(task="tts_sft_with_instruct").samplers()
    assert sidecar["effective_sampler"] == {"text": asdict(text), "audio": asdict(audio)}
    again = invoke(*args)
    assert "0 written, 4 skipped, 2 failed" in again.stderr, again.stderr
    done = {}
    for task in ("tts_sft", "tts_sft_with_instruct", "tts_sft_with_natural_instruction"):
        report = json.loads(invoke("status", out / task, "--input", batch, "--json").stdout)
        done[task] = (report["items"], report["done"])
    assert done == {"tts_sft": (2, 1), "tts_sft_with_instruct": (2, 1),
                    "tts_sft_with_natural_instruction": (2, 2)}


def test_b_a_run_instruct_that_a_line_task_cannot_take_fails_that_line(invoke, tmp_path):
    batch = _batch(tmp_path, [{"id": "x", "text": "Hi.", "task": "tts_sft"},
                              {"id": "y", "text": "Hi there."}])
    run = invoke("synth", "--model", "tiny", "--input", batch, "--max-new-groups", "2",
                 "--task", "tts_sft_with_instruct", "--instruct", "calm")
    assert run.exit_code == EXIT_PARTIAL, run.stderr
    assert "failed x: tasks.jsonl:1: task tts_sft: --instruct: task tts_sft takes no " \
           "instruction" in run.stderr
