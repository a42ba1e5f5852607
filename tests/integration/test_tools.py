"""diagnose, lr-find, estimate and report on real (tiny) runs, through the command line."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from difftrain.config import load_config
from difftrain.tools.common import build_setup
from difftrain.tools.estimate import activation_bytes, estimate
from difftrain.checkpoints import checkpoint as ckpt
from difftrain.training.loop import train


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "difftrain", *args], capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"difftrain {args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from conftest import TINY_OVERRIDES

    path = tmp_path_factory.mktemp("run")
    cfg = load_config(None, TINY_OVERRIDES + ["data.heldout_fraction=0.01", "validation.raw_grid=true"])
    train(cfg, path)
    return path


def test_lr_find_writes_plot_data_and_a_usable_suggestion(tmp_path, tiny_overrides):
    out = tmp_path / "lrf"
    proc = run("lr-find", *sets(tiny_overrides), "--num-steps", "30", "--start-lr", "1e-5", "--end-lr", "100",
               "--out", str(out))
    record = json.loads((out / "lr_find.json").read_text())
    assert "passed" in record["stop"] or "not finite" in record["stop"]  # lr 100 diverges: stopped early
    assert len(record["lr"]) < 30
    with open(out / "lr_find.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["lr"]) for r in rows] == pytest.approx(record["lr"])
    assert Image.open(out / "lr_find.png").size == (720, 440)
    suggested = re.search(r"--set (optim\.lr=\S+)", proc.stdout).group(1)
    cfg = load_config(None, tiny_overrides + [suggested])
    assert record["lr"][0] <= cfg.optim.lr < record["min_loss_lr"]


def test_estimate_measures_what_grows_with_the_batch(tiny_cfg):
    setup = build_setup(tiny_cfg)
    a4, _ = activation_bytes(setup, 4)
    a8, _ = activation_bytes(setup, 8)
    assert a8 == pytest.approx(2 * a4, rel=0.1)  # activations are linear in the batch
    r = estimate(tiny_cfg, batch_size=4, target_batch=50, memory_gib=1.0, scale_lr=True)
    n = sum(p.numel() for p in setup.model.parameters())
    assert r["params_mib"] == pytest.approx(n * 4 / 2**20, rel=1e-3)
    assert r["grads_mib"] == pytest.approx(r["params_mib"], rel=1e-3)
    assert r["optimizer_mib"] == pytest.approx(2 * r["params_mib"], rel=0.01)  # AdamW: two moments
    budget = 0.9 * 2**30 / 2**20
    fixed = r["total_mib"] - r["activations_mib"]
    assert r["max_batch_size"] == pytest.approx((budget - fixed) / r["activations_per_image_mib"], abs=2)
    assert r["micro_batch"] * r["grad_accum_steps"] >= 50 and r["grad_accum_steps"] == 13
    assert r["lr"] == pytest.approx(tiny_cfg.optim.lr * r["effective_batch"] / tiny_cfg.optim.base_batch)


def test_gradient_checkpointing_shows_in_the_estimate(tiny_overrides):
    plain = activation_bytes(build_setup(load_config(None, tiny_overrides)), 4)[0]
    ckpted = activation_bytes(build_setup(load_config(None, tiny_overrides + ["model.gradient_checkpointing=true"])), 4)[0]
    assert ckpted < plain


def test_estimate_cli(tiny_overrides):
    proc = run("estimate", *sets(tiny_overrides), "--batch-size", "4", "--target-batch", "32", "--json")
    r = json.loads(proc.stdout)
    assert r["batch_size"] == 4 and r["grad_accum_steps"] == 8 and r["max_batch_size"] > 4
    # memory depends on shapes only: a preset whose data is not on this machine still estimates
    proc = run("estimate", *sets(tiny_overrides + ["data.path=/nonexistent/images"]), "--batch-size", "4")
    assert "random stand-in" in proc.stdout and f"{r['activations_mib']:.1f} MiB" in proc.stdout


def test_diagnose_passes_a_healthy_checkpoint(run_dir, tmp_path):
    out = tmp_path / "diag"
    proc = run("diagnose", "--checkpoint", str(run_dir), "--out", str(out), "--timesteps", "0", "50", "99",
               "--num-images", "8")
    assert proc.stdout.count("[ok  ]") == 4, proc.stdout
    record = json.loads((out / "diagnose.json").read_text())
    errors = record["error_per_timestep"]
    assert [e["bucket"] for e in errors] == list(range(10)) and all(np.isfinite(e["eps_mse"]) for e in errors)
    grid = np.asarray(Image.open(out / "trajectory.png"))
    # 4 images x 2 rows (x_t, predicted x0), 1 + 3 columns of 16 px with 2 px padding
    assert grid.shape == (8 * 18 + 2, 4 * 18 + 2, 3)
    first = grid[2:18, 2:18]  # x0 heads both rows of an image
    assert np.array_equal(first, grid[20:36, 2:18])
    assert not np.array_equal(grid[2:18, 20:38], grid[2:18, 56:72])  # x_t at t=0 differs from t=99


def test_diagnose_flags_missing_optimizer_state_and_unscaled_data(run_dir, tmp_path, monkeypatch):
    state = ckpt.load_checkpoint(run_dir)
    state.pop("path")
    state["optimizer"] = {"state": {}, "param_groups": []}
    bad = tmp_path / "bad.pt"
    torch.save(state, bad)
    proc = run("diagnose", "--checkpoint", str(bad), "--out", str(tmp_path / "d"), "--num-images", "4", check=False)
    assert proc.returncode == 1 and re.search(r"\[fail\] optimizer state", proc.stdout)

    from difftrain.tools import diagnose as dg

    setup = build_setup(load_config(None, ["data.resolution=16", "data.num_workers=0"]))
    assert dg.check_data_range(setup).status == "ok"
    class ZeroToOne(torch.utils.data.Dataset):  # the classic bug: images left in [0, 1]
        def __len__(self):
            return len(setup_inner)

        def __getitem__(self, key):
            x, y = setup_inner[key]
            return (x + 1) / 2, y

    setup_inner = setup.dataset
    monkeypatch.setattr(setup, "dataset", ZeroToOne())
    assert dg.check_data_range(setup).status == "fail"  # [0, 1] data is caught


def test_report_is_self_contained(run_dir, tmp_path):
    out = tmp_path / "report.html"
    run("report", str(run_dir), "--out", str(out))
    page = out.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing fetched from the network
    assert page.count("data:image/png;base64,") == 4  # EMA grids at steps 3 and 6, raw grids too
    assert "held-out loss by noise-level bucket" in page and "step_00000006.pt" in page
    assert "[optim]" in page
