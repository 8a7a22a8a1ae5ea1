"""`serve --lm-quant w8a8`: the server runs the quantized LM and a request's flac file is the bytes
`synth` writes for the same text with the same flags (one run path under every face); a
float32 model is refused before either server loads (exit 2)."""

from __future__ import annotations

import httpx
import pytest

TEXT = "Served through the int8 products."


def test_a_w8a8_server_answers_with_the_clis_bytes(start_server, mimo, tmp_path):
    url = start_server("--dtype", "bfloat16", "--lm-quant", "w8a8", "--max-new-groups", "6")
    reply = httpx.post(url + "/v1/audio/speech", timeout=120,
                       json={"model": "tiny", "input": TEXT, "response_format": "flac"})
    assert reply.status_code == 200, reply.text
    done = mimo("synth", "--model", "tiny", "--dtype", "bfloat16", "--lm-quant", "w8a8",
                "--max-new-groups", "6", "-t", TEXT, "-o", "cli.flac")
    assert done.returncode == 0, done.stderr
    plain = mimo("synth", "--model", "tiny", "--dtype", "bfloat16", "--max-new-groups", "6",
                 "-t", TEXT, "-o", "plain.flac")
    assert plain.returncode == 0, plain.stderr
    assert reply.content == (tmp_path / "cli.flac").read_bytes()  # a whole file, both ways
    assert reply.content != (tmp_path / "plain.flac").read_bytes()  # the products did change


@pytest.mark.parametrize("command", ["serve", "wyoming"])
def test_a_float32_w8a8_server_is_refused_before_loading(mimo, command):
    done = mimo(command, "--model", "tiny", "--lm-quant", "w8a8", "--port", "0")
    assert done.returncode == 2
    assert done.stderr.decode().strip().splitlines() == [
        "Error: --lm-quant w8a8 needs bfloat16 weights, the LM is asked in float32 "
        "(--dtype bfloat16)"]
