"""Memory preflight (issue 11): estimates from headers, availability, refusal with exit 4.

The full-size checkpoints here have the published names, shapes and shard layout with sparse
data (tests/full_size.py), so the estimate and the refusal run on exactly what a user has.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mimo_tts.errors import EXIT_DEVICE, EXIT_OK, DeviceError, UsageError
from mimo_tts.runtime import machine as memory
from mimo_tts.synthesis.preflight import (
    PROMPT_GROUPS,
    RUNTIME_BYTES,
    UNLOADED,
    Lengths,
    check,
    header_numel,
    lm_need,
    plan,
    tokenizer_need,
    weights_bytes,
)
from tests.full_size import write_full_size_lm, write_full_size_tokenizer
from tests.helpers import FULL_SIZE

GIB = 2**30


@pytest.fixture(scope="module")
def full_size(tmp_path_factory):
    """(lm_dir, tokenizer_dir): the real layouts (4 bf16 shards + index; fp32 with EMA)."""
    root = tmp_path_factory.mktemp("full-size")
    lm_cfg = json.loads((FULL_SIZE / "lm-config.json").read_text())
    tok_cfg = json.loads((FULL_SIZE / "tokenizer-config.json").read_text())
    return (write_full_size_lm(root / "lm", lm_cfg),
            write_full_size_tokenizer(root / "tokenizer", tok_cfg))


def test_full_size_weights_match_the_published_sizes(full_size):
    lm, tok = full_size
    index = json.loads((lm / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 4
    params = sum(n for n, _ in header_numel(lm).values())
    assert 7.9e9 < params < 8.1e9  # MiMo-Audio-7B-Instruct: 8.0 B parameters
    assert weights_bytes(lm, "bfloat16") == index["metadata"]["total_size"]
    assert weights_bytes(lm, "float32") == 2 * weights_bytes(lm, "bfloat16")
    tok_params = sum(n for n, _ in header_numel(tok).values())
    assert 1.1e9 < tok_params < 1.4e9  # MiMo-Audio-Tokenizer: ~1.2 B with its EMA buffers
    # EMA buffers are never loaded; codebooks stay float32 in a bfloat16 run.
    assert weights_bytes(tok, "float32") < 4 * tok_params
    assert weights_bytes(tok, "bfloat16") > weights_bytes(tok, "float32") / 2


def test_kv_cache_is_sized_for_the_run_not_the_context(full_size):
    lm, _ = full_size
    short = lm_need(lm, "cpu", "bfloat16", Lengths(1, 100, 100))
    long = lm_need(lm, "cpu", "bfloat16", Lengths(1, 100, 900))
    batch = lm_need(lm, "cpu", "bfloat16", Lengths(8, 100, 100))
    per_group = 2 * 36 * 8 * 128 * 2  # K and V, 36 layers, 8 KV heads of 128, bfloat16
    assert long.parts["kv_cache"] - short.parts["kv_cache"] == 800 * per_group
    assert batch.parts["kv_cache"] > 7 * short.parts["kv_cache"]
    assert short.parts["kv_cache"] < 64 << 20  # not 8192 positions (1.2 GiB a row)


def test_only_weights_a_run_reads_count_on_the_cpu(full_size):
    """Memory-mapped weights stay on disk until read (issue 22): plain TTS never reads the
    tokenizer's encoder, and the LM reads only the text embedding's rows of its tokens. Copies
    (another device, another dtype) are resident whole."""
    lm, tok = full_size
    names = header_numel(tok)
    encoder = sum(n * 4 for name, (n, _) in names.items()
                  if name.startswith("encoder.") and not name.startswith("encoder.quantizer.")
                  and not UNLOADED.fullmatch(name))
    quantizer = sum(n * 4 for name, (n, _) in names.items()
                    if name.startswith("encoder.quantizer.") and not UNLOADED.fullmatch(name))
    assert encoder > 2 * GIB and quantizer > 0
    speaks, clones = Lengths(encodes=False), Lengths(encodes=True)
    plain = tokenizer_need(tok, "cpu", "float32", speaks).parts["weights"]
    assert tokenizer_need(tok, "cpu", "float32", clones).parts["weights"] == plain + encoder
    assert plain + encoder == weights_bytes(tok, "float32")  # the codebooks always count
    assert tokenizer_need(tok, "cuda:0", "float32", speaks).parts["weights"] == plain + encoder
    # converted to bfloat16 as it loads: every tensor is a copy
    assert tokenizer_need(tok, "cpu", "bfloat16", speaks).parts["weights"] == \
        weights_bytes(tok, "bfloat16")
    embedding = names_bytes(lm, "model.embed_tokens.weight")
    on_cpu = lm_need(lm, "cpu", "bfloat16", speaks).parts["weights"]
    cfg = json.loads((lm / "config.json").read_text())
    rows = speaks.batch * (speaks.prompt_groups + speaks.new_groups) * cfg["group_size"]
    row_bytes = cfg["hidden_size"] * 2 + 4096  # a row in bfloat16, on its pages
    assert weights_bytes(lm, "bfloat16") - on_cpu == embedding - rows * row_bytes
    assert weights_bytes(lm, "bfloat16") - on_cpu < embedding
    assert lm_need(lm, "cuda:0", "bfloat16", speaks).parts["weights"] == \
        weights_bytes(lm, "bfloat16")
    assert lm_need(lm, "cpu", "float32", speaks).parts["weights"] == weights_bytes(lm, "float32")


def names_bytes(path, name: str) -> int:
    count, dtype = header_numel(path)[name]
    return count * {"BF16": 2, "F32": 4}[dtype]


def test_lengths_follow_the_inputs():
    lengths = Lengths.for_run(["Hello there", "x" * 5000], 4, 300, None)
    assert lengths.batch == 2  # two items: never more rows than items
    assert lengths.prompt_groups == PROMPT_GROUPS + 1200  # split at 300 characters
    assert Lengths.for_run(["hi"], 1, 300, 50).new_groups == 50


@pytest.mark.parametrize(("text", "value"), [
    ("24GiB", 24 * GIB), ("512M", 512 << 20), ("1.5g", int(1.5 * GIB)), ("1000", 1000),
    ("7 GB", 7 * GIB),
])
def test_parse_size(text, value):
    assert memory.parse_size(text, "test") == value


def test_stated_availability_per_device():
    env = {memory.AVAILABLE_ENV: "cpu=20GiB, cuda:0=70GiB"}
    assert memory.available("cpu", env) == (20 * GIB, f"env {memory.AVAILABLE_ENV}")
    assert memory.available("cuda:0", env)[0] == 70 * GIB
    assert memory.available("cpu", {memory.AVAILABLE_ENV: "3G"})[0] == 3 * GIB
    with pytest.raises(UsageError, match="invalid memory size"):
        memory.available("cpu", {memory.AVAILABLE_ENV: "lots"})
    have, source = memory.available("cpu", {})
    assert have is not None and have > 0 and source in ("MemAvailable", "cgroup memory.max")


def test_both_stages_on_one_device_add_up(full_size):
    lm, tok = full_size
    lengths = Lengths()
    needs = [lm_need(lm, "cpu", "bfloat16", lengths),
             tokenizer_need(tok, "cpu", "float32", lengths)]
    (entry,) = plan(needs, {memory.AVAILABLE_ENV: "64GiB"})
    assert entry["need_bytes"] == RUNTIME_BYTES + needs[0].total + needs[1].total
    assert 19 * GIB < entry["need_bytes"] < 22 * GIB and entry["fits"]
    split = [lm_need(lm, "cuda:0", "bfloat16", lengths), needs[1]]
    assert [e["device"] for e in plan(split, {memory.AVAILABLE_ENV: "64GiB"})] == \
        ["cuda:0", "cpu"]


def test_refusal_names_need_availability_and_fixes(full_size):
    lm, tok = full_size
    lengths = Lengths()
    needs = [lm_need(lm, "cpu", "float32", lengths),
             tokenizer_need(tok, "cpu", "float32", lengths)]
    with pytest.raises(DeviceError) as info:
        check(needs, lengths, {memory.AVAILABLE_ENV: "23GiB"})
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == EXIT_DEVICE
    assert "not enough memory on cpu" in message and "23.0 GiB is available" in message
    assert "--dtype bfloat16 (saves 14.9 GiB)" in message and "--no-memory-check" in message
    # its prepacked linears replace the bfloat16 weights (codec.layers.PackedLinear): no copy
    assert "--tokenizer-dtype bfloat16 (saves 2.4 GiB)" in message
    on_gpu = [lm_need(lm, "cuda:0", "bfloat16", lengths),
              tokenizer_need(tok, "cuda:0", "float32", lengths)]
    with pytest.raises(DeviceError, match="--tokenizer-device cpu") as info:
        check(on_gpu, lengths, {memory.AVAILABLE_ENV: "cuda:0=16GiB"})
    assert "--tokenizer-dtype bfloat16 (saves 2.4 GiB)" in str(info.value)


def _cli(args, env_extra, tmp_path):
    import os

    env = {**os.environ, "MIMO_TTS_CACHE": str(tmp_path / "cache"), **env_extra}
    return subprocess.run([sys.executable, "-m", "mimo_tts.cli", *args], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)


def test_float32_full_size_exits_4_before_loading(full_size, tmp_path):
    """Refused before any weight is read: the child never holds more than the interpreter and
    torch (loading would map 30 GB); one line; nothing written."""
    import os

    lm, tok = full_size
    env = {**os.environ, "MIMO_TTS_CACHE": str(tmp_path / "cache"), memory.AVAILABLE_ENV: "23GiB"}
    err = tmp_path / "stderr.txt"
    with open(err, "wb") as stderr:
        child = subprocess.Popen([sys.executable, "-m", "mimo_tts.cli", "synth", "--model",
                                  str(lm), "--tokenizer", str(tok), "--dtype", "float32",
                                  "--text", "Hello"], stdout=subprocess.DEVNULL, stderr=stderr,
                                 env=env, cwd=tmp_path)
        _, status, usage = os.wait4(child.pid, 0)
    assert os.waitstatus_to_exitcode(status) == EXIT_DEVICE, err.read_text()
    lines = err.read_text().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: not enough memory on cpu")
    assert "--dtype bfloat16" in lines[0]
    assert not any(tmp_path.rglob("*.wav"))
    assert usage.ru_maxrss < 3 * 2**20  # KiB: far below a single LM shard (4 GB)


def test_dry_run_and_devices_report_the_plan(full_size, tmp_path):
    lm, tok = full_size
    base = ["--model", str(lm), "--tokenizer", str(tok)]
    fits = _cli(["synth", *base, "--dtype", "bfloat16", "--text", "Hi", "--dry-run", "--json"],
                {memory.AVAILABLE_ENV: "23GiB"}, tmp_path)
    assert fits.returncode == EXIT_OK, fits.stderr
    (entry,) = json.loads(fits.stdout)["memory"]
    assert entry["fits"] and entry["stages"]["LM"]["dtype"] == "bfloat16"
    refused = _cli(["devices", *base, "--dtype", "float32", "--json"],
                   {memory.AVAILABLE_ENV: "23GiB"}, tmp_path)
    assert refused.returncode == EXIT_DEVICE
    assert "not enough memory" in refused.stderr
    forced = _cli(["devices", *base, "--dtype", "float32", "--json", "--no-memory-check"],
                  {memory.AVAILABLE_ENV: "23GiB"}, tmp_path)
    assert forced.returncode == EXIT_OK


def test_bad_stated_memory_is_a_usage_error(tmp_path):
    for command in (["devices", "--model", "tiny"], ["synth", "--model", "tiny", "--text", "x"]):
        run = _cli(command, {memory.AVAILABLE_ENV: "plenty"}, tmp_path)
        assert run.returncode == 2, run.stderr
        assert f"invalid memory size 'plenty' (from env {memory.AVAILABLE_ENV})" in run.stderr


@pytest.mark.slow
def test_no_memory_check_still_runs(tmp_path):
    args = ["synth", "--model", "tiny", "--text", "Hello", "-o", str(tmp_path / "a.wav")]
    refused = _cli(args, {memory.AVAILABLE_ENV: "64M"}, tmp_path)
    assert refused.returncode == EXIT_DEVICE and not (tmp_path / "a.wav").exists()
    forced = _cli([*args, "--no-memory-check"], {memory.AVAILABLE_ENV: "64M"}, tmp_path)
    assert forced.returncode == EXIT_OK, forced.stderr
    assert (tmp_path / "a.wav").stat().st_size > 44


def test_the_run_sizes_what_it_reads(tmp_path):
    """`lengths_for`: Stage-1 decodes an item's pieces together (its most pieces, not the LM's
    rows); the runner counts the encoder only for runs with a prompt recording."""
    from mimo_tts.batch.items import Item
    from mimo_tts.batch.runner import BatchRunner
    from mimo_tts.batch.sinks import MemorySink
    from mimo_tts.synthesis.preflight import lengths_for
    from mimo_tts.synthesis.settings import resolve
    from mimo_tts.synthesis.text import split_text

    settings = resolve({"max_chars": 20, "batch_size": 4}, env={})
    long = "A first sentence here. A second one here. And a third sentence."
    lengths = lengths_for(settings, ["One. Two.", long])
    assert (lengths.batch, lengths.encodes) == (2, True)
    assert lengths.decode_rows == len(split_text(long, 20)) > lengths.batch
    assert lengths_for(settings, [], decode_rows=4, encodes=False).decode_rows == 4
    runner = BatchRunner(resolve({"model": "tiny", "max_new_groups": 2}, env={}), env={})
    list(runner.run([Item(id="a", text="Hello.", source="s")], MemorySink()))
    assert not runner.lengths.encodes  # plain TTS: the encoder stays on disk
    wav = tmp_path / "voice.wav"
    import soundfile

    soundfile.write(wav, [0.1, -0.1] * 12000, 24000)
    list(runner.run([Item(id="b", text="Hello.", source="s", prompt_audio=str(wav))],
                    MemorySink()))
    assert runner.lengths.encodes


def test_stage1_workspace_is_bounded_by_its_padded_pass(full_size):
    """`decode_batch` pads at most BATCH_FRAMES frames (or one chunk) a pass: 2048 short pieces
    need no more than the rows that fill one pass (before: 47 GiB, a run that fits refused)."""
    from mimo_tts.codec.config import BATCH_FRAMES, DECODE_CHUNK_FRAMES

    _, tok = full_size
    one = tokenizer_need(tok, "cpu", "float32", Lengths(decode_rows=1)).parts["workspace"]
    many = tokenizer_need(tok, "cpu", "float32", Lengths(decode_rows=2048)).parts["workspace"]
    frames = 2 * 4 * (Lengths().prompt_groups + Lengths().new_groups)
    full = -(-2 * max(BATCH_FRAMES, DECODE_CHUNK_FRAMES) // frames)  # rows filling one pass
    fill = tokenizer_need(tok, "cpu", "float32", Lengths(decode_rows=full)).parts["workspace"]
    assert one < many == fill < 2 * GIB


@pytest.mark.parametrize("quant", ["int8", "w8a8", "w4a8"])
def test_a_quantized_lm_counts_its_quantized_matrices_at_their_bytes(tiny_a, full_size, quant):
    """The estimate's quantized matrices are exactly those the loader quantizes (tiny-a loaded
    in bfloat16: every checkpoint tensor it leaves int8 or 4-bit is one the estimate counts, and
    those it leaves in bfloat16 are the matrices its blocks cannot hold); at full size the
    weights' part drops by the quantized elements' bytes (w4a8: 0.5625 a weight, its scales
    counted)."""
    import torch

    from mimo_tts.lm.load import load_lm
    from mimo_tts.synthesis.preflight import QUANTIZED

    pattern, per_element = QUANTIZED[quant]
    assert per_element == {"int8": 1.0, "w8a8": 1.0, "w4a8": 0.5625}[quant]
    lm_dir = tiny_a / "lm"
    names = header_numel(lm_dir)
    model = load_lm(lm_dir, dtype=torch.bfloat16, quant=quant)
    params = dict(model.named_parameters(remove_duplicate=False))
    small = {n for n in names if n in params and params[n].dtype in (torch.int8, torch.uint8)}
    counted = {n for n in names if pattern.fullmatch(n)}
    assert small and small <= counted
    for name in counted - small:  # not whole 16-row blocks (tiny-a's lm_head: 420 rows)
        assert params[name].shape[0] % 16, name
    lm = full_size[0]
    header = header_numel(lm)
    quantized = sum(int(header[n][0] * per_element) for n in header if pattern.fullmatch(n))
    plain = lm_need(lm, "cpu", "bfloat16", Lengths(1, 100, 100)).parts["weights"]
    assert quantized > 6.7e9 * per_element
    assert lm_need(lm, "cpu", "bfloat16", Lengths(1, 100, 100), quant).parts["weights"] == \
        plain - sum(header[n][0] * 2 for n in header if pattern.fullmatch(n)) + quantized
