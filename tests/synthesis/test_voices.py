"""The voice store: its folder, names, records and two processes at once."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest
import torch

from mimo_tts.errors import InputError, OutputError, UsageError
from mimo_tts.synthesis.voices import VoiceStore, voices_dir

RECORD = {"source": {"path": "/x.wav", "sha256": "0", "seconds": 1.0, "sample_rate": 16000},
          "transcript": None, "tokenizer": {"id": "t", "path": "/tok", "name": "tok"}}


def test_the_folder_follows_the_env_then_xdg():
    assert voices_dir({"MIMO_TTS_VOICES_DIR": "/v"}) == Path("/v")
    assert voices_dir({"XDG_DATA_HOME": "/d"}) == Path("/d/mimo-tts/voices")
    assert voices_dir({"HOME": "/h"}).parts[-3:] == ("share", "mimo-tts", "voices")


def test_codes_round_trip_and_a_mismatch_is_corrupt(tmp_path):
    store = VoiceStore(tmp_path)
    codes = torch.randint(0, 1000, (20, 7))
    store.add("me", codes, RECORD)
    voice = store.load("me")
    assert torch.equal(voice.codes, codes) and voice.codes.dtype == torch.int64
    assert not list(tmp_path.glob(".mimo-tmp-*"))
    (tmp_path / "me.safetensors").write_bytes(b"junk")
    with pytest.raises(InputError, match="corrupt"):
        store.load("me")
    with pytest.raises(UsageError, match="already exists"):
        store.add("me", codes, RECORD)
    with pytest.raises(UsageError, match="invalid voice name"):
        store.add("../me", codes, RECORD)


def _churn(root: str, seed: int, rounds: int, out) -> None:
    store, bad = VoiceStore(root), 0
    for i in range(rounds):
        codes = torch.full((20, 5 + (i + seed) % 4), seed)
        store.add("shared", codes, RECORD, overwrite=True)
        try:
            voice = store.load("shared")
        except InputError as exc:  # removed by the other process: fine; corrupt: not
            bad += "corrupt" in str(exc)
            continue
        bad += int(voice.codes.shape[1] != voice.record["codes"]["shape"][1])
        if i % 3 == 2:
            try:
                store.remove("shared")
            except InputError:
                pass
    out.put(bad)


def test_two_processes_never_see_half_a_voice(tmp_path):
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    workers = [context.Process(target=_churn, args=(str(tmp_path), s, 30, out)) for s in (1, 2)]
    for w in workers:
        w.start()
    results = [out.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(timeout=60)
    assert results == [0, 0]
    assert not list(tmp_path.glob(".mimo-tmp-*"))


# --- issue 32 items 16, 19, 20: equal inputs, equal bytes; read-only and broken stores ----------

ADD_ONE = """
import sys, torch
from mimo_tts.synthesis.voices import VoiceStore
torch.manual_seed(0)
VoiceStore(sys.argv[1]).add("me", torch.randint(0, 1024, (20, 50)), {
    "source": {"path": "/x.wav", "sha256": "0", "seconds": 1.0, "sample_rate": 16000},
    "transcript": None, "tokenizer": {"id": "t", "path": "/tok", "name": "tok"}},
    overwrite=True)
"""


def test_the_same_voice_added_again_is_the_same_bytes(tmp_path):
    """Each process adds the same codes; the codes file is byte for byte the same (before:
    safetensors wrote its metadata in a per-process hash order, so about half differed, and
    with them the record's sha256 and every resume key made with the voice)."""
    import subprocess
    import sys

    seen = set()
    for i in range(8):  # a fresh process each time: a fresh hash order
        subprocess.run([sys.executable, "-c", ADD_ONE, str(tmp_path / f"s{i % 2}")], check=True)
        seen.add((tmp_path / f"s{i % 2}" / "me.safetensors").read_bytes())
    assert len(seen) == 1
    records = [VoiceStore(tmp_path / f"s{i}").record("me") for i in (0, 1)]
    assert records[0]["codes"] == records[1]["codes"]
    assert torch.equal(VoiceStore(tmp_path / "s0").load("me").codes,
                       VoiceStore(tmp_path / "s1").load("me").codes)


def test_stable_safetensors_is_read_by_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load

    from mimo_tts.synthesis.voices import stable_safetensors

    tensors = {"codes": torch.randint(0, 9, (8, 3)), "b": torch.randn(2, 2).bfloat16(),
               "a": torch.tensor([True, False])}
    data = stable_safetensors(tensors, {"z": "1", "a": "2"})
    assert all(torch.equal(load(data)[k], v) for k, v in tensors.items())
    assert int.from_bytes(data[:8], "little") % 8 == 0  # the data starts 8-byte aligned
    (tmp_path / "x.safetensors").write_bytes(data)
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as handle:
        assert handle.metadata() == {"a": "2", "z": "1"}
    assert data == stable_safetensors(dict(reversed(tensors.items())), {"a": "2", "z": "1"})


def test_listing_a_missing_store_makes_nothing(tmp_path):
    store = VoiceStore(tmp_path / "nowhere")
    assert store.list() == [] and store.names() == []
    with pytest.raises(InputError, match="unknown voice"):
        store.record("me")
    assert not (tmp_path / "nowhere").exists()


def _read_only(monkeypatch):
    """The store's file system refuses writes (EROFS), as a read-only mount does; root ignores
    permission bits, so this is how the test makes one."""
    import errno
    import os

    from mimo_tts.synthesis import voices

    real = voices.open_no_follow

    def refuse(path, flags):
        if flags & (os.O_RDWR | os.O_WRONLY | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, flags)

    monkeypatch.setattr(voices, "open_no_follow", refuse)


@pytest.mark.parametrize("lock_file", [True, False])
def test_a_read_only_store_is_listed_and_loaded(tmp_path, monkeypatch, lock_file):
    store = VoiceStore(tmp_path)
    codes = torch.randint(0, 1000, (20, 7))
    store.add("me", codes, RECORD)
    if not lock_file:
        (tmp_path / ".voices.lock").unlink()
    _read_only(monkeypatch)
    assert [r["name"] for r in store.list()] == ["me"] and store.names() == ["me"]
    assert torch.equal(store.load("me").codes, codes)
    with pytest.raises(OutputError, match="the file system is read-only: voices can be listed "
                                          "and used, not added"):
        store.add("other", codes, RECORD)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes whatever the mode bits say")
def test_a_store_without_write_permission_is_listed(tmp_path):
    store = VoiceStore(tmp_path / "store")
    store.add("me", torch.randint(0, 1000, (20, 7)), RECORD)
    (tmp_path / "store" / ".voices.lock").unlink()
    (tmp_path / "store").chmod(0o555)
    try:
        assert [r["name"] for r in store.list()] == ["me"]
    finally:
        (tmp_path / "store").chmod(0o755)


def test_a_voice_whose_codes_are_gone_is_listed_as_broken(tmp_path):
    store = VoiceStore(tmp_path)
    store.add("gone", torch.randint(0, 1000, (20, 7)), RECORD)
    store.add("fine", torch.randint(0, 1000, (20, 7)), RECORD)
    (tmp_path / "gone.safetensors").unlink()
    listed = {r["name"]: r for r in store.list()}
    assert "error" not in listed["fine"]
    assert listed["gone"] == {"name": "gone", "error": (
        f"voice 'gone' is broken: its codes file {tmp_path / 'gone.safetensors'} is gone; "
        "add it again")}
    (tmp_path / "fine.safetensors").write_bytes(b"other bytes")
    assert "does not match its record" in {r["name"]: r for r in store.list()}["fine"]["error"]


def test_a_record_missing_what_a_listing_shows_is_corrupt(tmp_path):
    store = VoiceStore(tmp_path)
    store.add("me", torch.randint(0, 1000, (20, 7)), RECORD)
    record = json.loads((tmp_path / "me.json").read_text())
    del record["source"]
    (tmp_path / "me.json").write_text(json.dumps(record))
    assert "is not a voice record" in store.list()[0]["error"]


@pytest.mark.parametrize("make, words", [
    (lambda root: root.write_text("x"),
     "it is a file, not a folder; move it away or set MIMO_TTS_VOICES_DIR to a folder"),
    (lambda root: root.symlink_to(root.parent / "absent"),
     "it is a symbolic link to nothing; make it a folder"),
    (lambda root: None, "is a file, not a folder; set MIMO_TTS_VOICES_DIR to a folder"),
])
def test_store_folder_problems_are_said_in_words(tmp_path, make, words):
    root = tmp_path / "store"
    make(root)
    if not os.path.lexists(root):  # the third case: a file where a parent folder should be
        (tmp_path / "file").write_text("x")
        root = tmp_path / "file" / "voices"
    store = VoiceStore(root)
    for action in (lambda: store.add("me", torch.zeros(2, 2, dtype=torch.long), RECORD),
                   store.list):
        with pytest.raises(OutputError) as caught:
            action()
        assert words in str(caught.value) and "File exists" not in str(caught.value)
