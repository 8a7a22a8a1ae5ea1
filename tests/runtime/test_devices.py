"""Device policy (issue 2): precedence with visible sources, normalisation, errors, CUDA graphs."""

from __future__ import annotations

import pytest

from mimo_tts.errors import EXIT_DEVICE, EXIT_USAGE, DeviceError, UsageError
from mimo_tts.runtime import devices
from mimo_tts.runtime.devices import (
    CODEC_KERNEL_ENV,
    CPU_KERNEL_ENV,
    CUDA_GRAPH_ENV,
    DTYPE_ENV,
    LM_DEVICE_ENV,
    TOKENIZER_DEVICE_ENV,
    TOKENIZER_DTYPE_ENV,
    Choice,
    Probe,
    cpu_bf16_flags,
    cpu_flags,
    normalize_device,
    pick_dtype,
    resolve_cuda_graph,
    resolve_kernel,
    resolve_lm_device,
    resolve_placement,
    resolve_tokenizer_device,
)

NO_GPU = Probe(cuda_count=0, cuda_current=0, mps=False)
TWO_GPUS = Probe(cuda_count=2, cuda_current=1, mps=False)
MAC = Probe(cuda_count=0, cuda_current=0, mps=True)


# --- precedence: flag > env > config > default, with the source visible ---------------------


def test_flag_beats_env_and_config():
    env = {TOKENIZER_DEVICE_ENV: "cuda:1"}
    choice = resolve_tokenizer_device("cpu", config="cuda:0", env=env, probe=TWO_GPUS)
    assert (choice.value, choice.source) == ("cpu", "flag")


def test_env_beats_config():
    env = {TOKENIZER_DEVICE_ENV: "cpu"}
    choice = resolve_tokenizer_device(None, config="cuda:0", env=env, probe=TWO_GPUS)
    assert (choice.value, choice.source) == ("cpu", f"env {TOKENIZER_DEVICE_ENV}")


def test_config_beats_default():
    choice = resolve_tokenizer_device(None, config="cuda:0", env={}, probe=TWO_GPUS)
    assert (choice.value, choice.source) == ("cuda:0", "config")


def test_empty_env_value_is_ignored():
    choice = resolve_tokenizer_device(None, config="cpu", env={TOKENIZER_DEVICE_ENV: ""},
                                      probe=TWO_GPUS)
    assert (choice.value, choice.source) == ("cpu", "config")


def test_default_is_current_cuda_index_or_cpu():
    assert resolve_tokenizer_device(env={}, probe=TWO_GPUS).value == "cuda:1"
    assert resolve_tokenizer_device(env={}, probe=TWO_GPUS).source == "default"
    assert resolve_tokenizer_device(env={}, probe=NO_GPU).value == "cpu"


def test_lm_device_has_its_own_env_var():
    env = {LM_DEVICE_ENV: "cuda:0", TOKENIZER_DEVICE_ENV: "cpu"}
    assert resolve_lm_device(env=env, probe=TWO_GPUS).value == "cuda:0"
    assert resolve_tokenizer_device(env=env, probe=TWO_GPUS).value == "cpu"


def test_placement_records_every_source():
    placement = resolve_placement(
        lm_device="cuda:0", profile={"tokenizer_device": "cpu", "cuda_graph": True},
        env={}, probe=TWO_GPUS, checkpoint_dtypes=("bfloat16", "float32"),
    )
    described = placement.describe()
    assert described["lm_device"] == {"value": "cuda:0", "source": "flag"}
    assert described["tokenizer_device"] == {"value": "cpu", "source": "config"}
    assert described["tokenizer_dtype"] == {"value": "float32",
                                            "source": "checkpoint (torch_dtype float32)"}
    assert described["lm_dtype"] == {"value": "bfloat16",
                                     "source": "checkpoint (torch_dtype bfloat16)"}
    assert described["cuda_graph"]["value"] is False


# --- normalisation ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["cpu", "CPU", " cpu ", "cpu:0"])
def test_cpu_stays_cpu(text):
    assert normalize_device(text, probe=NO_GPU) == "cpu"


def test_cuda_index_is_kept_never_collapsed():
    assert normalize_device("cuda:0", probe=TWO_GPUS) == "cuda:0"
    assert normalize_device("cuda:1", probe=TWO_GPUS) == "cuda:1"


def test_bare_cuda_resolves_to_current_index():
    assert normalize_device("cuda", probe=TWO_GPUS) == "cuda:1"
    one = Probe(cuda_count=1, cuda_current=0, mps=False)
    assert normalize_device("cuda", probe=one) == normalize_device("cuda:0", probe=one)


def test_mps_where_available():
    assert normalize_device("mps", probe=MAC) == "mps"
    with pytest.raises(DeviceError, match="not available"):
        normalize_device("mps", probe=NO_GPU)


# --- errors name the value and where it came from -----------------------------------------------


BAD_DEVICES = ["gpu", "cuda:x", "cuda:-1", "cuda:", "cuda:1.5", "cuda:²", "cpu:1"]


@pytest.mark.parametrize("bad", BAD_DEVICES)
def test_invalid_strings(bad):
    with pytest.raises(DeviceError) as info:
        normalize_device(bad, "flag", probe=TWO_GPUS)
    message = str(info.value)
    assert repr(bad) in message and "flag" in message
    assert info.value.exit_code == EXIT_DEVICE


def test_index_past_count():
    with pytest.raises(DeviceError, match=r"'cuda:2'.*2 CUDA device"):
        normalize_device("cuda:2", "flag", probe=TWO_GPUS)


def test_cuda_absent_names_the_source():
    env = {TOKENIZER_DEVICE_ENV: "cuda"}
    with pytest.raises(DeviceError, match=f"env {TOKENIZER_DEVICE_ENV}.*not available"):
        resolve_tokenizer_device(env=env, probe=NO_GPU)


def test_invalid_config_value_names_config():
    with pytest.raises(DeviceError, match=r"'gpu' \(from config\)"):
        resolve_tokenizer_device(config="gpu", env={}, probe=NO_GPU)


# --- CUDA-graph policy --------------------------------------------------------------------------


def test_graphs_never_on_cpu():
    assert resolve_cuda_graph("cpu", True, env={}).value is False
    assert resolve_cuda_graph("cpu", env={CUDA_GRAPH_ENV: "1"}).value is False
    assert resolve_cuda_graph("mps", env={}).value is False


def test_graphs_default_on_cuda():
    choice = resolve_cuda_graph("cuda:0", env={})
    assert (choice.value, choice.source) == (True, "default")


@pytest.mark.parametrize("off", ["0", "false", "no", "off", "OFF", " False "])
def test_graph_env_disables(off):
    choice = resolve_cuda_graph("cuda:0", env={CUDA_GRAPH_ENV: off})
    assert (choice.value, choice.source) == (False, f"env {CUDA_GRAPH_ENV}")


def test_graph_flag_beats_env_and_explicit_false_wins():
    env_on = {CUDA_GRAPH_ENV: "1"}
    assert resolve_cuda_graph("cuda:0", False, config=True, env=env_on).value is False
    assert resolve_cuda_graph("cuda:0", True, env={CUDA_GRAPH_ENV: "0"}).value is True
    assert resolve_cuda_graph("cuda:0", None, config=False, env={}).value is False


@pytest.mark.parametrize("bad", ["maybe", "2", "enable"])
def test_unrecognised_graph_value_is_an_error(bad):
    with pytest.raises(UsageError, match=repr(bad)) as info:
        resolve_cuda_graph("cuda:0", env={CUDA_GRAPH_ENV: bad})
    assert info.value.exit_code == EXIT_USAGE
    # A typo is reported even where the device makes graphs moot.
    with pytest.raises(UsageError):
        resolve_cuda_graph("cpu", env={CUDA_GRAPH_ENV: bad})


# --- dtypes -------------------------------------------------------------------------------------


def test_dtype_flags_profile_and_aliases():
    assert pick_dtype("bf16", "float32", "cpu", "LM", env={}).value == "bfloat16"
    assert pick_dtype(None, "fp16", "cpu", "LM", env={}).source == "config"
    with pytest.raises(UsageError, match="int8"):
        pick_dtype("int8", None, "cpu", "LM", env={})


BF16_CPU = Probe(cuda_count=0, cuda_current=0, mps=False, cpu_bf16=("avx512_bf16",))
OLD_GPU = Probe(cuda_count=1, cuda_current=0, mps=False, cuda_bf16=False)


@pytest.mark.parametrize(("checkpoint", "device", "probe", "value", "why"), [
    ("float32", "cpu", BF16_CPU, "float32", "checkpoint (torch_dtype float32)"),  # tiny ones
    ("float32", "cuda:0", TWO_GPUS, "float32", "checkpoint"),
    ("bfloat16", "cpu", BF16_CPU, "bfloat16", "the CPU has avx512_bf16"),
    ("bfloat16", "cpu", NO_GPU, "bfloat16", "no AVX512-BF16/AMX: prefill in float32 blocks"),
    ("float16", "cpu", NO_GPU, "float32", "device (torch_dtype float16, but the CPU has no"),
    ("bfloat16", "cuda:0", TWO_GPUS, "bfloat16", "checkpoint (torch_dtype bfloat16)"),
    ("bfloat16", "cuda:0", OLD_GPU, "float16", "the GPU has no bf16"),
    ("float16", "cuda:0", TWO_GPUS, "float16", "checkpoint"),
    ("float16", "cpu", BF16_CPU, "bfloat16", "the CPU has"),
    (None, "cpu", BF16_CPU, "float32", "checkpoint dtype unknown"),
])
def test_auto_dtype_follows_checkpoint_and_device(checkpoint, device, probe, value, why):
    """(The LM's choice; a bfloat16 tokenizer on a CPU without bfloat16 runs in float32:
    `test_a_bfloat16_tokenizer_upcasts_on_cpus_without_bfloat16`.)"""
    choice = pick_dtype(None, None, device, "LM", checkpoint, env={}, probe=probe)
    assert choice.value == value
    assert why in choice.source
    assert pick_dtype("auto", None, device, "LM", checkpoint, env={}, probe=probe).value == value


def test_a_bfloat16_tokenizer_upcasts_on_cpus_without_bfloat16():
    tok = pick_dtype(None, None, "cpu", "tokenizer", "bfloat16", env={}, probe=NO_GPU)
    assert tok.value == "float32" and "no AVX512-BF16/AMX" in tok.source
    lm = pick_dtype(None, None, "cpu", "LM", "bfloat16", env={}, probe=NO_GPU)
    assert lm.value == "bfloat16"


def test_dtype_precedence_flag_env_profile_auto():
    env = {DTYPE_ENV: "float16", TOKENIZER_DTYPE_ENV: "bf16"}
    lm = pick_dtype(None, "float32", "cpu", "LM", "bfloat16", env=env, probe=BF16_CPU)
    assert (lm.value, lm.source) == ("float16", f"env {DTYPE_ENV}")
    tok = pick_dtype(None, None, "cpu", "tokenizer", "float32", env=env, probe=BF16_CPU)
    assert (tok.value, tok.source) == ("bfloat16", f"env {TOKENIZER_DTYPE_ENV}")
    flag = pick_dtype("float32", None, "cpu", "LM", "bfloat16", env=env, probe=BF16_CPU)
    assert (flag.value, flag.source) == ("float32", "flag")  # upcasting stays possible
    profile = pick_dtype(None, "auto", "cpu", "LM", "bfloat16", env={}, probe=BF16_CPU)
    assert profile.value == "bfloat16" and profile.source.startswith("config auto:")
    with pytest.raises(UsageError, match=f"env {DTYPE_ENV}"):
        pick_dtype(None, None, "cpu", "LM", None, env={DTYPE_ENV: "fp8"}, probe=BF16_CPU)


def test_cpu_bf16_flags_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16 avx512_bf16\n")
    assert cpu_bf16_flags(str(info)) == ("avx512_bf16", "amx_bf16")
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2\n")
    assert cpu_bf16_flags(str(info)) == ()
    assert cpu_bf16_flags(str(tmp_path / "missing")) == ()


def test_cpu_flags_keep_the_order_of_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2\nprocessor\t: 1\nflags\t: x\n")
    assert cpu_flags(str(info)) == ("fpu", "sse", "avx2")  # the first CPU's line
    assert cpu_flags(str(tmp_path / "missing")) == ()


# --- kernel modes: env > auto, resolved here for lm/ and codec/ ----------------------------------


@pytest.mark.parametrize(("text", "mode"), [("1", "on"), ("ON", "on"), (" yes ", "on"),
                                            ("true", "on"), ("0", "off"), ("no", "off"),
                                            ("false", "off"), ("off", "off"), ("auto", "auto")])
def test_kernel_mode_spellings(text, mode):
    assert resolve_kernel(CPU_KERNEL_ENV, {CPU_KERNEL_ENV: text}) == \
        Choice(mode, f"env {CPU_KERNEL_ENV}")


def test_kernel_mode_defaults_to_auto():
    assert resolve_kernel(CODEC_KERNEL_ENV, {}) == Choice("auto", "default")
    assert resolve_kernel(CODEC_KERNEL_ENV, {CODEC_KERNEL_ENV: ""}) == Choice("auto", "default")


def test_bad_kernel_mode_is_a_usage_error():
    with pytest.raises(UsageError) as info:
        resolve_kernel(CPU_KERNEL_ENV, {CPU_KERNEL_ENV: "fast"})
    assert str(info.value) == "MIMO_TTS_CPU_KERNEL='fast': use auto, 1 (on) or 0 (off)"
    assert info.value.exit_code == EXIT_USAGE


def test_placement_carries_both_kernel_modes():
    env = {CPU_KERNEL_ENV: "0", CODEC_KERNEL_ENV: "1"}
    placement = resolve_placement(lm_device="cpu", tokenizer_device="cpu", env=env)
    assert placement.cpu_kernel == Choice("off", f"env {CPU_KERNEL_ENV}")
    assert placement.codec_kernel == Choice("on", f"env {CODEC_KERNEL_ENV}")
    described = resolve_placement(lm_device="cpu", tokenizer_device="cpu", env={}).describe()
    assert described["cpu_kernel"] == described["codec_kernel"] == {"value": "auto",
                                                                    "source": "default"}


def test_one_choice_type_reads_as_a_kernel_decision():
    decision = Choice(True, "on: AMX tiles")
    assert decision.active and decision.reason == "on: AMX tiles"
    assert not Choice(False, "off (asked for)").active


def test_detect_probe_matches_torch():
    import torch

    probe = Probe.detect()
    assert probe.cuda_count == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert devices.default_device(probe) == ("cpu" if probe.cuda_count == 0 else
                                             f"cuda:{probe.cuda_current}")


def test_mps_takes_no_index():
    with pytest.raises(DeviceError, match="'mps:3'"):
        normalize_device("mps:3", probe=MAC)


# --- Probe.detect: no torch import where no accelerator can exist (issue 5, start-up) -----------


def test_accelerator_possible_sees_each_driver_trace(tmp_path):
    absent = str(tmp_path / "absent")
    assert not devices.accelerator_possible((absent,), ("libmimo-absent.so",), "linux")
    (tmp_path / "nvidia0").touch()
    assert devices.accelerator_possible((str(tmp_path / "nvidia*"),), (), "linux")
    assert devices.accelerator_possible((absent,), (), "darwin")  # MPS is asked of torch


def test_accelerator_possible_sees_a_loadable_driver_library():
    import ctypes.util

    libc = ctypes.util.find_library("c")
    assert libc is not None
    assert devices.accelerator_possible((), (libc,), "linux")
    assert not devices.accelerator_possible((), ("libmimo-absent.so",), "linux")


def _detect_in_fresh_interpreter() -> dict:
    import json
    import subprocess
    import sys

    code = ("import json, sys; from mimo_tts.runtime.devices import Probe, accelerator_possible; "
            "p = Probe.detect(); print(json.dumps({'probe': [p.cuda_count, p.cuda_current, p.mps],"
            " 'torch': 'torch' in sys.modules, 'possible': accelerator_possible()}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout)


def test_detect_skips_torch_without_an_accelerator():
    found = _detect_in_fresh_interpreter()
    if found["possible"]:
        pytest.skip("this machine may have a GPU: detect rightly imports torch")
    assert found == {"probe": [0, 0, False], "torch": False, "possible": False}


def test_fast_path_agrees_with_torch():
    import torch

    found = _detect_in_fresh_interpreter()
    assert found["torch"] == found["possible"]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert found["probe"][0] == count
    if not found["possible"]:
        mps = getattr(torch.backends, "mps", None)
        assert count == 0 and not (mps and mps.is_available())
