"""LR schedule: linear warm-up, cosine to the floor, constant."""

from __future__ import annotations

import pytest

from difftrain.training.lr_schedule import lr_at


def test_warmup_is_linear_to_the_peak():
    lrs = [lr_at(s, peak_lr=1.0, warmup_steps=4, total_steps=10) for s in range(4)]
    assert lrs == [0.25, 0.5, 0.75, 1.0]


def test_cosine_decays_to_the_floor():
    kw = dict(peak_lr=1.0, warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    lrs = [lr_at(s, **kw) for s in range(2, 13)]
    assert lrs[0] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert lr_at(7, **kw) == pytest.approx(0.55)  # half way


def test_constant_holds_the_peak():
    assert lr_at(500, peak_lr=3e-4, warmup_steps=10, total_steps=1000, schedule="constant") == 3e-4


def test_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="optim.lr_schedule"):
        lr_at(5, peak_lr=1.0, warmup_steps=0, total_steps=10, schedule="step")
