"""Streaming decode against the official scheme's fixtures (fixtures README §5.1, spec §7.2)."""

from __future__ import annotations

import pytest
import torch

from mimo_tts.codec import StreamingDecoder
from mimo_tts.errors import UsageError
from tests.helpers import find_case

STREAM_CASES = ("stream_T101_default", "stream_T37_small_overlap")


@pytest.mark.parametrize("name", STREAM_CASES)
def test_streaming_matches_reference(codec, cases, decode_cases, name):
    params = find_case(cases, name)["params"]
    config = params["streaming_config"]
    stream = StreamingDecoder(codec, config["left_overlap"], config["right_overlap"])
    codes = decode_cases[f"{name}.codes"]
    pieces, lengths = [], []
    for call in params["calls"]:
        chunk = codes[:, call["chunk_start"]:call["chunk_start"] + call["chunk_len"]]
        piece = stream.push(chunk, last=call["last_chunk"])
        lengths.append(0 if piece is None else piece.numel())
        assert lengths[-1] == (call["returned"] or 0)
        assert stream.processed_length == call["processed_length_after"]
        assert stream.cache_length == call["cache_len_after"]
        if piece is not None:
            pieces.append(piece)
    assert lengths == decode_cases[f"{name}.piece_lengths"].tolist()
    wave = torch.cat(pieces)
    assert wave.shape == (960 * codes.shape[1],)
    torch.testing.assert_close(wave, decode_cases[f"{name}.waveform"], atol=1e-4, rtol=0)


def test_streaming_cache_stays_bounded(codec, decode_cases):
    stream = StreamingDecoder(codec, left_overlap=12, right_overlap=3)
    codes = decode_cases["decode_T101.codes"]
    total = 0
    for start in range(0, 96, 8):
        piece = stream.push(codes[:, start:start + 8])
        total += 0 if piece is None else piece.numel()
        assert stream.cache_length <= 12
    total += stream.push(codes[:, 96:], last=True).numel()
    assert total == 960 * 101


def test_streaming_rejects_inconsistent_overlaps(codec):
    with pytest.raises(UsageError, match="right_overlap <= left_overlap"):
        StreamingDecoder(codec, left_overlap=5, right_overlap=10)
