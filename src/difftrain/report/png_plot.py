"""A line plot drawn with Pillow, for PNG files that need no plotting library."""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: a fixed bitmap font
        return ImageFont.load_default()


def _fmt(v: float) -> str:
    return f"{v:.0e}" if v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e4) else f"{v:.3g}"


def png_line_plot(
    path: Path,
    xs: list[float],
    curves: dict[str, list[float]],
    *,
    title: str,
    x_label: str,
    y_label: str,
    log_x: bool = False,
    marker_x: float | None = None,
    marker_label: str = "",
    size: tuple[int, int] = (720, 440),
) -> Path:
    """Draw ``curves`` (name -> ys, aligned with ``xs``) into a PNG at ``path``; non-finite
    points are left out. ``marker_x`` draws a labelled vertical line."""
    W, H = size
    left, right, top, bottom = 70, 20, 36, 50
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    font, small = _font(15), _font(12)
    fx = (lambda v: math.log10(v)) if log_x else (lambda v: v)
    pts_all = [(fx(x), y) for ys in curves.values() for x, y in zip(xs, ys)
               if math.isfinite(y) and (x > 0 or not log_x)]
    draw.text((left, 8), title, fill="black", font=font)
    if not pts_all:
        img.save(path)
        return path
    x0, x1 = min(p[0] for p in pts_all), max(p[0] for p in pts_all)
    y0, y1 = min(p[1] for p in pts_all), max(p[1] for p in pts_all)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    pw, ph = W - left - right, H - top - bottom

    def to_px(x: float, y: float) -> tuple[float, float]:
        return left + (fx(x) - x0) / (x1 - x0) * pw, top + (1 - (y - y0) / (y1 - y0)) * ph

    draw.rectangle([left, top, left + pw, top + ph], outline="#999")
    for i in range(5):
        yv = y0 + (y1 - y0) * i / 4
        yp = top + (1 - i / 4) * ph
        draw.line([left, yp, left + pw, yp], fill="#e6e6e6")
        draw.text((left - 6, yp), _fmt(yv), fill="black", font=small, anchor="rm")
    if log_x:
        ticks = [10.0**e for e in range(math.ceil(x0), math.floor(x1) + 1)]
    else:
        ticks = [x0 + (x1 - x0) * i / 4 for i in range(5)]
    for xv in ticks:
        xp = left + (fx(xv) - x0) / (x1 - x0) * pw
        draw.line([xp, top, xp, top + ph], fill="#e6e6e6")
        draw.text((xp, top + ph + 6), _fmt(xv), fill="black", font=small, anchor="mt")
    draw.text((left + pw / 2, H - 8), x_label, fill="black", font=small, anchor="ms")
    draw.text((8, top - 4), y_label, fill="black", font=small, anchor="ls")
    colors = ("#9ab", "#0072B2", "#D55E00", "#009E73")
    for k, (name, ys) in enumerate(curves.items()):
        line = [to_px(x, y) for x, y in zip(xs, ys) if math.isfinite(y) and (x > 0 or not log_x)]
        if len(line) > 1:
            draw.line(line, fill=colors[k % len(colors)], width=2)
        draw.text((left + pw - 8, top + 8 + 16 * k), name, fill=colors[k % len(colors)], font=small, anchor="rt")
    if marker_x is not None and math.isfinite(marker_x) and (marker_x > 0 or not log_x):
        xp = left + (fx(marker_x) - x0) / (x1 - x0) * pw
        draw.line([xp, top, xp, top + ph], fill="#D00", width=2)
        draw.text((xp + 4, top + ph - 6), marker_label, fill="#D00", font=small, anchor="ls")
    img.save(path)
    return path
