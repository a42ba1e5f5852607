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
from difftrain.runtime.distributed import EXIT_GROUP_FAULT
from difftrain.checkpoints import checkpoint as ckpt
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
    """One process, or ``torchrun --standalone`` with ``nproc``, training COMMON at ``batch`` per process."""
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
    _assert_same_run(tmp_path / "one", tmp_path / "two")


def _assert_same_run(first: Path, second: Path) -> None:
    """Two runs of COMMON + EVALUATION: the same weights, metrics, held-out loss, FID and grids
    (to float rounding)."""
    one, two = ckpt.load_checkpoint(first), ckpt.load_checkpoint(second)
    assert one["step"] == two["step"] == 4 and one["data_position"] == two["data_position"] == 32
    _assert_close(one["model"], two["model"])
    _assert_close(one["ema"]["model"], two["ema"]["model"])
    # Training moved the weights far more than the tolerance, so the match is not vacuous.
    before = ckpt.load_checkpoint(ckpt.list_checkpoints(first / "checkpoints")[0][1])["model"]
    assert max((one["model"][k] - before[k]).abs().max() for k in before) > 1e-3

    # Rank 0 alone logs, and what the ranks measured together is what one process measured.
    rows = {name: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            for name, run in (("one", first), ("two", second))}
    assert [sorted(r) for r in rows["two"]] == [sorted(r) for r in rows["one"]]
    logged = {name: {k: v for r in rows[name] for k, v in r.items()} for name in rows}
    for key in ("heldout/loss", "heldout_raw/loss", "fid"):
        assert logged["two"][key] == pytest.approx(logged["one"][key], rel=1e-3), key
    # Memorization and diversity of the grid (rank 0, the gathered images) and of the FID samples (each rank
    # its batches, gathered): equal to rounding.
    for key in ("memorization/near_copy_share", "memorization/median_ratio", "diversity/vendi",
                "fid_samples/memorization/median_ratio", "fid_samples/diversity/vendi"):
        assert logged["two"][key] == pytest.approx(logged["one"][key], rel=1e-2), key
    assert (second / "samples" / "neighbours" / "step_00000004.png").is_file()
    for grid in ("samples/step_00000004.png", "samples/raw/step_00000004.png"):
        a, b = (np.asarray(Image.open(run / grid), dtype=int) for run in (first, second))
        assert abs(a - b).max() <= 1 and (a != b).mean() < 0.01, grid  # the ddpm grid, to rounding


@pytest.mark.slow  # about 60 s: two torchrun agents and one process start
def test_two_nodes_of_one_process_train_like_one_node_of_two_and_one_process(tmp_path):
    """Multi-node, on one host: two torchrun agents (--nnodes 2) meet by c10d rendezvous on the
    loopback address, as two machines would at their head node's address."""
    weights = tmp_path / "standin.pt"
    write_standin(weights, 2048)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIFFTRAIN_FID_WEIGHTS": str(weights),
           "DIFFTRAIN_CACHE": str(tmp_path / "cache"), "GLOO_SOCKET_IFNAME": "lo"}
    extra = [a for kv in EVALUATION for a in ("--set", kv)]
    _run(tmp_path / "one", 1, 8, *extra, env_extra=env)
    _run(tmp_path / "node", 2, 4, *extra, env_extra=env)
    sets = [a for kv in COMMON + ["train.batch_size=4"] for a in ("--set", kv)]
    port = free_port()
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
              "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
              "--local-addr", "127.0.0.1",
              "-m", "difftrain", "train", "--run-dir", str(tmp_path / "nodes"), *sets, *extra]
    agents = [subprocess.Popen(launch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True) for _ in range(2)]
    try:
        logs = [agent.communicate(timeout=300)[0] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    assert [agent.returncode for agent in agents] == [0, 0], logs
    assert sum("2 x cpu" in log for log in logs) == 1, logs  # one rank 0, the other agent's rank is 1
    nodes, node = ckpt.load_checkpoint(tmp_path / "nodes"), ckpt.load_checkpoint(tmp_path / "node")
    assert ckpt.state_dict_sha256(nodes["model"]) == ckpt.state_dict_sha256(node["model"])  # the same ranks
    _assert_same_run(tmp_path / "one", tmp_path / "nodes")


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


def _finish(procs: list[subprocess.Popen], timeout_s: float = 300.0) -> list[tuple[int, str, str]]:
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
    deadline = time.monotonic() + 300
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


def _wait_for_steps(run, procs, steps: int) -> None:
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= steps):  # rank 0 logged `steps` steps
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, _finish(procs, 5)
        time.sleep(0.02)


@pytest.mark.slow  # about 20 s: two ranks start, one is stopped, the other waits out a 5 s timeout
def test_a_stopped_rank_ends_the_run_after_the_collective_timeout_naming_it_and_the_newest_checkpoint(tmp_path):
    run = tmp_path / "run"
    overrides = ONE_RANK + ["checkpoint.every_steps=2", "train.collective_timeout_s=5"]
    procs = _start_ranks(run, overrides)
    _wait_for_steps(run, procs, 3)
    os.kill(procs[1].pid, signal.SIGSTOP)  # hung: alive, holding its connections, answering nothing
    stopped_at = time.monotonic()
    try:
        out0, err0 = procs[0].communicate(timeout=60)
    finally:
        procs[1].kill()  # a stopped process still dies of SIGKILL
        procs[1].communicate()
    assert procs[0].returncode == EXIT_GROUP_FAULT, err0
    # The 5 s timeout (counted from when rank 0 began to wait, which can be before the SIGSTOP),
    # the check of who answers, leaving the group: 7 to 12 s here.
    waited = time.monotonic() - stopped_at
    assert waited < 40, waited
    lines = [line for line in err0.splitlines() if line.startswith("difftrain train: error:")]
    assert len(lines) == 1 and "Traceback" not in err0, err0
    newest = ckpt.list_checkpoints(run / "checkpoints")[-1]
    assert "rank 1 did not answer" in lines[0] and "collective_timeout_s=5" in lines[0], lines[0]
    assert f"{newest[1]} (step {newest[0]})" in lines[0], lines[0]


def _torchrun(run_dir, overrides: list[str], *launch: str) -> subprocess.Popen:
    """``torchrun LAUNCH... -m difftrain train`` in a session of its own, output to files in run_dir/.."""
    sets = [a for kv in overrides for a in ("--set", kv)]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "difftrain", "train",
           "--run-dir", str(run_dir), *sets]
    # A new rendezvous store for each restart: the shared one keeps the old group's addresses.
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    log = open(f"{run_dir}.log", "w")  # noqa: SIM115 - closed when the process is waited for
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait(proc: subprocess.Popen, run_dir, timeout_s: float = 300.0) -> str:
    """The agent's exit code is checked by the caller; its log is returned. Kills the group on a hang."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"torchrun still running after {timeout_s:.0f} s:\n{Path(f'{run_dir}.log').read_text()}")
    return Path(f"{run_dir}.log").read_text()


def _rank_pid(agent: subprocess.Popen, rank: int) -> int:
    """The pid of the worker process of ``rank`` among the torchrun agent's children."""
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
    for pid in children:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no rank {rank} among {children}")


ELASTIC = COMMON + ["train.batch_size=4", "train.total_steps=12", "train.log_every_steps=1",
                    "validation.every_steps=0", "checkpoint.every_steps=2", "data.num_workers=2"]


@pytest.mark.slow  # about 60 s (SIGKILL) and 100 s (SIGSTOP): two torchrun runs of 2 processes, one restarted
# A killed rank's connections close when its loader workers, which hold copies of its sockets,
# have ended too (within 5 s): a timeout of 60 s lets that be seen as what it is.
@pytest.mark.parametrize(("fault", "timeout_s", "said"),
                         [(signal.SIGKILL, 60, "process ended"), (signal.SIGSTOP, 5, "rank 1 did not answer")])
def test_a_killed_or_hung_rank_under_max_restarts_restarts_the_group_and_resumes_to_the_uninterrupted_weights(
    tmp_path, fault, timeout_s, said
):
    launch = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    overrides = ELASTIC + [f"train.collective_timeout_s={timeout_s}"]
    straight = tmp_path / "straight"
    agent = _torchrun(straight, overrides, *launch)
    log = _wait(agent, straight)
    assert agent.returncode == 0, log
    run = tmp_path / "run"
    agent = _torchrun(run, overrides, *launch)
    deadline = time.monotonic() + 180
    while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 3):
        assert agent.poll() is None and time.monotonic() < deadline, Path(f"{run}.log").read_text()
        time.sleep(0.02)
    os.kill(_rank_pid(agent, 1), fault)  # mid-run, without warning; a stopped rank is SIGKILLed by torchrun
    log = _wait(agent, run)
    assert agent.returncode == 0, log  # one command: torchrun restarted the group, which finished

    starts = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [s["elastic_restart"] for s in starts] == [0, 1], starts
    assert 2 <= starts[1]["resumed_at_step"] < 12, starts  # resumed from a checkpoint of the faulty run
    faults = [line for line in log.splitlines() if line.startswith("difftrain train: error: rank 0 of 2")]
    assert len(faults) == 1 and said in faults[0], log  # rank 0's one line about its peer
    a, b = ckpt.load_checkpoint(straight), ckpt.load_checkpoint(run)
    assert a["step"] == b["step"] == 12
    assert ckpt.state_dict_sha256(a["model"]) == ckpt.state_dict_sha256(b["model"])
    assert ckpt.state_dict_sha256(a["ema"]["model"]) == ckpt.state_dict_sha256(b["ema"]["model"])


@pytest.mark.slow  # about 15 s: two ranks start, one is stopped before it joins the group
def test_a_rank_stopped_during_start_up_ends_the_other_with_the_same_one_line_and_exit(tmp_path):
    run = tmp_path / "run"
    procs = _start_ranks(run, ONE_RANK + ["train.collective_timeout_s=5"])
    os.kill(procs[1].pid, signal.SIGSTOP)  # before it has even imported torch: rank 0 waits for it to join
    try:
        out0, err0 = procs[0].communicate(timeout=60)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == EXIT_GROUP_FAULT, err0
    lines = [line for line in err0.splitlines() if line.startswith("difftrain train: error:")]
    assert len(lines) == 1 and "Traceback" not in err0 and "internal error" not in err0, err0
    assert lines[0].startswith("difftrain train: error: rank 0 of 2, during start-up: a collective"), lines[0]
    assert "no checkpoint is on disk" in lines[0], lines[0]


@pytest.mark.slow  # about 90 s on a busy 2-core machine: two torchrun runs of 2 processes, one restarted
def test_an_fsdp_run_started_from_a_base_through_the_meta_path_survives_a_killed_rank_and_resumes_exactly(tmp_path):
    """``train.parallel='fsdp'`` full fine-tuning of the tiny Stable Diffusion UNet from its base folder, its
    shards filled from the base's files on the meta device (no whole build: no warning saying so); rank 1
    SIGKILLed mid-run, torchrun restarts the group (``--max-restarts 1``), which resumes from its newest
    sharded checkpoint, each rank reading its part: the uninterrupted run's weights and EMA, digest for digest."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from tests.integration.test_lora import _sd_overrides

    launch = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    overrides = _sd_overrides(tmp_path, list(ELASTIC), "lora.rank=0", "train.parallel=fsdp", "train.channels_last=off",
                              "train.batch_size=2", "train.total_steps=8", "train.collective_timeout_s=60")
    straight = tmp_path / "straight"
    agent = _torchrun(straight, overrides, *launch)
    log = _wait(agent, straight)
    assert agent.returncode == 0, log
    assert "building the network whole" not in log, log  # started through the meta path
    run = tmp_path / "run"
    agent = _torchrun(run, overrides, *launch)
    deadline = time.monotonic() + 300
    while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 3):
        assert agent.poll() is None and time.monotonic() < deadline, Path(f"{run}.log").read_text()
        time.sleep(0.02)
    os.kill(_rank_pid(agent, 1), signal.SIGKILL)  # mid-run, without warning
    log = _wait(agent, run)
    assert agent.returncode == 0, log  # one command: torchrun restarted the group, which finished
    assert "building the network whole" not in log, log

    starts = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [s["elastic_restart"] for s in starts] == [0, 1], starts
    assert 2 <= starts[1]["resumed_at_step"] < 8, starts  # resumed from a sharded checkpoint of the faulty run
    a, b = ckpt.load_checkpoint(straight), ckpt.load_checkpoint(run)
    assert a["path"].endswith("step_00000008.dcp") and b["path"].endswith("step_00000008.dcp")
    assert a["network"]["kind"] == "family"
    assert ckpt.state_dict_sha256(a["model"]) == ckpt.state_dict_sha256(b["model"])
    assert ckpt.state_dict_sha256(a["ema"]["model"]) == ckpt.state_dict_sha256(b["ema"]["model"])
