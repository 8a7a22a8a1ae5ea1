"""Issue 13, root causes G-J: hostile input values fail their item (exit 9) or the run with a
usage/input error, never crash it.

G seeds past 2**64, H lone surrogates (JSON escapes, argv bytes that are not UTF-8), I ids
(bytes not characters, non-string ids, collisions after sanitising), J input forms (upper-case
.JSONL, stdin that merely starts with "{", FIFOs and /dev/fd/N, a closed stdin).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from mimo_tts.batch import items as inputs
from mimo_tts.errors import InputError


def _items(tmp_path, name: str, lines: list[str]):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return inputs.read_items([], [str(path)])


def test_g_seed_past_64_bits_fails_that_item(tmp_path):
    good, big, negative = _items(tmp_path, "s.jsonl", [
        json.dumps({"id": "a", "text": "ok", "seed": 2**64 - 1}),
        json.dumps({"id": "b", "text": "big", "seed": 2**64}),
        json.dumps({"id": "c", "text": "neg", "seed": -1}),
    ])
    assert good.error is None and good.seed == 2**64 - 1
    for item in (big, negative):
        assert "seed must be an integer in [0, 2**64 - 1]" in str(item.error)


def test_h_lone_surrogates_fail_the_item(tmp_path):
    text, ident, audio = _items(tmp_path, "u.jsonl", [
        '{"id": "t", "text": "bad \\ud800 text"}',
        '{"id": "x\\udfff", "text": "fine text"}',
        '{"id": "p", "text": "fine", "prompt_audio": "v\\ud800.wav"}',
    ])
    assert "lone surrogate U+D800" in str(text.error)
    assert ident.error is None and "\udfff" not in ident.id  # sanitised away
    assert "not valid Unicode" in str(audio.error)
    (argv,) = inputs.read_items(["caf\udce9"], [])  # what Python makes of b"caf\xe9" in argv
    assert argv.error is not None and "invalid UTF-8" in str(argv.error)


def test_i_ids_bounded_in_bytes_typed_and_collisions_named(tmp_path):
    long_cjk = "语" * 100  # 300 bytes in UTF-8
    assert len(inputs.sanitize_id(long_cjk).encode()) <= inputs.MAX_ID_BYTES
    ok, listed, boolean, clash = _items(tmp_path, "ids.jsonl", [
        json.dumps({"id": "a/b", "text": "one"}),
        json.dumps({"id": ["x"], "text": "two"}),
        json.dumps({"id": True, "text": "three"}),
        json.dumps({"id": "a_b", "text": "four"}),
    ])
    assert ok.error is None and ok.id == "a_b"
    for item in (listed, boolean):
        assert "id must be a string or an integer" in str(item.error)
    assert "becomes the file name 'a_b', which id 'a/b'" in str(clash.error)
    assert clash.id != ok.id
    (number,) = _items(tmp_path, "n.jsonl", [json.dumps({"id": 7, "text": "seven"})])
    assert number.error is None and number.id == "7"


def test_j_upper_case_jsonl_and_braced_text_on_stdin(tmp_path):
    (item,) = _items(tmp_path, "BATCH.JSONL", [json.dumps({"id": "a", "text": "hello"})])
    assert item.error is None and item.text == "hello"

    class Stdin:
        closed = False

        def __init__(self, data: bytes):
            import io

            self.buffer = io.BytesIO(data)

        def isatty(self):
            return False

    braced = inputs.read_items([], ["-"], Stdin(b"{laughs} hello there\nsecond line\n"))
    assert [i.text for i in braced] == ["{laughs} hello there", "second line"]
    jsonl = inputs.read_items([], ["-"], Stdin(b'{"id": "z", "text": "hi"}\n'))
    assert jsonl[0].id == "z" and jsonl[0].text == "hi"


def test_j_fifo_and_dev_fd_are_read(tmp_path):
    fifo = tmp_path / "lines.txt"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("from a fifo\n"))
    writer.start()
    (item,) = inputs.read_items([], [str(fifo)])
    writer.join()
    assert item.text == "from a fifo"
    read, write = os.pipe()
    os.write(write, b"from a pipe\n")
    os.close(write)
    try:
        (item,) = inputs.read_items([], [f"/dev/fd/{read}"])
    finally:
        os.close(read)
    assert item.text == "from a pipe"
    with pytest.raises(InputError, match="is a directory"):
        inputs.read_items([], [str(tmp_path)])


def test_j_closed_stdin_is_an_input_error(tmp_path):
    code = ("import sys\nfrom mimo_tts.batch import items as inputs\n"
            "try:\n    inputs.read_items([], ['-'])\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc)\n")
    out = subprocess.run(f'"{sys.executable}" -c "$CODE" 0<&-', shell=True, capture_output=True,
                         text=True, env={**os.environ, "CODE": code}, timeout=60)
    assert out.stdout.startswith("InputError stdin is closed"), out.stdout + out.stderr
