"""The one atomic-write recipe (runtime/paths.py): temp beside the target, renamed into place."""

from __future__ import annotations

import os

from mimo_tts.runtime.paths import TEMP_MARK, atomic_write, publish, temp_beside


def test_temp_file_is_hidden_beside_its_target(tmp_path):
    temp = temp_beside(tmp_path / "model.safetensors")
    assert temp.parent == tmp_path
    assert temp.name == f"{TEMP_MARK}{os.getpid()}-model.safetensors.part"


def test_keep_same_leaves_an_identical_file_alone(tmp_path):
    path = tmp_path / "config.json"
    atomic_write(path, lambda f: f.write(b"{}\n"))
    os.utime(path, ns=(1, 1))
    atomic_write(path, lambda f: f.write(b"{}\n"), keep_same=True)
    assert path.stat().st_mtime_ns == 1 and path.read_bytes() == b"{}\n"
    atomic_write(path, lambda f: f.write(b"[]\n"), keep_same=True)
    assert path.read_bytes() == b"[]\n" and path.stat().st_mtime_ns != 1
    atomic_write(path, lambda f: f.write(b"[]\n"))  # without keep_same: always renamed
    assert not list(tmp_path.glob(f"{TEMP_MARK}*"))


def test_publish_renames_a_finished_folder(tmp_path):
    staging = tmp_path / "preset.tmp-1"
    (staging / "lm").mkdir(parents=True)
    publish(staging, tmp_path / "preset")
    assert (tmp_path / "preset" / "lm").is_dir() and not staging.exists()
