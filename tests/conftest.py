"""Shared fixtures: tiny configs that train in seconds on the CPU."""

from __future__ import annotations

import os

# One intra-op thread: the tests' tensors are small, and on a 2-core machine shared with other
# work, OpenMP threads that spin-wait for a busy core make a step many times slower. Set
# before torch is imported; subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Caches that outlive a run (scans, decode caches, FID statistics, compiled kernels) go to a
# folder of this test session, not the user's ~/.cache; with pytest-xdist (scripts/test.sh
# runs two workers), a folder per worker, so that no two test processes share one.
import tempfile  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER") or "DIFFTRAIN_CACHE" not in os.environ:
    os.environ["DIFFTRAIN_CACHE"] = tempfile.mkdtemp(prefix="difftrain-test-cache-")

import pytest  # noqa: E402

from difftrain.config import load_config  # noqa: E402

# A run small enough for the test suite: 16x16 built-in shapes, the tiny UNet, a few steps.
TINY_OVERRIDES = [
    "data.resolution=16",
    "data.num_workers=0",
    "model.preset=tiny",
    "model.attention_resolutions=[8]",
    "diffusion.num_timesteps=100",
    "optim.lr=1e-3",
    "optim.warmup_steps=2",
    "train.total_steps=6",
    "train.batch_size=8",
    "train.log_every_steps=2",
    "train.progress_bar=false",
    "ema.decay=0.9",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=2",
    "validation.every_steps=3",
    "validation.num_images=4",
    "validation.steps=3",
]


@pytest.fixture
def tiny_overrides() -> list[str]:
    return list(TINY_OVERRIDES)


@pytest.fixture
def tiny_cfg():
    return load_config(None, TINY_OVERRIDES)
