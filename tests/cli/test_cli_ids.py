"""Derived ids name what changes the audio: another seed, style or voice of one sentence is
another file in the same folder; the default command keeps its names, and outputs that earlier
versions named by the text alone are still found (issue 22, B)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import soundfile as sf

from mimo_tts.batch.items import Naming, read_items, text_id

TINY = ("synth", "--model", "tiny", "--max-new-groups", "2", "--text", "Hello there.")


def _voice(path, freq: float):
    sf.write(str(path), 0.3 * np.sin(np.arange(12000) * freq / 24000 * 2 * np.pi), 24000)
    return path


def test_b_the_id_hash_covers_seed_instruct_and_voice_and_not_only_the_text():
    assert text_id("Hello there.") == "Hello_there-95e3ac56"  # as every version named it
    assert text_id("Hello there.", seed=0) == "Hello_there-95e3ac56"
    named = {text_id("Hello there.", seed=4), text_id("Hello there.", instruct="calm"),
             text_id("Hello there.", prompt_audio="a.wav"), text_id("Hello there.", seed=5),
             text_id("Hello there.", prompt_audio="b.wav"), "Hello_there-95e3ac56"}
    assert len(named) == 6 and all(n.startswith("Hello_there-") for n in named)
    voiced = {text_id("Hello there.", voice="ann"), text_id("Hello there.", voice="bob")}
    assert len(voiced) == 2 and not voiced & named
    assert text_id("Hi", prompt_audio="a.wav", voice="ann") == text_id("Hi", prompt_audio="a.wav")
    assert text_id("Hi", prompt_audio="./v/a.wav") == text_id("Hi", prompt_audio="v/a.wav")


def test_b_a_line_seed_and_the_run_seed_name_an_item_alike(tmp_path):
    batch = tmp_path / "b.jsonl"
    batch.write_text('{"text": "Hello there.", "seed": 4}\n{"text": "Hello there."}\n'
                     '{"id": "mine", "text": "Hello there.", "seed": 4}\n')
    own, run, named = read_items([], [str(batch)], naming=Naming(seed=4))
    assert own.id == text_id("Hello there.", seed=4) != "Hello_there-95e3ac56"
    assert own.legacy_id == "Hello_there-95e3ac56" and own.error is None
    assert run.error is None and run.id == own.id + "-2"  # the same inputs twice
    assert named.id == "mine" and named.legacy_id is None  # an id given is kept as given


def test_b_other_seeds_styles_and_voices_are_other_files_in_one_folder(invoke, tmp_path):
    folder = tmp_path / "output_audio"
    first = invoke(*TINY)
    assert first.exit_code == 0, first.stderr
    assert first.stdout == "output_audio/tts_sft/Hello_there-95e3ac56.wav\n"
    seeded = invoke(*TINY, "--seed", "4")
    assert seeded.exit_code == 0, seeded.stderr  # was: exit 5, "exists from other inputs"
    assert seeded.stdout != first.stdout
    again = invoke(*TINY, "--seed", "4")
    assert again.exit_code == 0 and "0 written, 1 skipped" in again.stderr
    styles = ("--task", "tts_sft_with_instruct")
    for style in ("calm", "loud"):
        run = invoke(*TINY, *styles, "--instruct", style)
        assert run.exit_code == 0, run.stderr
    voices = ("--task", "tts_sft_with_audio")
    for name, freq in (("a.wav", 220.0), ("b.wav", 330.0)):
        run = invoke(*TINY, *voices, "--prompt-audio", _voice(tmp_path / name, freq))
        assert run.exit_code == 0, run.stderr
    assert {task: len(list((folder / task).glob("*.wav"))) for task in (
        "tts_sft", "tts_sft_with_instruct", "tts_sft_with_audio")} == {
        "tts_sft": 2, "tts_sft_with_instruct": 2, "tts_sft_with_audio": 2}


def test_two_stored_voices_reading_one_sentence_are_two_files(invoke, tmp_path, monkeypatch):
    """A voice is part of an item's identity: two stored voices reading one id-less sentence
    into one folder are two files, each skipped when run again (before: one name, and the
    second voice's run exit 5, 'exists from other inputs', or --overwrite lost the first)."""
    monkeypatch.setenv("MIMO_TTS_VOICES_DIR", str(tmp_path / "voices"))
    for name, freq in (("ann", 220.0), ("bob", 330.0)):
        made = invoke("voices", "add", name, _voice(tmp_path / f"{name}.wav", freq), "--model",
                      "tiny")
        assert made.exit_code == 0, made.stderr
    paths = {}
    for name in ("ann", "bob", "ann"):
        run = invoke(*TINY, "--voice", name)
        assert run.exit_code == 0, run.stderr
        paths.setdefault(name, run.stdout.strip())
        assert run.stdout.strip() == paths[name]
    assert paths["ann"] != paths["bob"]
    assert paths["ann"].endswith(text_id("Hello there.", voice="ann") + ".wav")
    for name in ("ann", "bob"):
        assert json.loads((tmp_path / paths[name]).with_suffix(".json").read_text())[
            "voice"]["name"] == name
    status = invoke("status", "output_audio", "--task", "tts_sft_with_audio", "--voice", "bob",
                    "--input", _line(tmp_path))
    assert status.exit_code == 0, status.stdout


def test_other_output_settings_of_one_sentence_are_their_own_files_or_a_skip(invoke, tmp_path):
    """One sentence with and then without --captions, or as wav-float then wav, into one
    folder: each keeps its own files (captions cut the text another way: another derived id;
    a float WAV is `<id>.f32.wav`), and each command again is a skip (before: the second of
    each pair was exit 5, 'exists from other inputs')."""
    runs = [("--captions", "srt"), (), ("--format", "wav-float"), ("--format", "wav")]
    paths = []
    for extra in runs:
        run = invoke(*TINY, *extra)
        assert run.exit_code == 0, run.stderr
        paths.append(run.stdout.strip())
    plain = "output_audio/tts_sft/Hello_there-95e3ac56"
    captioned = "output_audio/tts_sft/" + text_id("Hello there.", captions=True)
    assert paths == [captioned + ".wav", plain + ".wav", plain + ".f32.wav", plain + ".wav"]
    assert sorted(p.name for p in (tmp_path / "output_audio" / "tts_sft").iterdir()
                  if not p.name.startswith(".")) == sorted([
        f"{captioned.rsplit('/', 1)[1]}.{x}" for x in ("wav", "json", "srt")] + [
        f"Hello_there-95e3ac56.{x}" for x in ("wav", "json", "f32.wav", "f32.json")] + [
        "results.jsonl"])
    assert sf.info(str(tmp_path / (plain + ".f32.wav"))).subtype == "FLOAT"
    for extra in runs:
        again = invoke(*TINY, *extra)
        assert again.exit_code == 0 and "0 written, 1 skipped" in again.stderr, again.stderr
    status = invoke("status", "output_audio", "--captions", "--input", _line(tmp_path))
    assert status.exit_code == 0, status.stdout


def test_captions_in_another_format_are_written_beside_the_done_item(invoke, tmp_path):
    """--captions srt, then --captions vtt of the same item: the audio is the same (a piece per
    sentence either way), so the second run skips the synthesis and writes the .vtt from the
    sidecar's cues (before: a skip that wrote no .vtt), and lists it in its manifest line;
    the srt and the audio are left as they were; -o FILE alike."""
    first = invoke(*TINY, "--captions", "srt")
    assert first.exit_code == 0, first.stderr
    wav = tmp_path / first.stdout.strip()
    audio, srt = wav.read_bytes(), wav.with_suffix(".srt").read_bytes()
    second = invoke(*TINY, "--captions", "vtt", "--json")
    assert second.exit_code == 0 and "0 written, 1 skipped" in second.stderr, second.stderr
    vtt = wav.with_suffix(".vtt").read_text(encoding="utf-8")
    assert vtt.startswith("WEBVTT") and "Hello there." in vtt
    assert wav.read_bytes() == audio and wav.with_suffix(".srt").read_bytes() == srt
    line = json.loads(second.stdout)
    named = str(Path(first.stdout.strip()).with_suffix(".vtt"))
    assert line["status"] == "skipped" and line["captions"] == [named]
    cues = json.loads(wav.with_suffix(".json").read_text())["captions"]
    assert cues["formats"] == ["srt", "vtt"]
    both = invoke(*TINY, "--captions", "srt,vtt")
    assert both.exit_code == 0 and "0 written, 1 skipped" in both.stderr, both.stderr
    one = tmp_path / "one.wav"
    for fmt in ("srt", "vtt"):
        run = invoke(*TINY, "--captions", fmt, "-o", one)
        assert run.exit_code == 0, run.stderr
    assert one.with_suffix(".vtt").read_text(encoding="utf-8") == vtt


def _line(tmp_path):
    path = tmp_path / "line.txt"
    path.write_text("Hello there.\n")
    return path


def test_b_an_output_named_by_its_text_alone_by_an_earlier_version_is_still_skipped(
        invoke, tmp_path):
    assert invoke(*TINY, "--seed", "4").exit_code == 0
    folder = tmp_path / "output_audio" / "tts_sft"
    new = text_id("Hello there.", seed=4)
    for suffix in (".wav", ".json"):  # as an earlier version named it: by the text alone
        (folder / f"{new}{suffix}").rename(folder / f"Hello_there-95e3ac56{suffix}")
    lines = [json.loads(x) for x in (folder / "results.jsonl").read_text().splitlines()]
    (folder / "results.jsonl").write_text("".join(
        json.dumps({**r, "id": "Hello_there-95e3ac56"}) + "\n" for r in lines))
    again = invoke(*TINY, "--seed", "4", "--json")
    assert again.exit_code == 0 and "0 written, 1 skipped" in again.stderr
    (record,) = [json.loads(x) for x in again.stdout.splitlines()]
    assert record["id"] == "Hello_there-95e3ac56" and record["status"] == "skipped"
    assert not (folder / f"{new}.wav").exists()
    other = invoke(*TINY, "--seed", "5")  # the old file is another seed's: not taken for it
    assert other.exit_code == 0 and "1 written" in other.stderr
