"""torchrun with 2 processes (gloo, CPU) against one process at the same global batch, and
2 processes set up as torchrun sets them up, for faults that hit one rank only."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import TINY_OVERRIDES
from multiproc import free_port, rank_env
from fid_standin import write_standin

from difftrain.config import load_config
from difftrain.training import checkpoint as ckpt
from difftrain.training.loop import train
from difftrain.training.signals import EXIT_STOPPED

ROOT = Path(__file__).resolve().parents[2]

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


def _run(run_dir, nproc: int, batch: int, *extra: str, env_extra: dict | None = None) -> None:
    sets = [a for kv in COMMON + [f"train.batch_size={batch}"] for a in ("--set", kv)]
    args = ["-m", "difftrain", "train", "--run-dir", str(run_dir), *sets, *extra]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    else:
        cmd = [sys.executable, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# Validation, held-out loss and FID, each spread across the ranks.
EVALUATION = ["data.heldout_fraction=0.05", "validation.heldout_max_images=5", "validation.sampler=ddpm",
              "evaluation.fid_every_steps=4", "evaluation.fid_num_samples=5", "evaluation.fid_batch_size=2",
              "evaluation.fid_steps=2", "evaluation.fid_ref_num=8", "validation.raw_grid=true",
              "validation.memorization=pixels"]


def _weights(run_dir) -> dict[str, torch.Tensor]:
    return ckpt.load_checkpoint(run_dir)["model"]


def _assert_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.slow  # about 30 s alone, more on a busy 2-core machine: three processes start
def test_two_processes_equal_one_at_the_same_global_batch(tmp_path):
    weights = tmp_path / "standin.pt"
    write_standin(weights, 2048)  # stands in for the FID Inception network (too slow here)
    env = {"DIFFTRAIN_FID_WEIGHTS": str(weights), "DIFFTRAIN_CACHE": str(tmp_path / "cache")}
    extra = [a for kv in EVALUATION for a in ("--set", kv)]
    _run(tmp_path / "one", 1, 8, *extra, env_extra=env)
    _run(tmp_path / "two", 2, 4, *extra, env_extra=env)
    one, two = ckpt.load_checkpoint(tmp_path / "one"), ckpt.load_checkpoint(tmp_path / "two")
    assert one["step"] == two["step"] == 4 and one["data_position"] == two["data_position"] == 32
    _assert_close(one["model"], two["model"])
    _assert_close(one["ema"]["model"], two["ema"]["model"])
    # Training moved the weights far more than the tolerance, so the match is not vacuous.
    before = ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / "one" / "checkpoints")[0][1])["model"]
    assert max((one["model"][k] - before[k]).abs().max() for k in before) > 1e-3

    # Rank 0 alone logs, and what the ranks measured together is what one process measured.
    rows = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("one", "two")}
    assert [sorted(r) for r in rows["two"]] == [sorted(r) for r in rows["one"]]
    logged = {name: {k: v for r in rows[name] for k, v in r.items()} for name in rows}
    for key in ("heldout/loss", "heldout_raw/loss", "fid"):
        assert logged["two"][key] == pytest.approx(logged["one"][key], rel=1e-3), key
    # Memorization and diversity of the grid (rank 0, the gathered images) and of the FID samples (each rank
    # its batches, gathered): equal to rounding.
    for key in ("memorization/near_copy_share", "memorization/median_ratio", "diversity/vendi",
                "fid_samples/memorization/median_ratio", "fid_samples/diversity/vendi"):
        assert logged["two"][key] == pytest.approx(logged["one"][key], rel=1e-2), key
    assert (tmp_path / "two" / "samples" / "neighbours" / "step_00000004.png").is_file()
    for grid in ("samples/step_00000004.png", "samples/raw/step_00000004.png"):
        a, b = (np.asarray(Image.open(tmp_path / name / grid), dtype=int) for name in ("one", "two"))
        assert abs(a - b).max() <= 1 and (a != b).mean() < 0.01, grid  # the ddpm grid, to rounding


@pytest.mark.slow  # about 40 s: three processes start and load transformers
def test_a_latent_text_run_on_two_processes_equals_one(tmp_path):
    pytest.importorskip("transformers")
    from tests.text_components import write_tiny_text_encoder, write_tiny_vae

    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(16):
        colour = (200, 40, 40) if i % 2 else (40, 40, 200)
        a = np.full((16, 16, 3), 30, np.uint8)
        a[4 : 8 + i % 6, 4:12] = colour
        Image.fromarray(a).save(folder / f"{i:02d}.png")
        (folder / f"{i:02d}.txt").write_text(f"a {'red' if i % 2 else 'blue'} square")
    sets = [f"data.path={folder}", "data.captions=true", f"model.text_encoder={write_tiny_text_encoder(tmp_path / 't')}",
            f"model.vae={write_tiny_vae(tmp_path / 'v')}", "model.attention_resolutions=[4]",
            "validation.prompts=['a red square', 'a blue square']", "validation.num_images=4",
            "data.heldout_fraction=0.25", "validation.heldout_max_images=4"]
    extra = [a for kv in sets for a in ("--set", kv)]
    env = {"DIFFTRAIN_CACHE": str(tmp_path / "cache")}
    _run(tmp_path / "one", 1, 8, *extra, env_extra=env)
    _run(tmp_path / "two", 2, 4, *extra, env_extra=env)
    one, two = ckpt.load_checkpoint(tmp_path / "one"), ckpt.load_checkpoint(tmp_path / "two")
    _assert_close(one["model"], two["model"])
    assert one["frozen"] == two["frozen"] and set(one["frozen"]) == {"text_encoder", "vae"}
    logged = {name: {k: v for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
                     for k, v in json.loads(line).items()} for name in ("one", "two")}
    assert logged["two"]["heldout/loss"] == pytest.approx(logged["one"]["heldout/loss"], rel=1e-3)
    a, b = (np.asarray(Image.open(tmp_path / name / "samples" / "step_00000004.png"), dtype=int) for name in ("one", "two"))
    assert a.shape == b.shape and abs(a - b).max() <= 2


@pytest.mark.slow
def test_resume_on_another_world_size(tmp_path):
    _run(tmp_path / "straight", 1, 8)
    _run(tmp_path / "resumed", 2, 4, "--stop-at-step", "2")
    _run(tmp_path / "resumed", 1, 8)  # the same run continued by one process
    _assert_close(_weights(tmp_path / "straight"), _weights(tmp_path / "resumed"))


# Faults that reach one rank only. The ranks are started with torchrun's variables but without
# torchrun, whose agent would stop the other rank as soon as one exits: here each rank's exit
# code is its own.


def _start_ranks(run_dir, overrides: list[str], world_size: int = 2, extra: list[str] = ()) -> list[subprocess.Popen]:
    sets = [a for kv in overrides for a in ("--set", kv)]
    cmd = [sys.executable, "-m", "difftrain", "train", "--run-dir", str(run_dir), *sets, *extra]
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {**os.environ, **rank_env(rank, world_size, port), "PYTHONPATH": str(ROOT / "src")}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _finish(procs: list[subprocess.Popen], timeout_s: float = 120.0) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each rank; a rank still running after ``timeout_s`` is a hang."""
    deadline, results = time.monotonic() + timeout_s, []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        outputs = [proc.communicate() for proc in procs]
        pytest.fail(f"a rank hung; outputs: {outputs}")
    return results


def _stopped_at(stdout: str) -> int:
    match = re.search(r"SIGTERM stopped the run at step (\d+)", stdout)
    assert match, stdout
    return int(match.group(1))


ONE_RANK = COMMON + ["train.batch_size=4", "train.total_steps=10000", "train.log_every_steps=1",
                     "validation.every_steps=0", "checkpoint.every_steps=10000"]


def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step_and_resumes(tmp_path):
    run = tmp_path / "run"
    procs = _start_ranks(run, ONE_RANK)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # rank 0 logged 2 steps
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, _finish(procs, 5)
        time.sleep(0.02)
    os.kill(procs[1].pid, signal.SIGTERM)  # rank 1 only: rank 0 learns of it at the next step boundary
    (code0, out0, err0), (code1, out1, err1) = _finish(procs)
    assert code0 == code1 == EXIT_STOPPED, err0 + err1
    assert "SIGTERM received" in err1 and "SIGTERM received" not in err0
    step = _stopped_at(out0)
    assert step >= 2 and "stopped the run" not in out1  # one final line under torchrun: rank 0's
    state = ckpt.load_checkpoint(run)  # complete, and the step both ranks stopped after
    assert state["step"] == step and state["data_position"] == step * 8
    assert (run / "checkpoints" / "latest").read_text().strip() == ckpt.checkpoint_name(step)

    # Resumed by the same command, the run goes on as if never stopped: one step further, it has
    # the weights of one process that trained straight there at the same global batch.
    resume = ["--stop-at-step", str(step + 1)]
    results = _finish(_start_ranks(run, ONE_RANK, extra=resume))
    assert [code for code, _, _ in results] == [0, 0], results
    train(load_config(None, ONE_RANK + ["train.batch_size=8"]), tmp_path / "straight", stop_at_step=step + 1)
    resumed, straight = ckpt.load_checkpoint(run), ckpt.load_checkpoint(tmp_path / "straight")
    assert resumed["step"] == straight["step"] == step + 1
    _assert_close(resumed["model"], straight["model"])


def test_a_failed_checkpoint_write_on_rank_0_stops_every_rank_with_its_error(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    # A dangling link where the checkpoint folder should be: rank 0 can't create it.
    (run / "checkpoints").symlink_to(tmp_path / "missing" / "checkpoints")
    overrides = COMMON + ["train.batch_size=4", "train.total_steps=4", "validation.every_steps=0",
                          "checkpoint.every_steps=2", "checkpoint.on_write_error=stop"]
    results = _finish(_start_ranks(run, overrides))
    assert [code for code, _, _ in results] == [2, 2], results  # an error with a message, no hang
    for _, _, err in results:
        assert "cannot write the checkpoint of step 2" in err, err
