r"""`mimo-tts synth` on Ray Data: Stage-0 and Stage-1 actors, the CLI's output folder and exit
codes.

    python scripts/ray_synth.py lines.txt --output-dir out --address auto \
        --stage0-actors 4 --stage0-gpus 1 --stage1-actors 16

The synth options below mean what `mimo-tts synth`'s of the same names mean. A book's pieces
run here too: `mimo-tts book BOOK --output-dir DIR --items-out DIR/book-items.jsonl`, then this
script on that file with `--output-dir DIR` (and the book's --voice or model options), then
the same `mimo-tts book` command again, which finds the pieces done and assembles the book.
"""

import argparse
import sys

# (flag, type, help) of synth's options this script passes on, by their OptionValues names
SYNTH_OPTIONS = [
    ("--model", str, "LM checkpoint (default: the published LM)"),
    ("--tokenizer", str, "audio tokenizer checkpoint (default: the published one)"),
    ("--task", str, "prompt task (default tts_sft)"),
    ("--instruct", str, "style instruction"),
    ("--prompt-audio", str, "voice prompt audio file"),
    ("--voice", str, "a stored voice (mimo-tts voices add)"),
    ("--seed", int, "sampling seed (default 0)"),
    ("--max-new-groups", int, "cap on generated groups (one group = 160 ms)"),
    ("--batch-size", int, "prompts generated together per Stage-0 call (default 1)"),
    ("--lm-device", str, "Stage-0 device: cpu, cuda, cuda:N"),
    ("--tokenizer-device", str, "Stage-1 device"),
    ("--dtype", str, "LM dtype (default auto)"),
    ("--tokenizer-dtype", str, "tokenizer dtype (default auto)"),
    ("--engine", str, "Stage-0 engine: native or vllm"),
    ("--format", str, "audio format (default wav)"),
]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help=".txt or .jsonl items, as synth --input")
    p.add_argument("--output-dir", default="output_audio")
    p.add_argument("--config", help="a TOML profile, as synth --config")
    p.add_argument("--save-codes", action="store_true", default=None)
    p.add_argument("--overwrite", action="store_true", default=None)
    for flag, kind, text in SYNTH_OPTIONS:
        p.add_argument(flag, type=kind, help=text)
    p.add_argument("--address", help="a Ray cluster, e.g. auto (default: start a local instance)")
    p.add_argument("--stage0-actors", type=int, default=1)
    p.add_argument("--stage0-gpus", type=float, help="GPUs per Stage-0 actor (default: 1 on CUDA)")
    p.add_argument("--stage1-actors", type=int, default=1)
    return p


def request(args: argparse.Namespace):
    """The typed request synth's flags would make (`batch.plan.SynthRequest`)."""
    from mimo_tts.batch.plan import SynthRequest
    from mimo_tts.synthesis.settings import OptionValues

    names = ["output_dir", "save_codes", "overwrite",
             *(flag[2:].replace("-", "_") for flag, _, _ in SYNTH_OPTIONS)]
    return SynthRequest(OptionValues(**{n: getattr(args, n) for n in names}),
                        inputs=(args.input,), config=args.config)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import ray  # pip install 'mimo-tts[ray]'; --help works without it

    from mimo_tts.batch import ray as mray
    from mimo_tts.batch.results import exit_code_for
    from mimo_tts.errors import MimoTTSError

    ray.init(address=args.address, log_to_driver=False)
    try:
        results = list(mray.run(request(args), stage0_actors=args.stage0_actors,
                                stage0_gpus=args.stage0_gpus, stage1_actors=args.stage1_actors))
    except MimoTTSError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"{sum(r.status == 'ok' for r in results)} written, "
          f"{sum(r.status == 'skipped' for r in results)} skipped, "
          f"{sum(r.status == 'error' for r in results)} failed", file=sys.stderr)
    return exit_code_for(results)


if __name__ == "__main__":
    sys.exit(main())
