"""`mimo-tts status` on a book's folder: its pieces judged as for any output folder
(`batch.status.report` with the book's items file as the input: each piece's id, text, seed and
task), plus per chapter how many pieces are done. No torch here."""

from __future__ import annotations

from pathlib import Path

from mimo_tts.batch import status as folder_status
from mimo_tts.batch.files import iter_jsonl
from mimo_tts.batch.items import Naming
from mimo_tts.book.plan import ITEMS_NAME, chapter_number


def is_book(folder: str | Path) -> bool:
    """Whether a folder is a book's (it holds the items file `mimo-tts book` writes)."""
    return (Path(folder) / ITEMS_NAME).is_file()


def report(folder: str | Path, merge: bool = False) -> dict:
    """The folder's status over the book's pieces, with a count per chapter."""
    items = Path(folder) / ITEMS_NAME
    tasks = [r["task"] for r in iter_jsonl(items) if isinstance(r.get("task"), str)]
    task = tasks[0] if tasks else Naming.task
    out = folder_status.report(str(folder), task, [str(items)], merge, Naming(task=task))
    counts: dict[int, dict[str, int]] = {}
    for record in iter_jsonl(items):
        if isinstance(record.get("id"), str):
            counts.setdefault(chapter_number(record["id"]), {"pieces": 0, "failed": 0,
                                                             "missing": 0})["pieces"] += 1
    for kind in ("failed", "missing"):
        for entry in out[kind]:
            counts[chapter_number(entry["id"])][kind] += 1
    out["book"] = str(folder)
    out["chapters"] = {str(n): {**c, "done": c["pieces"] - c["failed"] - c["missing"]}
                       for n, c in sorted(counts.items())}
    return out


def lines(report: dict) -> list[str]:
    """The folder's summary line, the book's, one per chapter not done, then the rest."""
    first, *rest = folder_status.lines(report)
    chapters = report["chapters"]
    done = sum(c["done"] == c["pieces"] for c in chapters.values())
    waiting = [f"chapter {n}: {c['done']} of {c['pieces']} pieces done"
               + (f", {c['failed']} failed" if c["failed"] else "")
               for n, c in chapters.items() if c["done"] != c["pieces"]]
    return [first, f"book {report['book']}: {done} of {len(chapters)} chapters done",
            *waiting, *rest]
