"""`mimo-tts synth` on Ray Data: Stage-0 and Stage-1 actors, the CLI's output folder and exit codes.

    python scripts/ray_synth.py lines.txt --output-dir out --address auto \
        --stage0-actors 4 --stage0-gpus 1 --stage1-actors 16
"""

import argparse
import sys

from mimo_tts.batch.results import exit_code_for
from mimo_tts.errors import MimoTTSError

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
p.add_argument("input", help=".txt or .jsonl items, as synth --input")
p.add_argument("--output-dir", default="output_audio")
p.add_argument("--model", help="as synth --model (default: the published LM)")
p.add_argument("--address", help="a Ray cluster, e.g. auto (default: start a local instance)")
p.add_argument("--stage0-actors", type=int, default=1)
p.add_argument("--stage0-gpus", type=float, help="GPUs per Stage-0 actor (default: 1 on CUDA)")
p.add_argument("--stage1-actors", type=int, default=1)
p.add_argument("--max-new-groups", type=int)
a = p.parse_args()
import ray  # noqa: E402 (pip install 'mimo-tts[ray]'; --help works without it)

from mimo_tts.batch import ray as mray  # noqa: E402
from mimo_tts.batch.plan import SynthRequest  # noqa: E402
from mimo_tts.synthesis.settings import OptionValues  # noqa: E402

ray.init(address=a.address, log_to_driver=False)
request = SynthRequest(OptionValues(output_dir=a.output_dir, model=a.model,
                                    max_new_groups=a.max_new_groups), inputs=(a.input,))
try:
    results = list(mray.run(request, stage0_actors=a.stage0_actors, stage0_gpus=a.stage0_gpus,
                            stage1_actors=a.stage1_actors))
except MimoTTSError as exc:
    sys.exit(print(f"Error: {exc}", file=sys.stderr) or exc.exit_code)
print(f"{sum(r.status == 'ok' for r in results)} written, "
      f"{sum(r.status == 'skipped' for r in results)} skipped, "
      f"{sum(r.status == 'error' for r in results)} failed", file=sys.stderr)
sys.exit(exit_code_for(results))
