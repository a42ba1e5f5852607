"""The LR range test's pure parts: the sweep, the smoothing, the suggestion."""

from __future__ import annotations

import math

import pytest

from difftrain.tools.lr_find import lr_schedule, smooth, suggest_lr


def test_schedule_is_geometric_from_start_to_end():
    lrs = lr_schedule(1e-6, 1.0, 7)
    assert lrs[0] == pytest.approx(1e-6) and lrs[-1] == pytest.approx(1.0)
    ratios = [b / a for a, b in zip(lrs, lrs[1:])]
    assert all(r == pytest.approx(10.0) for r in ratios)
    with pytest.raises(ValueError, match="start-lr"):
        lr_schedule(1.0, 1e-3, 10)


def test_smoothing_is_bias_corrected():
    assert smooth([2.0] * 5, 0.98) == pytest.approx([2.0] * 5)  # no pull towards 0 at the start


def test_suggestion_sits_below_the_minimum_on_a_synthetic_curve():
    lrs = lr_schedule(1e-6, 1.0, 61)
    # flat, falls fastest near 1e-4, bottoms out at 1e-2, then explodes
    loss = [1 - 0.8 / (1 + math.exp(-3 * (math.log10(x) + 4))) + max(0.0, math.log10(x) + 2) ** 2 for x in lrs]
    s = suggest_lr(lrs, loss)
    assert s["min_loss_lr"] == pytest.approx(1e-2, rel=0.3)
    assert s["steepest"] == pytest.approx(1e-4, rel=0.3)
    assert s["suggested"] == min(s["steepest"], s["min_div10"]) < s["min_loss_lr"]
