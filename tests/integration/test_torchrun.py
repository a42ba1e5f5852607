"""torchrun with 2 processes (gloo, CPU) against one process at the same global batch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import TINY_OVERRIDES

from difftrain.training import checkpoint as ckpt

# Two processes of 4 images each against one of 8: the same global batch. The tiny test run,
# with these keys changed (later --set values win).
COMMON = TINY_OVERRIDES + [
    "train.total_steps=4",
    "train.device=cpu",
    "validation.every_steps=4",
    "validation.num_images=3",
    "validation.steps=2",
    "tracking.tensorboard=false",
]


def _run(run_dir, nproc: int, batch: int, *extra: str) -> None:
    sets = [a for kv in COMMON + [f"train.batch_size={batch}"] for a in ("--set", kv)]
    args = ["-m", "difftrain", "train", "--run-dir", str(run_dir), *sets, *extra]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    else:
        cmd = [sys.executable, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _weights(run_dir) -> dict[str, torch.Tensor]:
    return ckpt.load_checkpoint(run_dir)["model"]


def _assert_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.slow  # about 20 s alone, a minute on a busy 2-core machine: three processes start
def test_two_processes_equal_one_at_the_same_global_batch(tmp_path):
    _run(tmp_path / "one", 1, 8)
    _run(tmp_path / "two", 2, 4)
    one, two = ckpt.load_checkpoint(tmp_path / "one"), ckpt.load_checkpoint(tmp_path / "two")
    assert one["step"] == two["step"] == 4 and one["data_position"] == two["data_position"] == 32
    _assert_close(one["model"], two["model"])
    _assert_close(one["ema"]["model"], two["ema"]["model"])
    # Training moved the weights far more than the tolerance, so the match is not vacuous.
    before = ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / "one" / "checkpoints")[0][1])["model"]
    assert max((one["model"][k] - before[k]).abs().max() for k in before) > 1e-3
    assert (tmp_path / "two" / "samples" / "step_00000004.png").is_file()
    assert len((tmp_path / "two" / "metrics.jsonl").read_text().splitlines()) == 2  # rank 0 only


@pytest.mark.slow
def test_resume_on_another_world_size(tmp_path):
    _run(tmp_path / "straight", 1, 8)
    _run(tmp_path / "resumed", 2, 4, "--stop-at-step", "2")
    _run(tmp_path / "resumed", 1, 8)  # the same run continued by one process
    _assert_close(_weights(tmp_path / "straight"), _weights(tmp_path / "resumed"))
