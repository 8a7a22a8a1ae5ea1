"""The voice store: its folder, names, records and two processes at once."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from mimo_tts.errors import InputError, UsageError
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
