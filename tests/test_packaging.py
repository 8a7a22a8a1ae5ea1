"""The wheel carries what a non-editable install needs at run time: the built-in profiles
(`--config ci-smoke`) and the CPU kernel's C source, as package data."""

from __future__ import annotations

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
    assert not any(n.startswith(("tests/", "configs/")) for n in names)


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
