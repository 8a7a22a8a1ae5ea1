"""The prefill's products on CPUs whose bfloat16 GEMM is slow (`model.upcast_linear`) and the
measured choice of them (`cpu_kernel.prefill_products`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mimo_tts.lm import cpu_kernel
from mimo_tts.lm.int8 import quantize_rows
from mimo_tts.lm.model import SMALL_ROWS, UPCAST_BLOCK, linear, upcast_linear
from mimo_tts.runtime.measured import Decision
from mimo_tts.runtime.paths import CACHE_ENV


def _operands(rows: int, out: int = 2 * UPCAST_BLOCK + 40, width: int = 256, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen).to(torch.bfloat16)
    weight = torch.randn(out, width, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out, generator=gen).to(torch.bfloat16)
    return x, weight, bias


def test_many_rows_are_the_float32_product_rounded_once():
    x, weight, bias = _operands(3 * SMALL_ROWS)  # a last block shorter than UPCAST_BLOCK
    found = upcast_linear(x[None], weight, bias)
    assert found.shape == (1, x.shape[0], weight.shape[0]) and found.dtype == torch.bfloat16
    exact = (x.double() @ weight.double().T + bias.double()).float()
    # one rounding to bfloat16 (8 bits of mantissa) of a float32 sum, as the bfloat16 GEMM
    torch.testing.assert_close(found[0].float(), exact, rtol=2 ** -8, atol=1e-2)
    gemm = F.linear(x, weight, bias).float()
    assert (found[0].float() - exact).abs().max() <= (gemm - exact).abs().max() * 1.01 + 1e-2


def test_few_rows_and_other_dtypes_are_plain_linear():
    x, weight, bias = _operands(SMALL_ROWS)
    assert torch.equal(upcast_linear(x, weight, bias), linear(x, weight, bias))
    x32, w32 = x.float().repeat(4, 1), weight.float()
    assert torch.equal(upcast_linear(x32, w32), linear(x32, w32))


def test_int8_weights_are_dequantized_as_linear_does():
    x, weight, _ = _operands(4 * SMALL_ROWS)
    q = quantize_rows(weight)
    found, expected = upcast_linear(x, q), linear(x, q)
    torch.testing.assert_close(found.float(), expected.float(), rtol=2 ** -7, atol=2e-2)


def test_each_row_is_computed_alone():
    """A row's result does not depend on the rows beside it (a continuous batch's rows and a
    single run give the same prefill)."""
    x, weight, bias = _operands(5 * SMALL_ROWS)
    alone = upcast_linear(x[:2 * SMALL_ROWS], weight, bias)
    together = upcast_linear(x, weight, bias)
    assert torch.equal(alone, together[:2 * SMALL_ROWS])


class _Model:
    """What `prefill_products` reads of a model: its kernel mode and weights."""

    def __init__(self, dtype, mode="auto", device="cpu"):
        self.cpu_kernel = mode
        self.lm_head = torch.nn.Linear(4, 4, dtype=dtype, device=device)
        self.model = torch.nn.Module()
        self.model.norm = torch.nn.LayerNorm(4, dtype=dtype, device=device)


def test_the_choice_is_measured_and_follows_the_mode(monkeypatch):
    assert cpu_kernel.prefill_products(_Model(torch.float32))[0] is linear
    assert cpu_kernel.prefill_products(_Model(torch.bfloat16, "off"))[0] is linear
    monkeypatch.setattr(cpu_kernel, "upcast_faster",
                        lambda: Decision(True, 60.0, 8.0, "measured now"))
    product, choice = cpu_kernel.prefill_products(_Model(torch.bfloat16))
    assert product is upcast_linear and choice.active and "60.0 vs 8.0 GFLOP/s" in choice.reason
    monkeypatch.setattr(cpu_kernel, "upcast_faster",
                        lambda: Decision(False, 50.0, 400.0, "measured now"))
    product, choice = cpu_kernel.prefill_products(_Model(torch.bfloat16))
    assert product is linear and not choice.active


def test_the_measurement_compares_both_products(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    cpu_kernel.upcast_faster.cache_clear()
    try:
        decision = cpu_kernel.upcast_faster()
        assert decision.ours > 0 and decision.theirs > 0 and isinstance(decision.faster, bool)
        assert cpu_kernel.upcast_faster() == decision  # measured once
    finally:
        cpu_kernel.upcast_faster.cache_clear()


def test_bfloat16_prefill_agrees_across_products(tiny_a, special, case_tensors, greedy_options,
                                                 monkeypatch):
    """The tiny reference LM in bfloat16: the prefill's last hidden state through either
    product agrees to bfloat16 rounding."""
    from mimo_tts.lm import generate as gen
    from mimo_tts.lm.load import load_lm
    from mimo_tts.runtime.devices import Choice

    model = load_lm(tiny_a / "lm", "cpu", torch.bfloat16, cpu_kernel="off")
    prompt = case_tensors("lm_generate")["gen_tts_en_free_greedy.input_ids"]
    options = greedy_options(max_new_groups=3)
    states = {}
    for product in (linear, upcast_linear):
        monkeypatch.setattr(cpu_kernel, "prefill_products",
                            lambda model, product=product: (product, Choice(True, "test")))
        states[product] = gen.prefill(model, [prompt], options, special).hidden
    torch.testing.assert_close(states[upcast_linear].float(), states[linear].float(),
                               rtol=2 ** -6, atol=2e-2)


def _in_a_new_thread(fn):
    """fn() in a fresh thread (its own, still empty upcast scratch); its result or its error."""
    import threading

    box = {}

    def run():
        try:
            box["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_the_scratch_serves_calls_inside_and_outside_inference_mode():
    """A generation runs under inference mode; a library user's next call in the same thread
    may not (a second model, a test): the scratch kept between calls must take both orders.
    Before the fix the second order raised "Inplace update to inference tensor outside
    InferenceMode" (the scratch made by the first call was an inference tensor)."""
    x, weight, bias = _operands(3 * SMALL_ROWS)
    int8 = quantize_rows(weight.float())
    for products in ((weight, bias), (int8, None)):
        def both_orders(first_inference: bool, products=products):
            results = []
            for inference in (first_inference, not first_inference):
                with torch.inference_mode(inference):
                    results.append(upcast_linear(x, *products).clone())
            return results

        for first_inference in (True, False):
            inside_first = _in_a_new_thread(lambda f=first_inference: both_orders(f))
            assert torch.equal(inside_first[0], inside_first[1])
