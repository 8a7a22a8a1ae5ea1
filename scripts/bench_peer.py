"""Stage-1 side by side with vllm-omni's MiMo-Audio tokenizer, same weights, same run; prints JSON.

The peer is vllm-omni's own tokenizer module (`model_executor/models/mimo_audio`), taken from its
wheel on the package index and run from a cache, never vendored:

- `.bench/peer/wheels/`: `pip download --no-deps vllm-omni==VERSION`;
- `.bench/peer/src/`: only the wheel's `mimo_audio` folder (imported as a namespace package, so
  vllm-omni's heavy top-level `__init__` never runs);
- `.bench/peer/venv/`: a separate venv with our torch/torchaudio versions and the two packages
  that folder imports (transformers and einops, at versions inside the wheel's pins).

Shim (peer side only, here): the module imports `vllm.logger.init_logger` for a logger, and vLLM is
not installed in the peer venv, so `vllm.logger` is stubbed with `logging.getLogger`. flash-attn
is absent, so the module takes its CPU SDPA path, as vllm-omni does on CPU.

Both sides load one safetensors file of random full-size weights (bench_codec's `random_model`,
only the half a direction needs: decoder + RVQ codebooks, or encoder), each in its own process,
kept alive while the parent alternates single timed calls between them (ours, peer, peer, ours,
...), after the same untimed warm-up calls on both sides (for encode, enough for our float32
encoder to pack its layers, as a process that encodes a lot does: `warmup_calls`). Per op and
dtype: best of N per round, for R rounds; the ratio is peer time / ours. Decode takes 8
codebooks of random codes; encode is log-mel + encoder + RVQ of random audio. Fidelity
(same weights, same inputs): waveform max-abs/RMS distance and code agreement, in each dtype.

    .venv/bin/python scripts/bench_peer.py [--seconds 10] [--threads 2] [--repeats 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from _common import FULL_SIZE

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".bench" / "peer"
PEER_VERSION = "0.30.0"
PEER_MODULE = "vllm_omni/model_executor/models/mimo_audio/"
# What the module imports beyond torch, at versions inside vllm-omni 0.30.0's own pins
# (transformers>=5.13.0,<5.15; einops>=0.8.1).
PEER_REQUIREMENTS = ("transformers==5.14.1", "einops==0.8.2")
CONFIG = FULL_SIZE / "tokenizer-config.json"
OPS = {"decode": "decoder", "encode": "encoder"}  # op -> the model half it needs
# Tensor-name prefixes each half needs (decode dequantizes with the encoder's RVQ codebooks).
NEEDED = {"decoder": ("decoder.", "encoder.quantizer."), "encoder": ("encoder.",)}
DECODE_CHANNELS = 8  # the LM's codebooks: what Stage-1 decodes in TTS (spec §1)
WARMUP_ENV = "MIMO_TTS_BENCH_PEER_WARMUP"  # parent -> worker: untimed calls before the timed ones
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


# ---- the cache: wheel, module, venv, weights, inputs ------------------------------------------
def _pip(python: Path | str, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "-q", *args], check=True,
                   stdout=subprocess.DEVNULL)


def peer_python() -> Path:
    """The peer venv's python, building wheel cache, module and venv on first use."""
    wheels, src, venv = CACHE / "wheels", CACHE / "src", CACHE / "venv"
    wheel = next(wheels.glob(f"vllm_omni-{PEER_VERSION}-*.whl"), None)
    if wheel is None:
        _pip(sys.executable, "download", "--no-deps", f"vllm-omni=={PEER_VERSION}",
             "-d", str(wheels))
        wheel = next(wheels.glob(f"vllm_omni-{PEER_VERSION}-*.whl"))
    if not (src / PEER_MODULE / "modeling_audio_tokenizer.py").exists():
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(src, [n for n in archive.namelist() if n.startswith(PEER_MODULE)])
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        torch_pins = [f"{name}=={importlib.metadata.version(name)}"
                      for name in ("torch", "torchaudio")]
        _pip(python, "install", *torch_pins, *PEER_REQUIREMENTS)
    return python


def weights_file(part: str, write: bool = False) -> Path:
    """Random full-size weights of one half as float32 safetensors (`write`: once, in a child)."""
    path = CACHE / "weights" / f"{part}.safetensors"
    if write and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, __file__, "--write-weights", part, str(path)], check=True)
    return path


def write_weights(part: str, path: str) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_codec import random_model
    from safetensors.torch import save_file

    from mimo_tts.codec.config import CodecConfig

    model = random_model(CodecConfig.from_json(json.loads(CONFIG.read_text())), part)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if not v.is_meta}
    save_file(tensors, path + ".tmp")
    os.replace(path + ".tmp", path)


def write_inputs(path: Path, seconds: float) -> None:
    """Random codes [8, T] and audio [S] at 24 kHz, shared by both sides."""
    import torch

    config = json.loads(CONFIG.read_text())
    frames = round(seconds * config["sampling_rate"] / config["hop_length"] / 4)  # 25 Hz
    generator = torch.Generator().manual_seed(1)
    codes = torch.stack([torch.randint(0, size, (frames,), generator=generator)
                         for size in config["codebook_size"][:DECODE_CHANNELS]])
    audio = 0.1 * torch.randn(round(seconds * config["sampling_rate"]), generator=generator)
    torch.save({"codes": codes, "audio": audio}, path)


# ---- workers: one model half in one dtype, timing single calls on request ----------------------
def ours_runner(part: str, dtype_name: str):
    """Our tokenizer with only `part` loaded: returns the op as a function of the inputs."""
    import torch
    from safetensors.torch import load_file

    from mimo_tts.codec.config import CodecConfig
    from mimo_tts.codec.layers import prepack
    from mimo_tts.codec.load import build_model
    from mimo_tts.codec.tokenizer import AudioTokenizer

    dtype = getattr(torch, dtype_name)
    config = CodecConfig.from_json(json.loads(CONFIG.read_text()))
    model = build_model(config, dtype)
    targets = model.state_dict(keep_vars=True)
    tensors = {k: v.to(targets[k].dtype) for k, v in load_file(weights_file(part)).items()}
    missing = model.load_state_dict(tensors, strict=False, assign=True).missing_keys
    if lost := [k for k in missing if k.startswith(NEEDED[part])]:
        raise SystemExit(f"ours: weights missing from {part}: {lost[:3]}")
    model.eval().requires_grad_(False)
    # what `place_model` does on CPU (it cannot move a half-meta model), MIMO_TTS_CODEC_KERNEL
    # read as a run's placement reads it
    prepack(model, codec_kernel=_codec_kernel())
    tok = AudioTokenizer(model, "cpu", dtype)
    if part == "decoder":
        return lambda inputs: tok.decode(inputs["codes"])
    return lambda inputs: tok.encode(inputs["audio"], config.sampling_rate)


def _codec_kernel() -> str:
    """The codec GEMM's mode: MIMO_TTS_CODEC_KERNEL (auto when unset)."""
    from mimo_tts.runtime.devices import CODEC_KERNEL_ENV, resolve_kernel

    return resolve_kernel(CODEC_KERNEL_ENV).value


def _stub_vllm_logger() -> None:
    """The peer module's only vLLM import is `vllm.logger.init_logger`: give it logging's."""
    import logging
    import types

    vllm = types.ModuleType("vllm")
    vllm.logger = types.ModuleType("vllm.logger")
    vllm.logger.init_logger = logging.getLogger
    sys.modules.update({"vllm": vllm, "vllm.logger": vllm.logger})


def peer_runner(part: str, dtype_name: str):
    """vllm-omni's MiMoAudioTokenizer, built on meta, `part` assigned from the same file."""
    import torch
    from safetensors.torch import load_file

    _stub_vllm_logger()
    sys.path.insert(0, str(CACHE / "src"))
    from torchaudio.transforms import MelSpectrogram
    from vllm_omni.model_executor.models.mimo_audio import modeling_audio_tokenizer as peer
    from vllm_omni.model_executor.models.mimo_audio.config_mimo_audio import (
        MiMoAudioTokenizerConfig,
    )

    raw = json.loads(CONFIG.read_text())
    config = MiMoAudioTokenizerConfig(**raw)
    with torch.device("meta"):
        model = peer.MiMoAudioTokenizer(config)
    result = model.load_state_dict(load_file(weights_file(part)), strict=False, assign=True)
    # Training-only RVQ buffers are not in our checkpoint; RoPE tables are derived, not stored.
    for name in result.missing_keys:
        owner, _, leaf = name.rpartition(".")
        if leaf in ("inited", "cluster_size", "embed_avg") and name.startswith(NEEDED[part]):
            model.get_submodule(owner).register_buffer(leaf, torch.zeros(model.get_buffer(
                name).shape))
    for name, module in list(model.named_modules()):
        if isinstance(module, peer.RotaryEmbedding) and name.startswith(part):
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, peer.RotaryEmbedding(
                module._rope_base, module._rope_dim, module.max_seq_len, module.rope_type))
    half = model.decoder if part == "decoder" else model.encoder
    meta = [n for n, t in [*half.state_dict().items(),
                           *model.encoder.quantizer.state_dict().items()] if t.is_meta]
    if meta:
        raise SystemExit(f"peer: tensors left unloaded: {meta[:3]}")
    dtype = getattr(torch, dtype_name)
    for module in (half, model.encoder.quantizer):
        module.to(dtype)  # as vllm-omni's tokenizer worker casts the whole tokenizer
    model.eval()
    if part == "decoder":
        def decode(inputs):
            with torch.inference_mode():
                return model.decode(inputs["codes"]).float().reshape(-1)
        return decode
    with torch.device("cpu"):  # as vllm-omni's worker builds it (spec: log of the magnitude mel)
        mel = MelSpectrogram(sample_rate=raw["sampling_rate"], n_fft=raw["nfft"],
                             hop_length=raw["hop_length"], win_length=raw["window_size"],
                             f_min=raw["fmin"], f_max=raw["fmax"], n_mels=raw["n_mels"],
                             power=1.0, center=True)

    def encode(inputs):
        with torch.inference_mode():
            spec = mel(inputs["audio"].float()[None])
            features = torch.log(torch.clip(spec, min=1e-7)).squeeze().transpose(0, 1)
            codes, _ = model.encoder.encode(
                input_features=features, input_lens=torch.tensor([features.shape[0]]),
                return_codes_only=True)
            return codes
    return encode


def worker(side: str, part: str, dtype_name: str, threads: int, inputs_path: str) -> None:
    """Serve `run` (one timed call -> {"seconds"}) and `dump PATH` (save the output) on stdin.

    Replies go to the original stdout; anything the libraries print goes to stderr.
    """
    import torch

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    torch.set_num_threads(threads)
    op = (ours_runner if side == "ours" else peer_runner)(part, dtype_name)
    inputs = torch.load(inputs_path)
    for _ in range(int(os.environ.get(WARMUP_ENV, "1"))):  # the parent's count (`warmup_calls`)
        op(inputs)
    ready = {"ready": True}
    if side == "ours" and dtype_name == "float32":
        from mimo_tts.codec.gemm import choose

        choice = choose(mode=_codec_kernel())
        ready["engine"] = f"{choice.words} ({choice.reason})"
    replies.write(json.dumps(ready) + "\n")
    replies.flush()
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        start = time.perf_counter()
        output = op(inputs)
        reply = {"seconds": time.perf_counter() - start}
        if command == "dump":
            torch.save(output.detach().cpu(), arg)
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def warmup_calls(part: str, inputs: Path) -> int:
    """Untimed calls before the timed ones, the same on both sides: one, and as many more as
    ours runs before it packs that half's float32 layers (a process that encodes or decodes a
    lot packs them, `layers.ENCODER_PACK_AFTER_S`, `DECODER_PACK_AFTER_S`): the timed calls
    measure such a process."""
    import torch

    from mimo_tts.codec.layers import DECODER_PACK_AFTER_S, ENCODER_PACK_AFTER_S

    after_s = {"encoder": ENCODER_PACK_AFTER_S, "decoder": DECODER_PACK_AFTER_S}[part]
    seconds = len(torch.load(inputs)["audio"]) / json.loads(CONFIG.read_text())["sampling_rate"]
    return 1 + math.ceil(after_s / seconds)  # the codes stand for as long as the audio


class Worker:
    """The parent's handle on one worker process."""

    def __init__(self, side: str, part: str, dtype: str, threads: int, inputs: Path):
        python = sys.executable if side == "ours" else peer_python()
        env = {**os.environ, WARMUP_ENV: str(warmup_calls(part, inputs))}
        self.process = subprocess.Popen(
            [str(python), __file__, "--worker", side, part, dtype, str(threads), str(inputs)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.side = side
        self.engine = self._reply().get("engine")

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"{self.side} worker exited (code {self.process.wait()})")
        return json.loads(line)

    def call(self, command: str) -> float:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._reply()["seconds"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


# ---- the comparison --------------------------------------------------------------------------
def fidelity(op: str, ours, peer) -> dict:
    """Distance between the two sides' outputs on the same weights and inputs."""
    if op == "decode":
        diff = (ours.double() - peer.double())
        return {"samples": ours.numel(), "max_abs": float(diff.abs().max()),
                "rms": float(diff.pow(2).mean().sqrt()),
                "reference_rms": float(peer.double().pow(2).mean().sqrt())}
    same = ours == peer
    return {"codes_shape": list(ours.shape), "agreement": round(float(same.float().mean()), 4),
            "agreement_first_8": round(float(same[:DECODE_CHANNELS].float().mean()), 4),
            "agreement_codebook_0": round(float(same[0].float().mean()), 4)}


def compare(op: str, dtype: str, args, inputs: Path) -> dict:
    """Both workers up, outputs dumped once, then R rounds of N alternating timed calls."""
    import torch

    part = OPS[op]
    workers = {}
    try:
        weights_file(part, write=True)
        for side in ("ours", "peer"):
            workers[side] = Worker(side, part, dtype, args.threads, inputs)
        outputs = {}
        for side, handle in workers.items():
            path = CACHE / f"out-{side}.pt"
            handle.call(f"dump {path}")
            outputs[side] = torch.load(path)
        rounds = []
        for _ in range(args.rounds):
            times = {"ours": [], "peer": []}
            for repeat in range(args.repeats):
                order = ("ours", "peer") if repeat % 2 == 0 else ("peer", "ours")
                for side in order:
                    times[side].append(workers[side].call("run"))
            best = {side: min(values) for side, values in times.items()}
            rounds.append({"ours_s": round(best["ours"], 4), "peer_s": round(best["peer"], 4),
                           "ratio": round(best["peer"] / best["ours"], 3),
                           "all_s": {k: [round(t, 4) for t in v] for k, v in times.items()}})
            print(json.dumps({"op": op, "dtype": dtype, **rounds[-1]}), file=sys.stderr)
    finally:
        for handle in workers.values():
            handle.close()
    engine = workers["ours"].engine
    ours_best = min(r["ours_s"] for r in rounds)
    peer_best = min(r["peer_s"] for r in rounds)
    return {"op": op, "dtype": dtype, "audio_s": args.seconds, "ours_s": ours_best,
            "peer_s": peer_best, "ratio": round(peer_best / ours_best, 3),
            "ratio_min_round": min(r["ratio"] for r in rounds), "rounds": rounds,
            "fidelity": fidelity(op, outputs["ours"], outputs["peer"]),
            **({"ours_engine": engine} if engine else {})}


def machine() -> dict:
    """CPU model and the ISA features that decide the matmul paths."""
    from mimo_tts.runtime.devices import cpu_flags

    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = cpu_flags()
    return {"cpu": fields.get("Model name", platform.processor()).strip(),
            "cpus": os.cpu_count(), "isa": [f for f in ISA_FLAGS if f in flags]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per side per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ops", default="decode,encode")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--write-weights", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        side, part, dtype, threads, inputs = args.worker
        return worker(side, part, dtype, int(threads), inputs)
    if args.write_weights:
        return write_weights(*args.write_weights)
    import torch

    python = peer_python()
    inputs = CACHE / "inputs.pt"
    write_inputs(inputs, args.seconds)
    peer_versions = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('transformers'))"],
        capture_output=True, text=True, check=True).stdout.strip()
    report = {"benchmark": "stage1_vs_vllm_omni", "machine": machine(),
              "torch": torch.__version__, "threads": args.threads, "repeats": args.repeats,
              "rounds": args.rounds, "config": str(CONFIG),
              "peer": {"package": f"vllm-omni=={PEER_VERSION}", "module": PEER_MODULE,
                       "transformers": peer_versions, "attention": "CPU SDPA path"},
              "load_average_start": os.getloadavg(), "results": []}
    for op in args.ops.split(","):
        for dtype in args.dtypes.split(","):
            report["results"].append(compare(op, dtype, args, inputs))
    report["load_average_end"] = os.getloadavg()
    with contextlib.suppress(FileNotFoundError):
        for side in ("ours", "peer"):
            (CACHE / f"out-{side}.pt").unlink()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
