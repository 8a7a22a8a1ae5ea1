"""The wheel carries what a non-editable install needs at run time: the built-in profiles
(`--config ci-smoke`, from the top-level configs/), the C kernels' sources and the server's page,
as package data; installed from the wheel, `synth --config ci-smoke` runs in any folder."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from tests.helpers import REPO


@pytest.mark.slow
def test_wheel_ships_profiles_and_kernel_source(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "-w", str(tmp_path), "--no-deps",
         "--no-build-isolation", "-q"], capture_output=True, text=True, timeout=300,
        cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("mimo_tts-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    profiles = {p.name for p in (REPO / "configs").glob("*.toml")}
    assert profiles == {"ci-smoke.toml", "cpu-tokenizer.toml", "default.toml"}
    assert {f"mimo_tts/configs/{name}" for name in profiles} <= names
    assert {"mimo_tts/lm/cpu_kernel.c", "mimo_tts/codec/gemm.c"} <= names
    assert "mimo_tts/server/page/index.html" in names  # the page at / of `mimo-tts serve`
    assert not any(n.startswith(("tests/", "configs/")) for n in names)
    # installed from the wheel (not editable), in a folder far from the checkout: the packaged
    # profile is found and a whole run works
    target, scratch = tmp_path / "site", tmp_path / "scratch"
    scratch.mkdir()
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
         str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(target), "MIMO_TTS_CONFIG_DIR": str(tmp_path / "no")}
    code = ("import sys, mimo_tts; print(mimo_tts.__file__, file=sys.stderr); "
            "from mimo_tts.cli import main; sys.argv[0] = 'mimo-tts'; main()")
    run = subprocess.run([sys.executable, "-c", code, "synth", "--config", "ci-smoke", "--text",
                          "From a wheel.", "--json"], capture_output=True, text=True,
                         timeout=600, cwd=scratch, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert str(target) in run.stderr.splitlines()[0]  # the installed copy ran, not the checkout
    (wav,) = (scratch / "output_audio" / "tts_sft").glob("*.wav")
    assert wav.stat().st_size > 44


def test_every_subpackage_is_listed_for_the_wheel():
    """`packages` is a list (the mapped configs/ hides from packages.find): a new folder under
    mimo_tts/ with an __init__.py must be in it, or the wheel ships without it."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
                 ["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts)
             for p in (REPO / "mimo_tts").rglob("__init__.py")}
    assert found | {"mimo_tts.configs"} == listed


def test_ray_is_an_optional_extra_the_default_install_is_free_of():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    heavy = ("ray", "pandas", "pyarrow")
    assert not any(dep.lower().startswith(heavy) for dep in project["dependencies"])
    assert project["optional-dependencies"]["ray"] == ["ray[data]==2.60.0"]
    code = ("import sys, mimo_tts.cli, mimo_tts.batch.plan; "
            "print(sorted(set(sys.modules) & {'ray'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr
