"""The CPU fast paths of codec.layers against the plain per-layer paths they replace."""

import pytest
import torch
from torch import nn

from mimo_tts.codec.layers import (
    AttnSpec,
    Rotary,
    TransformerLayer,
    attention_mask,
    onednn_bf16,
    prepack,
    run_layers,
)

DIM, HEADS, FFN = 64, 4, 128


def stack(layers: int = 2, dtype=torch.float32) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(TransformerLayer(DIM, HEADS, FFN) for _ in range(layers)).to(
        dtype).eval().requires_grad_(False)


def per_layer(layers, rotary, x, spec, lengths=None):
    """The reference: every layer on the unpadded sequence with the shared plain mask."""
    rope = rotary.tables(x.shape[1], x.device, x.dtype)
    mask = attention_mask(spec, x.shape[0], x.shape[1], lengths, x.device)
    for layer in layers:
        x = layer(x, rope, spec, mask)
    return x


@pytest.mark.parametrize("size", [7, 128, 300])
def test_windowed_stack_padded_once_equals_per_layer_padding(size):
    layers, rotary, spec = stack(), Rotary(DIM // HEADS, 10000), AttnSpec(40, 10)
    x = torch.randn(1, size, DIM)
    with torch.inference_mode():
        got, _ = run_layers(layers, rotary, x, spec)
        expected = per_layer(layers, rotary, x, spec)
    assert got.shape == x.shape
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_windowed_batch_rows_equal_each_sequence_alone():
    layers, rotary, spec = stack(), Rotary(DIM // HEADS, 10000), AttnSpec(40, 10)
    x = torch.randn(2, 200, DIM)
    x[1, 150:] = 0
    with torch.inference_mode():
        got, _ = run_layers(layers, rotary, x, spec, torch.tensor([200, 150]))
        alone, _ = run_layers(layers, rotary, x[1:, :150], spec)
    torch.testing.assert_close(got[1, :150], alone[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("spec", [AttnSpec(causal=True), AttnSpec()])
def test_half_precision_stack_padded_once_equals_per_layer_key_padding(spec):
    """501 positions: the stack pads to 512 once; the reference pads K/V in every layer."""
    layers, rotary = stack(dtype=torch.bfloat16), Rotary(DIM // HEADS, 10000)
    x = torch.randn(1, 501, DIM).bfloat16()
    with torch.inference_mode():
        got, kept = run_layers(layers, rotary, x, spec, keep=0)
        expected = per_layer(layers, rotary, x, spec)
    assert got.shape == kept.shape == x.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=0.05, rtol=0.02)


@pytest.mark.skipif(not onednn_bf16(),
                    reason="needs oneDNN bfloat16 linears (AVX512-BW/VL/DQ, AVX-NE-CONVERT or AMX)")
def test_prepacked_bfloat16_layers_match_plain_and_follow_new_weights():
    layers, rotary, spec = stack(dtype=torch.bfloat16), Rotary(DIM // HEADS, 10000), AttnSpec()
    x = torch.randn(1, 64, DIM).bfloat16()
    with torch.inference_mode():
        plain, _ = run_layers(layers, rotary, x, spec)
        prepack(layers)
        assert hasattr(layers[0].fc1, "packed")
        packed, _ = run_layers(layers, rotary, x, spec)
        torch.testing.assert_close(packed.float(), plain.float(), atol=0.05, rtol=0.02)
        # the packed form replaced the weights: meta placeholders of their dtype in the modules
        assert layers[0].fc1.weight.is_meta and layers[0].fc1.weight.dtype == torch.bfloat16
        for layer in layers:  # new weights after packing: the stale packed form is not used
            layer.fc2.weight = nn.Parameter(
                torch.zeros(layer.fc2.weight.shape, dtype=torch.bfloat16), requires_grad=False)
            layer.fc2.bias.zero_()
        changed, _ = run_layers(layers, rotary, x, spec)
        prepack(layers)
        repacked, _ = run_layers(layers, rotary, x, spec)
    assert not torch.allclose(changed.float(), packed.float(), atol=0.1)
    torch.testing.assert_close(changed.float(), repacked.float(), atol=0.05, rtol=0.02)


def test_bfloat16_layers_run_where_onednn_refuses_bfloat16(monkeypatch):
    """On a CPU whose oneDNN has no bfloat16 linears (an AVX2-only EPYC) nothing is packed and
    the layers run PyTorch's own bfloat16 products, close to float32."""
    from mimo_tts.codec import layers as codec_layers

    monkeypatch.setattr(codec_layers, "onednn_bf16", lambda: False)
    half, full = stack(dtype=torch.bfloat16), stack()
    full.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    rotary, spec = Rotary(DIM // HEADS, 10000), AttnSpec()
    x = torch.randn(1, 32, DIM)
    with torch.inference_mode():
        prepack(half)
        assert not hasattr(half[0].fc1, "packed")
        got, _ = run_layers(half, rotary, x.bfloat16(), spec)
        expected, _ = run_layers(full, rotary, x, spec)
    torch.testing.assert_close(got.float(), expected, atol=0.1, rtol=0.05)
