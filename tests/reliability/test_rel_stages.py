"""Start-up and stage overlap (issue 5 items owned by the orchestration): the light commands
never import torch; each stage's CPU thread budget holds in its own thread; the `--stream`
path run in memory reports per-stage timings (what scripts/bench_overlap.py times)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from mimo_tts.errors import UsageError
from mimo_tts.presets import ensure_tiny_preset
from mimo_tts.runtime import devices
from mimo_tts.runtime.paths import CACHE_ENV

# Runs the real CLI entry point; at exit (after typer's SystemExit) reports heavy imports.
TRACE = """
import atexit, json, sys
atexit.register(lambda: sys.stderr.write("\\nMODULES " + json.dumps(
    [m for m in ("torch", "safetensors.torch", "torchaudio") if m in sys.modules]) + "\\n"))
sys.argv = ["mimo-tts", *sys.argv[1:]]
from mimo_tts.cli import main
main()
"""


def _imports(args, env, cwd) -> tuple[int, list[str]]:
    proc = subprocess.run([sys.executable, "-c", TRACE, *args], capture_output=True, env=env,
                          cwd=cwd, timeout=120, stdin=subprocess.DEVNULL)
    line = [x for x in proc.stderr.decode().splitlines() if x.startswith("MODULES ")][-1]
    return proc.returncode, json.loads(line.removeprefix("MODULES "))


@pytest.mark.parametrize("args, code", [
    (["--help"], 0),
    (["synth", "--help"], 0),
    (["devices", "--model", "tiny", "--json"], 0),
    (["devices"], 3),  # default HF ids, not in the (empty) cache
    (["synth", "--model", "tiny", "--text", "hi", "--dry-run", "--json"], 0),
])
def test_light_commands_never_import_torch(base_env, tiny_cache, tmp_path, args, code):
    returncode, heavy = _imports(args, base_env, tmp_path)
    assert returncode == code
    assert "safetensors.torch" not in heavy and "torchaudio" not in heavy
    probing = args[0] != "--help" and args[-1] != "--help"
    if probing and devices.accelerator_possible():
        pytest.skip("a GPU driver is present: the device probe asks torch by design")
    assert "torch" not in heavy


def _busy_threads(fn) -> dict[str, int]:
    """OS threads of this process that used CPU time while `fn` ran: {tid: clock ticks}."""
    def ticks():
        out = {}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            out[tid] = int(fields[11]) + int(fields[12])
        return out

    before = ticks()
    fn()
    after = ticks()
    return {t: after[t] - before.get(t, 0) for t in after if after[t] - before.get(t, 0) > 2}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_thread_budgets_hold_per_thread():
    """LM thread with 2 intra-op threads, decode thread with 1, concurrently: 3 busy OS threads,
    and each thread reports its own budget."""
    from mimo_tts.runtime.guards import thread_budget

    x = torch.randn(2_000_000)
    worked, release, seen = threading.Event(), threading.Event(), {}

    def work():
        for _ in range(60):
            torch.exp(x).sin_()

    def stage1():
        with thread_budget(1):
            seen["stage1"] = torch.get_num_threads()
            work()
        worked.set()
        release.wait(60)  # a finished thread leaves /proc: stay until it has been read

    def both():
        with thread_budget(2):
            worker = threading.Thread(target=stage1)
            worker.start()
            work()
            seen["stage0"] = torch.get_num_threads()
            worked.wait(60)
        return worker

    holder = {}
    busy = _busy_threads(lambda: holder.update(worker=both()))
    release.set()
    holder["worker"].join()
    assert seen == {"stage0": 2, "stage1": 1}
    assert len(busy) == 3, busy  # the LM thread + its helper, the decode thread alone


@pytest.fixture
def tiny_synth_options(tiny_cache):

    lm, tok = ensure_tiny_preset({CACHE_ENV: str(tiny_cache)})
    return dict(model=str(lm), tokenizer=str(tok), lm_device="cpu", tokenizer_device="cpu")


def _runner(**values):
    """A BatchRunner for option values (resolved without env or profile)."""
    from mimo_tts.batch.runner import BatchRunner
    from mimo_tts.synthesis.settings import resolve

    return BatchRunner(resolve(values, env={}), env={})


def test_stream_in_memory_reports_stage_timings(tiny_synth_options):
    """The benchmark path: a MemorySink keeps the audio; the result times both stages."""
    from mimo_tts.batch.items import Item
    from mimo_tts.batch.sinks import MemorySink

    synth = _runner(**tiny_synth_options, stream=True, lm_threads=1, tokenizer_threads=1,
                    max_new_groups=8, stream_chunk_groups=2)
    chunks = []
    (result,) = synth.run([Item(id="a", text="Timing check.", source="test")],
                          MemorySink(chunks.append))
    assert result.status == "ok" and result.path is None, result.error
    assert synth.threads == {"lm": 1, "tokenizer": 1, "source": "options"}
    assert result.audio.shape == (960 * 4 * 8,) and torch.equal(torch.cat(chunks), result.audio)
    t = result.timings
    assert {"stage0_s", "stage1_s", "stage1_wait_s", "first_audio_s", "generate_s"} <= set(t)
    assert 0 < t["stage1_s"] and 0 < t["first_audio_s"] <= t["generate_s"]
    assert t["stage0_s"] + t["stage1_wait_s"] <= t["generate_s"] + 1e-3


def test_stream_on_one_cpu_keeps_stage0_threads_by_default(tiny_synth_options):
    """Up to 8 cores the stages take turns with every thread; on more, Stage-1 decodes
    beside Stage-0 with an eighth of them; explicit budgets and plain runs keep the options'."""
    from mimo_tts.synthesis.loader import thread_budgets

    before = torch.get_num_threads()
    budgets = {}
    try:
        for n in (4, 16):
            torch.set_num_threads(n)
            split = _runner(**tiny_synth_options, stream=True)
            plain = _runner(**tiny_synth_options)
            explicit = _runner(**tiny_synth_options, stream=True, lm_threads=3)
            budgets[n] = [thread_budgets(s.settings) for s in (split, plain, explicit)]
    finally:
        torch.set_num_threads(before)
    assert budgets[4][0] == {"lm": 4, "tokenizer": 4, "interleave": True,
                             "source": "auto (--stream, cpu: the stages take turns)"}
    assert budgets[16][0] == {"lm": 14, "tokenizer": 2, "source": "auto (--stream, cpu)"}
    for n in (4, 16):
        assert budgets[n][1] == {"lm": None, "tokenizer": None, "source": "options"}
        assert budgets[n][2] == {"lm": 3, "tokenizer": None, "source": "options"}


def test_incremental_stream_mode_through_the_runner(tiny_synth_options):
    """`stream_mode="incremental"` (the default) reaches the worker: whole frames, close to
    one-shot audio; the official scheme's outputs are kept apart by their resume keys."""
    from mimo_tts.batch.items import Item
    from mimo_tts.batch.sinks import MemorySink
    from mimo_tts.synthesis.options import SynthesisOptions

    item = Item(id="a", text="Incremental.", source="test")
    common = dict(**tiny_synth_options, lm_threads=1, tokenizer_threads=1, max_new_groups=8)
    streamed = _runner(**common, stream=True, stream_mode="incremental", stream_chunk_groups=2)
    (result,) = streamed.run([item], MemorySink())
    one_shot = _runner(**common)
    (reference,) = one_shot.run([item], MemorySink())
    assert result.status == reference.status == "ok", (result.error, reference.error)
    assert result.generated_text_ids == reference.generated_text_ids
    assert result.audio.shape == reference.audio.shape == (960 * 4 * 8,)
    assert (result.audio - reference.audio).abs().max() < 5e-3
    assert SynthesisOptions().stream_mode == "incremental"
    assert streamed.item_key(item) != _runner(**common, stream=True,
                                              stream_mode="official").item_key(item)


def test_chunk_schedule_grows_from_the_first_chunk_to_the_cap():
    from itertools import islice

    from mimo_tts.synthesis.streaming import chunk_schedule

    assert list(islice(chunk_schedule(5, 30), 6)) == [5, 10, 20, 30, 30, 30]
    assert list(islice(chunk_schedule(3), 3)) == [3, 3, 3]  # no cap: fixed chunks
    assert list(islice(chunk_schedule(4, 2), 2)) == [4, 4]  # a cap below the first: fixed
    # the default: the decoder's look-ahead and one group, then 2, 4, 8 up to the cap
    assert list(islice(chunk_schedule(1, 10, lead=10), 6)) == [11, 2, 4, 8, 10, 10]


def test_stream_pushes_follow_the_chunk_schedule(tiny_synth_options, monkeypatch):
    """Stage-1 gets the first audio after the decoder's look-ahead and `stream_chunk_groups`,
    then ever larger chunks (the stages take turns here: one push a round)."""
    import mimo_tts.codec
    from mimo_tts.batch.items import Item
    from mimo_tts.batch.sinks import MemorySink
    from mimo_tts.synthesis.options import SynthesisOptions

    pushed, push_streams = [], mimo_tts.codec.push_streams

    def record(decoders, codes, lasts):
        pushed.extend((c.shape[1], last) for c, last in zip(codes, lasts, strict=True))
        return push_streams(decoders, codes, lasts)

    monkeypatch.setattr(mimo_tts.codec, "push_streams", record)
    runner = _runner(**tiny_synth_options, stream=True, max_new_groups=28,
                     stream_chunk_groups=1, stream_max_chunk_groups=4)
    (result,) = runner.run([Item(id="a", text="Chunks.", source="t")], MemorySink())
    assert result.status == "ok", result.error
    assert runner.threads.get("interleave")
    frames = result.audio.shape[0] // 960
    assert sum(n for n, _ in pushed) == frames and frames > 8 * 4
    # the tiny preset holds back 9 groups (its norm warm-up of 40 frames): 9 + 1, then 2, 4
    assert [n for n, _ in pushed[:3]] == [40, 8, 16]  # each group 4 frames
    assert all(n == 16 for n, _ in pushed[3:-1]) and pushed[-1][0] <= 16
    assert [last for _, last in pushed] == [False] * (len(pushed) - 1) + [True]
    with pytest.raises(UsageError, match="stream_max_chunk_groups"):
        SynthesisOptions(stream_chunk_groups=8, stream_max_chunk_groups=4)


