"""The command line end to end, in real subprocesses: train, resume, inspect, sample."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

TINY = str(Path(__file__).parents[2] / "configs" / "tiny.toml")


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "difftrain", *args], capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"difftrain {args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_train_resume_inspect_sample(tmp_path, tiny_overrides):
    run_dir = tmp_path / "run"
    sets = [a for o in tiny_overrides for a in ("--set", o)]
    run("train", *sets, "--stop-at-step", "4", "--run-dir", str(run_dir))
    info = json.loads(run("inspect", str(run_dir), "--json").stdout)
    assert info["step"] == 4 and len(info["model_sha256"]) == 64 and len(info["ema_sha256"]) == 64

    resumed = run("train", *sets, "--run-dir", str(run_dir))  # same command, longer: resumes
    assert "resumed from" in resumed.stdout and "step 4" in resumed.stdout
    info = json.loads(run("inspect", str(run_dir), "--json").stdout)
    assert info["step"] == 6 and info["images_seen"] == 48 and info["parameters"] > 0
    text = run("inspect", str(run_dir)).stdout
    assert info["model_sha256"] in text and "[train]" in text

    out_a, out_b, out_c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    shown = run("sample", "--checkpoint", str(run_dir), "--num", "5", "--steps", "4", "--seed", "3", "--out", str(out_a))
    assert "sample: 5/5 (100%)" in shown.stderr and "images/s" in shown.stderr  # a progress line
    run("sample", "--checkpoint", str(run_dir), "--num", "5", "--steps", "4", "--seed", "3", "--out", str(out_b))
    run("sample", "--checkpoint", str(run_dir), "--num", "5", "--sampler", "ddpm", "--steps", "4", "--no-ema",
        "--seed", "4", "--out", str(out_c))
    names = sorted(p.name for p in out_a.iterdir())
    assert names == ["000000.png", "000001.png", "000002.png", "000003.png", "000004.png", "grid.png"]
    first = np.asarray(Image.open(out_a / "000000.png"))
    assert first.shape == (16, 16, 3)
    assert np.array_equal(first, np.asarray(Image.open(out_b / "000000.png")))
    assert not np.array_equal(first, np.asarray(Image.open(out_c / "000000.png")))


def test_dry_run_prints_the_resolved_config(tmp_path):
    proc = run("train", "--config", TINY, "--set", "optim.lr=5e-4", "--dry-run")
    assert "lr = 0.0005" in proc.stdout and "[model]" in proc.stdout
    assert not (tmp_path / "runs").exists()


def test_config_typo_and_bad_value_name_the_key():
    proc = run("train", "--config", TINY, "--set", "optim.lrr=1", "--dry-run", check=False)
    assert proc.returncode == 2 and "optim.lrr" in proc.stderr
    proc = run("train", "--config", TINY, "--set", "train.batch_size=-4", "--dry-run", check=False)
    assert proc.returncode == 2 and "train.batch_size" in proc.stderr


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    proc = run("sample", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), check=False)
    assert proc.returncode == 2 and "nope" in proc.stderr


def test_version_defaults_in_help_and_config_once():
    assert run("--version").stdout.startswith("difftrain ")
    assert "(default: 256)" in run("sample", "--help").stdout
    proc = run("train", "--config", TINY, "--config", TINY, check=False)
    assert proc.returncode == 2 and "--config given twice" in proc.stderr


def test_posthoc_ema_writes_a_checkpoint_that_sample_and_inspect_read(tmp_path, tiny_overrides, capsys):
    from difftrain.cli import main
    from difftrain.config import load_config
    from difftrain.training.loop import train

    run_dir, out = tmp_path / "run", tmp_path / "ema_0.08.pt"
    train(load_config(None, tiny_overrides + ["ema.posthoc_std=[0.05, 0.1]", "validation.every_steps=0"]), run_dir)
    proc = run("posthoc-ema", str(run_dir), "--std", "0.08", "--out", str(out))
    assert "sigma_rel 0.08" in proc.stdout and "at step 6" in proc.stdout and "profile residual" in proc.stdout
    samples = tmp_path / "samples"
    proc = run("sample", "--checkpoint", str(out), "--num", "2", "--steps", "2", "--out", str(samples))
    assert "EMA weights" in proc.stdout and (samples / "grid.png").is_file()

    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert "reconstructed post hoc: sigma_rel 0.08 at step 6" in capsys.readouterr().out
    assert main(["posthoc-ema", str(run_dir), "--std", "0.5", "--out", str(out)]) == 2
    assert "sigma_rel must be in (0, 0.3)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def step_2_checkpoint(tmp_path_factory) -> Path:
    """A tiny run's step-2 checkpoint (``train --stop-at-step 2``), trained once for the damage cases
    below, each of which damages its own copy; trained in this process, as the file is not what they test."""
    from conftest import TINY_OVERRIDES

    from difftrain.config import load_config
    from difftrain.training.loop import train

    run_dir = tmp_path_factory.mktemp("cli") / "run"
    train(load_config(None, list(TINY_OVERRIDES)), run_dir, stop_at_step=2)
    return run_dir / "checkpoints" / "step_00000002.pt"


@pytest.mark.parametrize("damage", ["wrong shape", "missing key", "not a dict", "all NaN"])
def test_a_checkpoint_with_wrong_contents_is_one_line_in_every_command(tmp_path, tiny_overrides, step_2_checkpoint,
                                                                       damage):
    """train --resume, sample and diagnose: exit 2 and one line naming the file and the key."""
    import torch

    sets = [a for o in tiny_overrides for a in ("--set", o)]
    state = torch.load(step_2_checkpoint, weights_only=True)
    conv = next(k for k, v in state["model"].items() if v.ndim == 4)
    if damage == "wrong shape":
        state["model"][conv] = torch.zeros(1, 1, 1, 1)
        state["ema"]["model"][conv] = torch.zeros(1, 1, 1, 1)
    elif damage == "missing key":
        del state["optimizer"]
    elif damage == "not a dict":
        state["ema"] = [1, 2, 3]
    else:
        state["ema"]["model"] = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
                                 for k, v in state["ema"]["model"].items()}
    bad = tmp_path / "bad.pt"
    torch.save(state, bad)
    for args in (["train", *sets, "--resume", str(bad), "--run-dir", str(tmp_path / "new")],
                 ["sample", "--checkpoint", str(bad), "--num", "2", "--steps", "2", "--out", str(tmp_path / "s")],
                 ["diagnose", "--checkpoint", str(bad), "--out", str(tmp_path / "d")]):
        proc = run(*args, check=False)
        lines = [line for line in proc.stderr.splitlines() if "error" in line]
        assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, (args[0], proc.stderr)
        assert "bad.pt" in lines[0] and ("key" in lines[0] or "not finite" in lines[0]), lines[0]
