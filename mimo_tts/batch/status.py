"""`mimo-tts status`: which items of an output folder are done, failed or missing.

Reads every manifest of a task folder (`results.jsonl` and each shard's
`results.shard-K-of-N.jsonl`) without locking or rewriting them, so it runs beside live
shards. An item is done as the next `synth` judges it: a line says `ok`, its sidecar holds
that key and its audio has the recorded size; with `--input`, also its resume key from its
line (`resume.item_key`: the item's text, seed, instruct, prompt audio and task, with the rest
of the settings as its sidecar records them). An item with no line, or done for other inputs,
is missing. `--merge` writes one `results.jsonl` with a line per item (under the folder's lock:
refused while a run writes). No torch here.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from mimo_tts.batch.files import companion_paths, jsonl_records
from mimo_tts.batch.items import Naming, read_items
from mimo_tts.batch.manifest import MANIFEST_NAME, audio_problem, manifest_name, read_sidecar
from mimo_tts.batch.resume import item_inputs, resume_key, tagged_inputs
from mimo_tts.batch.shards import Shard, parse_tag, shard_of
from mimo_tts.batch.sinks import DirectorySink
from mimo_tts.errors import EXIT_INCOMPLETE, EXIT_OK, MimoTTSError, OutputError
from mimo_tts.lm.tasks import TASKS
from mimo_tts.synthesis.markup import DEFAULT_SENTENCE_SILENCE
from mimo_tts.synthesis.options import SynthesisOptions


def manifests(folder: Path) -> list[Path]:
    """The unsharded manifest first, then the shards' in (N, K) order. A name of a manifest
    held by anything but a regular file (a directory, a FIFO, a link) is an OutputError."""
    tags = {p: parse_tag(p.name) for p in folder.glob("results.*.jsonl")}
    sharded = [p for p, tag in tags.items()
               if tag and 1 <= tag[0] <= tag[1] and p.name == manifest_name(Shard(*tag))]
    unsharded = folder / MANIFEST_NAME
    found = [unsharded] if unsharded.exists() or unsharded.is_symlink() else []
    found += sorted(sharded, key=lambda p: tags[p][::-1])
    for path in found:
        _refuse_odd(os.lstat(path).st_mode, path)
    return found


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def _refuse_odd(mode: int, path: Path) -> None:
    if not stat.S_ISREG(mode):
        kind = next((k for test, k in _KINDS if test(mode)), "a device")
        raise OutputError(f"{path} is {kind}, not a manifest file; remove it or give "
                          "another folder")


def _records(path: Path) -> Iterator[dict]:
    """A manifest's records, opened without following a link or blocking on a FIFO swapped
    in since `manifests` looked, and read only when it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise OutputError(f"cannot read {path}: {exc.strerror or exc}") from None
    with open(fd, "rb") as handle:
        _refuse_odd(os.fstat(fd).st_mode, path)
        yield from jsonl_records(handle)


def task_folder(output_dir: str, task: str, inputs: list[str]) -> Path:
    """OUTPUT_DIR/<task>, or OUTPUT_DIR itself when it is the task folder."""
    root = Path(output_dir)
    if (root / task).is_dir() or (inputs and not manifests(root)):
        return root / task
    if root.is_dir() and manifests(root):
        return root
    raise OutputError(f"no manifest in {root} or {root / task} (results*.jsonl); "
                      "give the folder a synth run wrote, or --input to list what is missing")


def report(output_dir: str, task: str = "tts_sft", inputs: list[str] = (),
           merge: bool = False, naming: Naming | None = None) -> dict:
    """Done / failed / missing items over every manifest (and `--input`, its items named and
    keyed as `synth` does with the same `--seed`, `--instruct`, `--prompt-audio`: `naming`),
    per shard."""
    folder = task_folder(output_dir, task, list(inputs))
    found = manifests(folder) if folder.is_dir() else []
    records = _latest(found)
    counts = {parse_tag(p.name)[1] for p in found if parse_tag(p.name)}
    count = counts.pop() if len(counts) == 1 else None  # missing items get their shard
    naming = replace(naming or Naming(), task=task)  # the run's --task
    here = folder.name if folder.name in TASKS else task  # this folder's task
    judge = _Judge(folder, here, naming)
    items = None if not inputs else [  # a line naming its own task is in that task's folder
        i for i in read_items([], inputs, sys.stdin, naming) if (i.task or task) == here]
    done, failed, missing, order = [], [], [], []
    entries = [(i.id, i) for i in items] if items is not None else [(i, None) for i in records]
    for item_id, item in entries:
        record, problem = judge.verdict(records, item, item_id)
        where = _shard(item_id, count)
        if record is not None:
            order.append(str(record["id"]))
        if record is not None and problem is None and record.get("status") != "ok":
            failed.append({"id": item_id, "shard": where, "exit_code": record.get("exit_code"),
                           "error": record.get("error")})
        elif record is None or problem is not None:
            missing.append({"id": item_id, "shard": where,
                            **({} if problem is None else {"reason": problem})})
        else:
            done.append(item_id)
    out = {"dir": str(folder), "manifests": [p.name for p in found], "items": len(entries),
           "done": len(done), "failed": failed, "missing": missing,
           "complete": not failed and not missing, "merged": None}
    if count is not None:
        out["shards"] = {f"{k}/{count}": {
            "done": sum(_shard(i, count) == f"{k}/{count}" for i in done),
            "failed": sum(e["shard"] == f"{k}/{count}" for e in failed),
            "missing": sum(e["shard"] == f"{k}/{count}" for e in missing)}
            for k in range(1, count + 1)}
    elif len(counts) > 1:
        out["warning"] = "manifests of different shard counts: use one N per folder"
    if merge:
        out["merged"] = str(_merge(folder, records, order))
    return out


def _latest(found: list[Path]) -> dict[str, dict]:
    """Each id's line over all manifests: an `ok` line wins over a failure."""
    records: dict[str, dict] = {}
    for path in found:
        for record in _records(path):
            item_id = str(record.get("id"))
            if records.get(item_id, {}).get("status") != "ok" or record.get("status") == "ok":
                records[item_id] = record
    return records


class _Judge:
    """Whether an item is done as the next `synth` into this folder would judge it."""

    def __init__(self, folder: Path, task: str, naming: Naming):
        self.folder, self.task, self.naming = folder, task, naming

    def verdict(self, records: dict[str, dict], item, item_id: str):
        """(the item's line or None, why it is not done or None). An item from `--input`
        is also found under the text-only id earlier versions gave it, when that output's
        key is this item's."""
        record = records.get(item_id)
        legacy = records.get(item.legacy_id) if item is not None and item.legacy_id else None
        if record is None and legacy is not None and legacy.get("status") == "ok" and \
                self.problem(legacy, item) is None:
            return legacy, None
        if record is None:
            return None, None
        if item is not None and record.get("text") != item.text:
            return record, "other text"
        return record, self.problem(record, item) if record.get("status") == "ok" else None

    def problem(self, record: dict, item) -> str | None:
        """Why an `ok` line's output is not done (`manifest.done_record`): its sidecar gone or
        from other inputs, the item's key (`resume.item_key`, from the run's part recorded in
        the sidecar) another, its audio gone or cut; None when it is done."""
        audio = self.folder / Path(str(record.get("path"))).name
        if not audio.exists():
            return "audio file gone"
        sidecar = read_sidecar(companion_paths(audio)[0])
        result = (sidecar or {}).get("result")
        if not isinstance(result, dict):
            return "sidecar gone or unreadable"
        if result.get("key") != record.get("key") or result.get("status") != "ok":
            return "sidecar from other inputs"
        if item is not None and self.key(sidecar, item) not in (None, result["key"]):
            return "other inputs (another seed, instruct, prompt audio or task)"
        return audio_problem(audio, sidecar)

    def key(self, sidecar: dict, item) -> str | None:
        """The item's resume key with the settings its sidecar records; None for sidecars
        from before they were recorded (the line's text is compared alone)."""
        run = sidecar.get("resume")
        if not isinstance(run, dict) or not run:
            return None
        n = self.naming
        seed = item.seed if item.seed is not None else n.seed
        try:  # how the run cut the text, for the stored voices its tags name
            cut = SynthesisOptions(max_chars=run.get("max_chars", SynthesisOptions.max_chars),
                                   captions=bool(run.get("captions")),
                                   sentence_silence=run.get("sentence_silence",
                                                            DEFAULT_SENTENCE_SILENCE))
            tagged = tagged_inputs(item.text, cut)
        except MimoTTSError:  # a sidecar that lies, or a bad tag: not this item's output
            return ""
        return resume_key({**run, **item_inputs(item.text, item.instruct or n.instruct, seed,
                                                item.prompt_audio or n.prompt_audio,
                                                self.task), **tagged})


def _shard(item_id: str, count: int | None) -> str | None:
    return None if count is None else f"{shard_of(item_id, count)}/{count}"


def _merge(folder: Path, records: dict[str, dict], order: list[str]) -> Path:
    """One line per item (input order first) into results.jsonl, under the folder lock."""
    with DirectorySink(folder.parent, folder.name, who="status --merge") as sink:
        ordered = [i for i in order if i in records] + [i for i in records if i not in order]
        sink.manifest.records = {i: records[i] for i in ordered}
        sink.manifest.compact()
        return sink.manifest.path


def exit_code(report: dict) -> int:
    return EXIT_OK if report["complete"] else EXIT_INCOMPLETE


def lines(report: dict) -> list[str]:
    """The report as text: a summary, one line per shard, then each failed / missing item."""
    out = [f"{report['dir']}: {report['items']} items: {report['done']} done, "
           f"{len(report['failed'])} failed, {len(report['missing'])} missing "
           f"({', '.join(report['manifests']) or 'no manifest'})"]
    for label, c in report.get("shards", {}).items():
        out.append(f"shard {label}: {c['done']} done, {c['failed']} failed, "
                   f"{c['missing']} missing")
    if report.get("warning"):
        out.append(f"warning: {report['warning']}")
    for e in report["failed"]:
        out.append(f"failed {e['id']}{_in(e)} (exit {e['exit_code']}): {e['error']}")
    for e in report["missing"]:
        out.append(f"missing {e['id']}{_in(e)}" + (f" ({e['reason']})" if "reason" in e else ""))
    if report["merged"]:
        out.append(f"merged manifest: {report['merged']}")
    return out


def _in(entry: dict) -> str:
    return f" [shard {entry['shard']}]" if entry.get("shard") else ""
