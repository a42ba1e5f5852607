"""Monitoring during training: held-out loss, raw grids, and the optional trackers' local modes."""

from __future__ import annotations

import json
import sys

import pytest

from difftrain.config import load_config
from difftrain.training.loop import train


def _lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_heldout_loss_and_raw_grid_are_logged(tmp_path, tiny_overrides):
    cfg = load_config(None, tiny_overrides + ["data.heldout_fraction=0.02", "validation.raw_grid=true"])
    train(cfg, tmp_path)
    held = [line for line in _lines(tmp_path) if "heldout/loss" in line]
    assert [line["step"] for line in held] == [3, 6]
    for line in held:
        assert 0 < line["heldout/loss"] < 10 and "heldout_raw/loss" in line
        assert len([k for k in line if k.startswith("heldout/loss_bucket/")]) == 10
    assert held[0]["heldout_raw/loss"] != held[1]["heldout_raw/loss"]  # the weights moved
    assert sorted(p.name for p in (tmp_path / "samples" / "raw").iterdir()) == [
        "step_00000003.png", "step_00000006.png"]


def test_wandb_offline(tmp_path, tiny_overrides, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = load_config(None, tiny_overrides + ["tracking.wandb=true", "tracking.tensorboard=false"])
    train(cfg, tmp_path)
    # The records are written by W&B's service process; finish() may return before it has flushed
    # them (seen on CI). A `difftrain train` process gets this wait from W&B's atexit hook.
    wandb.teardown()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb")), "no offline W&B log written"
    log = next(runs[0].glob("*.wandb")).read_bytes()  # the records, protobuf: keys appear verbatim
    assert b"grad_norm" in log and b"loss_bucket/9" in log and b"data_wait_frac" in log
    assert len(list(runs[0].rglob("media/images/samples/ema_*.png"))) == 2  # the validation grids


def test_mlflow_local_store(tmp_path, tiny_overrides, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    cfg = load_config(None, tiny_overrides + ["tracking.mlflow=true", "tracking.tensorboard=false",
                                              "data.heldout_fraction=0.02"])
    train(cfg, tmp_path)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("difftrain")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.params["optim.lr"] == "0.001"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [2, 4, 6]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "heldout/loss")] == [3, 6]
    assert run.info.status == "FINISHED"


def test_a_chosen_tracker_that_is_missing_names_the_option(tmp_path, tiny_overrides, monkeypatch):
    from difftrain.runtime.optional import MissingDependency

    for name in [m for m in sys.modules if m == "wandb" or m.startswith("wandb.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable, as when not installed
    cfg = load_config(None, tiny_overrides + ["tracking.wandb=true"])
    with pytest.raises(MissingDependency, match=r"tracking.wandb=true .*pip install 'difftrain\[tracking\]'"):
        train(cfg, tmp_path)


def test_resume_with_a_heldout_split_stays_exact(tmp_path, tiny_overrides):
    from difftrain.checkpoints import checkpoint as ckpt

    cfg = load_config(None, tiny_overrides + ["data.heldout_fraction=0.01", "validation.raw_grid=true"])
    train(cfg, tmp_path / "straight")
    train(cfg, tmp_path / "resumed", stop_at_step=4)
    train(cfg, tmp_path / "resumed")
    digests = [ckpt.state_dict_sha256(ckpt.load_checkpoint(tmp_path / d)["model"]) for d in ("straight", "resumed")]
    assert digests[0] == digests[1]
    last = [[r for r in _lines(tmp_path / d) if r["step"] == 6 and "heldout/loss" in r][-1] for d in ("straight", "resumed")]
    for row in last:
        assert row.pop("time") > 0  # wall-clock time of the row: differs between the two runs
    assert last[0] == last[1]  # frozen held-out triples: the same weights give the same numbers
