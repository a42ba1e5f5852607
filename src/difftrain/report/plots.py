"""Line plots as inline SVG text: no plotting library, no script, nothing to fetch."""

from __future__ import annotations

import html
import math

# Colours that stay apart on white (Okabe & Ito 2008), then a 10-step ramp for buckets.
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")
RAMP = ("#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58",
        "#b5de2b", "#fde725")


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-2:
        return f"{v:.1e}"
    return f"{v:.3g}"


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def svg_line_plot(
    title: str,
    series: dict[str, tuple[list[float], list[float]]],
    *,
    log_y: bool = False,
    log_x: bool = False,
    x_label: str = "step",
    width: int = 410,
    height: int = 230,
    colors: tuple[str, ...] = PALETTE,
    marker: tuple[float, float] | None = None,
) -> str:
    """One SVG chart of ``series`` (name -> (xs, ys)); non-finite points are dropped.

    ``log_y`` / ``log_x`` use log10 axes (non-positive values dropped); ``marker`` draws a
    dot at (x, y). Returns ``<figure>`` markup with ``class="plot"`` and a legend.
    """
    clean = {}
    for name, (xs, ys) in series.items():
        pts = [(x, y) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)
               and (not log_y or y > 0) and (not log_x or x > 0)]
        if pts:
            clean[name] = pts
    fx = (lambda v: math.log10(v)) if log_x else (lambda v: v)
    fy = (lambda v: math.log10(v)) if log_y else (lambda v: v)
    esc = html.escape(title)
    if not clean:
        return f'<figure class="plot empty"><figcaption>{esc}</figcaption><p>no data</p></figure>'
    all_x = [fx(x) for pts in clean.values() for x, _ in pts]
    all_y = [fy(y) for pts in clean.values() for _, y in pts]
    x0, x1 = min(all_x), max(all_x)
    y0, y1 = min(all_y), max(all_y)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - abs(y0) * 0.1 - 1e-9, y1 + abs(y1) * 0.1 + 1e-9
    left, right, top, bottom = 58, 10, 10, 34
    pw, ph = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (fx(x) - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return top + (1 - (fy(y) - y0) / (y1 - y0)) * ph

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
             f'height="{height}" role="img" aria-label="{esc}">',
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>']
    for v in _ticks(y0, y1):
        y = top + (1 - (v - y0) / (y1 - y0)) * ph
        label = _fmt(10**v if log_y else v)
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e4e4e4"/>')
        parts.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end" font-size="11">{label}</text>')
    for v in _ticks(x0, x1):
        x = left + (v - x0) / (x1 - x0) * pw
        label = _fmt(10**v) if log_x else (f"{round(v):,}" if x1 - x0 >= 8 else _fmt(v))
        parts.append(f'<text x="{x:.1f}" y="{top + ph + 14}" text-anchor="middle" font-size="11">{label}</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{height - 4}" text-anchor="middle" font-size="11">'
                 f'{html.escape(x_label)}</text>')
    legend = []
    for i, (name, pts) in enumerate(clean.items()):
        color = colors[i % len(colors)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        if len(pts) == 1:
            parts.append(f'<circle class="series" cx="{px(pts[0][0]):.1f}" cy="{py(pts[0][1]):.1f}" r="3" '
                         f'fill="{color}"/>')
        else:
            parts.append(f'<polyline class="series" fill="none" stroke="{color}" stroke-width="1.6" '
                         f'points="{path}"/>')
        legend.append(f'<span><i style="background:{color}"></i>{html.escape(name)}</span>')
    if marker is not None and all(math.isfinite(v) for v in marker):
        parts.append(f'<circle cx="{px(marker[0]):.1f}" cy="{py(marker[1]):.1f}" r="5" fill="none" '
                     f'stroke="#D00" stroke-width="2"/>')
    parts.append("</svg>")
    return (f'<figure class="plot"><figcaption>{esc}</figcaption>{"".join(parts)}'
            f'<div class="legend">{"".join(legend)}</div></figure>')
