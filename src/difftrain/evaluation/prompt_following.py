"""Prompt following on the shapes data: does an image show the shape and colour its prompt names?

A classical judge, no network: an image of one shape on a plain background (the kind
``builtin:shapes`` draws) is read by image analysis:

- background: the median colour of the image's border pixels;
- foreground: the pixels far from it (the largest connected region of them, so stray specks of
  a generated image do not stretch the shape's bounding box);
- colour: ``colour_name`` (the function the captions use) of the median colour of the
  foreground's core, the pixels furthest from the background (antialiased edges are blends with
  the background, which would pull a mean toward gray);
- shape: a ring (``NEW_SHAPES``, never in the data; taught by fine-tuning) when the middle of
  the region's bounding box is background (its hole); else from how much of its bounding box
  the region fills: a square fills all of it, a disc pi/4 (0.785), a triangle half.

``prompt_following`` scores a batch of images against their prompts and reports the chance
levels beside the accuracies, so a score can be read against guessing.
"""

from __future__ import annotations

import collections
import re

import numpy as np

from difftrain.data.builtin import COLOUR_NAMES, NEW_SHAPES, SHAPE_CLASSES, colour_name

_MIN_CONTRAST = 24  # foreground pixels differ from the background by more than this, in 8-bit levels
_SQUARE_FILL = 0.89  # fill ratio above which a region is a square (a disc fills 0.785)
_DISC_FILL = 0.64  # ... and above which a disc (a triangle fills 0.5)
_HOLE = 0.16  # the middle of the bounding box this wide (a fraction of it) is looked at for a ring's hole
JUDGED_SHAPES = SHAPE_CLASSES + NEW_SHAPES  # what judge_image can answer and a prompt can name


def _largest_region(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected region of a boolean mask (H, W), as a mask."""
    labels = np.zeros(mask.shape, dtype=np.int32)
    h, w = mask.shape
    best, best_size, current = 0, 0, 0
    for y0, x0 in zip(*np.nonzero(mask)):
        if labels[y0, x0]:
            continue
        current += 1
        labels[y0, x0] = current
        queue, size = collections.deque([(y0, x0)]), 0
        while queue:
            y, x = queue.popleft()
            size += 1
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not labels[ny, nx]:
                    labels[ny, nx] = current
                    queue.append((ny, nx))
        if size > best_size:
            best, best_size = current, size
    return labels == best if best else mask


def judge_image(image: np.ndarray) -> tuple[str | None, str | None]:
    """(shape, colour) an RGB uint8 image (H, W, 3) of one shape on a plain background shows:
    a name of ``JUDGED_SHAPES`` and one of ``COLOUR_NAMES``, or (None, None) when nothing stands
    out from the background."""
    a = np.asarray(image)
    if a.ndim != 3 or a.shape[2] != 3 or a.shape[0] < 4 or a.shape[1] < 4:
        raise ValueError(f"judge_image needs an RGB image (H, W, 3) of at least 4x4 pixels, got shape {a.shape}")
    a = a.astype(np.int16)
    border = np.concatenate([a[0], a[-1], a[1:-1, 0], a[1:-1, -1]])  # (P, 3)
    background = np.median(border, axis=0)
    distance = np.abs(a - background).max(axis=2)  # (H, W): the most different channel
    peak = float(np.percentile(distance, 99.5))
    if peak <= _MIN_CONTRAST:
        return None, None
    mask = _largest_region(distance > max(_MIN_CONTRAST, 0.5 * peak))
    core = mask & (distance >= 0.75 * peak)
    colour = colour_name(np.median(a[core if core.any() else mask], axis=0))

    ys, xs = np.nonzero(mask)
    (y0, y1), (x0, x1) = (ys.min(), ys.max()), (xs.min(), xs.max())
    box = (y1 - y0 + 1) * (x1 - x0 + 1)
    fill = len(ys) / box
    middle = mask[_middle(y0, y1), _middle(x0, x1)]  # a disc, square or triangle covers it; a ring's hole does not
    if middle.mean() < 0.5:
        return "ring", colour
    shape = "square" if fill >= _SQUARE_FILL else "disc" if fill >= _DISC_FILL else "triangle"
    return shape, colour


def _middle(lo: int, hi: int) -> slice:
    """The pixels within ``_HOLE / 2`` of the span's centre (at least one)."""
    centre, half = (lo + hi) / 2, _HOLE / 2 * (hi - lo + 1)
    return slice(round(centre - half), max(round(centre + half), round(centre - half)) + 1)


def parse_prompt(prompt: str) -> tuple[str, str]:
    """(shape, colour) a prompt names: its first word of ``JUDGED_SHAPES`` and of ``COLOUR_NAMES``.
    Raises ValueError quoting the prompt when it names either none."""
    words = re.findall(r"[a-z]+", prompt.lower())
    shape = next((w for w in words if w in JUDGED_SHAPES), None)
    colour = next((w for w in words if w in COLOUR_NAMES), None)
    if shape is None or colour is None:
        missing = "shape" if shape is None else "colour"
        names = JUDGED_SHAPES if shape is None else COLOUR_NAMES
        raise ValueError(f"prompt {prompt!r} names no {missing} (one of {', '.join(names)})")
    return shape, colour


def prompt_following(images: np.ndarray, prompts: list[str]) -> dict[str, float | int]:
    """How often each image shows the shape and colour of its prompt.

    Args:
        images: uint8 (N, H, W, 3), RGB.
        prompts: N prompts, each naming a shape and a colour ("a red disc on a dark background").

    Returns:
        ``shape_accuracy``, ``colour_accuracy``, ``both_accuracy`` (fractions of the N images),
        ``n``, and the chance levels of guessing uniformly: ``shape_chance`` (1 / shapes),
        ``colour_chance`` (1 / colours) and ``both_chance`` (their product).
    """
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
        raise ValueError(f"prompt_following needs uint8 images (N, H, W, 3), got {images.dtype} {images.shape}")
    if len(images) != len(prompts) or not prompts:
        raise ValueError(f"prompt_following needs one prompt per image, got {len(prompts)} for {len(images)} images")
    wanted = [parse_prompt(p) for p in prompts]
    seen = [judge_image(image) for image in images]
    shape_ok = np.array([s == w[0] for (s, _), w in zip(seen, wanted)])
    colour_ok = np.array([c == w[1] for (_, c), w in zip(seen, wanted)])
    return {
        "shape_accuracy": float(shape_ok.mean()),
        "colour_accuracy": float(colour_ok.mean()),
        "both_accuracy": float((shape_ok & colour_ok).mean()),
        "n": len(prompts),
        "shape_chance": 1.0 / len(SHAPE_CLASSES),
        "colour_chance": 1.0 / len(COLOUR_NAMES),
        "both_chance": 1.0 / (len(SHAPE_CLASSES) * len(COLOUR_NAMES)),
    }
