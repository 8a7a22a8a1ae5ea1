"""`scripts/ray_synth.py`: its help example reads as written, and synth's options it takes
reach the typed request as synth's own flags would (issue 22, B). Ray is not needed here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from mimo_tts.batch.plan import SynthRequest
from mimo_tts.synthesis.settings import OptionValues
from tests.helpers import REPO

SCRIPT = REPO / "scripts" / "ray_synth.py"


def _script():
    spec = importlib.util.spec_from_file_location("ray_synth", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines its functions; runs nothing
    return module


def test_b_the_help_example_keeps_its_line_break():
    shown = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                           text=True, timeout=60).stdout
    assert "--address auto \\\n        --stage0-actors 4" in shown  # was: joined, no "\"


def test_b_synth_options_map_onto_the_synth_request():
    script = _script()
    args = script.parser().parse_args([
        "book.jsonl", "--output-dir", "o", "--batch-size", "4", "--task",
        "tts_sft_with_instruct", "--seed", "7", "--instruct", "calm", "--tokenizer", "tok",
        "--lm-device", "cuda", "--tokenizer-device", "cpu", "--dtype", "bfloat16",
        "--tokenizer-dtype", "float32", "--model", "tiny", "--max-new-groups", "6",
        "--save-codes", "--config", "ci-smoke", "--stage0-actors", "2", "--voice", "narrator"])
    assert script.request(args) == SynthRequest(OptionValues(
        output_dir="o", batch_size=4, task="tts_sft_with_instruct", seed=7, instruct="calm",
        tokenizer="tok", lm_device="cuda", tokenizer_device="cpu", dtype="bfloat16",
        tokenizer_dtype="float32", model="tiny", max_new_groups=6, save_codes=True,
        voice="narrator"), inputs=("book.jsonl",), config="ci-smoke")
    plain = script.request(script.parser().parse_args(["lines.txt"]))
    assert plain == SynthRequest(OptionValues(output_dir="output_audio"), inputs=("lines.txt",))
