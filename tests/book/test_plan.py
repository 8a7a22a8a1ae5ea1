"""A book's plan without a model: chapter selection, one item per sentence with its place as
id and seed, the items file the Ray pipeline and `synth --input` read, the `--list` table."""

from __future__ import annotations

import json
import re

import pytest

from mimo_tts.batch.items import read_items
from mimo_tts.book.plan import (
    BookRequest,
    book_items,
    piece_seed,
    plan_book,
    select_chapters,
    table,
    table_lines,
    write_items,
)
from mimo_tts.book.read import read_book
from mimo_tts.errors import UsageError
from mimo_tts.synthesis.options import MAX_SEED
from mimo_tts.synthesis.settings import OptionValues, resolve_options
from tests.book.books import SENTENCES, THREE, THREE_TABLE, write_epub


def test_select_chapters():
    assert select_chapters(None, 3) == (1, 2, 3)
    assert select_chapters("1-3,7", 9) == (1, 2, 3, 7)
    assert select_chapters(" 3 , 1-2,2 ", 3) == (1, 2, 3)
    for spec, words in [("4", "--chapters 4: the book has 3 chapters (1-3)"),
                        ("0-1", "the book has 3 chapters"), ("3-2", "runs backwards"),
                        ("one", "numbers and ranges"), ("1,", "numbers and ranges")]:
        with pytest.raises(UsageError, match=re.escape(words)):
            select_chapters(spec, 3)


def test_seeds_follow_the_place_and_the_book_seed():
    seeds = {piece_seed(0, c, p) for c in range(1, 20) for p in range(1, 50)}
    assert len(seeds) == 19 * 49 and all(0 <= s <= MAX_SEED for s in seeds)
    assert piece_seed(0, 2, 5) == piece_seed(0, 2, 5) != piece_seed(1, 2, 5)


def test_one_item_per_sentence_with_place_ids(tmp_path):
    book = read_book(write_epub(tmp_path / "three.epub"))
    items = book_items(book, resolve_options(OptionValues(seed=4)))
    flat = [i for chapter in items.values() for i in chapter]
    assert len(flat) == SENTENCES
    assert [i.id for i in items[1]] == ["c001-p0001", "c001-p0002", "c001-p0003"]
    assert [i.text for i in items[1]] == ["Chapter 1: The Harbour", "The boats came in at dawn.",
                                          "Gulls followed them & cried."]
    assert [i.seed for i in items[2]] == [piece_seed(4, 2, p) for p in (1, 2, 3)]
    # the seed is the place, not the text: a chapter read alone gets the same seeds
    alone = book_items(read_book(write_epub(tmp_path / "one.epub", THREE[1:2])),
                       resolve_options(OptionValues(seed=4)))
    assert [i.seed for i in alone[1]] == [piece_seed(4, 1, p) for p in (1, 2, 3)]


def test_items_file_reads_back_as_synth_items(tmp_path):
    book = read_book(write_epub(tmp_path / "three.epub"))
    voice = tmp_path / "voice.wav"
    items = book_items(book, resolve_options(OptionValues(prompt_audio=str(voice))))[2]
    path = write_items(tmp_path / "items.jsonl", items, "tts_sft_with_audio")
    before = path.stat().st_mtime_ns
    write_items(path, items, "tts_sft_with_audio")
    assert path.stat().st_mtime_ns == before  # unchanged: not rewritten
    back = read_items([], [str(path)])
    assert [(i.id, i.text, i.seed, i.task, i.prompt_audio, i.error) for i in back] == [
        (i.id, i.text, i.seed, "tts_sft_with_audio", str(voice), None) for i in items]
    assert json.loads(path.read_text().splitlines()[0])["prompt_audio"] == str(voice)


def test_list_table(tmp_path):
    listed = table(read_book(write_epub(tmp_path / "three.epub")))
    assert [r["title"] for r in listed["chapters"]] == ["The Harbour", "The Lighthouse",
                                                        "The Return"]
    assert table_lines(listed) == THREE_TABLE


def test_plan_refuses_before_anything_is_written(tmp_path):
    book = write_epub(tmp_path / "three.epub")
    out = tmp_path / "out"
    options = OptionValues(model="tiny", output_dir=str(out))
    with pytest.raises(UsageError, match="the book has 3 chapters"):
        plan_book(BookRequest(str(book), options, chapters="2-5", m4b=False))
    with pytest.raises(UsageError, match="--format must be one of"):
        plan_book(BookRequest(str(book), options, format="aiff", m4b=False))
    with pytest.raises(UsageError, match="--seed must be"):
        plan_book(BookRequest(str(book), OptionValues(seed=-1, output_dir=str(out)), m4b=False))
    plan = plan_book(BookRequest(str(book), options, chapters="2", shard="1/2", m4b=False))
    assert {i.id[:4] for i in plan.plan.items} <= {"c002"} and plan.plan.shard.label == "1/2"
    assert plan.settings.run.format == "wav"
    o = plan.settings.synthesis  # the book's voice, planned: its first piece, read to out/
    assert (o.task, o.prompt_audio) == ("tts_sft_with_audio", str(out / "book-voice.wav"))
    assert [i.id for i in plan.voice.plan.items] == ["c001-p0001"]
    assert plan.voice.plan.settings.run.output == str(out / "book-voice.wav")
    assert plan.voice.plan.settings.synthesis.task == "tts_sft"
    own = plan_book(BookRequest(str(book), options, m4b=False, voice_per_piece=True))
    assert own.voice is None and own.settings.synthesis.task == "tts_sft"
    assert not out.exists()
