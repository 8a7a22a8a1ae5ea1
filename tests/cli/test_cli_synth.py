"""`mimo-tts synth` end to end on the tiny preset: outputs, manifest, resume, stdin, stdout."""

from __future__ import annotations

import io
import json
import subprocess

import numpy as np
import pytest
import soundfile as sf
import torch

from mimo_tts.errors import EXIT_DEVICE
from mimo_tts.presets import ensure_tiny_preset
from mimo_tts.runtime.paths import CACHE_ENV

SPF = 960  # samples per code frame at 24 kHz (spec §1)
HELLO = "Hello from MiMo"


@pytest.fixture(scope="module")
def default_run(base_env, tmp_path_factory, entry_point):
    """The README's first command (plus --save-codes), run once through the entry point."""
    cwd = tmp_path_factory.mktemp("default-run")
    args = [str(entry_point), "synth", "--model", "tiny", "--text", HELLO, "--save-codes"]
    proc = subprocess.run(args, capture_output=True, cwd=cwd, env=base_env, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    return cwd, proc


def _only(directory, pattern):
    found = sorted(directory.glob(pattern))
    assert len(found) == 1, found
    return found[0]


def test_default_run_writes_a_playable_few_seconds_wav(default_run):
    cwd, proc = default_run
    task_dir = cwd / "output_audio" / "tts_sft"
    wav = _only(task_dir, "*.wav")
    assert wav.name.startswith("Hello_from_MiMo-")
    info = sf.info(str(wav))
    assert (info.format, info.subtype, info.samplerate, info.channels) == ("WAV", "PCM_16",
                                                                           24000, 1)
    assert 1.0 <= info.duration <= 10.0
    audio, _ = sf.read(str(wav), dtype="float32")
    assert np.isfinite(audio).all() and 0.01 < np.abs(audio).max() <= 1.0
    # data on stdout (the written path), logs on stderr
    assert proc.stdout.decode().strip() == str(wav.relative_to(cwd))
    assert "1 written" in proc.stderr.decode() and "RTF" in proc.stderr.decode()


def test_layout_header_and_960_samples_per_frame(default_run):
    cwd, _ = default_run
    task_dir = cwd / "output_audio" / "tts_sft"
    wav = _only(task_dir, "*.wav")
    stem = wav.stem
    names = {p.name for p in task_dir.iterdir()}
    assert names == {f"{stem}.wav", f"{stem}.json", f"{stem}.codes.safetensors",
                     "results.jsonl", ".mimo-tts.lock"}
    from mimo_tts.batch.files import load_codes

    pieces, meta = load_codes(task_dir / f"{stem}.codes.safetensors")
    assert len(pieces) == 1 and pieces[0].shape[0] == 8 and meta["id"] == stem
    assert sf.info(str(wav)).frames == SPF * pieces[0].shape[1]


def test_manifest_and_sidecar(default_run, manifest):
    cwd, _ = default_run
    task_dir = cwd / "output_audio" / "tts_sft"
    (line,) = manifest(task_dir)
    wav = _only(task_dir, "*.wav")
    assert line["id"] == wav.stem and line["text"] == HELLO and line["task"] == "tts_sft"
    assert line["path"] == str(wav.relative_to(cwd)) and line["status"] == "ok"
    assert line["error"] is None and line["seed"] == 0 and line["rtf"] > 0
    assert line["seconds"] == pytest.approx(sf.info(str(wav)).duration, abs=1e-3)
    sidecar = json.loads((task_dir / f"{wav.stem}.json").read_text())
    assert sidecar["runner"]["name"] == "mimo-tts" and sidecar["task"] == "tts_sft"
    assert sidecar["model"]["kind"] == "preset" and sidecar["seed"] == 0
    piece = sidecar["pieces"][0]
    assert piece["rendered_prompt"].startswith("<|im_start|>user\n")
    assert piece["rendered_prompt"].endswith("<|im_start|>assistant\n<|sostm|>")
    assert HELLO in piece["rendered_prompt"] and piece["template_index"] in range(10)
    assert sidecar["placement"]["tokenizer_device"] == {"value": "cpu", "source": "default"}
    assert sidecar["effective_sampler"]["text"]["temperature"] == 0.6
    assert {"load_s", "generate_s", "decode_s"} <= set(sidecar["timings"])
    assert sidecar["result"]["key"] == line["key"]
    gemm = (sidecar["engine"].pop("tokenizer_gemm"), sidecar["engine"].pop("tokenizer_gemm_engine"),
            sidecar["engine"].pop("tokenizer_gemm_reason"))
    # how the float32 tokenizer's linears were packed, measured per machine
    assert gemm[0] == (gemm[1] is not None) and gemm[1] in (None, "bf16x3", "onednn") and gemm[2]
    fused = (sidecar["engine"].pop("tokenizer_attention_fused"),
             sidecar["engine"].pop("tokenizer_attention_reason"))
    assert isinstance(fused[0], bool) and fused[1].startswith("auto: ")  # measured per machine
    assert sidecar["engine"] == {"name": "native", "cpu_kernel": False,  # float32: eager
                                 "cpu_kernel_reason": "auto: float32 weights run faster in "
                                                      "eager PyTorch",
                                 "prefill_products": "PyTorch's products (not bfloat16)"}


def test_bfloat16_lm_records_the_fused_cpu_kernel(invoke, tmp_path):
    """A bfloat16 LM on CPU runs its patch decoder in the fused kernel where the CPU has
    AVX512-BF16; the sidecar says which path ran, and the audio is finite either way."""
    from mimo_tts.lm import cpu_kernel

    result = invoke("synth", "--model", "tiny", "--text", "Kernel.", "--dtype", "bfloat16",
                    "--max-new-groups", "4", "--json")
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    sidecar = json.loads((tmp_path / record["path"]).with_suffix(".json").read_text())
    assert sidecar["engine"]["cpu_kernel"] == cpu_kernel.features()["avx512_bf16"]
    assert sidecar["engine"]["cpu_kernel_reason"].startswith("auto: ")
    audio, _ = sf.read(str(tmp_path / record["path"]), dtype="float32")
    assert audio.size > 0 and np.isfinite(audio).all()


def test_bad_cpu_kernel_setting_is_a_one_line_usage_error(invoke, tmp_path):
    result = invoke("synth", "--model", "tiny", "--text", "Kernel.", "--dtype", "bfloat16",
                    env={"MIMO_TTS_CPU_KERNEL": "fast"})
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "MIMO_TTS_CPU_KERNEL='fast'" in lines[0]
    assert not list(tmp_path.rglob("*.wav"))


@pytest.mark.slow
def test_saved_codes_decode_to_the_same_audio(default_run, mimo):
    cwd, _ = default_run
    task_dir = cwd / "output_audio" / "tts_sft"
    wav = _only(task_dir, "*.wav")
    codes = task_dir / f"{wav.stem}.codes.safetensors"
    out = cwd / "decoded.wav"
    proc = mimo("decode", codes, "-o", out, "--tokenizer", "tiny", "--tokenizer-device", "cpu")
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().strip() == str(out)
    assert out.read_bytes() == wav.read_bytes()


def test_decode_that_cannot_fit_exits_4_before_loading(default_run, mimo):
    """decode loads the tokenizer through the loader's memory preflight, as synth does."""
    cwd, _ = default_run
    codes = _only(cwd / "output_audio" / "tts_sft", "*.codes.safetensors")
    out = cwd / "refused.wav"
    proc = mimo("decode", codes, "-o", out, "--tokenizer", "tiny", "--tokenizer-device", "cpu",
                env={"MIMO_TTS_AVAILABLE_MEMORY": "200MiB"})
    assert proc.returncode == EXIT_DEVICE, proc.stderr.decode()
    lines = proc.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: not enough memory on cpu"), lines
    assert proc.stdout == b"" and not out.exists()
    forced = mimo("decode", codes, "-o", out, "--tokenizer", "tiny", "--tokenizer-device", "cpu",
                  "--no-memory-check", env={"MIMO_TTS_AVAILABLE_MEMORY": "200MiB"})
    assert forced.returncode == 0, forced.stderr.decode()
    assert out.read_bytes() == _only(codes.parent, "*.wav").read_bytes()


def test_rerun_skips_and_loads_nothing(default_run, mimo, manifest):
    cwd, _ = default_run
    task_dir = cwd / "output_audio" / "tts_sft"
    wav = _only(task_dir, "*.wav")
    before = (wav.stat().st_mtime_ns, wav.read_bytes())
    proc = mimo("synth", "--model", "tiny", "--text", HELLO, "--save-codes", "--json", cwd=cwd)
    assert proc.returncode == 0, proc.stderr.decode()
    (record,) = [json.loads(x) for x in proc.stdout.decode().splitlines()]
    assert record["status"] == "skipped" and "1 skipped" in proc.stderr.decode()
    assert (wav.stat().st_mtime_ns, wav.read_bytes()) == before
    assert "load" not in proc.stderr.decode()  # nothing was loaded
    assert len(manifest(task_dir)) == 1


def test_b_a_rerun_prints_the_paths_of_skipped_items_too(invoke, tmp_path):
    """`f=$(mimo-tts synth ...)` works on every run, not only the first."""
    lines = tmp_path / "lines.txt"
    lines.write_text("First line.\nSecond line.\n")
    args = ("synth", "--model", "tiny", "--max-new-groups", "2")
    first = invoke(*args, "--input", lines)
    assert first.exit_code == 0 and len(first.stdout.splitlines()) == 2
    again = invoke(*args, "--input", lines)
    assert again.exit_code == 0 and "0 written, 2 skipped" in again.stderr
    assert again.stdout == first.stdout  # was: empty
    listed = invoke(*args, "--input", lines, "--json").stdout.splitlines()
    as_json = [json.loads(x) for x in listed]
    assert [(r["status"], r["path"]) for r in as_json] == [
        ("skipped", p) for p in first.stdout.splitlines()]
    one = invoke(*args, "--text", "Hi.", "-o", tmp_path / "hi.wav")
    assert invoke(*args, "--text", "Hi.", "-o", tmp_path / "hi.wav").stdout == one.stdout \
        == f"{tmp_path / 'hi.wav'}\n"


def test_a_continuous_rerun_with_every_item_done_loads_nothing(invoke, tmp_path):
    args = ("synth", "--model", "tiny", "--max-new-groups", "2", "--batch-size", "3",
            "--text", "One two.", "--text", "Three four.")
    first = invoke(*args)
    assert first.exit_code == 0, first.stderr
    again = invoke(*args)  # was: exit 1, "unexpected AttributeError" (no engine to run)
    assert again.exit_code == 0 and "0 written, 2 skipped, 0 failed" in again.stderr
    assert again.stdout == first.stdout


def test_text_file_batch_resume_and_overwrite(invoke, tmp_path, manifest):
    lines = tmp_path / "lines.txt"
    lines.write_text("First line.\n\nSecond line.\n", encoding="utf-8")
    args = ["synth", "--model", "tiny", "--input", lines, "--max-new-groups", "3", "--json"]
    first = invoke(*args)
    assert first.exit_code == 0, first.stderr
    task_dir = tmp_path / "output_audio" / "tts_sft"
    records = manifest(task_dir)
    assert [json.loads(x) for x in first.stdout.splitlines()] == records
    assert [r["text"] for r in records] == ["First line.", "Second line."]
    assert [r["source"] for r in records] == ["lines.txt:1", "lines.txt:3"]
    for record in records:
        assert sf.info(str(tmp_path / record["path"])).frames == SPF * 4 * 3  # 3 groups
    mtimes = {p: p.stat().st_mtime_ns for p in task_dir.glob("*.wav")}
    again = invoke(*args)
    assert again.exit_code == 0
    assert [json.loads(x)["status"] for x in again.stdout.splitlines()] == ["skipped"] * 2
    assert {p: p.stat().st_mtime_ns for p in task_dir.glob("*.wav")} == mtimes
    redo = invoke(*args, "--overwrite")
    assert [json.loads(x)["status"] for x in redo.stdout.splitlines()] == ["ok"] * 2
    assert len(manifest(task_dir)) == 2  # one line per item, still
    changed = invoke(*args, "--max-new-groups", "4")  # other inputs: new keys, same ids
    assert changed.exit_code == 5  # both items failed with the same I/O error
    assert all("use --overwrite" in json.loads(x)["error"] for x in changed.stdout.splitlines())
    seeded = invoke(*args, "--seed", "3")  # another seed: other derived ids, other files
    assert [json.loads(x)["status"] for x in seeded.stdout.splitlines()] == ["ok"] * 2
    assert len(list(task_dir.glob("*.wav"))) == 4


def test_jsonl_batch_with_bad_lines_is_a_partial_failure(invoke, tmp_path, manifest):
    batch = tmp_path / "batch.jsonl"
    rows = [{"id": "../../escape", "text": "Good one.", "seed": 7},
            {"id": "empty", "text": "   "},
            {"id": "ok2", "text": "Another good one."}]
    batch.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken\n", encoding="utf-8")
    result = invoke("synth", "--model", "tiny", "--input", batch, "--max-new-groups", "2",
                    "--output-dir", "out")
    assert result.exit_code == 8, result.stderr
    task_dir = tmp_path / "out" / "tts_sft"
    assert sorted(p.name for p in task_dir.glob("*.wav")) == ["escape.wav", "ok2.wav"]
    assert not (tmp_path.parent / "escape.wav").exists()
    by_id = {r["id"]: r for r in manifest(task_dir)}
    assert by_id["escape"]["seed"] == 7 and by_id["escape"]["source_id"] == "../../escape"
    assert by_id["empty"]["status"] == "error" and by_id["empty"]["exit_code"] == 9
    assert "batch.jsonl:2: empty text" in by_id["empty"]["error"]
    assert by_id["line-00004"]["exit_code"] == 9
    assert "malformed JSON" in by_id["line-00004"]["error"]
    assert "failed empty" in result.stderr and "2 written" in result.stderr
    assert "2 failed" in result.stderr
    assert result.stdout.splitlines() == [str(task_dir.relative_to(tmp_path) / "escape.wav"),
                                          str(task_dir.relative_to(tmp_path) / "ok2.wav")]


@pytest.mark.slow
def test_stdin_items(mimo, tmp_path, manifest):
    proc = mimo("synth", "--model", "tiny", "--input", "-", "--max-new-groups", "2", "--json",
                input="From a pipe.\nSecond piped line.\n")
    assert proc.returncode == 0, proc.stderr.decode()
    records = [json.loads(x) for x in proc.stdout.decode().splitlines()]
    assert [r["source"] for r in records] == ["stdin:1", "stdin:2"]
    assert [r["status"] for r in records] == ["ok", "ok"]
    assert manifest(tmp_path / "output_audio" / "tts_sft") == records


def test_piped_text_without_flags_is_read_as_input_dash(base_env, entry_point, tmp_path):
    """`echo text | mimo-tts synth`: a real pipe into the console script, no --text/--input;
    the same items, ids and bytes as `--input -`; an empty pipe still says what to give."""
    args = [str(entry_point), "synth", "--model", "tiny", "--max-new-groups", "2", "--json"]
    runs = {}
    for name, extra in (("piped", []), ("dash", ["--input", "-"])):
        with subprocess.Popen(args + ["--output-dir", name] + extra, cwd=tmp_path, env=base_env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) as proc:
            out, err = proc.communicate(b"Piped in.\nA second line.\n", timeout=300)
        assert proc.returncode == 0, err.decode()
        runs[name] = [json.loads(line) for line in out.decode().splitlines()]
    assert [r["source"] for r in runs["piped"]] == ["stdin:1", "stdin:2"]
    for piped, dash in zip(runs["piped"], runs["dash"], strict=True):
        assert piped["id"] == dash["id"]
        assert (tmp_path / piped["path"]).read_bytes() == (tmp_path / dash["path"]).read_bytes()
    empty = subprocess.run(args, cwd=tmp_path, env=base_env, input=b"", capture_output=True,
                           timeout=300)
    assert empty.returncode == 2 and b"pipe text to stdin" in empty.stderr


@pytest.mark.slow
def test_wav_to_stdout_with_logs_on_stderr(mimo, tmp_path):
    proc = mimo("synth", "--model", "tiny", "--text", "To stdout.", "-o", "-",
                "--max-new-groups", "2", "-v")
    assert proc.returncode == 0, proc.stderr.decode()
    audio, rate = sf.read(io.BytesIO(proc.stdout), dtype="float32")
    assert rate == 24000 and audio.shape == (SPF * 8,)
    assert "loaded models" in proc.stderr.decode()
    assert not (tmp_path / "output_audio").exists()


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "max_error"), [("incremental", 0.03), ("official", 0.015)])
def test_stream_raw_pcm_to_stdout(mimo, invoke, tmp_path, mode, max_error):
    args = ["synth", "--model", "tiny", "--text", "Streamed.", "--max-new-groups", "12"]
    streamed = mimo(*args, "--stream", "--raw", "--stream-mode", mode)
    assert streamed.returncode == 0, streamed.stderr.decode()
    pcm = np.frombuffer(streamed.stdout, "<i2")
    assert pcm.size == SPF * 4 * 12
    one_shot = invoke(*args, "-o", "-")
    reference, _ = sf.read(io.BytesIO(one_shot.stdout_bytes), dtype="float32")
    # Streaming differs slightly from one-shot decode: GroupNorm statistics of the frames so
    # far (incremental) or of the re-decoded window (official), relative to the peak.
    peak = np.abs(reference).max()
    assert peak > 0.01
    assert np.abs(pcm / 32767.0 - reference).max() < max_error * peak


def test_stream_to_file_matches_codes(invoke, tmp_path):
    result = invoke("synth", "--model", "tiny", "--text", "Stream to a file.", "--stream",
                    "--max-new-groups", "7", "--save-codes", "--json")
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    from mimo_tts.batch.files import load_codes

    pieces, _ = load_codes(tmp_path / record["codes_path"])
    assert sf.info(str(tmp_path / record["path"])).frames == SPF * pieces[0].shape[1] == SPF * 28


def test_split_long_text_joins_pieces_with_a_pause(invoke, tmp_path):
    text = "First sentence here. Second sentence here."
    result = invoke("synth", "--model", "tiny", "--text", text, "--max-chars", "25",
                    "--max-new-groups", "2", "--save-codes", "--json")
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    from mimo_tts.batch.files import load_codes
    from mimo_tts.synthesis.audio import PAUSE_FRAMES

    pieces, meta = load_codes(tmp_path / record["codes_path"])
    assert len(pieces) == 2 and meta["pause_frames"] == PAUSE_FRAMES
    assert len(record["generated_text_ids"]) == 2
    assert sf.info(str(tmp_path / record["path"])).frames == SPF * (8 + PAUSE_FRAMES + 8)


def test_format_and_sample_rate(invoke, tmp_path):
    result = invoke("synth", "--model", "tiny", "--text", "Flac output.", "--format", "flac",
                    "--sample-rate", "16000", "--max-new-groups", "2", "-q")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""  # --quiet: the data stays on stdout
    (flac,) = (tmp_path / "output_audio" / "tts_sft").glob("*.flac")
    assert result.stdout == f"{flac.relative_to(tmp_path)}\n"
    info = sf.info(str(flac))
    assert (info.format, info.samplerate, info.frames) == ("FLAC", 16000, 8 * 640)


def test_version_and_help():
    from typer.testing import CliRunner

    from mimo_tts import __version__
    from mimo_tts.cli.app import app

    runner = CliRunner()
    assert runner.invoke(app, ["--version"]).stdout.strip() == f"mimo-tts {__version__}"
    help_text = runner.invoke(app, ["synth", "--help"], env={"COLUMNS": "200"}).stdout
    for panel in ("Inputs", "Models", "Devices", "Generation", "Outputs", "Run", "Examples"):
        assert panel in help_text
    bare = runner.invoke(app, [])
    assert "synth" in bare.stdout and "selftest" in bare.stdout


def test_streamed_piece_matches_one_shot_codes(tiny_cache):
    """Streaming Stage-1 (the speech worker, a streamed job): same codes, audio close to
    one-shot decode."""
    import torch

    import mimo_tts
    from mimo_tts.synthesis.options import SynthesisOptions
    from mimo_tts.synthesis.worker import Chunk, Done, SpeechJob

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lm_dir, tok_dir = ensure_tiny_preset(
            {CACHE_ENV: str(tiny_cache)})
        tts = mimo_tts.load(str(lm_dir), str(tok_dir), lm_device="cpu", tokenizer_device="cpu")
        options = SynthesisOptions(max_new_groups=12, stream_chunk_groups=2)
        (prompt,) = tts.prompts("Streaming check.", options, 0)
        generation = options.generation_options(0)
        runs = {}
        for decode in ("stream", "whole"):
            worker = tts.worker(1, stream=decode == "stream", schedule=("incremental", 2, None))
            runs[decode] = list(worker.run([SpeechJob(prompt, generation, 0, decode=decode)]))
    finally:
        torch.set_num_threads(threads)
    piece, reference = runs["stream"][-1].piece, runs["whole"][-1].piece
    assert isinstance(runs["stream"][-1], Done) and isinstance(runs["whole"][-1], Done)
    assert torch.equal(piece.codes, reference.codes) and piece.note is None
    one_shot = reference.audio.cpu()
    streamed = torch.cat([e.samples for e in runs["stream"] if isinstance(e, Chunk)])
    assert streamed.shape == one_shot.shape == (SPF * reference.codes.shape[1],)
    assert torch.equal(streamed, piece.audio)
    assert (streamed - one_shot).abs().max() < 0.03 * one_shot.abs().max()  # as above


def test_int8_lm_is_opt_in_and_recorded(invoke, tmp_path):
    """--lm-quant int8 runs (finite audio) and the sidecar says so; a bad value is exit 2."""
    result = invoke("synth", "--model", "tiny", "--text", "Quant.", "--dtype", "bfloat16",
                    "--lm-quant", "int8", "--max-new-groups", "4", "--json")
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    sidecar = json.loads((tmp_path / record["path"]).with_suffix(".json").read_text())
    assert sidecar["engine"]["lm_quant"] == "int8"
    audio, _ = sf.read(str(tmp_path / record["path"]), dtype="float32")
    assert audio.size > 0 and np.isfinite(audio).all()
    bad = invoke("synth", "--model", "tiny", "--text", "Quant.", "--lm-quant", "int4")
    assert bad.exit_code == 2 and "--lm-quant must be one of int8" in bad.stderr


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0", "--audio-temperature", "0"]],
                         ids=["sampled", "greedy"])
def test_continuous_batch_writes_each_items_single_run_audio(invoke, tmp_path, sampling):
    """--batch-size 3 (a continuous batch: rows refilled as pieces stop) gives every item,
    whatever its length, seed or neighbours, the wav bytes of its run at --batch-size 1."""
    rows = [{"id": "a", "text": "Three. Short. Pieces.", "seed": 1},
            {"id": "b", "text": "A longer line of one piece.", "seed": 2},
            {"id": "c", "text": "Same seed. Other text.", "seed": 2},
            {"id": "d", "text": "Default seed."}]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    outputs = {}
    for size in (1, 3):
        result = invoke("synth", "--model", "tiny", "--input", batch, "--max-chars", "14",
                        "--max-new-groups", "5", "--batch-size", size, "--output-dir",
                        f"out{size}", "--json", *sampling)
        assert result.exit_code == 0, result.stderr
        records = [json.loads(x) for x in result.stdout.splitlines()]
        assert [r["id"] for r in records] == [r["id"] for r in rows]  # input order
        outputs[size] = {r["id"]: ((tmp_path / r["path"]).read_bytes(),
                                   [len(p) for p in r["generated_text_ids"]]) for r in records}
    assert outputs[3] == outputs[1]
    pieces = [len(p) for _, p in outputs[1].values()]
    assert sum(pieces) > 3 and len(set(pieces)) > 1, pieces  # refills; items of 1-3 pieces


def test_speed_stretches_the_audio_and_keeps_the_codes(invoke, tmp_path):
    """--speed 2: the same codes as speed 1 (stretched after Stage-1), half the samples, its
    own resume key; --speed 1 is today's run, byte for byte, key included."""
    args = ["synth", "--model", "tiny", "--text", "Faster now.", "--max-new-groups", "4",
            "--save-codes", "--json"]
    runs = {}
    for name, extra in (("plain", []), ("one", ["--speed", "1"]), ("fast", ["--speed", "2"])):
        result = invoke(*args, "--output-dir", name, *extra)
        assert result.exit_code == 0, result.stderr
        runs[name] = json.loads(result.stdout)
    plain, one, fast = (runs[n] for n in ("plain", "one", "fast"))
    assert (tmp_path / plain["path"]).read_bytes() == (tmp_path / one["path"]).read_bytes()
    assert plain["key"] == one["key"] != fast["key"]
    from mimo_tts.batch.files import load_codes

    codes = [load_codes(tmp_path / r["codes_path"])[0] for r in (plain, fast)]
    assert all(torch.equal(a, b) for a, b in zip(*codes, strict=True))
    assert fast["id"] != plain["id"] == one["id"]  # its own file: the id says the speed
    frames = sf.info(str(tmp_path / plain["path"])).frames
    assert sf.info(str(tmp_path / fast["path"])).frames == round(frames / 2)
    sidecar = json.loads((tmp_path / fast["path"]).with_suffix(".json").read_text())
    assert sidecar["speed"] == 2.0 and "speed" not in json.loads(
        (tmp_path / plain["path"]).with_suffix(".json").read_text())
    bad = invoke(*args, "--speed", "5")
    assert bad.exit_code == 2 and "--speed must be in [0.25, 4]" in bad.stderr


def _silent_runs(samples: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of each run of exact zeros in `samples`."""
    zero = np.concatenate([[False], samples == 0, [False]])
    edges = np.flatnonzero(np.diff(zero.astype(np.int8)))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def test_pauses_are_the_asked_samples_and_the_captions_follow(invoke, tmp_path):
    """[pause:1.5] between two sentences, <break> in SSML, --sentence-silence: the silence in the
    file is exactly the asked samples, the cues start after it, and `decode` of the codes file
    (its pause_samples) gives the same file byte for byte."""
    base = ["synth", "--model", "tiny", "--max-new-groups", "4", "--save-codes", "--json",
            "--captions", "vtt", "--format", "wav-float"]
    cases = {"tag": (["--text", "One here. [pause:1.5] Two here. [pause:250ms]"],
                     (0, 36000, 6000)),
             "ssml": (["--text", '<speak>One here.<break time="500ms"/> Two here.</speak>'],
                      (0, 12000, 0)),
             "silence": (["--text", "One here. Two here.", "--sentence-silence", "1"],
                         (0, 24000, 0))}
    for name, (args, pauses) in cases.items():
        result = invoke(*base, *args, "--output-dir", name)
        assert result.exit_code == 0, result.stderr
        out = json.loads(result.stdout)
        wav = tmp_path / out["path"]
        samples, rate = sf.read(str(wav), dtype="float32")
        sidecar = json.loads(wav.with_suffix(".json").read_text())
        cues = sidecar["captions"]["cues"]
        assert len(cues) == 2 and rate == 24000
        lengths = [c["end_sample"] - c["start_sample"] for c in cues]
        assert cues[0]["start_sample"] == pauses[0]
        assert cues[1]["start_sample"] == cues[0]["end_sample"] + pauses[1]
        assert len(samples) == sum(lengths) + sum(pauses)
        gap = samples[cues[0]["end_sample"]:cues[1]["start_sample"]]
        assert len(gap) == pauses[1] and not gap.any()
        assert not samples[len(samples) - pauses[2]:].any()
        assert sidecar["audio"]["pause_samples"] == list(pauses)
        decoded = invoke("decode", "--tokenizer", "tiny", "--format", "wav-float",
                         str(tmp_path / out["codes_path"]), "-o", f"{name}.decoded.wav")
        assert decoded.exit_code == 0, decoded.stderr
        assert (tmp_path / f"{name}.decoded.wav").read_bytes() == wav.read_bytes()


@pytest.mark.parametrize(("text", "named"), [
    ("<speak>Hi <emphasis>there</emphasis></speak>", "SSML tag <emphasis> is not supported"),
    ("Hi [pause:x] there", "[pause:x]")])
def test_a_bad_tag_is_a_one_line_usage_error_before_loading(invoke, tmp_path, text, named):
    result = invoke("synth", "--model", "tiny", "--text", text)
    assert result.exit_code == 2 and named in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "output_audio").exists()


def test_another_speed_or_silence_of_the_same_text_is_its_own_file(invoke, tmp_path):
    """A speed-1 run, then --speed 1.5 and --sentence-silence 0.5 of the same text into the same
    folder: each writes its own file (the id carries what differs), never exit 5; the same
    command again skips."""
    args = ["synth", "--model", "tiny", "--text", "Same words.", "--max-new-groups", "3",
            "--json"]
    ids = set()
    for extra in ([], ["--speed", "1.5"], ["--sentence-silence", "0.5"], ["--speed", "1.5"]):
        result = invoke(*args, *extra)
        assert result.exit_code == 0, result.stderr
        ids.add(json.loads(result.stdout)["id"])
    assert len(ids) == 3
    assert len(list((tmp_path / "output_audio" / "tts_sft").glob("*.wav"))) == 3
