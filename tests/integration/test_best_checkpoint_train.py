"""The best-FID checkpoint of a real run: kept past keep_last, across a resume and through a kill
inside its write (a real process, a real signal); named by sample and export as RUN/best; FID that
keeps rising warns."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fid_standin import use_standin, write_standin

from difftrain.cli import main
from difftrain.config import load_config
from difftrain.evaluation import during_training
from difftrain.checkpoints import checkpoint as ckpt
from difftrain.training.loop import train

ROOT = Path(__file__).resolve().parents[2]
FID_EVERY_2 = ["evaluation.fid_every_steps=2", "evaluation.fid_num_samples=2", "evaluation.fid_batch_size=2",
               "evaluation.fid_steps=2", "evaluation.fid_ref_num=4", "validation.every_steps=0",
               "checkpoint.every_steps=100", "checkpoint.keep_last=1", "tracking.tensorboard=false",
               "train.device=cpu"]

# A scripted FID (the stand-in's number would be arbitrary): the stand-in network still runs.
SCRIPT = """
import difftrain.evaluation.during_training as m
_fids = iter({fids})
_real = m.fid_result
def _scripted(*a, **k):
    out = _real(*a, **k)
    out["fid"] = next(_fids)
    return out
m.fid_result = _scripted
"""


def _env(tmp_path) -> dict:
    weights = write_standin(tmp_path / "standin.pt", 2048)
    return {"DIFFTRAIN_FID_WEIGHTS": str(weights), "DIFFTRAIN_CACHE": str(tmp_path / "cache")}


def _scripted(monkeypatch, fids):
    from difftrain.evaluation.evaluate import fid_result as real

    it = iter(fids)

    def scripted(*args, **kwargs):
        return {**real(*args, **kwargs), "fid": next(it)}

    monkeypatch.setattr(during_training, "fid_result", scripted)


def test_best_survives_keep_last_and_resume_and_rising_fid_warns(tmp_path, tiny_overrides, monkeypatch, capsys):
    # In this process the stand-in can have 64 features (2048 in the subprocesses below, which read
    # the weights from the environment alone): the FIDs are scripted, and a 2048x2048 covariance's
    # eigendecomposition per FID is most of this test's time.
    use_standin(monkeypatch, write_standin(tmp_path / "standin.pt", 64), 64, tmp_path / "cache")
    run = tmp_path / "run"
    _scripted(monkeypatch, [50.0, 30.0, 40.0, 45.0])
    train(load_config(None, tiny_overrides + FID_EVERY_2 + ["train.total_steps=8"]), run)
    names = [p.name for _, p in ckpt.list_checkpoints(run / "checkpoints")]
    assert names == ["step_00000004.pt", "step_00000008.pt"]  # keep_last=1, and the best (FID 30 at step 4)
    assert ckpt.read_best(run / "checkpoints") == ("step_00000004.pt", 30.0)

    _scripted(monkeypatch, [60.0, 35.0])  # resumed: neither beats 30, and FID rose 3 times in a row by step 10
    train(load_config(None, tiny_overrides + FID_EVERY_2 + ["train.total_steps=12"]), run)
    assert ckpt.read_best(run / "checkpoints") == ("step_00000004.pt", 30.0)
    assert ckpt.load_checkpoint(f"{run}/best")["step"] == 4
    assert ckpt.find_checkpoint(run).name == "step_00000012.pt"
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "FID has risen" in line]
    assert len(warned) == 1 and "step 10:" in warned[0] and "since step 4" in warned[0]

    # The report marks the best checkpoint and lists the warning.
    from difftrain.report.html import build_report

    page = build_report(run).read_text()
    assert "step_00000004.pt <b class=\"best\">best FID 30.000</b>" in page
    assert "<h2>Warnings</h2>" in page and "step 10: FID has risen" in page

    # sample and export take RUN/best and RUN:best.
    assert main(["sample", "--checkpoint", f"{run}/best", "--num", "2", "--steps", "2", "--out",
                 str(tmp_path / "samples"), "--device", "cpu"]) == 0
    assert len(list((tmp_path / "samples").glob("*.png"))) >= 2
    assert main(["export", f"{run}:best", str(tmp_path / "best.safetensors"), "--format", "safetensors"]) == 0
    assert (tmp_path / "best.safetensors").is_file()


@pytest.mark.slow  # about 45 s: two training processes start
def test_a_kill_inside_the_write_of_a_new_best_keeps_the_previous_best(tmp_path, tiny_overrides):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SCRIPT.format(fids=[50.0, 40.0, 30.0, 20.0, 10.0, 5.0]))
    env = {**os.environ, **_env(tmp_path), "PYTHONPATH": f"{site}{os.pathsep}{ROOT / 'src'}", ckpt.PAUSE_ENV: "3"}
    sets = [x for o in tiny_overrides + FID_EVERY_2 + ["train.total_steps=10"] for x in ("--set", o)]
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "difftrain", "train", "--run-dir", str(run), *sets]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ckpt_dir = run / "checkpoints"
    deadline = time.monotonic() + 300
    while not ((ckpt_dir / ckpt.BEST).exists() and any(ckpt_dir.glob(".step_*.tmp"))):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)  # inside the write of step 4, the new best (FID 40)
    proc.communicate(timeout=60)
    assert ckpt.read_best(ckpt_dir) == ("step_00000002.pt", 50.0)
    assert ckpt.load_checkpoint(f"{run}/best")["step"] == 2

    # Resumed, the run goes on from step 2 and the best moves with the new FIDs (30, 20, ...).
    env[ckpt.PAUSE_ENV] = "0"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    best = ckpt.read_best(ckpt_dir)
    assert best is not None and best[0] == "step_00000010.pt"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "fid" in r][-1] == 10
    assert not list(ckpt_dir.glob(".step_*.tmp"))


def test_a_run_without_fid_has_no_best_and_says_so(tmp_path, tiny_overrides, capsys):
    run = tmp_path / "run"
    train(load_config(None, tiny_overrides + ["train.total_steps=2", "validation.every_steps=0",
                                              "tracking.tensorboard=false", "train.device=cpu"]), run)
    assert main(["sample", "--checkpoint", f"{run}/best", "--num", "1", "--steps", "2",
                 "--out", str(tmp_path / "s"), "--device", "cpu"]) == 2
    assert "no best checkpoint" in capsys.readouterr().err
