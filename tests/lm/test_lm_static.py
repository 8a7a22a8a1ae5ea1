"""The fused weights and the fixed-shape decode step (the CUDA-graph formulation, run
eagerly here) against the reference (fixtures README §5.4) and the eager path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mimo_tts.errors import UsageError
from mimo_tts.lm.generate import GenerationOptions, generate
from mimo_tts.lm.graph import SPAN_MIN, span_buckets
from mimo_tts.lm.model import SMALL_ROWS, linear
from mimo_tts.runtime.safetensors import load_tensors
from tests.helpers import find_case

TOL = 1e-4
CASES = [
    ("lm_generate", "gen_tts_en_forced"),
    ("lm_generate", "gen_tts_instruct_forced"),
    ("lm_generate", "gen_tts_en_free_greedy"),
    ("voice_prompt", "gen_tts_voice_forced"),
]


@pytest.mark.parametrize(("group", "name"), CASES)
def test_static_decode_matches_reference(lm, special, cases, case_tensors, forcing,
                                         greedy_options, group, name):
    case, t = find_case(cases, name), case_tensors(group)
    script = case["params"]["forced_script_ids"]
    options = greedy_options(max_new_groups=case["params"]["max_new_groups"], keep_logits=True,
                             text_logits_processor=forcing([script]) if script else None,
                             decode_step="static")
    result = generate(lm, [t[f"{name}.input_ids"]], options, special)[0]
    assert result.text_tokens == case["generated_text_tokens"]
    assert torch.equal(result.new_ids, t[f"{name}.new_ids"].long())
    torch.testing.assert_close(result.step_logits, t[f"{name}.step_text_logits"],
                               atol=TOL, rtol=0)


def test_static_padded_batch_matches_reference(lm, special, cases, case_tensors, forcing,
                                               greedy_options):
    """Three prompt lengths (54, 56, 147 groups): two rows are left-padded and the key
    mask carries the padding into every fixed-span step."""
    names = ["gen_tts_en_forced", "gen_tts_zh_forced_interleaved", "gen_tts_instruct_forced"]
    scripts = [find_case(cases, n)["params"]["forced_script_ids"] for n in names]
    t = case_tensors("lm_generate")
    options = greedy_options(text_logits_processor=forcing(scripts), keep_logits=True,
                             decode_step="static")
    results = generate(lm, [t[f"{n}.input_ids"] for n in names], options, special)
    assert [len(r.text_tokens) for r in results] == [7, 9, 8]
    for name, result in zip(names, results, strict=True):
        assert torch.equal(result.new_ids, t[f"{name}.new_ids"].long())
        torch.testing.assert_close(result.step_logits, t[f"{name}.step_text_logits"],
                                   atol=TOL, rtol=0)


def test_static_equals_eager_across_span_buckets(lm, case_tensors, modes_agree):
    """A 54-group prompt run for 16 groups crosses the first span bucket (64)."""
    prompt = case_tensors("lm_generate")["gen_tts_en_forced.input_ids"]
    assert prompt.shape[1] // lm.cfg.group_size < SPAN_MIN < prompt.shape[1] // 4 + 16
    modes_agree(lm, prompt, ("eager", "static"), groups=16, atol=1e-5)


def test_static_sampling_follows_the_seed_like_eager(lm, special, case_tensors, forcing):
    """Padded rows of the fixed-shape patch decoder are never sampled: the random stream,
    hence the sampled codes, equal the eager path's."""
    prompt = case_tensors("lm_generate")["gen_tts_en_forced.input_ids"]
    hook = forcing([[special.empty, special.eot, special.empty, special.empty]])
    runs = [generate(lm, [prompt], GenerationOptions.for_task(
        "tts", seed=5, max_new_groups=4, text_logits_processor=hook, decode_step=mode),
        special)[0].new_ids for mode in ("eager", "static")]
    assert torch.equal(runs[0], runs[1])


def test_decode_step_choice_by_option_and_device(lm, special, case_tensors, greedy_options):
    from mimo_tts.lm.generate import decode_step, prefill
    from mimo_tts.lm.graph import GraphStep
    from mimo_tts.lm.step import EagerStep

    prompt = case_tensors("lm_generate")["gen_tts_en_forced.input_ids"]
    state = prefill(lm, [prompt], greedy_options(max_new_groups=4), special)
    for mode in ("auto", "eager"):  # on CPU, float32: eager (the kernel is slower there)
        assert type(decode_step(lm, state, GenerationOptions(decode_step=mode))) is EagerStep
    static = decode_step(lm, state, GenerationOptions(decode_step="static"))
    assert isinstance(static, GraphStep)
    assert not static.capture and static.spans == [state.cache.length]
    assert static.valid.shape == (1, state.cache.length)
    width = state.prompt_len
    assert static.valid[0, :width].all() and not static.valid[0, width:].any()


def test_span_buckets():
    assert span_buckets(30) == [30]
    assert span_buckets(64) == [64]
    assert span_buckets(300) == [64, 128, 256, 300]
    spans = span_buckets(8192)
    assert spans[0] == SPAN_MIN and spans[-1] == 8192
    assert all(b == 2 * a for a, b in zip(spans, spans[1:], strict=False))


def test_decode_step_option_is_checked(lm, special, case_tensors, greedy_options):
    with pytest.raises(UsageError, match="decode_step must be one of"):
        GenerationOptions(decode_step="fast")
    prompt = case_tensors("lm_generate")["gen_tts_en_forced.input_ids"]
    with pytest.raises(UsageError, match="needs a CUDA device"):
        generate(lm, [prompt], greedy_options(max_new_groups=2, decode_step="graph"), special)


def test_fused_parameters_keep_checkpoint_names_and_share_memory(lm, lm_dir):
    checkpoint = load_tensors(lm_dir)
    state = lm.state_dict()
    assert set(state) == set(checkpoint) - {k for k in checkpoint if k.startswith("mel_")}
    for name, tensor in state.items():
        assert torch.equal(tensor, checkpoint[name].float()), name
    for stack in (lm.model, lm.input_local_transformer, lm.local_transformer):
        for layer in stack.layers:
            attn, mlp = layer.self_attn, layer.mlp
            base = attn.qkv_weight.untyped_storage().data_ptr()
            for part in (attn.q_proj, attn.k_proj, attn.v_proj):
                assert part.weight.untyped_storage().data_ptr() == base
                assert part.bias.untyped_storage().data_ptr() == \
                    attn.qkv_bias.untyped_storage().data_ptr()
            assert mlp.up_proj.weight.untyped_storage().data_ptr() == \
                mlp.gate_up_weight.untyped_storage().data_ptr()
    heads = lm.local_transformer_lm_heads
    assert heads.fused.shape == (sum(lm.cfg.speech_vocab_sizes), lm.cfg.local_dim)
    assert heads[7].weight.untyped_storage().data_ptr() == heads.fused.untyped_storage().data_ptr()


def test_fused_blocks_equal_their_checkpoint_parts(lm):
    """The fused matrices compute what the separate checkpoint layers would (the only path
    the blocks have): one layer's q/k/v and gate/up outputs, split back."""
    layer = lm.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    x = torch.randn(3, 1, lm.cfg.hidden, generator=torch.Generator().manual_seed(0))
    qkv = linear(x, attn.qkv_weight, attn.qkv_bias)
    parts = torch.cat([F.linear(x, p.weight, p.bias)
                       for p in (attn.q_proj, attn.k_proj, attn.v_proj)], dim=-1)
    torch.testing.assert_close(qkv, parts, atol=1e-5, rtol=0)
    gate_up = linear(x, mlp.gate_up_weight)
    parts = torch.cat([F.linear(x, p.weight) for p in (mlp.gate_proj, mlp.up_proj)], dim=-1)
    torch.testing.assert_close(gate_up, parts, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows", [1, 2, SMALL_ROWS, SMALL_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_kernels_equal_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1, 48, generator=gen)
    weight = torch.randn(40, 48, generator=gen)
    b = torch.randn(40, generator=gen) if bias else None
    out = linear(x, weight, b)
    assert out.shape == (rows, 1, 40)
    torch.testing.assert_close(out, F.linear(x, weight, b), atol=1e-5, rtol=0)
