"""`Piece`: one generated text piece (its prompt, generated ids, codes and audio), as data:
what a job of the speech worker (`worker.py`) gives every face; sidecars record it (`record`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Piece:
    """One generated text piece: its prompt record, generated ids, codes and audio."""

    prompt: object  # mimo_tts.prompts.Prompt
    seed: int
    new_text_ids: list[int]
    text: str
    codes: object | None  # [8, T] int64, None when no audio was generated
    audio: object | None = None  # [960 T] float32 once decoded
    note: str | None = None
    timings: dict = field(default_factory=dict)  # prefill_s; streaming: per-stage seconds

    def record(self) -> dict:
        """This piece as recorded in provenance (the sidecar's `pieces`)."""
        prompt = self.prompt
        return {"text": prompt.text, "rendered_prompt": prompt.rendered,
                "template_index": prompt.template_index, "template": prompt.template,
                "prompt_groups": prompt.n_groups, "seed": self.seed,
                "generated_text_ids": self.new_text_ids, "generated_text": self.text,
                "frames": 0 if self.codes is None else int(self.codes.shape[1]),
                "timings": {k: round(v, 4) for k, v in self.timings.items()}}
