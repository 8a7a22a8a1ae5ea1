"""Preflight (`devices`, `synth --dry-run`), device sources, config profiles and `selftest`."""

from __future__ import annotations

import json

import pytest
import torch

from mimo_tts.errors import EXIT_CHECKPOINT, EXIT_DEVICE, EXIT_INPUT, EXIT_OK

ENV_DEVICE = "MIMO_AUDIO_TOKENIZER_DEVICE"


def test_devices_preflight_reads_only_headers(mimo, tmp_path, tiny_cache):
    """The LM weights are holes after the safetensors header (a sparse file of the right
    size): loading would read zeros, preflight reads nothing past the headers."""
    source = next(tiny_cache.glob("presets/*/lm"))
    headers_only = tmp_path / "lm"
    headers_only.mkdir()
    for f in source.iterdir():
        (headers_only / f.name).write_bytes(f.read_bytes())
    size = (source / "model.safetensors").stat().st_size
    data = (source / "model.safetensors").read_bytes()
    header_len = 8 + int.from_bytes(data[:8], "little")
    with open(headers_only / "model.safetensors", "wb") as handle:
        handle.write(data[:header_len])
        handle.truncate(size)
    proc = mimo("devices", "--model", headers_only, "--tokenizer", "tiny", "--tokenizer-device",
                "cpu", "--lm-device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr.decode()
    report = json.loads(proc.stdout)
    placement = report["placement"]
    assert placement["tokenizer_device"] == {"value": "cpu", "source": "flag"}
    assert placement["lm_device"] == {"value": "cpu", "source": "flag"}
    assert placement["cuda_graph"]["value"] is False and "not a CUDA device" in \
        placement["cuda_graph"]["source"]
    assert report["cuda"]["available"] == torch.cuda.is_available()
    lm = report["checkpoints"]["model"]
    assert lm["status"].startswith("present")
    (plan,) = report["memory"]  # both stages on the CPU: one device, added up
    assert plan["device"] == "cpu" and plan["fits"] and plan["need_bytes"] > 0
    assert plan["stages"]["LM"]["kv_cache"] > 0 and "kv_cache" not in plan["stages"]["tokenizer"]


def _truncate(d):
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def _drop_shard(d):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    names = sorted(tensors)
    (d / "model.safetensors").unlink()
    save_file({k: tensors[k] for k in names[:10]}, str(d / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {k: f"model-0000{1 + (i >= 10)}-of-00002.safetensors"
                            for i, k in enumerate(names)}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_lies(d):
    _drop_shard(d)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "model-00001-of-00002.safetensors"))
    save_file(dict(list(tensors.items())[:5]), str(d / "model-00002-of-00002.safetensors"))


@pytest.mark.parametrize(("build", "message"), [
    (_truncate, "corrupt or truncated safetensors file"),
    (_drop_shard, "names missing shard(s): model-00002-of-00002.safetensors"),
    (_index_lies, "names tensor(s) its shards lack"),
])
@pytest.mark.parametrize("command", [["devices"], ["synth", "--text", "x", "--dry-run"]])
def test_preflight_refuses_what_a_run_would(mimo, tmp_path, tiny_cache, build, message,
                                            command):
    """Issue 13 item 8: no false green for a truncated file or a partial snapshot."""
    import shutil

    broken = tmp_path / "lm"
    shutil.copytree(next(tiny_cache.glob("presets/*/lm")), broken)
    build(broken)
    proc = mimo(*command, "--model", broken, "--tokenizer", "tiny")
    assert proc.returncode == EXIT_CHECKPOINT, proc.stderr.decode()
    assert message in proc.stderr.decode()


def test_tokenizer_device_env_var_wins_over_profile(invoke, tmp_path):
    profile = tmp_path / "p.toml"
    profile.write_text('model = "tiny"\ntokenizer_device = "cpu"\nlm_device = "cpu"\n')
    from_profile = json.loads(invoke("devices", "--config", profile, "--json").stdout)
    assert from_profile["placement"]["tokenizer_device"] == {"value": "cpu", "source": "config"}
    from_env = json.loads(invoke("devices", "--config", profile, "--json",
                                 env={ENV_DEVICE: "cpu"}).stdout)
    assert from_env["placement"]["tokenizer_device"]["source"] == f"env {ENV_DEVICE}"
    from_flag = json.loads(invoke("devices", "--config", profile, "--json",
                                  "--tokenizer-device", "cpu", env={ENV_DEVICE: "cpu"}).stdout)
    assert from_flag["placement"]["tokenizer_device"]["source"] == "flag"


def test_synth_records_the_env_device_in_the_sidecar(invoke, tmp_path):
    result = invoke("synth", "--model", "tiny", "--text", "Env device.", "--max-new-groups",
                    "1", "--json", env={ENV_DEVICE: "cpu"})
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    sidecar = json.loads((tmp_path / record["path"]).with_suffix(".json").read_text())
    assert sidecar["placement"]["tokenizer_device"] == {"value": "cpu",
                                                       "source": f"env {ENV_DEVICE}"}
    flagged = invoke("synth", "--model", "tiny", "--text", "Flag device.", "--max-new-groups",
                     "1", "--json", "--tokenizer-device", "cpu", env={ENV_DEVICE: "cpu"})
    record = json.loads(flagged.stdout)
    sidecar = json.loads((tmp_path / record["path"]).with_suffix(".json").read_text())
    assert sidecar["placement"]["tokenizer_device"]["source"] == "flag"


def test_dry_run_reports_a_missing_model_without_loading(mimo):
    proc = mimo("synth", "--text", "hi", "--dry-run", "--json")
    assert proc.returncode == EXIT_CHECKPOINT
    report = json.loads(proc.stdout)
    assert report["checkpoints"]["model"]["status"].startswith("missing")
    assert "mimo-tts download" in proc.stderr.decode()


def test_dry_run_reads_the_input_files(invoke, tmp_path):
    """Issue 13 item 8: a dry run checks the inputs a run would read (before: exit 0)."""
    missing = invoke("synth", "--model", "tiny", "--input", str(tmp_path / "none.txt"),
                     "--dry-run")
    assert missing.exit_code == EXIT_INPUT and "input file not found" in missing.stderr
    lines = tmp_path / "lines.txt"
    lines.write_text("First line.\nSecond line.\n")
    ok = invoke("synth", "--model", "tiny", "--input", str(lines), "--dry-run", "--json")
    assert ok.exit_code == EXIT_OK, ok.stderr
    assert json.loads(ok.stdout)["inputs"] == {"files": [str(lines)], "items": 2, "bad_items": 0}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the profile is valid on a CUDA machine")
def test_cpu_tokenizer_profile_needs_cuda(invoke):
    result = invoke("devices", "--config", "cpu-tokenizer")
    assert result.exit_code == EXIT_DEVICE and "'cuda:0' (from config)" in result.stderr


def test_ci_smoke_profile_runs_the_tiny_model(invoke, tmp_path):
    result = invoke("synth", "--config", "ci-smoke", "--text", "Smoke test.",
                    "--max-new-groups", "2", "--json")
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    sidecar = json.loads((tmp_path / record["path"]).with_suffix(".json").read_text())
    assert sidecar["model"]["kind"] == "preset"
    assert sidecar["model"]["source"] == "config"
    assert sidecar["placement"]["lm_device"] == {"value": "cpu", "source": "config"}


def test_flag_beats_profile_even_when_zero(invoke, tmp_path):
    profile = tmp_path / "p.toml"
    profile.write_text('model = "tiny"\nseed = 5\ntemperature = 0.9\n')
    result = invoke("synth", "--config", profile, "--text", "Zero wins.", "--seed", "0",
                    "--temperature", "0", "--max-new-groups", "1", "--json")
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    sidecar = json.loads((tmp_path / record["path"]).with_suffix(".json").read_text())
    assert record["seed"] == 0 and sidecar["effective_sampler"]["text"]["temperature"] == 0
    from_profile = invoke("synth", "--config", profile, "--text", "Profile seed.",
                          "--max-new-groups", "1", "--json")
    assert json.loads(from_profile.stdout)["seed"] == 5


def test_selftest(mimo):
    proc = mimo("selftest", "--json")
    assert proc.returncode == 0, proc.stderr.decode()
    report = json.loads(proc.stdout)
    assert report["status"] == "ok" and report["seconds"] == report["frames"] * 960 / 24000
    assert 0.5 <= report["seconds"] <= 60 and report["peak"] > 1e-3


def test_checkpoints_are_found_in_the_hugging_face_cache(mimo, tmp_path, tiny_cache):
    """Repo ids resolve through the HF cache layout (refs/main -> snapshots/<commit>) offline;
    a synth from there records the snapshot's commit, and a missing revision is reported."""
    import shutil

    hub, commit = tmp_path / "hf" / "hub", "0123456789abcdef0123456789abcdef01234567"
    for repo, part in (("org/tiny-lm", "lm"), ("org/tiny-tok", "tokenizer")):
        root = hub / f"models--{repo.replace('/', '--')}"
        shutil.copytree(next(tiny_cache.glob(f"presets/*/{part}")), root / "snapshots" / commit)
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text(commit)
    env = {"HF_HOME": str(tmp_path / "hf")}
    proc = mimo("devices", "--model", "org/tiny-lm", "--tokenizer", "org/tiny-tok", "--lm-device",
                "cpu", "--tokenizer-device", "cpu", "--json", env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    report = json.loads(proc.stdout)
    for role in ("model", "tokenizer"):
        assert report["checkpoints"][role]["status"].startswith("present")
    synth = mimo("synth", "--model", "org/tiny-lm", "--tokenizer", "org/tiny-tok", "--text", "Hi.",
                 "--max-new-groups", "3", "--json", env=env)
    assert synth.returncode == 0, synth.stderr.decode()
    record = json.loads(synth.stdout)
    sidecar = json.loads((tmp_path / record["path"]).with_suffix(".json").read_text())
    assert sidecar["model"]["kind"] == "hf-cache" and sidecar["model"]["revision"] == commit
    (hub / "models--org--tiny-tok" / "refs" / "main").unlink()
    missing = mimo("devices", "--model", "org/tiny-lm", "--tokenizer", "org/tiny-tok", env=env)
    assert missing.returncode == EXIT_CHECKPOINT
    assert "org/tiny-tok is not in the local Hugging Face cache" in missing.stderr.decode()
