"""Every benchmark and tool in scripts/ imports and parses its options (`--help`, exit 0).

The scripts are not run by the suite (they are minutes long), so an import they lose in a
refactor would otherwise only show when someone next benchmarks.
"""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted(p for p in (Path(__file__).resolve().parents[1] / "scripts").glob("*.py")
                 if not p.name.startswith("_"))


def test_the_scripts_are_found():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_help(script):
    run = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage" in run.stdout.lower()


def test_bench_e2e_takes_every_items_prefill_out_of_a_batchs_group_steps():
    """A batch prefills each item alone, and an item's generate_s is its prefill plus its
    share of each batch step: the steps' time is the sum less every prefill."""
    sys.path.insert(0, str(SCRIPTS[0].parent))
    try:
        import bench_e2e
    finally:
        sys.path.remove(str(SCRIPTS[0].parent))
    placement = {"lm_dtype": {"value": "bfloat16"}, "tokenizer_dtype": {"value": "float32"}}

    def sidecar(prefill, share, groups):
        return {"placement": placement, "audio": {"seconds": 0.16 * groups},
                "timings": {"prompt_s": 0.0, "generate_s": prefill + share, "decode_s": 1.0,
                            "load_s": 20.0},
                "pieces": [{"generated_text_ids": [0] * groups,
                            "timings": {"prefill_s": prefill}}]}

    # two items, prefills of 2.0 and 3.0 s, then 10 steps of 0.8 s shared between them
    run = {"sidecars": [sidecar(2.0, 4.0, 10), sidecar(3.0, 4.0, 10)], "peak_rss_gib": 1.0,
           "wall_s": 40.0}
    out = bench_e2e.summarise(run, {"lm": {"bfloat16": 2 ** 30}, "tokenizer": {"float32": 2 ** 30}})
    assert out["s_per_group"] == 0.8 and out["prefills_s"] == 5.0 and out["prefill_s"] == 2.0


@pytest.mark.parametrize("value", ["4", "8", "-1"])
def test_bench_lm_refuses_a_prefill_without_text_before_building_a_model(value):
    """The prefill's prompt ends in 8 audio groups: --prefill asks for more (or 0), and
    says so in one line, exit 2, before the minutes of building the model."""
    script = next(p for p in SCRIPTS if p.name == "bench_lm.py")
    run = subprocess.run([sys.executable, str(script), "--prefill", value], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2
    assert "--prefill needs more than 8 groups" in run.stderr
    assert "Traceback" not in run.stderr


def test_bench_lm_refuses_an_unknown_march_before_building_a_model():
    """--march names an x86-64 level for the kernels' build; anything else (a flag smuggled
    into the compiler's command line, say) is refused in one line, exit 2."""
    script = next(p for p in SCRIPTS if p.name == "bench_lm.py")
    for value in ("native -O0", "skylake", "x86-64-v5"):
        run = subprocess.run([sys.executable, str(script), "--march", value],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2, value
        assert "--march takes x86-64, x86-64-v2, x86-64-v3 or x86-64-v4" in run.stderr
        assert "Traceback" not in run.stderr


def test_a_checkouts_child_started_at_the_repository_root_runs_that_checkouts_package(tmp_path):
    """`bench_e2e --checkouts` and `bench_serve --variants` run `python -m mimo_tts.cli` under
    another checkout's package; `-m` puts the working directory first on sys.path, so from
    the repository root the root's own package would shadow it (`_common.checkout_env`)."""
    sys.path.insert(0, str(SCRIPTS[0].parent))
    try:
        import _common
    finally:
        sys.path.remove(str(SCRIPTS[0].parent))
    package = tmp_path / "other" / "mimo_tts"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "where.py").write_text("print(__file__)\n")
    run = subprocess.run([sys.executable, "-m", "mimo_tts.where"], capture_output=True,
                         text=True, timeout=60, cwd=_common.REPO,
                         env=_common.checkout_env(str(tmp_path / "other")))
    assert run.returncode == 0, run.stderr[-2000:]
    assert Path(run.stdout.strip()) == package / "where.py"
