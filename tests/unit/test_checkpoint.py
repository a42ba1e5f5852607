"""Checkpoints: atomic files, latest-pointer, rotation, safe loading, digests."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from difftrain.checkpoints import checkpoint as ckpt


def _state(step: int) -> dict:
    """A checkpoint of every key the schema asks for, with a tiny model."""
    w = {"w": torch.full((3,), float(step))}
    return {"step": step, "data_position": 8 * step, "skipped_steps": 0, "num_classes": 0,
            "config": {"train": {"seed": 0}}, "model": w, "ema": {"model": dict(w), "num_updates": step},
            "optimizer": {"state": {}, "param_groups": []}, "scaler": {}, "rng": {"torch": torch.get_rng_state()},
            "posthoc_ema": {"stds": [], "gammas": [], "models": []}, "network": {"kind": "unet"}, "frozen": {}}


def test_save_points_latest_at_the_newest(tmp_path):
    for step in (1, 2, 3):
        ckpt.save_checkpoint(_state(step), tmp_path, step, keep_last=5)
    assert (tmp_path / "latest").read_text().strip() == "step_00000003.pt"
    state = ckpt.load_checkpoint(tmp_path)
    assert state["step"] == 3 and torch.equal(state["model"]["w"], torch.full((3,), 3.0))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_rotation_keeps_last_n_and_every_k(tmp_path):
    for step in range(1, 11):
        ckpt.save_checkpoint(_state(step), tmp_path, step, keep_last=2, keep_every_steps=4)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 8, 9, 10]


def test_find_checkpoint_falls_back_when_the_pointer_is_stale(tmp_path):
    ckpt.save_checkpoint(_state(1), tmp_path, 1)
    ckpt.save_checkpoint(_state(2), tmp_path, 2)
    (tmp_path / "step_00000002.pt").unlink()
    assert ckpt.find_checkpoint(tmp_path).name == "step_00000001.pt"
    (tmp_path / "latest").unlink()
    assert ckpt.find_checkpoint(tmp_path).name == "step_00000001.pt"


def test_run_directory_resolves_through_checkpoints(tmp_path):
    ckpt.save_checkpoint(_state(7), tmp_path / "checkpoints", 7)
    assert ckpt.find_checkpoint(tmp_path).name == "step_00000007.pt"


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        ckpt.find_checkpoint(tmp_path)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_a_pickle_that_runs_code_is_refused(tmp_path):
    path = tmp_path / "step_00000001.pt"
    with open(path, "wb") as f:
        pickle.dump({"format": ckpt.FORMAT, "step": 1, "payload": _RunsCode()}, f)
    with pytest.raises(ValueError, match="cannot load checkpoint"):
        ckpt.load_checkpoint(path)


def test_a_foreign_file_is_refused(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"weights": torch.zeros(1)}, path)
    with pytest.raises(ValueError, match="not a difftrain checkpoint"):
        ckpt.load_checkpoint(path)


def test_digest_depends_on_values_names_and_dtype():
    a = {"w": torch.zeros(4), "b": torch.ones(2)}
    digest = ckpt.state_dict_sha256(a)
    assert digest == ckpt.state_dict_sha256({"b": torch.ones(2), "w": torch.zeros(4)})
    assert digest != ckpt.state_dict_sha256({"w": torch.zeros(4), "b": torch.tensor([1.0, 1.0 + 1e-7])})
    assert digest != ckpt.state_dict_sha256({"v": torch.zeros(4), "b": torch.ones(2)})
    assert digest != ckpt.state_dict_sha256({"w": torch.zeros(4, dtype=torch.float64), "b": torch.ones(2)})
