"""The CPU kernel's packed weights (mimo_tts/lm/cpu_kernel.py `pack_model`): the layout round
trips, sits on huge pages and replaces the loaded matrices (one resident copy); its products
and patch-decoder steps give a row the same bytes alone or in a batch of any width, on any
number of threads, on every path this CPU can run (AVX512-BF16, AVX2, plain C; AMX where
granted), and track float32 like the eager modules."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mimo_tts.lm import cpu_kernel
from mimo_tts.lm.generate import generate
from mimo_tts.lm.load import load_lm
from mimo_tts.lm.model import KVCache, unpack_rows
from mimo_tts.lm.native import NativeEngine
from mimo_tts.runtime.devices import Choice
from tests.full_size import lm_config_cut, write_random_lm
from tests.helpers import FULL_SIZE

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
WIDTHS = range(1, 18)


def _paths() -> list[str]:
    """The packed products' paths this CPU runs: AMX tiles (where granted) and each
    instruction set below them that the kernel was compiled with."""
    isa = cpu_kernel.features()
    paths = ["amx"] if isa["amx"] else []
    if isa["avx512_bf16"]:
        paths.append("avx512_bf16")
    if isa["avx2"]:
        paths.append("avx2")
    return paths + ["c"]


@pytest.fixture(params=_paths())
def path(request):
    """Run the test on one path of the packed products (`cpu_kernel.set_isa`, AMX off below
    the tiles); restored after."""
    before = cpu_kernel.features()["amx_min_rows"]
    levels = {"amx": 2, "avx512_bf16": 2, "avx2": 1, "c": 0}
    cpu_kernel.set_amx_min_rows(1 if request.param == "amx" else cpu_kernel.MAX_ROWS + 1)
    cpu_kernel.set_isa(levels[request.param])
    yield request.param
    cpu_kernel.set_isa(2)
    cpu_kernel.set_amx_min_rows(before)


def _operands(out: int = 96, width: int = 320, rows: int = 17, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen).bfloat16()
    weight = torch.randn(out, width, generator=gen).bfloat16()
    bias = torch.randn(out, generator=gen).bfloat16()
    return x, weight, bias


def test_packing_round_trips_and_the_arena_is_on_huge_pages():
    lib = cpu_kernel.library()
    x, weight, _ = _operands(out=1024, width=2048)  # 4 MiB: two huge pages
    arena = cpu_kernel.huge_bytes(weight.numel() * 2)
    packed = cpu_kernel.pack(lib, weight, arena)
    assert packed.shape == (64, 1024, 32) and packed.data_ptr() == arena.data_ptr()
    assert torch.equal(unpack_rows(packed), weight)
    assert packed[1, 2, 2 * 3 + 1] == weight[16 + 3, 2 * 2 + 1]  # block 1, pair 2, row 3
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    assert arena.data_ptr() % cpu_kernel.HUGE_PAGE == 0
    assert cpu_kernel.huge_page_bytes([packed]) > 0  # AnonHugePages of its mapping


@pytest.mark.parametrize("bias", [False, True])
def test_packed_products_give_a_row_the_same_bytes_at_every_width(path, bias):
    """Widths 1-17 (and 40, a prefill's many rows): each row equals its single product byte
    for byte, and F.linear within one bfloat16 rounding."""
    x, weight, b = _operands(rows=40)
    b = b if bias else None
    packed = cpu_kernel.pack(cpu_kernel.library(), weight)
    alone = torch.cat([cpu_kernel.packed_linear(x[i:i + 1], packed, b) for i in range(40)])
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    torch.testing.assert_close(alone.float(), want, rtol=0,
                               atol=2 ** -7 * want.abs().amax().item())
    for n in [*WIDTHS, 40]:
        got = cpu_kernel.packed_linear(x[:n, None], packed, b)
        assert got.shape == (n, 1, 96) and torch.equal(got[:, 0], alone[:n]), n


def test_packed_products_do_not_depend_on_the_thread_count(path):
    x, weight, b = _operands(out=16 * 37, rows=17)  # 37 blocks: uneven shares
    packed = cpu_kernel.pack(cpu_kernel.library(), weight)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append([cpu_kernel.packed_linear(x[:n], packed, b) for n in (1, 8, 17)])
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, o) for a, o in zip(results[0], other, strict=True))


@pytest.fixture(scope="module")
def packed_lm(lm_dir):
    model = load_lm(lm_dir, dtype=torch.bfloat16, cpu_kernel="on")
    assert model.packed_bytes > 0
    return model


def test_q_k_v_and_gate_up_packed_from_their_mapped_parts_are_their_stacks_packed(
        lm_dir, packed_lm, monkeypatch):
    """The loader leaves q/k/v and gate/up in their mapped parts where the kernel packs them
    (no stack copied first); packing part after part gives the bytes of packing the stack a
    kernel-off load builds. Where the kernel then does not pack (measured slower), the parts
    are concatenated into the stack that load builds."""
    stacked = load_lm(lm_dir, dtype=torch.bfloat16, cpu_kernel="off")
    lib = cpu_kernel.library()
    pairs = list(zip(packed_lm.streamed_matrices(), stacked.streamed_matrices(), strict=True))
    fused = [(o, n) for (o, n, parts), _ in pairs if parts]
    assert len(fused) == 2 * (len(packed_lm.model.layers) + len(packed_lm.local_transformer.layers)
                              + len(packed_lm.input_local_transformer.layers))
    for (owner, name, parts), (plain_owner, _, plain_parts) in pairs:
        if parts:
            assert torch.equal(getattr(owner, name),
                               cpu_kernel.pack(lib, getattr(plain_owner, name)))
            for part, plain in zip(parts, plain_parts, strict=True):
                assert part.bias is None or torch.equal(part.bias, plain.bias)
    assert torch.equal(packed_lm.model.layers[0].self_attn.qkv_bias,
                       stacked.model.layers[0].self_attn.qkv_bias)
    monkeypatch.setattr(cpu_kernel, "choose", lambda model: Choice(False, "not in this test"))
    unpacked = load_lm(lm_dir, dtype=torch.bfloat16, cpu_kernel="auto")
    assert unpacked.packed_bytes == 0
    for (owner, name, parts), (plain_owner, _, _) in zip(
            unpacked.streamed_matrices(), stacked.streamed_matrices(), strict=True):
        assert torch.equal(getattr(owner, name), getattr(plain_owner, name))
        for part in parts:  # row views of the one concatenated matrix
            assert part.weight.untyped_storage().data_ptr() == \
                getattr(owner, name).untyped_storage().data_ptr()


@pytest.mark.parametrize("quant", ["w8a8", "w4a8"])
def test_the_fast_profiles_pack_q_k_v_and_gate_up_from_their_parts_as_their_stacks(lm_dir,
                                                                                     quant):
    """`--lm-quant w8a8` and `w4a8` pack q/k/v and gate/up from their mapped parts too: the
    int8 or 4-bit blocks and every row's (or row group's) scales equal those of packing the
    stack that a kernel-off load builds."""
    model = load_lm(lm_dir, dtype=torch.bfloat16, quant=quant)
    stacked = load_lm(lm_dir, dtype=torch.bfloat16, cpu_kernel="off")
    lib, packer = cpu_kernel.library(), cpu_kernel.QUANT_PACKERS[quant][1]
    fused = 0
    for (owner, name, parts), (plain_owner, _, _) in zip(
            model.streamed_matrices(), stacked.streamed_matrices(), strict=True):
        if parts:
            want, got = packer(lib, getattr(plain_owner, name)), getattr(owner, name)
            assert torch.equal(got, want)  # the scales by their bits (w8a8's sums are int32)
            assert torch.equal(got.scale.view(torch.int16), want.scale.view(torch.int16))
            fused += 1
    assert fused == 2 * (len(model.model.layers) + len(model.local_transformer.layers)
                         + len(model.input_local_transformer.layers))


def test_load_packs_every_streamed_matrix_in_place(packed_lm):
    """The streamed matrices are packed (all but the tiny model's lm_head, 420 rows: not
    whole blocks); the checkpoint-named parts are blocks of them (no unpacked copy stays
    reachable); the channel heads stay row-major; the sidecar says so."""
    for owner, name, parts in packed_lm.streamed_matrices():
        weight = getattr(owner, name)
        assert weight.dim() == 3 or owner is packed_lm.lm_head, name
        for part in parts:
            assert part.weight.dim() == 3
            assert part.weight.untyped_storage().data_ptr() == \
                weight.untyped_storage().data_ptr()
    assert packed_lm.local_transformer_lm_heads.fused.dim() == 2
    described = NativeEngine(packed_lm, None).describe()
    assert "packed in 16-row blocks" in described["lm_weights"]
    assert cpu_kernel.prefill_products(packed_lm)[1].active


def _steps(model, xs: torch.Tensor) -> torch.Tensor:
    """Eleven patch-decoder positions of xs [11, n, 1, D] through the kernel's step."""
    cache = KVCache(model.cfg.patch_decoder, xs.shape[1], model.cfg.local_steps,
                    dtype=xs.dtype, device="cpu")
    step = cpu_kernel.LocalStepKernel(model.local_transformer, cpu_kernel.library())
    assert step.packed
    with torch.inference_mode():
        return torch.stack([step(x, t, cache, t)[:, 0] for t, x in enumerate(xs)])


def test_packed_patch_decoder_rows_are_independent_of_width_and_threads(packed_lm, path):
    xs = torch.randn(11, 17, 1, packed_lm.cfg.local_dim,
                     generator=torch.Generator().manual_seed(4)).bfloat16()
    alone = torch.cat([_steps(packed_lm, xs[:, r:r + 1]) for r in range(17)], dim=1)
    for n in WIDTHS:
        assert torch.equal(_steps(packed_lm, xs[:, :n]), alone[:, :n]), n
    before = torch.get_num_threads()
    try:
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(_steps(packed_lm, xs[:, :5]), alone[:, :5]), threads
    finally:
        torch.set_num_threads(before)


def test_packed_generation_tracks_float32_like_eager(lm_dir, packed_lm, special, cases,
                                                     case_tensors, greedy_options, forcing,
                                                     path):
    """Forced generations (every decode step: backbone, lm_head, patch encoder and decoder)
    with packed weights drift from float32 no more than eager bfloat16 does, over the groups
    until either's codes leave float32's (then the inputs differ)."""
    eager = load_lm(lm_dir, dtype=torch.bfloat16, cpu_kernel="off")
    exact = load_lm(lm_dir)
    name = "gen_tts_en_forced"
    case = next(c for c in cases["groups"]["lm_generate"]["cases"] if c["name"] == name)
    prompt = case_tensors("lm_generate")[f"{name}.input_ids"]
    options = greedy_options(max_new_groups=case["params"]["max_new_groups"], keep_logits=True,
                             text_logits_processor=forcing([case["params"]["forced_script_ids"]]))
    want = generate(exact, [prompt], options, special)[0]
    runs = {name: generate(model, [prompt], options, special)[0]
            for name, model in (("packed", packed_lm), ("eager", eager))}
    group = exact.cfg.group_size
    same = min(_agreeing_groups(run.new_ids, want.new_ids, group) for run in runs.values())
    assert same >= 1
    scale = want.step_logits.abs().amax()
    errors = {name: ((run.step_logits[:same + 1] - want.step_logits[:same + 1]).abs().amax()
                     / scale).item() for name, run in runs.items()}
    assert errors["packed"] < 0.05 and errors["packed"] <= 1.5 * errors["eager"] + 1e-3, errors


def _agreeing_groups(ids: torch.Tensor, want: torch.Tensor, group: int) -> int:
    """How many leading groups of generated ids [1 + K, frames] equal the reference's."""
    n, total = 0, min(ids.shape[1], want.shape[1]) // group
    while n < total and torch.equal(ids[:, n * group:(n + 1) * group],
                                    want[:, n * group:(n + 1) * group]):
        n += 1
    return n


RSS_PROBE = """
import json, sys, torch
from mimo_tts.lm.load import load_config, load_lm
from mimo_tts.lm.model import MiMoAudioLM
from mimo_tts.lm import cpu_kernel
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
with torch.device("meta"):  # one-time runtime cost (torch's meta kernels load): not weights
    MiMoAudioLM(load_config(sys.argv[1]))
cpu_kernel.library()
base = status("VmRSS:")
model = load_lm(sys.argv[1], "cpu", "bfloat16", cpu_kernel="on")  # "on": no speed probe
for p in model.parameters():
    p.sum()  # touch every weight page
print(json.dumps({"delta": status("VmRSS:") - base, "peak": status("VmHWM:") - base,
                  "packed": model.packed_bytes}))
"""


@pytest.mark.slow
def test_packed_load_costs_the_weights_once(tmp_path):
    """Packing replaces each loaded matrix (a zero-copy mapping or a fused stack) as it goes:
    the packed model holds its weights once, as the row-major one does, and the load never
    held much more (its peak: the weights and the matrix in hand)."""
    cfg = lm_config_cut(json.loads((FULL_SIZE / "lm-config.json").read_text()),
                        hidden_size=1024, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=2, intermediate_size=3072, vocab_size=8192,
                        local_layers=2, input_local_layers=1)
    weights = write_random_lm(tmp_path / "lm", cfg)
    out = subprocess.run([sys.executable, "-c", RSS_PROBE, str(tmp_path / "lm")],
                         capture_output=True, text=True, timeout=300, check=True)
    found = json.loads(out.stdout)
    assert found["packed"] > 0.8 * weights, found
    assert found["delta"] < 1.05 * weights + (48 << 20), (found["delta"] / weights, weights)
    assert found["peak"] < 1.15 * weights + (48 << 20), (found["peak"] / weights, weights)
