"""GPU-only checks: decode on a CUDA tokenizer device, CUDA graphs equal eager decode."""

from __future__ import annotations

import pytest
import torch

from mimo_tts.codec import StreamingDecoder, load_audio_tokenizer

from .conftest import cuda, requires_cuda

pytestmark = [cuda, requires_cuda]


@pytest.fixture(scope="module")
def gpu_codec(tokenizer_dir):
    return load_audio_tokenizer(tokenizer_dir, device="cuda", dtype=torch.float32)


def test_cpu_inputs_are_moved_to_the_tokenizer_device(gpu_codec, decode_cases, encode_cases):
    codes = decode_cases["decode_T37.codes"]  # on CPU
    wave = gpu_codec.decode(codes)
    assert wave.device.type == "cuda"
    torch.testing.assert_close(wave.cpu(), decode_cases["decode_T37.waveform"], atol=1e-4, rtol=0)
    audio = encode_cases["encode_chirp_1p3s.waveform_in"]
    mel = gpu_codec.log_mel(audio)
    torch.testing.assert_close(mel.cpu(), encode_cases["encode_chirp_1p3s.log_mel"],
                               atol=1e-3, rtol=0)
    codes_all = encode_cases["encode_chirp_1p3s.codes_all"].long()
    assert torch.equal(gpu_codec.encode(audio, 24000).cpu(), codes_all)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_equals_eager(tokenizer_dir, decode_cases, dtype):
    eager = load_audio_tokenizer(tokenizer_dir, device="cuda", dtype=dtype)
    graphed = load_audio_tokenizer(tokenizer_dir, device="cuda", dtype=dtype, cuda_graph=True)
    assert graphed.cuda_graph
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    codes = decode_cases["decode_T101.codes"]
    for frames in (4, 5, 37, 101, 37):  # a repeated length replays an existing graph
        a = eager.decode(codes[:, :frames])
        b = graphed.decode(codes[:, :frames])
        assert b.shape == a.shape == (960 * frames,)
        torch.testing.assert_close(b, a, atol=tol, rtol=0)
    assert set(graphed._graphs._graphs) == {4, 6, 64, 128}


def test_graph_streaming_matches_reference(tokenizer_dir, decode_cases):
    graphed = load_audio_tokenizer(tokenizer_dir, device="cuda", cuda_graph=True)
    stream = StreamingDecoder(graphed, left_overlap=20, right_overlap=6)
    codes = decode_cases["stream_T37_small_overlap.codes"]
    pieces = [stream.push(codes[:, s:s + 8], last=s + 8 >= 37) for s in range(0, 37, 8)]
    wave = torch.cat([p for p in pieces if p is not None]).cpu()
    torch.testing.assert_close(wave, decode_cases["stream_T37_small_overlap.waveform"],
                               atol=1e-4, rtol=0)


def test_meta_context_with_cuda_device(tokenizer_dir, decode_cases):
    with torch.device("meta"):
        codec = load_audio_tokenizer(tokenizer_dir, device="cuda")
        wave = codec.decode(decode_cases["decode_T4.codes"])
    assert wave.device.type == "cuda"
    torch.testing.assert_close(wave.cpu(), decode_cases["decode_T4.waveform"], atol=1e-4, rtol=0)


def test_incremental_streaming_on_cuda(gpu_codec, decode_cases):
    """The incremental mode keeps its state on the tokenizer device and stays exact there."""
    from mimo_tts.codec.incremental import IncrementalDecoder

    codes = decode_cases["decode_T101.codes"]
    stream = IncrementalDecoder(gpu_codec, context=101, norm_window=101, warmup=101)
    pieces = [stream.push(codes[:, s:s + 20], last=s + 20 >= 101) for s in range(0, 101, 20)]
    wave = torch.cat([p for p in pieces if p is not None])
    assert wave.device.type == "cuda"
    torch.testing.assert_close(wave.cpu(), decode_cases["decode_T101.waveform"], atol=1e-4, rtol=0)
    default = StreamingDecoder(gpu_codec, mode="incremental")
    pieces = [default.push(codes[:, s:s + 20], last=s + 20 >= 101) for s in range(0, 101, 20)]
    assert torch.cat([p for p in pieces if p is not None]).shape == (960 * 101,)
