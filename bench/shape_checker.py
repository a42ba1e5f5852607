"""Is an image a single clean disc, square or triangle on a plain background? A judge for the
quickstart's samples, validated on real and corrupted built-in shapes.

An image of ``builtin:shapes`` is two colours and the antialiased blend between them, and its
foreground is one ideal shape. The judge reads an image (H, W, 3) uint8 as such, pure NumPy:

1. colours: the background is the median of the border pixels; the foreground the median of
   the pixels far from it (twice refined). Below ``MIN_CONTRAST`` levels apart: no shape.
2. coverage: each pixel p is projected on the segment background -> foreground,
   alpha = clip((p - bg) . (fg - bg) / |fg - bg|^2, 0, 1), the fraction of it the shape covers.
3. plain colours: away from the shape's edge (pixels whose 3x3 neighbourhood is all on one side
   of alpha = 0.5) a pixel must be its side's colour: the mean of the most different channel's
   deviation at most ``MAX_FLAT_MEAN`` levels and its 95th percentile at most ``MAX_FLAT_P95``;
   on the edge a pixel must lie on the blend line (same limits on its distance from the line).
   Grain, noise, gradients and a second colour fail here.
4. one shape: alpha > 0.5 is one 8-connected region and the rest one 4-connected region (no
   specks, no second shape, no hole), covering 4-70% of the image.
5. its class: the ideal disc, square (axis-aligned) and upward equilateral triangle of the
   same area and centroid are rendered with 8x8 subpixel coverage and nudged (centre +-0.5 px,
   size +-6%); the class is the best fit and the fit error sum|alpha - ideal| / sum(ideal)
   (0 for a perfect match; a disc against the best square of its area is about 0.2) must be at
   most ``MAX_FIT_ERROR``. Blobs, bitten shapes and blurred shapes fail here.

``judge`` returns a ``Verdict`` (clean, the class, the reason it is not clean, the measures);
``clean_rate`` of a folder or an .npz of samples; ``--validate`` draws real built-in shapes and
corrupted ones and prints how often each kind is called clean (the accuracy table of
docs/quickstart_shapes.md):

    python bench/shape_checker.py --validate --num 300 --resolution 16
    python bench/shape_checker.py runs/quickstart/final-samples      # the share of clean samples
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

MIN_CONTRAST = 60  # 8-bit levels, most different channel; the data's shapes stand out by >= 100
MAX_FLAT_MEAN = 6.0  # mean deviation (levels) of flat pixels from their colour, and of edge pixels from the blend line
MAX_FLAT_P95 = 15.0  # ... and its 95th percentile
MAX_FIT_ERROR = 0.10  # sum |alpha - ideal shape| / ideal area (real shapes: at most 0.06)
AREA_RANGE = (0.04, 0.75)  # the shape's share of the image, alpha > 0.5 (the data's: 0.07 to 0.71 at 16 px)
CLASSES = ("disc", "square", "triangle")
_SUB = 8  # subpixels per pixel side when rendering the ideal shapes
_NUDGES = [(dy, dx, s) for dy in (-0.5, -0.25, 0.0, 0.25, 0.5) for dx in (-0.5, -0.25, 0.0, 0.25, 0.5)
           for s in (0.94, 0.97, 1.0, 1.03, 1.06)]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What ``judge`` says of one image."""

    clean: bool
    shape: str | None  # best-fitting class of CLASSES (None when no shape was found)
    reason: str  # "" when clean, else the first test that failed
    fit_error: float = float("nan")  # of the best class
    flat_mean: float = float("nan")
    flat_p95: float = float("nan")


def _components(mask: np.ndarray, eight: bool) -> int:
    """How many connected regions (4- or 8-connected) a boolean mask (H, W) has."""
    h, w = mask.shape
    seen = np.zeros_like(mask)
    steps = [(-1, 0), (1, 0), (0, -1), (0, 1)]
    if eight:
        steps += [(-1, -1), (-1, 1), (1, -1), (1, 1)]
    count = 0
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        count += 1
        seen[y0, x0] = True
        stack = [(y0, x0)]
        while stack:
            y, x = stack.pop()
            for dy, dx in steps:
                ny, nx = y + dy, x + dx
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return count


def _colours(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(background, foreground) RGB float (3,) of an image (H, W, 3) float."""
    border = np.concatenate([a[0], a[-1], a[1:-1, 0], a[1:-1, -1]])
    bg = np.median(border, axis=0)
    fg = bg
    for _ in range(3):
        d = np.abs(a - bg).max(axis=2)
        if fg is bg:
            far = d >= 0.5 * d.max()
        else:  # pixels nearer the foreground than the background
            far = np.abs(a - fg).max(axis=2) < d
        if not far.any():
            break
        fg = np.median(a[far], axis=0)
    return bg, fg


def _ideal(shape: str, h: int, w: int, cy: float, cx: float, area: float) -> np.ndarray:
    """(H, W) coverage in [0, 1] of an ideal shape of ``area`` pixels, centroid (cy, cx)."""
    ys = (np.arange(h * _SUB) + 0.5) / _SUB
    xs = (np.arange(w * _SUB) + 0.5) / _SUB
    y, x = np.meshgrid(ys, xs, indexing="ij")
    if shape == "disc":
        r = np.sqrt(area / np.pi)
        inside = (y - cy) ** 2 + (x - cx) ** 2 <= r * r
    elif shape == "square":
        half = np.sqrt(area) / 2
        inside = (np.abs(y - cy) <= half) & (np.abs(x - cx) <= half)
    else:  # equilateral, pointing up; the centroid is a third of the height above the base
        side = np.sqrt(4 * area / np.sqrt(3))
        height = side * np.sqrt(3) / 2
        top, base = cy - 2 * height / 3, cy + height / 3
        half_at = (y - top) / height * side / 2  # half-width at height y
        inside = (y >= top) & (y <= base) & (np.abs(x - cx) <= half_at)
    return inside.reshape(h, _SUB, w, _SUB).mean(axis=(1, 3))


def _fit(alpha: np.ndarray) -> tuple[str, float]:
    """(best class, its fit error) of a coverage map (H, W)."""
    h, w = alpha.shape
    area = float(alpha.sum())
    yy, xx = np.mgrid[0:h, 0:w] + 0.5
    cy, cx = float((alpha * yy).sum() / area), float((alpha * xx).sum() / area)
    def error(shape, dy=0.0, dx=0.0, s=1.0):
        ideal = _ideal(shape, h, w, cy + dy, cx + dx, area * s * s)
        return float(np.abs(alpha - ideal).sum() / ideal.sum())

    unnudged = {shape: error(shape) for shape in CLASSES}
    best = min(((shape, err) for shape, err in unnudged.items()), key=lambda item: item[1])
    for shape in CLASSES:  # nudging lowers an error by a few hundredths: only near-best classes gain
        if unnudged[shape] > best[1] + 0.1:
            continue
        for dy, dx, s in _NUDGES:
            err = error(shape, dy, dx, s)
            if err < best[1]:
                best = (shape, err)
    return best


def judge(image: np.ndarray) -> Verdict:
    """Is ``image`` (H, W, 3) uint8 one clean disc, square or triangle on a plain background?"""
    a = np.asarray(image)
    if a.ndim != 3 or a.shape[2] != 3 or min(a.shape[:2]) < 8:
        raise ValueError(f"judge needs an RGB image (H, W, 3) of at least 8x8 pixels, got shape {a.shape}")
    a = a.astype(np.float64)
    bg, fg = _colours(a)
    axis = fg - bg
    if np.abs(axis).max() < MIN_CONTRAST:
        return Verdict(False, None, "no shape stands out")
    alpha = np.clip(((a - bg) @ axis) / (axis @ axis), 0.0, 1.0)  # (H, W)
    on_line = bg + alpha[..., None] * axis
    inside = alpha > 0.5
    padded = np.pad(inside, 1, mode="edge")
    windows = np.stack([padded[dy:dy + inside.shape[0], dx:dx + inside.shape[1]]
                        for dy in range(3) for dx in range(3)])
    flat = windows.all(axis=0) | ~windows.any(axis=0)  # all nine on one side of alpha = 0.5
    colour = np.where(inside[..., None], fg, bg)
    deviation = np.where(flat, np.abs(a - colour).max(axis=2), np.abs(a - on_line).max(axis=2))
    flat_mean, flat_p95 = float(deviation.mean()), float(np.percentile(deviation, 95))
    if flat_mean > MAX_FLAT_MEAN or flat_p95 > MAX_FLAT_P95:
        return Verdict(False, None, "not two plain colours", flat_mean=flat_mean, flat_p95=flat_p95)
    share = float(inside.mean())
    if not AREA_RANGE[0] <= share <= AREA_RANGE[1]:
        return Verdict(False, None, "shape too small or too large", flat_mean=flat_mean, flat_p95=flat_p95)
    if _components(inside, eight=True) != 1 or _components(~inside, eight=False) != 1:
        return Verdict(False, None, "not one region", flat_mean=flat_mean, flat_p95=flat_p95)
    shape, err = _fit(alpha)
    clean = err <= MAX_FIT_ERROR
    return Verdict(clean, shape, "" if clean else "not a disc, square or triangle", err, flat_mean, flat_p95)


def split_grid(grid: np.ndarray, tile: int, pad: int = 2) -> np.ndarray:
    """(N, tile, tile, 3) uint8: the images of a ``make_grid`` grid (H', W', 3), also one enlarged
    by an integer factor (docs/images/quickstart-grid.png is 4x), read row by row."""
    ncols = None
    for cols in range(1, 65):  # the factor and the columns that explain the width
        scale, rest = divmod(grid.shape[1], cols * (tile + pad) + pad)
        if rest == 0 and scale >= 1 and (grid.shape[0] // scale - pad) % (tile + pad) == 0:
            ncols = cols
            break
    if ncols is None:
        raise SystemExit(f"a grid {grid.shape[1]} px wide is not one of {tile}-px images with {pad}-px padding")
    small = grid[::scale, ::scale]
    nrows = (small.shape[0] - pad) // (tile + pad)
    return np.stack([small[pad + r * (tile + pad): pad + r * (tile + pad) + tile,
                           pad + c * (tile + pad): pad + c * (tile + pad) + tile]
                     for r in range(nrows) for c in range(ncols)])


def load_images(path: Path, tile: int = 16) -> np.ndarray:
    """(N, H, W, 3) uint8 from a folder of PNGs (its grid.png left out), an .npz (first array) or
    one grid PNG of ``tile``-px images (``split_grid``)."""
    from PIL import Image

    if not path.exists():
        raise SystemExit(f"{path}: no such file or folder")
    if path.suffix == ".png":
        return split_grid(np.asarray(Image.open(path).convert("RGB")), tile)
    if path.suffix == ".npz":
        with np.load(path) as z:
            return np.asarray(z[z.files[0]], dtype=np.uint8)
    files = sorted(p for p in path.glob("*.png") if p.name != "grid.png")
    if not files:
        raise SystemExit(f"{path}: no .png samples")
    return np.stack([np.asarray(Image.open(p).convert("RGB")) for p in files])


def clean_rate(images: np.ndarray) -> tuple[float, list[Verdict]]:
    """(share of clean images, one verdict per image) of (N, H, W, 3) uint8."""
    verdicts = [judge(im) for im in images]
    return sum(v.clean for v in verdicts) / len(verdicts), verdicts


# Validation: real shapes and corruptions of them.

def _real(index: int, resolution: int) -> np.ndarray:
    from difftrain.data.builtin import draw_shape

    return draw_shape(index, resolution)[0]


def _blob(rng: np.random.Generator, resolution: int, like: np.ndarray) -> np.ndarray:
    """A blob (the union of 2-4 random discs) in the colours of ``like``, antialiased."""
    bg, fg = _colours(like.astype(np.float64))
    n = resolution
    ys = (np.arange(n * _SUB) + 0.5) / _SUB
    y, x = np.meshgrid(ys, ys, indexing="ij")
    inside = np.zeros_like(y, dtype=bool)
    for _ in range(rng.integers(2, 5)):
        cy, cx = rng.uniform(0.3, 0.7, size=2) * n
        r = rng.uniform(0.12, 0.25) * n
        inside |= (y - cy) ** 2 + (x - cx) ** 2 <= r * r
    alpha = inside.reshape(n, _SUB, n, _SUB).mean(axis=(1, 3))[..., None]
    return np.round(bg + alpha * (fg - bg)).astype(np.uint8)


def _blur(a: np.ndarray, sigma: float) -> np.ndarray:
    from PIL import Image, ImageFilter

    return np.asarray(Image.fromarray(a).filter(ImageFilter.GaussianBlur(sigma)))


def corruptions(resolution: int) -> dict:
    """name -> f(index, rng) -> uint8 (H, W, 3): the kinds of images the judge must call unclean."""
    def noisy(sigma):
        return lambda i, rng: np.clip(_real(i, resolution) + rng.normal(0, sigma, (resolution, resolution, 3)), 0, 255).astype(np.uint8)

    def grainy_background(i, rng):
        a = _real(i, resolution).astype(np.float64)
        bg, fg = _colours(a)
        back = np.abs(a - bg).max(axis=2) < 0.5 * np.abs(fg - bg).max()
        a[back] += rng.normal(0, 10, (int(back.sum()), 3))
        return np.clip(a, 0, 255).astype(np.uint8)

    def two_shapes(i, rng):
        a, b = _real(i, resolution), _real(i + 1 + int(rng.integers(1000)), resolution)
        bb, fb = _colours(b.astype(np.float64))
        mask = np.abs(b.astype(np.float64) - bb).max(axis=2) > 0.5 * np.abs(fb - bb).max()
        half = np.zeros_like(mask)  # half of the second shape, so the two rarely cover each other
        if rng.random() < 0.5:
            half[:, : resolution // 2] = True
        else:
            half[:, resolution // 2:] = True
        out = a.copy()
        out[mask & half] = b[mask & half]
        return out

    def erased(i, rng):  # a bite half the shape's width wide out of its edge
        a = _real(i, resolution)
        bg, fg = _colours(a.astype(np.float64))
        shape = np.abs(a - bg).max(axis=2) > 0.5 * np.abs(fg - bg).max()
        padded = np.pad(shape, 1)
        edge = shape & ~(padded[:-2, 1:-1] & padded[2:, 1:-1] & padded[1:-1, :-2] & padded[1:-1, 2:])
        ys, xs = np.nonzero(edge)
        y, x = ys[rng.integers(len(ys))], xs[rng.integers(len(xs))]
        half = max(1, int(np.ptp(np.nonzero(shape)[1]) + 1) // 4)
        out = a.copy()
        out[max(0, y - half): y + half + 1, max(0, x - half): x + half + 1] = np.round(bg).astype(np.uint8)
        return out

    def shuffled(i, rng):
        a = _real(i, resolution).reshape(-1, 3)
        return a[rng.permutation(len(a))].reshape(resolution, resolution, 3)

    def two_tone(i, rng):
        a = _real(i, resolution).astype(np.float64)
        bg, fg = _colours(a)
        shape = np.abs(a - bg).max(axis=2) > 0.5 * np.abs(fg - bg).max()
        xs = np.nonzero(shape.any(axis=0))[0]  # a ramp of 50-80 levels across the shape
        ramp = np.clip((np.arange(resolution) - xs.min()) / max(1, xs.max() - xs.min()), 0, 1) * 2 - 1
        ramp = ramp[None, :, None] * rng.uniform(25, 40)
        return np.clip(np.where(shape[..., None], a + ramp, a), 0, 255).astype(np.uint8)

    return {
        "noise sigma 4 (hardly visible; may pass)": noisy(4),
        "noise sigma 6": noisy(6),
        "noise sigma 8": noisy(8),
        "noise sigma 16": noisy(16),
        "grainy background (sigma 10)": grainy_background,
        "two shapes": two_shapes,
        "blurred (sigma 1 px)": lambda i, rng: _blur(_real(i, resolution), 1.0),
        "blob (2-4 discs, clean colours)": lambda i, rng: _blob(rng, resolution, _real(i, resolution)),
        "bitten (half its width)": erased,
        "shuffled pixels": shuffled,
        "two-tone shape (gradient)": two_tone,
        "uniform noise image": lambda i, rng: rng.integers(0, 256, (resolution, resolution, 3), dtype=np.uint8),
    }


def validate(num: int, resolution: int, seed: int = 0, first: int = 10_000) -> list[tuple[str, float, str]]:
    """[(kind, share called clean, most common reason)] for ``num`` real shapes (indices
    ``first``..) and ``num`` of each corruption; a good judge: ~1 for real, ~0 for the rest."""
    rows = []
    rng = np.random.default_rng(seed)
    real = [judge(_real(first + i, resolution)) for i in range(num)]
    wrong_class = sum(v.clean and v.shape != CLASSES[(first + i) % 3] for i, v in enumerate(real))
    rows.append(("real shapes", sum(v.clean for v in real) / num, f"{wrong_class} clean ones of the wrong class"))
    for name, make in corruptions(resolution).items():
        verdicts = [judge(make(first + i, rng)) for i in range(num)]
        reasons = [v.reason for v in verdicts if not v.clean]
        common = max(set(reasons), key=reasons.count) if reasons else ""
        rows.append((name, sum(v.clean for v in verdicts) / num, common))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("samples", nargs="*", type=Path, help="folders of PNG samples, .npz files or grid PNGs to judge")
    p.add_argument("--validate", action="store_true", help="print the accuracy table on real and corrupted shapes")
    p.add_argument("--num", type=int, default=300, help="images per kind for --validate")
    p.add_argument("--resolution", type=int, default=16, help="of --validate's images, and of a grid's tiles")
    p.add_argument("--verbose", action="store_true", help="one line per sample")
    args = p.parse_args(argv)
    if not args.validate and not args.samples:
        p.error("give sample folders or --validate")
    if args.validate:
        print(f"| kind ({args.num} each, {args.resolution} px) | called clean | most common reason otherwise |")
        print("|---|---|---|")
        for name, rate, reason in validate(args.num, args.resolution):
            print(f"| {name} | {100 * rate:.1f}% | {reason} |")
    for path in args.samples:
        rate, verdicts = clean_rate(load_images(path, args.resolution))
        if args.verbose:
            for i, v in enumerate(verdicts):
                print(f"{i:3d} {'clean' if v.clean else 'no   '} {v.shape or '-':8s} fit {v.fit_error:.3f} "
                      f"flat {v.flat_mean:.1f}/{v.flat_p95:.1f} {v.reason}")
        shapes = {c: sum(v.clean and v.shape == c for v in verdicts) for c in CLASSES}
        print(f"{path}: {100 * rate:.1f}% clean ({sum(v.clean for v in verdicts)}/{len(verdicts)}; "
              + ", ".join(f"{c} {n}" for c, n in shapes.items()) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
