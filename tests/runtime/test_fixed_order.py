"""Sums whose order the thread count cannot change (mimo_tts/runtime/fixed_order.py and its
users), at sizes where PyTorch does split work across threads: each result at 1, 2 and 3
threads is bit-equal. Covers the LM's products (`linear`, `upcast_linear`, the CPU kernel's
GEMV at K=2048, N=512, M=1..8), one-query attention, SiLU and the codec's masked sums."""

from __future__ import annotations

import shutil

import pytest
import torch

from mimo_tts.codec.layers import _item_sums
from mimo_tts.lm import cpu_kernel
from mimo_tts.lm.model import linear, upcast_linear
from mimo_tts.runtime.fixed_order import attend_one, product, silu

THREADS = (1, 2, 3)


def at_each(fn) -> list[torch.Tensor]:
    """fn() at 1, 2 and 3 torch threads (restored after)."""
    before = torch.get_num_threads()
    try:
        out = []
        for threads in THREADS:
            torch.set_num_threads(threads)
            with torch.inference_mode():
                out.append(fn())
        return out
    finally:
        torch.set_num_threads(before)


def assert_bit_equal(results: list[torch.Tensor]) -> None:
    for threads, other in zip(THREADS[1:], results[1:], strict=True):
        assert torch.equal(results[0], other), f"1 vs {threads} threads"


def rand(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("rows", [1, 3, 5, 7, 9, 11, 62])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_of_every_row_count(rows, dtype):
    """MKL's float32 GEMM sums rows 5-11 of a [4096, 4096] product in thread-dependent
    shares (measured on an AVX512-BF16 EPYC); `linear` and `product` must not."""
    weight, bias = rand(4096, 4096, dtype=dtype) * 0.02, rand(4096, dtype=dtype, seed=1)
    x = rand(1, rows, 4096, dtype=dtype, seed=2)
    assert_bit_equal(at_each(lambda: linear(x, weight, bias)))
    assert_bit_equal(at_each(lambda: product(x, weight, bias)))
    torch.testing.assert_close(product(x.float(), weight.float(), bias.float()),
                               torch.nn.functional.linear(x.float(), weight.float(),
                                                          bias.float()), rtol=1e-4, atol=1e-4)


def test_upcast_prefill_product():
    weight, x = rand(1536, 2048, dtype=torch.bfloat16) * 0.02, rand(37, 2048, dtype=torch.bfloat16)
    assert_bit_equal(at_each(lambda: upcast_linear(x, weight)))


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_products_at_larger_sizes(dtype):
    """The CPU kernel splits a product's output rows between threads, never its sums: the
    same bits at 1, 2 and 3 threads for K=2048, N=512 and every row count 1-8."""
    lib = cpu_kernel.library()
    if lib is None:
        pytest.skip("the CPU kernel cannot be built here")
    weight, bias = rand(512, 2048, dtype=dtype) * 0.02, rand(512, dtype=dtype, seed=1)
    for rows in range(1, 9):
        x = rand(rows, 2048, dtype=dtype, seed=rows)
        results = [cpu_kernel._gemv(lib, x, weight, bias, threads) for threads in THREADS]
        assert_bit_equal(results)


@pytest.mark.parametrize(("batch", "heads", "kv", "dim", "keys"),
                         [(1, 32, 8, 128, 80), (3, 32, 8, 128, 1000), (1, 64, 64, 16, 11)])
def test_one_query_attention(batch, heads, kv, dim, keys):
    """PyTorch's float32 attention of one query splits its keys by the thread count."""
    q, k, v = (rand(batch, heads, 1, dim), rand(batch, kv, keys, dim, seed=1),
               rand(batch, kv, keys, dim, seed=2))
    mask = torch.rand(batch, 1, 1, keys, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[..., 0] = True
    for m in (None, mask):
        results = at_each(lambda m=m: attend_one(q, k, v, m))
        assert_bit_equal(results)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                                enable_gqa=heads != kv)
        torch.testing.assert_close(results[0], want, rtol=1e-5, atol=1e-5)


def test_silu_of_any_length():
    """PyTorch's float32 SiLU rounds its vector and scalar loops differently, and where a
    thread's share ends decides the loop: an odd length puts a share's end mid-vector."""
    x = rand(100003) * 4
    assert_bit_equal(at_each(lambda: silu(x)))
    torch.testing.assert_close(silu(x), torch.nn.functional.silu(x), rtol=1e-6, atol=1e-6)


def test_masked_group_norm_sums_of_one_item():
    """A sum of one value per item is split across threads by PyTorch when the batch is one
    item; the codec's masked GroupNorm sums chunk by chunk instead."""
    x = rand(1, 256, 9000)
    results = at_each(lambda: _item_sums(x))
    assert_bit_equal(results)
    assert results[0].shape == (1, 1, 1)
    torch.testing.assert_close(results[0], x.double().sum().float().view(1, 1, 1),
                               rtol=1e-5, atol=1e-2)
