"""Per-item results of a run, the run's exit code, and the checks audio must pass to be written.

An item ends `ok` (written, or kept in memory), `skipped` (already done with the same inputs)
or `error` with the exit code of its failure; `exit_code_for` folds a run into one code
(README "Exit codes"). `check_audio` refuses NaN/inf and silent audio before any file exists.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from mimo_tts.errors import EXIT_OK, EXIT_PARTIAL, AudioCheckError, MimoTTSError, NoAudioError
from mimo_tts.inputs import Item

PAUSE_FRAMES = 8  # silence between split text pieces: 8 frames = 0.32 s, whole frames
SILENCE_PEAK = 1e-4  # peak |sample| below this is "all silent"


@dataclass
class ItemResult:
    """The outcome of one item: status `ok`, `skipped` or `error` (with its exit code)."""

    item: Item
    status: str
    key: str = ""
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

    def record(self, task: str) -> dict:
        """The manifest line / `--json` object of this item."""
        return {
            "id": self.item.id, "text": self.item.text, "task": task,
            "path": str(self.path) if self.path else None, "seconds": round(self.seconds, 4),
            "seed": self.seed, "rtf": None if self.rtf is None else round(self.rtf, 4),
            "status": self.status, "error": self.error, "exit_code": self.exit_code,
            "key": self.key, "source": self.item.source, "source_id": self.item.source_id,
            "codes_path": str(self.codes_path) if self.codes_path else None,
            "template_index": self.template_index,
            "generated_text_ids": self.generated_text_ids, "generated_text": self.text_out,
            "timings": {k: round(v, 4) for k, v in self.timings.items()},
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


def piece_record(piece) -> dict:
    """A `models.Piece` as recorded in the sidecar."""
    prompt = piece.prompt
    return {"text": prompt.text, "rendered_prompt": prompt.rendered,
            "template_index": prompt.template_index, "template": prompt.template,
            "prompt_groups": prompt.n_groups, "seed": piece.seed,
            "generated_text_ids": piece.new_text_ids, "generated_text": piece.text,
            "frames": 0 if piece.codes is None else int(piece.codes.shape[1]),
            "timings": {k: round(v, 4) for k, v in piece.timings.items()}}


def check_audio(audio, item_id: str) -> None:
    """Refuse NaN/inf or all-silent audio (exit 6) rather than write a broken file."""
    import torch

    if audio.numel() == 0:
        raise NoAudioError(f"item {item_id!r}: no audio samples")
    if not bool(torch.isfinite(audio).all()):
        raise AudioCheckError(f"item {item_id!r}: decoded audio has NaN or infinite samples")
    if float(audio.abs().max()) < SILENCE_PEAK:
        raise AudioCheckError(f"item {item_id!r}: decoded audio is silent "
                              f"(peak below {SILENCE_PEAK})")


def join_pieces(audios: list, pause_frames: int, samples_per_frame: int):
    """Pieces' audio [S_i] joined with `pause_frames` frames of silence: [S] float32 on CPU."""
    import torch

    pause = torch.zeros(pause_frames * samples_per_frame)
    parts = []
    for i, audio in enumerate(audios):
        if i:
            parts.append(pause)
        parts.append(audio.detach().float().cpu())
    return torch.cat(parts)
