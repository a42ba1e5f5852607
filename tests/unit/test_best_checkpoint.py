"""checkpoints/best: the checkpoint with the lowest FID, kept by rotation, named as RUN/best or RUN:best."""

from __future__ import annotations

import pytest

from difftrain.checkpoints import checkpoint as ckpt
from tests.unit.test_checkpoint import _state


def _save(run, step, fid=None, keep_last=1):
    return ckpt.save_checkpoint(_state(step), run / "checkpoints", step, keep_last=keep_last, best=fid)


def test_the_best_checkpoint_survives_keep_last(tmp_path):
    _save(tmp_path, 10, fid=50.0)
    _save(tmp_path, 20, fid=30.0)  # best
    for step, fid in ((30, 40.0), (40, None), (50, 35.0)):
        _save(tmp_path, step, fid)
    names = [p.name for _, p in ckpt.list_checkpoints(tmp_path / "checkpoints")]
    assert names == ["step_00000020.pt", "step_00000050.pt"]  # keep_last=1, plus the best
    assert ckpt.read_best(tmp_path / "checkpoints") == ("step_00000020.pt", 30.0)
    assert ckpt.find_checkpoint(tmp_path).name == "step_00000050.pt"  # latest is unchanged
    _save(tmp_path, 60, fid=20.0)  # a new best: the old one goes with the rotation
    names = [p.name for _, p in ckpt.list_checkpoints(tmp_path / "checkpoints")]
    assert names == ["step_00000060.pt"]


@pytest.mark.parametrize("form", ["{run}/best", "{run}:best", "{run}/checkpoints/best", "{run}/checkpoints:best"])
def test_best_is_named_by_run_slash_best_or_run_colon_best(tmp_path, form):
    _save(tmp_path, 10, fid=5.0)
    _save(tmp_path, 20, fid=9.0, keep_last=3)
    path = form.format(run=tmp_path)
    assert ckpt.find_checkpoint(path).name == "step_00000010.pt"
    assert ckpt.load_checkpoint(path)["step"] == 10


def test_a_run_without_a_best_checkpoint_says_so(tmp_path):
    _save(tmp_path, 10)
    with pytest.raises(FileNotFoundError, match="no best checkpoint .*evaluation.fid_every_steps"):
        ckpt.find_checkpoint(f"{tmp_path}/best")


@pytest.mark.parametrize("content", [b"", b"step_00000010.pt\n", b"../x.pt\n1.0\n", b"step_00000099.pt\n1.0\n",
                                     b"\xff\xfe\n", b"step_00000010.pt\nnot-a-number\n"])
def test_a_broken_best_pointer_is_ignored_and_rewritten(tmp_path, content):
    _save(tmp_path, 10, keep_last=3)
    (tmp_path / "checkpoints" / ckpt.BEST).write_bytes(content)
    assert ckpt.read_best(tmp_path / "checkpoints") is None
    assert ckpt.is_better(tmp_path / "checkpoints", 1e9)
    _save(tmp_path, 20, fid=7.0, keep_last=3)
    assert ckpt.read_best(tmp_path / "checkpoints") == ("step_00000020.pt", 7.0)


def test_a_non_finite_fid_is_never_best(tmp_path):
    _save(tmp_path, 10, fid=float("nan"))
    _save(tmp_path, 20, fid=float("inf"))
    assert ckpt.read_best(tmp_path / "checkpoints") is None
