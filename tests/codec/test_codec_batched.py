"""Several incremental streams pushed together (`codec.push_streams`, the server's Stage-1):
each stream's samples are the ones it gets alone."""

from __future__ import annotations

import pytest
import torch

from mimo_tts.codec import StreamingDecoder, push_streams
from mimo_tts.codec.incremental import DecoderCache, step_streams

SAME_TOL = 1e-5  # tests/codec/test_codec_incremental.py
GROWING = [44, 8, 16, 32, 40]  # frames: look-ahead + 1 group, then 2, 4, 8, 10 groups


def _cuts(total: int, sizes=GROWING) -> list[tuple[int, int]]:
    out, start, index = [], 0, 0
    while start < total:
        out.append((start, min(total, start + sizes[min(index, len(sizes) - 1)])))
        start, index = out[-1][1], index + 1
    return out


def _solo(codec, codes, mode):
    decoder = StreamingDecoder(codec, mode=mode)
    pieces = [decoder.push(codes[:, a:b], last=b == codes.shape[1])
              for a, b in _cuts(codes.shape[1])]
    return torch.cat([p for p in pieces if p is not None])


def _together(codec, codes_list, starts, mode):
    """Rounds as the server runs them: each live stream's next push, all in one call; streams
    join at their own round and leave after their last push."""
    decoders = [StreamingDecoder(codec, mode=mode) for _ in codes_list]
    plans = [_cuts(c.shape[1]) for c in codes_list]
    outs: list[list] = [[] for _ in codes_list]
    sizes, round_ = [], 0
    while any(plans):
        live = [i for i, plan in enumerate(plans) if plan and starts[i] <= round_]
        round_ += 1
        if not live:
            continue
        cuts = [plans[i].pop(0) for i in live]
        waves = push_streams([decoders[i] for i in live],
                             [codes_list[i][:, a:b] for i, (a, b) in zip(live, cuts, strict=True)],
                             [b == codes_list[i].shape[1]
                              for i, (_, b) in zip(live, cuts, strict=True)])
        sizes.append(len(live))
        for i, wave in zip(live, waves, strict=True):
            if wave is not None:
                outs[i].append(wave)
    return [torch.cat(o) for o in outs], sizes


@pytest.fixture(scope="module")
def wide_codec(tmp_path_factory):
    """A random tokenizer of 12x tiny-a's width (d_model 768, bench_overlap.py's), where the
    fused oneDNN products round apart from the plain ones tiny-a's sizes share."""
    from mimo_tts.codec import load_audio_tokenizer
    from mimo_tts.presets.codec import TINY_CODEC
    from mimo_tts.presets.write import write_random_checkpoint

    dims = {**TINY_CODEC, "d_model": 768, "decoder_attention_heads": 12, "decoder_ffn_dim": 1536}
    _, tok = write_random_checkpoint(tmp_path_factory.mktemp("wide"), codec_dims=dims)
    return load_audio_tokenizer(tok, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize(("which", "mode", "threads"), [
    ("tiny-a", "incremental", 1), ("tiny-a", "incremental", 2), ("tiny-a", "official", 1),
    ("wide", "incremental", 1), ("wide", "incremental", 2)])
def test_streams_pushed_together_equal_their_solo_runs(request, which, mode, threads):
    """Four streams of different lengths, joining at different rounds: the same samples as
    alone. Exactly at one thread; at two, a product's split between the threads can follow
    its row count, which rounds ~1e-8 differently (docs/performance.md)."""
    codec = request.getfixturevalue("codec" if which == "tiny-a" else "wide_codec")
    generator = torch.Generator().manual_seed(11)
    codes_list = [torch.randint(0, 128, (8, n), generator=generator) for n in (130, 47, 88, 201)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        solo = [_solo(codec, codes, mode) for codes in codes_list]
        together, sizes = _together(codec, codes_list, [0, 1, 1, 2], mode)
    finally:
        torch.set_num_threads(before)
    assert max(sizes) == 4 and min(sizes) < 4  # the streams did share rounds, not all of them
    for codes, alone, joint in zip(codes_list, solo, together, strict=True):
        assert joint.shape == alone.shape == (960 * codes.shape[1],)
        if threads == 1:
            assert torch.equal(joint, alone)
        else:
            torch.testing.assert_close(joint, alone, atol=SAME_TOL, rtol=0)


def test_step_streams_shares_the_weight_pass_not_the_attention(codec, one_thread):
    """The decoder stack over two caches at once: each cache holds what it holds alone, and
    a stream never sees the other's keys (its outputs equal its solo outputs exactly)."""
    decoder = codec.model.decoder
    generator = torch.Generator().manual_seed(12)
    xs = [torch.randn(1, n, codec.config.d_model, generator=generator) for n in (8, 40)]
    with torch.inference_mode():
        alone = [DecoderCache(decoder, 100).step(x) for x in xs]
        caches = [DecoderCache(decoder, 100) for _ in xs]
        joint = step_streams(caches, xs)
        assert [c.position for c in caches] == [8, 40]
        again = step_streams(caches, [x[:, :4] for x in xs])  # the next push of each
        solo_next = []
        for x in xs:
            cache = DecoderCache(decoder, 100)
            cache.step(x)
            solo_next.append(cache.step(x[:, :4]))
    for a, b in zip(alone + solo_next, joint + again, strict=True):
        assert torch.equal(a, b)
