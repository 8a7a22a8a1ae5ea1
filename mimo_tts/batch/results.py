"""Per-item results of a batch run and the run's exit code.

An item ends `ok` (written, or kept in memory), `skipped` (already done with the same inputs)
or `error` with the exit code of its failure; `exit_code_for` folds a run into one code
(README "Exit codes").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from mimo_tts.batch.items import Item
from mimo_tts.errors import EXIT_OK, EXIT_PARTIAL, MimoTTSError


@dataclass
class ItemResult:
    """The outcome of one item: status `ok`, `skipped` or `error` (with its exit code)."""

    item: Item
    status: str
    key: str = ""
    format: str | None = None  # the output format (each format of an item has its own files)
    path: Path | None = None
    sidecar: Path | None = None
    codes_path: Path | None = None
    seconds: float = 0.0
    rtf: float | None = None
    seed: int | None = None
    error: str | None = None
    exit_code: int = EXIT_OK
    timings: dict = field(default_factory=dict)
    generated_text_ids: list[list[int]] = field(default_factory=list)
    text_out: list[str] = field(default_factory=list)
    template_index: int | None = None
    audio: object | None = None  # [S] float32 at the output rate, in-memory runs only
    captions: list[str] | None = None  # the caption files written (--captions)

    def record(self, task: str) -> dict:
        """The manifest line / `--json` object of this item (`task`: the run's, unless the
        item's line names its own)."""
        return {
            "id": self.item.id, "text": self.item.text, "task": self.item.task or task,
            "format": self.format,
            "path": str(self.path) if self.path else None, "seconds": round(self.seconds, 4),
            "seed": self.seed, "rtf": None if self.rtf is None else round(self.rtf, 4),
            "status": self.status, "error": self.error, "exit_code": self.exit_code,
            "key": self.key, "source": self.item.source, "source_id": self.item.source_id,
            "codes_path": str(self.codes_path) if self.codes_path else None,
            "template_index": self.template_index,
            "generated_text_ids": self.generated_text_ids, "generated_text": self.text_out,
            "timings": {k: round(v, 4) for k, v in self.timings.items()},
            **({"captions": self.captions} if self.captions else {}),
        }


def exit_code_for(results: Iterable[ItemResult]) -> int:
    """0 if every item is fine; one failure kind -> its code; mixed outcomes -> partial (8)."""
    results = list(results)
    failed = [r for r in results if r.status == "error"]
    if not failed:
        return EXIT_OK
    codes = {r.exit_code for r in failed}
    if len(failed) == len(results) and len(codes) == 1:
        return codes.pop()
    return EXIT_PARTIAL


def fail(result: ItemResult, exc: MimoTTSError) -> None:
    result.status, result.error, result.exit_code = "error", str(exc), exc.exit_code


def guarded(result: ItemResult, fn, *args):
    """Run one item step; a MimoTTSError fails that item only."""
    try:
        return fn(*args)
    except MimoTTSError as exc:
        fail(result, exc)
        return None
