"""A book's pieces on the Ray pipeline: `mimo-tts book --items-out` writes them as items, the
pipeline (`mimo_tts.batch.ray.run`, what scripts/ray_synth.py runs) synthesises them into the
book's folder, and the same `mimo-tts book` command then only assembles: every piece skipped,
the chapters and captions those of a book read without Ray (both clone the book's voice,
`book-voice.wav`, which `--items-out` reads first).

Runs in its own venv (`.ci/run-ray`); without Ray installed the module skips itself.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("ray", reason="Ray is not installed here (pip install '.[ray]')")

from mimo_tts.batch import ray as mray  # noqa: E402
from mimo_tts.batch.plan import SynthRequest  # noqa: E402
from mimo_tts.synthesis.settings import OptionValues  # noqa: E402
from tests.book.books import write_epub  # noqa: E402

TINY = ("--model", "tiny", "--max-new-groups", "4")
IDS = [f"c{c:03d}-p{p:04d}" for c in (1, 2, 3) for p in (1, 2, 3)]
M4B = () if importlib.util.find_spec("av") else ("--no-m4b",)


def test_a_books_pieces_run_on_ray_then_the_book_assembles(local_ray, invoke, tmp_path):
    epub = write_epub(tmp_path / "small-sea.epub")
    folder = tmp_path / "book"
    items = folder / "book-items.jsonl"
    made = invoke("book", epub, "--output-dir", folder, "--items-out", items, *TINY)
    assert made.exit_code == 0, made.output
    voice = folder / "book-voice.wav"  # the book's voice, read first; every item names it
    assert {json.loads(line)["prompt_audio"] for line in items.read_text().splitlines()} == {
        str(voice)}
    request = SynthRequest(OptionValues(model="tiny", max_new_groups=4, output_dir=str(folder)),
                           inputs=(str(items),))
    results = list(mray.run(request, stage0_actors=1, stage1_actors=1))
    assert sorted((r.item.id, r.status) for r in results) == [(i, "ok") for i in IDS]
    status = invoke("status", folder, "--json")
    assert status.exit_code == 0 and json.loads(status.stdout)["done"] == len(IDS)

    done = invoke("book", epub, "--output-dir", folder, *TINY, *M4B)
    assert done.exit_code == 0, done.output
    assert f"0 written, {len(IDS)} skipped, 0 failed" in done.stderr  # Ray wrote them all
    assert json.loads((folder / "book.json").read_text())["complete"]
    plain = tmp_path / "plain"
    alone = invoke("book", epub, "--output-dir", plain, *TINY, *M4B)
    assert alone.exit_code == 0, alone.output
    assert json.loads((folder / "book.json").read_text())["book_voice"] == voice.name
    for name in ["book.srt", "book-voice.wav",
                 *(f"chapters/{p.name}" for p in (plain / "chapters").iterdir())]:
        assert (folder / name).read_bytes() == (plain / name).read_bytes(), name
