"""bench/shape_checker.py: real built-in shapes are clean and of their class; noisy, grainy,
doubled, shuffled, blurred, blob-shaped and bitten ones are not; grids split back into images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from difftrain.data.builtin import SHAPE_CLASSES, draw_shape
from difftrain.generation.sampling import make_grid
from tests.bench_modules import load_bench

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checker():
    return load_bench("shape_checker")


@pytest.mark.parametrize("resolution", [16, 32])
def test_real_shapes_are_clean_and_of_their_class(checker, resolution):
    for index in range(6):
        verdict = checker.judge(draw_shape(index, resolution)[0])
        assert verdict.clean, (index, verdict)
        assert verdict.shape == SHAPE_CLASSES[index % 3]
        assert verdict.fit_error < checker.MAX_FIT_ERROR


@pytest.mark.parametrize("kind", ["noise sigma 8", "noise sigma 16", "grainy background (sigma 10)",
                                  "blurred (sigma 1 px)", "shuffled pixels", "uniform noise image"])
def test_corrupted_shapes_are_not_clean(checker, kind):
    make = checker.corruptions(16)[kind]
    rng = np.random.default_rng(0)
    verdicts = [checker.judge(make(index, rng)) for index in range(6)]
    assert not any(v.clean for v in verdicts), verdicts
    assert all(v.reason for v in verdicts)


def test_two_shapes_blobs_and_gradients_are_mostly_not_clean(checker):
    """A second half-shape or a blob of discs can by chance hide behind or look like one shape,
    a gradient clipped at 0 or 255 can leave a small shape nearly plain."""
    rng = np.random.default_rng(0)
    for kind in ("two shapes", "blob (2-4 discs, clean colours)", "two-tone shape (gradient)"):
        make = checker.corruptions(16)[kind]
        assert sum(checker.judge(make(index, rng)).clean for index in range(10)) <= 3, kind


def test_plain_image_has_no_shape(checker):
    verdict = checker.judge(np.full((16, 16, 3), 128, dtype=np.uint8))
    assert not verdict.clean and verdict.shape is None and verdict.reason == "no shape stands out"


def test_grid_splits_back_into_its_images_also_enlarged(checker):
    images = np.stack([draw_shape(i, 16)[0] for i in range(6)])
    grid = make_grid(images)
    assert np.array_equal(checker.split_grid(grid, 16), images)
    enlarged = grid.repeat(4, axis=0).repeat(4, axis=1)
    assert np.array_equal(checker.split_grid(enlarged, 16), images)


def test_clean_rate_and_cli(checker, tmp_path, capsys):
    images = np.stack([draw_shape(i, 16)[0] for i in range(3)] + [np.zeros((16, 16, 3), np.uint8)])
    rate, verdicts = checker.clean_rate(images)
    assert rate == 0.75 and [v.clean for v in verdicts] == [True, True, True, False]
    np.savez(tmp_path / "s.npz", images)
    assert checker.main([str(tmp_path / "s.npz")]) == 0
    assert "75.0% clean (3/4; disc 1, square 1, triangle 1)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="RGB image"):
        checker.judge(np.zeros((16, 16), np.uint8))
