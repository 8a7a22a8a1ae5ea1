"""`mimo-tts voices add/list/show/rm` and `synth --voice` on the tiny preset."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf

from mimo_tts.errors import EXIT_INPUT, EXIT_USAGE

TINY = ("--model", "tiny")


@pytest.fixture
def store(tmp_path, monkeypatch):
    root = tmp_path / "voices"
    monkeypatch.setenv("MIMO_TTS_VOICES_DIR", str(root))
    rng = np.random.default_rng(0)
    sf.write(str(tmp_path / "voice.wav"), (0.1 * rng.standard_normal(16000)).astype("float32"),
             16000)
    return root


def test_add_list_show_rm(invoke, store, tmp_path):
    added = invoke("voices", "add", "me", "voice.wav", *TINY, "--transcript", "a test")
    assert added.exit_code == 0, added.stderr
    assert added.stdout.strip() == str(store / "me.json")
    assert sorted(p.name for p in store.iterdir()) == [".voices.lock", "me.json",
                                                       "me.safetensors"]
    listed = invoke("voices", "list", "--json")
    (record,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert record["name"] == "me" and record["transcript"] == "a test"
    assert record["source"]["seconds"] == 1.0 and record["tokenizer"]["name"] == "tiny"
    shown = json.loads(invoke("voices", "show", "me").stdout)
    assert shown == record
    again = invoke("voices", "add", "me", "voice.wav", *TINY)
    assert again.exit_code == EXIT_USAGE and "--overwrite" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    assert invoke("voices", "add", "me", "voice.wav", *TINY, "--overwrite").exit_code == 0
    assert invoke("voices", "rm", "me").exit_code == 0
    assert sorted(p.name for p in store.iterdir()) == [".voices.lock"]
    gone = invoke("voices", "show", "me")
    assert gone.exit_code == EXIT_INPUT and "unknown voice 'me'" in gone.stderr


def test_synth_voice_is_byte_identical_to_prompt_audio(invoke, store, tmp_path):
    assert invoke("voices", "add", "me", "voice.wav", *TINY).exit_code == 0
    by_name = invoke("synth", *TINY, "-t", "Hello there.", "--voice", "me", "-o", "a.wav",
                     "--seed", "3")
    assert by_name.exit_code == 0, by_name.stderr
    by_file = invoke("synth", *TINY, "-t", "Hello there.", "--task", "tts_sft_with_audio",
                     "--prompt-audio", "voice.wav", "-o", "b.wav", "--seed", "3")
    assert by_file.exit_code == 0, by_file.stderr
    assert (tmp_path / "a.wav").read_bytes() == (tmp_path / "b.wav").read_bytes()
    sidecar = json.loads((tmp_path / "a.json").read_text())
    assert sidecar["task"] == "tts_sft_with_audio" and sidecar["voice"]["name"] == "me"


def test_codes_of_another_tokenizer(invoke, store, tmp_path):
    assert invoke("voices", "add", "me", "voice.wav", *TINY).exit_code == 0
    record_path = store / "me.json"
    record = json.loads(record_path.read_text())
    record["tokenizer"] = {"id": "another", "path": "/elsewhere/tokenizer", "name": "other"}
    record_path.write_text(json.dumps(record))
    redone = invoke("synth", *TINY, "-t", "Hi.", "--voice", "me", "-o", "a.wav", "-v")
    assert redone.exit_code == 0, redone.stderr
    assert "re-encoded from its source" in redone.stderr
    (tmp_path / "voice.wav").unlink()
    refused = invoke("synth", *TINY, "-t", "Hi.", "--voice", "me", "-o", "b.wav")
    assert refused.exit_code == EXIT_INPUT
    assert "encoded by another audio tokenizer" in refused.stderr
    assert not (tmp_path / "b.wav").exists()


def test_bad_voice_inputs_are_one_line_errors(invoke, store, tmp_path):
    unknown = invoke("synth", *TINY, "-t", "Hi.", "--voice", "nobody")
    assert unknown.exit_code == EXIT_INPUT and "unknown voice 'nobody'" in unknown.stderr
    assert not (tmp_path / "output_audio").exists()
    for name in ("../x", "a/b", "", ".hidden", "x" * 65, "default"):
        bad = invoke("voices", "add", name, "voice.wav", *TINY)
        assert bad.exit_code == EXIT_USAGE, (name, bad.stderr)
        assert bad.stderr.startswith("Error:") and len(bad.stderr.strip().splitlines()) == 1
    (tmp_path / "broken.wav").write_bytes(b"RIFF\x00\x00")
    unreadable = invoke("voices", "add", "b", "broken.wav", *TINY)
    assert unreadable.exit_code == EXIT_INPUT and "unreadable" in unreadable.stderr
    assert not store.exists() or not list(store.glob("b.*"))
    assert invoke("voices", "add", "me", "voice.wav", *TINY).exit_code == 0
    (store / "me.json").write_text("{not json")
    corrupt = invoke("synth", *TINY, "-t", "Hi.", "--voice", "me")
    assert corrupt.exit_code == EXIT_INPUT and "voice 'me' is corrupt" in corrupt.stderr
    listed = invoke("voices", "list")
    assert listed.exit_code == 0 and "corrupt" in listed.stdout
    clash = invoke("synth", *TINY, "-t", "Hi.", "--voice", "me", "--prompt-audio", "voice.wav")
    assert clash.exit_code == EXIT_USAGE and "give one" in clash.stderr


FIVE = ("The first sentence is short. A second one follows it. Then a third, with a comma. "
        "The fourth asks why? And the fifth ends it!")


def _times(line: str, mark: str) -> tuple[float, float]:
    def seconds(stamp: str) -> float:
        h, m, rest = stamp.split(":")
        s, ms = rest.split(mark)
        return int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000

    start, end = line.split(" --> ")
    return seconds(start), seconds(end)


def test_captions_srt_and_vtt_for_five_sentences(invoke, tmp_path, manifest):
    result = invoke("synth", *TINY, "-t", FIVE, "--captions", "srt,vtt")
    assert result.exit_code == 0, result.stderr
    task_dir = tmp_path / "output_audio" / "tts_sft"
    (wav,) = task_dir.glob("*.wav")
    srt, vtt = wav.with_suffix(".srt").read_text(), wav.with_suffix(".vtt").read_text()
    assert vtt.startswith("WEBVTT\n\n")
    duration = sf.info(str(wav)).frames / 24000
    for text, mark in ((srt, ","), (vtt.removeprefix("WEBVTT\n\n"), ".")):
        blocks = text.strip().split("\n\n")
        assert [b.splitlines()[0] for b in blocks] == ["1", "2", "3", "4", "5"]
        spans = [_times(b.splitlines()[1], mark) for b in blocks]
        assert all(a < b for a, b in spans)
        assert all(b[0] > a[1] for a, b in zip(spans, spans[1:], strict=False))
        assert abs(spans[-1][1] - duration) <= 0.04
    sidecar = json.loads(wav.with_suffix(".json").read_text())
    cues = sidecar["captions"]["cues"]
    assert len(cues) == 5 and cues[-1]["end_sample"] == sf.info(str(wav)).frames
    (line,) = manifest(task_dir)
    assert line["captions"] == [str(wav.with_suffix(s).relative_to(tmp_path))
                                for s in (".srt", ".vtt")]


def test_cue_samples_are_in_the_output_rate(invoke, tmp_path):
    """With --sample-rate the sidecar's cue samples count the written file's samples (before:
    24 kHz samples in a 16 kHz file, the last cue ending 1.5 times past the audio); the times
    in seconds stay those of the 24 kHz run."""
    runs = {}
    for rate in (24000, 16000):
        done = invoke("synth", *TINY, "-t", FIVE, "--captions", "srt", "--sample-rate", rate,
                      "-o", f"r{rate}.wav")
        assert done.exit_code == 0, done.stderr
        sidecar = json.loads((tmp_path / f"r{rate}.json").read_text())
        runs[rate] = sidecar["captions"]["cues"]
        assert runs[rate][-1]["end_sample"] == sf.info(str(tmp_path / f"r{rate}.wav")).frames
    for fast, slow in zip(runs[24000], runs[16000], strict=True):
        for bound in ("start", "end"):
            assert slow[f"{bound}_sample"] == -(-fast[f"{bound}_sample"] * 2 // 3)
            assert abs(slow[bound] - fast[bound]) < 1e-4  # the caption files' times


def test_bad_caption_flags_are_usage_errors(invoke, tmp_path):
    for args in (("--captions", "ass"), ("--captions", "srt,srt"),
                 ("--captions", "srt", "-o", "-")):
        result = invoke("synth", *TINY, "-t", "Hi.", *args)
        assert result.exit_code == EXIT_USAGE and "--captions" in result.stderr, args
    assert not (tmp_path / "output_audio").exists()


def test_voice_tags_speak_each_span_in_its_voice_and_the_vtt_names_them(invoke, store,
                                                                        tmp_path):
    """[voice:default] then [voice:me]: one file, each span in its voice (the tagged span's
    codes are those of `--voice me` on its words alone, the other's those of the plain run),
    cues naming the speaker (WebVTT <v>); an unknown voice is a one-line exit 2 before the
    model loads."""
    import torch

    from mimo_tts.batch.files import load_codes

    assert invoke("voices", "add", "me", "voice.wav", *TINY).exit_code == 0
    text = "[voice:default] Narration here. [voice:me] Hello there."
    common = ("--seed", "3", "--max-new-groups", "5", "--save-codes")
    both = invoke("synth", *TINY, "-t", text, "-o", "both.wav", *common, "--captions", "vtt")
    assert both.exit_code == 0, both.stderr
    alone = {}
    for name, words, extra in (("narr", "Narration here.", []),
                               ("me", "Hello there.", ["--voice", "me"])):
        done = invoke("synth", *TINY, "-t", words, "-o", f"{name}.wav", *common, *extra)
        assert done.exit_code == 0, done.stderr
        alone[name] = load_codes(next(tmp_path.glob(f"{name}.*safetensors")))[0][0]
    pieces = load_codes(next(tmp_path.glob("both.*safetensors")))[0]
    assert torch.equal(pieces[0], alone["narr"]) and torch.equal(pieces[1], alone["me"])
    cues = json.loads((tmp_path / "both.json").read_text())["captions"]["cues"]
    assert [c["voice"] for c in cues] == ["default", "me"]
    assert cues[-1]["end_sample"] == sf.info(str(tmp_path / "both.wav")).frames
    vtt = (tmp_path / "both.vtt").read_text()
    assert "<v default>Narration here." in vtt and "<v me>Hello there." in vtt
    unknown = invoke("synth", *TINY, "-t", "[voice:nobody] Hi.", "--output-dir", "never")
    assert unknown.exit_code == EXIT_USAGE and "unknown voice 'nobody'" in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1 and not (tmp_path / "never").exists()


def test_status_finds_items_whose_tags_name_a_stored_voice_done(invoke, store, tmp_path):
    """Lines whose `[voice:me]` tag names a stored voice (its codes' hash joins their key):
    `status` with the same input finds them done, and missing once the voice is stored
    again from other audio (other codes: the next synth would redo them)."""
    assert invoke("voices", "add", "me", "voice.wav", *TINY).exit_code == 0
    lines = tmp_path / "lines.txt"
    lines.write_text("[voice:me] Hello there.\nPlain words. [voice:natural] Soft ones.\n")
    done = invoke("synth", *TINY, "--input", lines, "--output-dir", "out",
                  "--max-new-groups", "2")
    assert done.exit_code == 0, done.stderr

    def status():
        run = invoke("status", "out", "--input", lines, "--json")
        return run.exit_code, json.loads(run.stdout)

    code, report = status()
    assert (code, report["done"], report["missing"]) == (0, 2, []), report
    rng = np.random.default_rng(1)
    sf.write(str(tmp_path / "other.wav"), (0.1 * rng.standard_normal(16000)).astype("float32"),
             16000)
    assert invoke("voices", "add", "me", "other.wav", *TINY, "--overwrite").exit_code == 0
    code, report = status()
    assert (code, report["done"]) == (10, 1), report
    assert [m["reason"] for m in report["missing"]][0].startswith("other inputs")
