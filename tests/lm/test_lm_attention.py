"""The CPU kernel's attention of one query position (mimo_tts/lm/cpu_kernel.py `Attention`):
the backbone's decode step in bfloat16. Against a float64 softmax and PyTorch's bfloat16
attention, a row's bytes apart from its batch, padding and thread count, what it leaves to
`attend_one`, and the kernel step's choice of it."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from mimo_tts.lm import cpu_kernel
from mimo_tts.lm.load import load_lm
from mimo_tts.lm.model import KVCache
from mimo_tts.runtime.fixed_order import attend_one

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(scope="module")
def attention():
    return cpu_kernel.Attention(cpu_kernel.library())


def _operands(batch, heads, kv, dim, keys, seed=0, room=7):
    """q [B, h, 1, D] sliced from a wider projection and k, v [B, kv, S, D] sliced from a
    longer cache, as the backbone passes them; a mask [B, 1, 1, S] with row 0 left-padded by
    3 keys and a hole in the last row."""
    gen = torch.Generator().manual_seed(seed)
    qk = torch.randn(batch, heads + kv, 1, dim, generator=gen).bfloat16()
    k = torch.randn(batch, kv, keys + room, dim, generator=gen).bfloat16()[:, :, :keys]
    v = torch.randn(batch, kv, keys + room, dim, generator=gen).bfloat16()[:, :, :keys]
    mask = torch.ones(batch, keys + room, dtype=torch.bool)[:, None, None, :keys]
    mask[0, ..., :3] = False
    mask[-1, ..., keys // 2] = False
    return qk[:, :heads], k, v, mask


SHAPES = [(1, 32, 8, 128, 64), (3, 4, 2, 16, 37), (2, 8, 8, 32, 5), (2, 6, 1, 48, 300)]


@pytest.mark.parametrize(("batch", "heads", "kv", "dim", "keys"), SHAPES)
def test_it_is_as_close_to_a_float64_softmax_as_pytorchs(attention, batch, heads, kv, dim, keys):
    q, k, v, mask = _operands(batch, heads, kv, dim, keys)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                          enable_gqa=heads != kv)
    ours = attention(q, k, v, mask)
    theirs = attend_one(q, k, v, mask)
    assert ours.dtype == torch.bfloat16 and ours.shape == (batch, heads, 1, dim)
    err = (ours.double() - want).abs().amax().item()
    err_torch = (theirs.double() - want).abs().amax().item()
    # both round the output to bfloat16 (half a step: 2^-9 relative) and the softmax weights
    # for the values; ours may differ from PyTorch's by a step here and there, no more
    assert err <= 2 * err_torch + 2 ** -8 * want.abs().amax().item()
    torch.testing.assert_close(ours.float(), theirs.float(), atol=2 ** -7, rtol=2 ** -7)


def test_a_rows_bytes_do_not_depend_on_the_batch_its_padding_or_the_threads(attention):
    q, k, v, mask = _operands(3, 8, 2, 32, 40, seed=1)
    together = attention(q, k, v, mask)
    for r in range(3):  # alone, only its own keys, no mask
        keep = mask[r, 0, 0]
        alone = attention(q[r:r + 1], k[r:r + 1, :, keep], v[r:r + 1, :, keep])
        assert torch.equal(alone, together[r:r + 1]), r
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            assert torch.equal(attention(q, k, v, mask), together), threads
    finally:
        torch.set_num_threads(before)


def test_a_shared_mask_row_and_no_mask(attention):
    q, k, v, mask = _operands(2, 4, 2, 16, 12, seed=2)
    shared = mask[:1]  # [1, 1, 1, S]: one row of keys for every row
    assert torch.equal(attention(q, k, v, shared),
                       attention(q, k[:, :, shared[0, 0, 0]], v[:, :, shared[0, 0, 0]]))
    torch.testing.assert_close(attention(q, k, v).float(), attend_one(q, k, v).float(),
                               atol=2 ** -7, rtol=2 ** -7)


@pytest.mark.parametrize("case", ["float32", "width 24", "two queries", "strided heads"])
def test_other_operands_go_to_attend_one(attention, case):
    q, k, v, mask = _operands(2, 4, 2, 16 if case != "width 24" else 24, 10, seed=3)
    if case == "float32":
        q, k, v = q.float(), k.float(), v.float()
    elif case == "two queries":
        q, mask = torch.cat([q, q], dim=2), None
    elif case == "strided heads":
        k = k.transpose(2, 3).contiguous().transpose(2, 3)  # dims not contiguous
    assert torch.equal(attention(q, k, v, mask), attend_one(q, k, v, mask))


def test_the_kernel_step_attends_through_it_where_chosen(lm_dir, monkeypatch):
    model = load_lm(lm_dir, dtype=torch.bfloat16, cpu_kernel="on")
    cache = KVCache(model.cfg.patch_decoder, 1, model.cfg.local_steps, dtype=torch.bfloat16,
                    device="cpu")
    step = cpu_kernel.CpuKernelStep(model, None, cache)
    assert isinstance(step.attend, cpu_kernel.Attention)  # "on": wherever it runs
    auto = load_lm(lm_dir, dtype=torch.bfloat16, cpu_kernel="auto")
    for value, kind in (("0", type(attend_one)), ("1", cpu_kernel.Attention)):
        monkeypatch.setenv("MIMO_TTS_PRODUCT_CHOICES", f"lm_attention={value}")
        cpu_kernel.attention_faster.cache_clear()
        try:
            assert isinstance(cpu_kernel.CpuKernelStep(auto, None, cache).attend, kind)
        finally:
            cpu_kernel.attention_faster.cache_clear()
