"""The local Ray instance the Ray tests share (one per module: 2 CPUs, the tiny preset)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def local_ray(base_env):
    """A local Ray instance whose workers see the test env (the tiny preset's cache)."""
    ray = pytest.importorskip("ray", reason="Ray is not installed here (pip install '.[ray]')")
    saved = dict(os.environ)
    os.environ.update({k: base_env[k] for k in ("MIMO_TTS_CACHE", "HF_HUB_OFFLINE", "HF_HOME",
                                                "OMP_NUM_THREADS")})
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()
    os.environ.clear()
    os.environ.update(saved)
