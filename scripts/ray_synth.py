r"""`mimo-tts synth` on Ray Data: Stage-0 and Stage-1 actors, the CLI's output folder and exit
codes.

    python scripts/ray_synth.py lines.txt --output-dir out --address auto \
        --stage0-actors 4 --stage0-gpus 1 --stage1-actors 16

The synth options below mean what `mimo-tts synth`'s of the same names mean. A book's pieces
run here too: `mimo-tts book BOOK --output-dir DIR --items-out DIR/book-items.jsonl` (without a
voice it reads the book's voice, DIR/book-voice.wav, which every item names), then this
script on that file with `--output-dir DIR` (and the book's --voice or model options), then
the same `mimo-tts book` command again, which finds the pieces done and assembles the book.
"""

import argparse
import sys


def parser() -> argparse.ArgumentParser:
    from mimo_tts.cli.params import add_arguments
    from mimo_tts.synthesis.options import RunOptions

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help=".txt or .jsonl items, as synth --input")
    add_arguments(p, "ray_synth")  # synth's flags that a Ray run takes (cli/params.py)
    p.set_defaults(output_dir=RunOptions.output_dir)
    p.add_argument("--address", help="a Ray cluster, e.g. auto (default: start a local instance)")
    p.add_argument("--stage0-actors", type=int, default=1)
    p.add_argument("--stage0-gpus", type=float, help="GPUs per Stage-0 actor (default: 1 on CUDA)")
    p.add_argument("--stage1-actors", type=int, default=1)
    return p


def request(args: argparse.Namespace):
    """The typed request synth's flags would make (`batch.plan.SynthRequest`)."""
    from mimo_tts.batch.plan import SynthRequest
    from mimo_tts.cli.params import OPTIONS, options_of
    from mimo_tts.synthesis.settings import OptionValues

    given = {o.name: getattr(args, o.name) for o in options_of("ray_synth") if o.home == OPTIONS}
    return SynthRequest(OptionValues(**given), inputs=(args.input,), config=args.config)


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
