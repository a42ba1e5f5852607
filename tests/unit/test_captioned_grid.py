"""The captioned grid: its size, the images placed unchanged, the text inside its bands."""

import numpy as np
import pytest
import torch

from difftrain.generation.captioned_grid import (
    ELLIPSIS,
    PAD,
    _font,
    caption_band_height,
    caption_font_size,
    captioned_grid,
    wrap_caption,
)


def _images(n, h, w, c, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, h, w, c), dtype=np.uint8)


def _layout(n, h, w, ncols, band):
    """Top-left corner of each image, and the band rows of each grid row."""
    row_height = PAD + h + band
    corners = [(r * row_height + PAD, PAD + q * (w + PAD))
               for r, q in (divmod(i, ncols) for i in range(n))]
    bands = [(r * row_height + PAD + h, (r + 1) * row_height) for r in range(-(-n // ncols))]
    return corners, bands


@pytest.mark.parametrize("c", [1, 3])
def test_size_images_and_bands(c):
    n, h, w, ncols = 7, 32, 32, 3  # 3 rows, the last one short
    images = _images(n, h, w, c)
    captions = ["a red cat", "a dog on grass", "the sky"]
    grid = captioned_grid(images, captions, ncols)
    band = caption_band_height(h, 1)
    assert band >= 12
    assert grid.dtype == np.uint8
    assert grid.shape == (3 * (PAD + h + band) + PAD, ncols * (w + PAD) + PAD, c)
    corners, bands = _layout(n, h, w, ncols, band)
    for i, (top, left) in enumerate(corners):
        np.testing.assert_array_equal(grid[top:top + h, left:left + w], images[i])
    for top, bottom in bands:
        strip = grid[top:bottom].astype(int)
        assert (strip < 100).sum() >= 20  # dark text
        assert np.median(strip) == 255  # on white
        assert (strip[:, :, :] == strip[:, :, :1]).all()  # black on white: gray levels only
    # The empty cells of the short last row stay white.
    top, left = corners[-1]
    assert (grid[top:top + h, left + w + PAD:] == 255).all()


def test_different_captions_draw_different_bands():
    images = _images(4, 32, 32, 3)
    a = captioned_grid(images, ["a cat", "a cat"], 2)
    b = captioned_grid(images, ["a cat", "a dog"], 2)
    band = caption_band_height(32, 1)
    _, bands = _layout(4, 32, 32, 2, band)
    (t0, b0), (t1, b1) = bands
    np.testing.assert_array_equal(a[t0:b0], a[t1:b1])
    np.testing.assert_array_equal(a[t0:b0], b[t0:b0])
    assert not np.array_equal(b[t0:b0], b[t1:b1])


def test_long_captions_wrap_and_stay_inside_their_band():
    n, h, w, ncols = 4, 32, 32, 2
    images = np.zeros((n, h, w, 3), np.uint8)  # black images: any text would not show, so
    long = "an extraordinarily long caption " * 20  # check the white gaps and the bands
    grid = captioned_grid(images, [long, "short " + "x" * 200], ncols, max_lines=2)
    band = caption_band_height(h, 2)
    assert grid.shape == (2 * (PAD + h + band) + PAD, ncols * (w + PAD) + PAD, 3)
    corners, bands = _layout(n, h, w, ncols, band)
    mask = np.ones(grid.shape[:2], bool)  # True where only white is allowed
    for top, bottom in bands:
        mask[top:bottom, PAD:grid.shape[1] - PAD] = False  # text may go here, not in the margins
    for top, left in corners:
        mask[top:top + h, left:left + w] = False
    assert (grid[mask] == 255).all()
    for top, bottom in bands:
        assert (grid[top:bottom] < 100).any()
    font = _font(caption_font_size(h))
    width = grid.shape[1] - 2 * (PAD + 2)
    lines = wrap_caption(long, font, width, max_lines=2)
    assert len(lines) == 2 and lines[-1].endswith(ELLIPSIS)
    assert all(font.getlength(line) <= width for line in lines)
    unbroken = wrap_caption("x" * 200, font, width, max_lines=3)
    assert len(unbroken) == 3 and all(font.getlength(line) <= width for line in unbroken)


def test_wrap_keeps_every_word_when_it_fits():
    font = _font(11)
    text = "a photo of a small red house by the sea"
    lines = wrap_caption(text, font, width=60, max_lines=10)
    assert " ".join(lines) == text and len(lines) > 1
    assert all(font.getlength(line) <= 60 for line in lines)
    assert wrap_caption("", font, 60, 2) == [""]


def test_font_grows_with_the_images_and_torch_input_works():
    assert caption_font_size(32) == 11 and caption_font_size(256) == 24
    assert caption_band_height(256, 1) > caption_band_height(32, 1)
    images = torch.from_numpy(_images(2, 16, 24, 1))
    grid = captioned_grid(images, ["gray"], 2)
    assert grid.shape == (PAD + 16 + caption_band_height(16, 1) + PAD, 2 * (24 + PAD) + PAD, 1)


def test_input_checks():
    images = _images(5, 8, 8, 3)
    with pytest.raises(ValueError, match="3 rows, but 2 row captions"):
        captioned_grid(images, ["a", "b"], 2)
    with pytest.raises(ValueError, match="N, H, W"):
        captioned_grid(images[..., :2], ["a", "b", "c"], 2)
    with pytest.raises(TypeError, match="uint8"):
        captioned_grid(images.astype(np.float32), ["a", "b", "c"], 2)
