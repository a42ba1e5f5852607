"""An image grid with a caption under each row, drawn with Pillow's built-in font.

Layout (all in pixels), for N images of h x w in rows of `ncols`, nrows = ceil(N / ncols):

    width  = ncols * (w + pad) + pad
    height = nrows * (pad + h + band) + pad,   band = caption_band_height(h, lines)

Each row is pad + h pixels of images (white gaps, as `sampling.make_grid`), then a white
band of `band` pixels holding the row's caption in black, word-wrapped to the row's width
and cut with "..." after `lines` lines. `lines` is the largest number of lines any caption
needs, capped at `max_lines`, so all rows have the same height.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

PAD = 2  # pixels between images and around the grid, as sampling.make_grid
TEXT_MARGIN = 2  # pixels between the band's edges and the text
ELLIPSIS = "..."


def caption_font_size(image_height: int) -> int:
    """Font size in pixels: 11 for small images (readable at 32 px), up to 24 for large ones."""
    return max(11, min(24, image_height // 8))


def _font(size: int):
    """Pillow's built-in font at `size` (FreeType), or its fixed bitmap font without FreeType."""
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):  # Pillow < 10.1 or no FreeType
        return ImageFont.load_default()


def _line_height(font) -> int:
    """Pixels per line of text in `font`, ascenders to descenders plus 2."""
    left, top, right, bottom = font.getbbox("Ag|yQ")
    return bottom + 2


def caption_band_height(image_height: int, lines: int) -> int:
    """Height in pixels of a caption band of `lines` lines (at least 12)."""
    font = _font(caption_font_size(image_height))
    return max(12, lines * _line_height(font) + 2 * TEXT_MARGIN)


def _fit(text: str, font, width: int) -> str:
    """`text` cut so that it plus "..." fits in `width` pixels."""
    while text and font.getlength(text + ELLIPSIS) > width:
        text = text[:-1]
    return text.rstrip() + ELLIPSIS


def wrap_caption(text: str, font, width: int, max_lines: int) -> list[str]:
    """Lines of `text` at most `width` pixels wide in `font`; at most max_lines, the last
    ending in "..." when text was left out. Words wider than a line are split."""
    lines: list[str] = []
    current = ""
    for word in text.split():
        while font.getlength(word) > width:  # split an over-long word at the width
            cut = len(word)
            while cut > 1 and font.getlength(word[:cut]) > width:
                cut -= 1
            if current:
                lines.append(current)
                current = ""
            lines.append(word[:cut])
            word = word[cut:]
        candidate = f"{current} {word}" if current else word
        if font.getlength(candidate) <= width:
            current = candidate
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    if len(lines) > max_lines:
        lines = lines[:max_lines - 1] + [_fit(lines[max_lines - 1], font, width)]
    return lines or [""]


def captioned_grid(images: np.ndarray | torch.Tensor, row_captions: list[str], ncols: int,
                   max_lines: int = 2) -> np.ndarray:
    """(N, H, W, C) uint8 images, C of 1 or 3, in rows of `ncols` with a caption under each
    row -> one (H', W', C) uint8 image (sizes in the module docstring).

    row_captions: one caption per row, ceil(N / ncols) of them. Cells after the last image
    of a short last row stay white.
    """
    array = images.detach().cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    if array.ndim != 4 or array.shape[-1] not in (1, 3):
        raise ValueError(f"images must be (N, H, W, 1 or 3), got shape {array.shape}")
    if array.dtype != np.uint8:
        raise TypeError(f"images must be uint8, got {array.dtype}")
    n, h, w, c = array.shape
    if ncols < 1 or n == 0:
        raise ValueError(f"need ncols >= 1 and at least one image, got ncols={ncols}, N={n}")
    if max_lines < 1:
        raise ValueError(f"max_lines must be >= 1, got {max_lines}")
    nrows = math.ceil(n / ncols)
    if len(row_captions) != nrows:
        raise ValueError(f"{n} images in rows of {ncols} make {nrows} rows, but "
                         f"{len(row_captions)} row captions were given")

    width = ncols * (w + PAD) + PAD
    font = _font(caption_font_size(h))
    text_width = width - 2 * (PAD + TEXT_MARGIN)
    wrapped = [wrap_caption(str(t), font, text_width, max_lines) for t in row_captions]
    band = caption_band_height(h, max(len(lines) for lines in wrapped))
    row_height = PAD + h + band
    canvas = Image.new("L" if c == 1 else "RGB", (width, nrows * row_height + PAD),
                       255 if c == 1 else (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    line_height = _line_height(font)
    for r, lines in enumerate(wrapped):  # text first: images are pasted over any overhang
        band_top = r * row_height + PAD + h
        for k, line in enumerate(lines):
            draw.text((PAD + TEXT_MARGIN, band_top + TEXT_MARGIN + k * line_height), line,
                      fill=0 if c == 1 else (0, 0, 0), font=font)
    grid = np.array(canvas).reshape(canvas.height, width, c)
    for i in range(n):
        r, q = divmod(i, ncols)
        top, left = r * row_height + PAD, PAD + q * (w + PAD)
        grid[top:top + h, left:left + w] = array[i]
    return grid
