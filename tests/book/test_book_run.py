"""`mimo-tts book` on the tiny preset with the three-chapter EPUB (a cover and a nav page):
`--list` (no model, no torch), the whole book (the m4b read back against book.json, one cue
per sentence, status), a re-run that rewrites nothing, `--chapters 2` alone (the same audio as
in the whole book), shards, `kill -9` and the same command again (each piece written once),
and bad inputs (one line, an exit code, nothing written)."""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import soundfile as sf

from mimo_tts.batch.shards import shard_of
from mimo_tts.book.assemble import CHAPTER_PAUSE_FRAMES
from mimo_tts.errors import EXIT_INCOMPLETE, EXIT_INPUT, EXIT_IO, EXIT_USAGE
from mimo_tts.synthesis.audio import PAUSE_FRAMES
from tests.book.books import (
    AUTHOR,
    SENTENCES,
    THREE,
    THREE_TABLE,
    TITLE,
    encryption_xml,
    write_epub,
)
from tests.helpers import ENTRY_POINT, error_line, read_lines

HAS_AV = importlib.util.find_spec("av") is not None
needs_av = pytest.mark.skipif(not HAS_AV, reason="PyAV is not installed (pip install "
                              "'mimo-tts[book]'): book.m4b cannot be written or read")
TINY = ("--model", "tiny", "--max-new-groups", "4")
IDS = [f"c{c:03d}-p{p:04d}" for c in (1, 2, 3) for p in (1, 2, 3)]
PIECES = "tts_sft_with_audio"  # each piece read with the book's voice (book-voice.wav)
SPF, RATE = 960, 24000
AAC_FRAME_S = 1024 / RATE


def _book(tmp_path: Path) -> Path:
    return write_epub(tmp_path / "small-sea.epub")


def _files(folder: Path) -> dict[str, int]:
    """Every output file (not the hidden locks) -> its mtime."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")
            if p.is_file() and not p.name.startswith(".")}


def _run(args, env, cwd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(ENTRY_POINT), "book", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd, stdin=subprocess.DEVNULL, timeout=300,
                          **kw)


@pytest.fixture(scope="module")
def whole(base_env, tmp_path_factory):
    """The whole book, once, by the installed command in a real process."""
    root = tmp_path_factory.mktemp("whole")
    done = _run([_book(root), "--output-dir", root / "out", *TINY,
                 *([] if HAS_AV else ["--no-m4b"])], base_env, root)
    assert done.returncode == 0, done.stderr
    return root / "out", done


def test_list_prints_the_table_without_torch(base_env, tmp_path):
    trace = ("import atexit, sys; atexit.register(lambda: sys.stderr.write("
             "'\\nTORCH %s\\n' % ('torch' in sys.modules))); sys.argv = ['mimo-tts', "
             "*sys.argv[1:]]; from mimo_tts.cli import main; main()")
    done = subprocess.run([sys.executable, "-c", trace, "book", str(_book(tmp_path)), "--list"],
                          capture_output=True, text=True, env=base_env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == THREE_TABLE
    assert "TORCH False" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small-sea.epub"]  # nothing written


def test_whole_book(whole, invoke):
    out, done = whole
    record = json.loads((out / "book.json").read_text())
    assert record["complete"] and (record["title"], record["author"]) == (TITLE, AUTHOR)
    assert [c["title"] for c in record["chapters"]] == [name for name, _, _ in THREE]
    pieces = sorted((out / PIECES).glob("*.wav"))
    assert [p.stem for p in pieces] == IDS
    lengths = {p.stem: sf.info(str(p)).frames for p in pieces}
    start = 0
    for number, chapter in enumerate(record["chapters"], 1):  # starts from the samples
        ids = [i for i in IDS if i.startswith(f"c{number:03d}")]
        samples = sum(lengths[i] for i in ids) + (len(ids) - 1) * PAUSE_FRAMES * SPF
        assert chapter["start_sample"] == start and chapter["end_sample"] == start + samples
        assert sf.info(str(out / chapter["file"])).frames == samples
        start += samples + CHAPTER_PAUSE_FRAMES * SPF
    assert record["seconds"] == round(record["chapters"][-1]["end_sample"] / RATE, 6)
    cues = [b.splitlines() for b in (out / "book.srt").read_text().split("\n\n") if b.strip()]
    assert len(cues) == SENTENCES == len(IDS)  # one cue per sentence
    assert [c[2] for c in cues[3:6]] == ["Chapter 2: The Lighthouse",
                                         "The keeper climbed the stairs.",
                                         "His lamp burned all night."]
    hours, minutes, seconds = cues[3][1].split(" --> ")[0].replace(",", ".").split(":")
    assert float(seconds) == round(record["chapters"][1]["start"], 3)  # chapter 2's first cue
    assert (out / "book.vtt").read_text().startswith("WEBVTT\n\n1\n00:00:00.000 --> ")
    assert done.stdout.splitlines()[-1] == str(out / "book.json")
    assert re.search(r"9 written, 0 skipped, 0 failed \| load [\d.]+ s \| synthesis [\d.]+ s "
                     r"for [\d.]+ s of audio \(RTF [\d.]+\)", done.stderr)
    assert "book: 3 chapters, 0:00:" in done.stderr
    # off a terminal (a log) a line per chapter as it is read (before: nothing until the end)
    assert re.findall(r"^chapter (\d)/3 read: (.*) \((\d) of 9 pieces, \d+ s\)$",
                      done.stderr, re.M) == [("1", "The Harbour", "3"),
                                             ("2", "The Lighthouse", "6"),
                                             ("3", "The Return", "9")]
    status = invoke("status", out, "--json")
    report = json.loads(status.stdout)
    assert status.exit_code == 0 and report["done"] == 9 and report["items"] == 9
    assert report["chapters"]["2"] == {"pieces": 3, "done": 3, "failed": 0, "missing": 0}


@needs_av
def test_m4b_chapters_and_metadata_equal_book_json(whole):
    from mimo_tts.book.m4b import read_chapters

    out, _ = whole
    record = json.loads((out / "book.json").read_text())
    marks = read_chapters(out / "book.m4b")
    assert [m["title"] for m in marks] == [c["title"] for c in record["chapters"]]
    for mark, chapter in zip(marks, record["chapters"], strict=True):
        assert abs(mark["start"] - chapter["start"]) <= AAC_FRAME_S
    import av

    with av.open(str(out / "book.m4b")) as container:
        assert container.metadata["title"] == TITLE and container.metadata["artist"] == AUTHOR
        (stream,) = container.streams.audio
        assert (stream.codec_context.name, stream.rate) == ("aac", RATE)
        assert abs(container.duration / 1e6 - record["seconds"]) <= AAC_FRAME_S


def test_without_a_voice_every_piece_is_read_in_the_first_pieces_voice(whole, invoke,
                                                                       tmp_path):
    """A book is one narrator: without --voice or --prompt-audio, its first piece read in the
    model's own voice is kept as book-voice.wav, named in book.json, and every piece is read
    with it as the voice prompt (before: each piece in the model's own voice, a speaker per
    piece); --voice-per-piece keeps the old reading."""
    out, _ = whole
    voice = out / "book-voice.wav"
    record = json.loads((out / "book.json").read_text())
    assert record["book_voice"] == "book-voice.wav" and record["task"] == PIECES
    assert record["prompt_audio"] == str(voice)
    for piece in IDS:
        sidecar = json.loads((out / PIECES / f"{piece}.json").read_text())
        assert (sidecar["task"], sidecar["prompt_audio"]) == (PIECES, str(voice))
    own = tmp_path / "own"
    done = invoke("book", out.parent / "small-sea.epub", "--output-dir", own, "--chapters", "1",
                  "--voice-per-piece", *TINY, "--no-m4b")
    assert done.exit_code == 0, done.output
    assert not (own / "book-voice.wav").exists() and "book voice" not in done.stderr
    assert json.loads((own / "book.json").read_text())["book_voice"] is None
    assert sorted(p.stem for p in (own / "tts_sft").glob("*.wav")) == IDS[:3]
    first, _ = sf.read(str(own / "tts_sft" / "c001-p0001.wav"), dtype="int16")
    kept, rate = sf.read(str(voice), dtype="int16")
    assert rate == RATE and first.tolist() == kept.tolist()  # the first piece, as read alone
    both = invoke("book", out.parent / "small-sea.epub", "--output-dir", own, "--voice-per-piece",
                  "--voice", "narrator", *TINY, "--no-m4b")
    assert both.exit_code == EXIT_USAGE and "--voice-per-piece" in error_line(both.stderr)


def test_rerun_rewrites_nothing(whole, invoke):
    out, _ = whole
    before = _files(out)
    again = invoke("book", out.parent / "small-sea.epub", "--output-dir", out, *TINY,
                   *([] if HAS_AV else ["--no-m4b"]))
    assert again.exit_code == 0, again.output
    assert "0 written, 9 skipped, 0 failed" in again.stderr
    assert _files(out) == before  # every output kept, mtimes included


def test_one_chapter_alone_is_the_same_audio(whole, invoke, tmp_path):
    out, _ = whole
    one = tmp_path / "one"
    done = invoke("book", out.parent / "small-sea.epub", "--output-dir", one, "--chapters", "2",
                  *TINY)
    assert done.exit_code == 0, done.output
    assert sorted(p.stem for p in (one / PIECES).glob("*.wav")) == IDS[3:6]
    assert (one / "book-voice.wav").read_bytes() == (out / "book-voice.wav").read_bytes()
    files = sorted((one / "chapters").iterdir())
    assert [p.name for p in files] == [f"002-The_Lighthouse.{x}" for x in ("srt", "vtt", "wav")]
    for chapter in files:  # the audio and its captions, as in the whole book
        assert chapter.read_bytes() == (out / "chapters" / chapter.name).read_bytes()
    assert not (one / "book.m4b").exists() and not (one / "book.srt").exists()
    record = json.loads((one / "book.json").read_text())
    assert not record["complete"] and [c["done"] for c in record["chapters"]] == [0, 3, 0]
    assert "book: 1 of 3 chapters done; " in done.stderr and "6 piece(s) of chapter(s) 1, 3" \
        in done.stderr
    status = invoke("status", one)
    assert status.exit_code == EXIT_INCOMPLETE
    assert status.stdout.splitlines()[1:4] == [f"book {one}: 1 of 3 chapters done",
                                               "chapter 1: 0 of 3 pieces done",
                                               "chapter 3: 0 of 3 pieces done"]


def test_speed_stretches_each_piece_and_the_captions_follow(whole, invoke, tmp_path):
    """`book --speed 2`: each piece file holds half the samples of speed 1's, the chapter and
    its cues follow (the pauses between pieces keep their length)."""
    out, _ = whole
    fast = tmp_path / "fast"
    # chapter 2 alone would take its own first piece as the book's voice: give it the whole
    # book's, so its pieces are the whole book's at speed 1
    done = invoke("book", out.parent / "small-sea.epub", "--output-dir", fast, "--chapters", "2",
                  "--speed", "2", "--prompt-audio", out / "book-voice.wav", *TINY)
    assert done.exit_code == 0, done.output
    for stem in IDS[3:6]:
        frames = sf.info(str(out / PIECES / f"{stem}.wav")).frames
        assert sf.info(str(fast / PIECES / f"{stem}.wav")).frames == round(frames / 2)
    (chapter,) = (fast / "chapters").glob("*.wav")
    pieces = [sf.info(str(fast / PIECES / f"{stem}.wav")).frames for stem in IDS[3:6]]
    assert sf.info(str(chapter)).frames == sum(pieces) + 2 * PAUSE_FRAMES * SPF


def test_two_shards_make_the_same_book(whole, invoke, tmp_path):
    out, _ = whole
    shards = tmp_path / "shards"
    owned = {k: [i for i in IDS if shard_of(i, 2) == k] for k in (1, 2)}
    assert owned[1] and owned[2]
    extra = [] if HAS_AV else ["--no-m4b"]
    first = invoke("book", out.parent / "small-sea.epub", "--output-dir", shards, "--shard",
                   "1/2", *TINY, *extra)
    assert first.exit_code == 0, first.output
    assert f"{len(owned[1])} written, 0 skipped" in first.stderr
    assert not (shards / "book.srt").exists()  # shard 2's pieces are missing yet
    second = invoke("book", out.parent / "small-sea.epub", "--output-dir", shards, "--shard",
                    "2/2", *TINY, *extra)
    assert second.exit_code == 0, second.output
    lines = {k: [r["id"] for r in read_lines(shards / PIECES / f"results.shard-{k}-of-2.jsonl")]
             for k in (1, 2)}
    assert {k: sorted(v) for k, v in lines.items()} == owned
    for name in ["book.srt", "book.json", *(["book.m4b"] if HAS_AV else []),
                 *(f"chapters/{p.name}" for p in (out / "chapters").iterdir())]:
        assert (shards / name).read_bytes() == (out / name).read_bytes() or name == "book.json"
    assert json.loads((shards / "book.json").read_text())["chapters"] == json.loads(
        (out / "book.json").read_text())["chapters"]


@pytest.mark.slow
def test_kill_9_then_the_same_command_writes_each_piece_once(whole, base_env, tmp_path):
    out, _ = whole
    args = [out.parent / "small-sea.epub", "--output-dir", tmp_path / "book", *TINY,
            *([] if HAS_AV else ["--no-m4b"])]
    pieces = tmp_path / "book" / PIECES
    proc = subprocess.Popen([str(ENTRY_POINT), "book", *map(str, args)], cwd=tmp_path,
                            env=base_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and len(list(pieces.glob("*.wav"))) < 2:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    kept = {p.name: p.stat().st_mtime_ns for p in pieces.glob("*.wav")}
    assert 2 <= len(kept) < len(IDS), "the run must be killed mid-book"
    voice = (tmp_path / "book" / "book-voice.wav").stat().st_mtime_ns
    again = _run(args, base_env, tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"{len(IDS) - len(kept)} written, {len(kept)} skipped, 0 failed" in again.stderr
    after = {p.name: p.stat().st_mtime_ns for p in pieces.glob("*.wav")}
    assert sorted(after) == [f"{i}.wav" for i in IDS]
    assert all(after[name] == mtime for name, mtime in kept.items())  # not written again
    assert (tmp_path / "book" / "book-voice.wav").stat().st_mtime_ns == voice  # the same voice
    assert Counter(r["id"] for r in read_lines(pieces / "results.jsonl")) == Counter(IDS)
    for name in ["book.srt", *(["book.m4b"] if HAS_AV else [])]:  # the book it would have been
        assert (tmp_path / "book" / name).read_bytes() == (out / name).read_bytes()


@pytest.mark.slow
def test_a_stop_after_chapter_1_leaves_chapter_1(whole, base_env, tmp_path):
    """Each chapter (and its captions) is written as soon as its pieces are done: a run
    killed after chapter 1 leaves chapter 1's file, the same bytes as the whole run's, and the
    same command again keeps it (before: nothing under chapters/ until the run's end)."""
    out, _ = whole
    folder = tmp_path / "book"
    args = [out.parent / "small-sea.epub", "--output-dir", folder, *TINY,
            *([] if HAS_AV else ["--no-m4b"])]
    first = folder / "chapters" / "001-The_Harbour.wav"
    proc = subprocess.Popen([str(ENTRY_POINT), "book", *map(str, args)], cwd=tmp_path,
                            env=base_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None and not (
            folder / "book.json").exists():  # written last, after the chapter's files
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run must be stopped mid-book"
    done = sorted(p.stem for p in (folder / PIECES).glob("*.wav"))
    assert done[:3] == IDS[:3] and len(done) < len(IDS), "the run must be stopped mid-book"
    assert first.read_bytes() == (out / "chapters" / first.name).read_bytes()
    for caption in ("srt", "vtt"):
        path = first.with_suffix(f".{caption}")
        assert path.read_bytes() == (out / "chapters" / path.name).read_bytes()
    srt = first.with_suffix(".srt").read_text()
    assert srt.startswith("1\n00:00:00,000 --> ") and srt.count(" --> ") == 3
    assert not (folder / "book.srt").exists()
    record = json.loads((folder / "book.json").read_text())
    assert record["chapters"][0]["file"] == f"chapters/{first.name}" and not record["complete"]
    kept = first.stat().st_mtime_ns
    again = _run(args, base_env, tmp_path)
    assert again.returncode == 0, again.stderr
    assert first.stat().st_mtime_ns == kept  # not written again
    assert sorted(p.name for p in (folder / "chapters").iterdir()) == sorted(
        p.name for p in (out / "chapters").iterdir())


def test_a_run_refused_by_the_folder_lock_writes_nothing(invoke, tmp_path):
    """Nothing is written before the folder lock is held: a book run refused by it (another
    run reads into the folder) leaves book-items.jsonl as it was and reads no voice (before:
    the items file was rewritten first, so `status` then judged the folder by other items)."""
    import fcntl

    folder = tmp_path / "book"
    (folder / PIECES).mkdir(parents=True)
    items = folder / "book-items.jsonl"
    items.write_bytes(b'{"id": "c001-p0001", "text": "Other.", "seed": 1, "task": "tts_sft"}\n')
    before = _files(folder)
    with open(folder / PIECES / ".mimo-tts.lock", "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another run holds the folder
        held.write(b"4242")
        held.flush()
        done = invoke("book", _book(tmp_path), "--output-dir", folder, *TINY, "--no-m4b")
    assert done.exit_code == EXIT_IO, done.output
    assert "another mimo-tts run (pid 4242) is writing to" in error_line(done.stderr)
    assert _files(folder) == before and items.read_bytes().startswith(b'{"id": "c001-p0001", '
                                                                      b'"text": "Other."')


@pytest.mark.parametrize("make, args, code, words", [
    (lambda p: p.write_bytes(b"not a zip"), (), EXIT_INPUT, "is not a readable EPUB"),
    (lambda p: write_epub(p, encryption=encryption_xml("OEBPS/text/chap2.xhtml")), (),
     EXIT_INPUT, "is DRM-protected"),
    (lambda p: write_epub(p, [("Cover only", None, [])]), (), EXIT_INPUT, "has no text to read"),
    (write_epub, ("--chapters", "4"), EXIT_USAGE, "--chapters 4: the book has 3 chapters"),
    (write_epub, ("--chapters", "2-x"), EXIT_USAGE, "--chapters takes numbers and ranges"),
])
def test_bad_input_is_one_line_an_exit_code_and_nothing_written(invoke, tmp_path, make, args,
                                                                code, words):
    path = tmp_path / "bad.epub"
    make(path)
    for listing in ((), ("--list",)):
        done = invoke("book", path, "--output-dir", tmp_path / "out", *TINY, *args, *listing)
        assert done.exit_code == code, done.output
        assert words in error_line(done.stderr) and not done.stdout
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.epub"]


def test_items_out_writes_the_pieces_for_synth_and_ray(whole, invoke, tmp_path):
    out, _ = whole
    items = tmp_path / "items.jsonl"
    folder = tmp_path / "out"
    done = invoke("book", out.parent / "small-sea.epub", "--output-dir", folder,
                  "--chapters", "1,3", "--items-out", items, *TINY)
    assert done.exit_code == 0, done.output
    assert done.stdout.strip() == str(items)
    # the pieces name the book's voice, read first into the book's folder (Ray clones it)
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [
        "book-voice.json", "book-voice.wav"]
    assert (folder / "book-voice.wav").read_bytes() == (out / "book-voice.wav").read_bytes()
    lines = [json.loads(line) for line in items.read_text().splitlines()]
    whole_lines = [json.loads(line) for line in (out / "book-items.jsonl").read_text()
                   .splitlines()]
    assert {line.pop("prompt_audio") for line in lines} == {str(folder / "book-voice.wav")}
    for line in whole_lines:
        line.pop("prompt_audio")
    assert lines == whole_lines[:3] + whole_lines[6:]
    assert lines[0] == {"id": "c001-p0001", "text": "Chapter 1: The Harbour",
                        "seed": lines[0]["seed"], "task": PIECES}


def test_without_the_extra(base_env, tmp_path):
    """Without PyAV: --list works, a run naming no --no-m4b is refused (exit 2) before
    anything is written."""
    code = ("import sys; sys.modules['av'] = None; sys.argv = ['mimo-tts', *sys.argv[1:]]; "
            "from mimo_tts.cli import main; main()")
    text = tmp_path / "story.txt"
    text.write_text("Chapter 1\n\nOnce upon a time.\n\nChapter 2\n\nThe end.\n")

    def run(*args):
        return subprocess.run([sys.executable, "-c", code, "book", str(text), *args],
                              capture_output=True, text=True, env=base_env, cwd=tmp_path)

    listed = run("--list")
    assert listed.returncode == 0 and "2  Chapter 2" in listed.stdout
    refused = run("--output-dir", "out", *TINY)
    assert refused.returncode == EXIT_USAGE
    assert error_line(refused.stderr) == ("Error: writing book.m4b needs PyAV: pip install "
                                          "'mimo-tts[book]' (or give --no-m4b)")
    assert not (tmp_path / "out").exists()


def test_pause_tags_in_a_chapter_are_exact_and_the_captions_follow(invoke, tmp_path):
    """[pause:1] inside a paragraph and [pause:0.5] at its end (standing for the sentence
    silence before the next paragraph): the chapter file is its pieces (the title first) with
    exactly those zero samples between them; an untagged chapter keeps today's pauses; the
    captions hold the words without the tags, each cue after its pause."""
    import numpy as np

    book = tmp_path / "paused.md"
    book.write_text("# Paused\n\nOne here. [pause:1] Two here. [pause:0.5]\n\nThree here.\n\n"
                    "# Plain\n\nFour here. Five here.\n")
    done = invoke("book", book, "--output-dir", tmp_path / "out", "--no-m4b", *TINY)
    assert done.exit_code == 0, done.output
    out = tmp_path / "out"

    def piece(chapter, k):
        return sf.read(str(out / PIECES / f"c{chapter:03d}-p{k:04d}.wav"), dtype="int16")[0]

    first, second = (sf.read(str(p), dtype="int16")[0]
                     for p in sorted((out / "chapters").glob("*.wav")))
    gaps = (PAUSE_FRAMES * SPF, 24000, 12000)
    expected = [piece(1, 1)]
    for k, gap in zip((2, 3, 4), gaps, strict=True):
        expected += [np.zeros(gap, "int16"), piece(1, k)]
    assert np.array_equal(first, np.concatenate(expected))
    plain = [len(piece(2, k)) for k in (1, 2, 3)]
    assert len(second) == sum(plain) + 2 * PAUSE_FRAMES * SPF  # untagged: today's pauses
    srt = (out / "book.srt").read_text()
    assert "Two here." in srt and "[pause" not in srt
    blocks = [b.splitlines() for b in srt.strip().split("\n\n")]
    starts = [_srt_seconds(b[1].split(" --> ")[0]) for b in blocks]
    ends = [_srt_seconds(b[1].split(" --> ")[1]) for b in blocks]
    assert abs(starts[2] - ends[1] - 1.0) <= 0.002 and abs(starts[3] - ends[2] - 0.5) <= 0.002


def test_voice_tags_per_chapter_and_per_paragraph_name_both_speakers(invoke, tmp_path):
    """A chapter whose first paragraph opens with `[voice:natural]` (lasting to the next tag)
    and a later paragraph with its own `[voice:default]`: the chapter's VTT names both
    speakers, each on its own words (`<v NAME>`, no tag left in the text), the title before
    any tag unnamed; the next chapter starts again in the run's voice."""
    book = tmp_path / "voices.md"
    book.write_text("# Dialogue\n\n[voice:natural] Speak softly now.\n\nStill soft here.\n\n"
                    "[voice:default] One here.\n\n# Plain\n\nFour here.\n")
    done = invoke("book", book, "--output-dir", tmp_path / "out", "--no-m4b", *TINY)
    assert done.exit_code == 0, done.output
    chapters = tmp_path / "out" / "chapters"
    first, second = sorted(chapters.glob("*.vtt"))
    vtt = first.read_text()
    assert "[voice" not in vtt
    spoken = [b.splitlines()[-1] for b in vtt.strip().split("\n\n")[1:]]
    assert spoken == ["Dialogue", "<v natural>Speak softly now.", "<v natural>Still soft here.",
                      "<v default>One here."]
    assert "<v " not in second.read_text() and "Four here." in second.read_text()
    book_vtt = (tmp_path / "out" / "book.vtt").read_text()
    assert "<v natural>Speak softly now." in book_vtt and "<v default>One here." in book_vtt


def _srt_seconds(stamp: str) -> float:
    h, m, rest = stamp.split(":")
    return int(h) * 3600 + int(m) * 60 + float(rest.replace(",", "."))


@pytest.mark.parametrize("threads", [("--lm-threads", "3", "--tokenizer-threads", "2"),
                                     ("--lm-threads", "2", "--tokenizer-threads", "1")])
def test_any_thread_counts_make_the_same_book(whole, base_env, tmp_path, threads):
    """The same seed gives the same book, byte for byte, on any thread counts: the pieces,
    the chapter files, the captions and book.m4b (the whole book ran at one thread)."""
    out, _ = whole
    again = tmp_path / "out"
    done = _run([_book(tmp_path), "--output-dir", again, *TINY, *threads,
                 *([] if HAS_AV else ["--no-m4b"])], {**base_env, "OMP_NUM_THREADS": "2"},
                tmp_path)
    assert done.returncode == 0, done.stderr
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.suffix in (
        ".wav", ".m4b", ".srt", ".vtt", ".flac") and not p.name.startswith("."))
    assert len(names) >= 9 + 3 + 1  # the pieces, the chapters, the captions
    assert [n for n in names if (out / n).read_bytes() != (again / n).read_bytes()] == []
