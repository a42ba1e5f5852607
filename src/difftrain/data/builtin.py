"""Built-in datasets that need no download: procedurally drawn images for quickstarts and tests."""

from __future__ import annotations

import colorsys
import dataclasses
import random

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.utils.data import Dataset

from .sampler import mix_seed, split_key
from .transforms import augment, check_image_options, to_tensor

_SHAPES_TAG = 0x7368_6170  # "shap": keeps these draws apart from other seeded streams
_SUPERSAMPLE = 4  # shapes are drawn at 4x and box-reduced, for antialiased edges
SHAPE_CLASSES = ("disc", "square", "triangle")  # label k is SHAPE_CLASSES[k]

# Colour names by hue, (name, upper bound in degrees) in order round the circle; red wraps past
# 345. The bounds are where a person's word for a saturated colour changes (yellow-green is
# called green, magenta pink, violet purple). Captions and the prompt-following judge
# (difftrain.evaluation.prompt_following) both name colours with colour_name.
_HUE_NAMES = (
    ("red", 15), ("orange", 45), ("yellow", 70), ("green", 165), ("cyan", 190),
    ("blue", 260), ("purple", 300), ("pink", 345), ("red", 360),
)
COLOUR_NAMES = ("red", "orange", "yellow", "green", "cyan", "blue", "purple", "pink")
GRAY = "gray"  # the colour of every shape of a grayscale (channels = 1) image
BACKGROUNDS = ("dark", "light")


@dataclasses.dataclass(frozen=True)
class ShapeDescription:
    """What image ``index`` of the shapes dataset shows, in words."""

    shape: str  # one of SHAPE_CLASSES
    colour: str  # one of COLOUR_NAMES, or GRAY for grayscale images
    background: str  # one of BACKGROUNDS


def colour_name(rgb: tuple[int, int, int] | np.ndarray) -> str:
    """The name (one of ``COLOUR_NAMES``) of an 8-bit RGB colour, from its hue alone."""
    r, g, b = (float(c) / 255.0 for c in rgb)
    hue = colorsys.rgb_to_hsv(r, g, b)[0] * 360.0
    return next(name for name, upper in _HUE_NAMES if hue < upper)


def shape_caption(desc: ShapeDescription) -> str:
    """The caption of a description: "a red disc on a dark background", "an orange square ..."."""
    article = "an" if desc.colour[0] in "aeiou" else "a"
    return f"{article} {desc.colour} {desc.shape} on a {desc.background} background"


# Every word a shapes caption can hold (a text encoder's vocabulary must cover them).
CAPTION_WORDS = tuple(sorted(
    {"a", "an", "on", "background", GRAY} | set(COLOUR_NAMES) | set(SHAPE_CLASSES) | set(BACKGROUNDS)
))


def _contrast_ok(fg: tuple[int, ...], bg: int, channels: int) -> bool:
    """Whether the shape stands out: by luma in grayscale, by the most different channel in RGB."""
    if channels == 1:
        return abs(0.299 * fg[0] + 0.587 * fg[1] + 0.114 * fg[2] - bg) >= 80
    return max(abs(c - bg) for c in fg) >= 100


def draw_shape(index: int, resolution: int, channels: int = 3) -> tuple[np.ndarray, int]:
    """Draw image ``index`` of the shapes dataset: (uint8 array (H, W, C), class 0..2).

    The class is ``index % 3`` (disc, square, triangle), so classes are balanced. One filled
    shape, 45-80% of the image wide, in a saturated colour at a random position, on a plain
    light or dark gray background; everything else is drawn from ``random.Random`` seeded by
    the index, whose stream Python keeps stable across versions. A colour that would not stand
    out is redrawn, judged by luma when ``channels == 1``, so a grayscale image may have a
    different colour from its RGB twin.
    """
    rng = random.Random(mix_seed(_SHAPES_TAG, index))
    label = index % len(SHAPE_CLASSES)
    size = resolution * _SUPERSAMPLE
    _, bg, fg = _draw_colours(rng, channels)

    width = rng.uniform(0.45, 0.8) * size  # bounding-box width of the shape
    height = width * (3**0.5 / 2 if label == 2 else 1.0)
    margin = 0.04 * size
    x0 = rng.uniform(margin, size - margin - width)
    y0 = rng.uniform(margin, size - margin - height)
    box = (x0, y0, x0 + width, y0 + height)

    img = Image.new("RGB", (size, size), (bg, bg, bg))
    draw = ImageDraw.Draw(img)
    if label == 0:
        draw.ellipse(box, fill=fg)
    elif label == 1:
        draw.rectangle(box, fill=fg)
    else:  # equilateral, pointing up
        draw.polygon([(x0, y0 + height), (x0 + width, y0 + height), (x0 + width / 2, y0)], fill=fg)
    img = img.reduce(_SUPERSAMPLE)
    if channels == 1:
        img = img.convert("L")
    a = np.asarray(img)
    return (a[:, :, None] if a.ndim == 2 else a), label


# Shapes the data never shows, for teaching a trained model a new concept (bench/fine_tune_demo.py);
# the prompt-following judge knows them too.
NEW_SHAPES = ("ring",)
_RING_TAG = 0x7269_6E67  # "ring"
_RING_HOLE = 0.5  # the hole's diameter, as a fraction of the ring's


def draw_ring(index: int, resolution: int, hue_deg: tuple[float, float] = (0.0, 360.0),
              dark: bool | None = None) -> np.ndarray:
    """Image ``index`` of a set of rings in the style of ``draw_shape``: a disc with a hole half
    its diameter, 45-80% of the image wide at a random position, a saturated colour of hue in
    ``hue_deg`` (degrees; (-10, 10) is red) on a dark (``dark``; None: either) or light plain
    background. Returns uint8 (H, W, 3), deterministic from ``index`` and the arguments."""
    rng = random.Random(mix_seed(_RING_TAG, index))
    size = resolution * _SUPERSAMPLE
    is_dark = rng.random() < 0.5 if dark is None else dark
    bg = round(rng.uniform(10, 50) if is_dark else rng.uniform(200, 245))
    while True:  # as _draw_colours, with the hue drawn from hue_deg
        hue = (rng.uniform(*hue_deg) / 360.0) % 1.0
        sat = rng.uniform(0.75, 1.0)
        val = rng.uniform(0.8, 1.0) if is_dark else rng.uniform(0.55, 0.9)
        fg = tuple(round(255 * c) for c in colorsys.hsv_to_rgb(hue, sat, val))
        if _contrast_ok(fg, bg, 3):
            break
    width = rng.uniform(0.45, 0.8) * size
    margin = 0.04 * size
    x0 = rng.uniform(margin, size - margin - width)
    y0 = rng.uniform(margin, size - margin - width)
    inset = width * (1 - _RING_HOLE) / 2
    img = Image.new("RGB", (size, size), (bg, bg, bg))
    draw = ImageDraw.Draw(img)
    draw.ellipse((x0, y0, x0 + width, y0 + width), fill=fg)
    draw.ellipse((x0 + inset, y0 + inset, x0 + width - inset, y0 + width - inset), fill=(bg, bg, bg))
    return np.asarray(img.reduce(_SUPERSAMPLE))


def _draw_colours(rng: random.Random, channels: int) -> tuple[bool, int, tuple[int, int, int]]:
    """(dark background?, background gray level, shape RGB): the first draws of an image."""
    dark = rng.random() < 0.5
    bg = round(rng.uniform(10, 50) if dark else rng.uniform(200, 245))
    while True:  # a saturated colour that stands out from the background
        hue, sat = rng.random(), rng.uniform(0.75, 1.0)
        val = rng.uniform(0.8, 1.0) if dark else rng.uniform(0.55, 0.9)
        fg = tuple(round(255 * c) for c in colorsys.hsv_to_rgb(hue, sat, val))
        if _contrast_ok(fg, bg, channels):
            return dark, bg, fg


def describe_shape(index: int, resolution: int, channels: int = 3) -> ShapeDescription:
    """What ``draw_shape(index, resolution, channels)`` draws: the shape, the colour named from
    the drawn 8-bit RGB (``colour_name``; GRAY when ``channels == 1``) and the background."""
    del resolution  # the colours do not depend on it; kept so the call mirrors draw_shape
    dark, _, fg = _draw_colours(random.Random(mix_seed(_SHAPES_TAG, index)), channels)
    colour = GRAY if channels == 1 else colour_name(fg)
    return ShapeDescription(SHAPE_CLASSES[index % len(SHAPE_CLASSES)], colour, BACKGROUNDS[0 if dark else 1])


class ShapesDataset(Dataset):
    """Procedurally drawn shapes (disc, square, triangle), deterministic from the index.

    A stand-in for a folder of images that needs no download: at 32x32 a person sees at once
    what the data is and a tiny model learns it in minutes on a CPU. Images are drawn when
    asked for, not cached: at 32x32 drawing is ~0.1 ms, far below a training step's cost per
    image, and a cache would be duplicated in every DataLoader worker.

    Same contract as ``ImageFolderDataset``: ``dataset[i]`` or ``dataset[(i, sample_seed)]``
    returns ``(image (C, H, W) float32 in [-1, 1], label int)``; labels are 0..2 when
    ``class_conditional``, else 0. With ``captions`` the second entry is the image's caption,
    ``shape_caption(describe_shape(...))`` (a flipped image keeps it: the words name no side).
    """

    def __init__(
        self,
        resolution: int = 32,
        channels: int = 3,
        num_items: int = 20000,
        random_flip: bool = False,
        color_jitter: float = 0.0,
        class_conditional: bool = False,
        captions: bool = False,
    ) -> None:
        check_image_options(resolution, channels, color_jitter, min_resolution=4)
        if num_items < 1:
            raise ValueError(f"num_items must be >= 1, got {num_items}")
        if captions and class_conditional:
            raise ValueError("set data.captions or data.class_conditional, not both")
        self.captions = captions
        self.resolution = resolution
        self.channels = channels
        self.num_items = num_items
        self.random_flip = random_flip
        self.color_jitter = color_jitter
        self.classes = list(SHAPE_CLASSES) if class_conditional else []

    @property
    def num_classes(self) -> int:
        """Number of classes (0 when unconditional)."""
        return len(self.classes)

    def __len__(self) -> int:
        return self.num_items

    def caption(self, index: int) -> str:
        """The caption of image ``index`` (whether or not the dataset returns captions)."""
        return shape_caption(describe_shape(index % self.num_items, self.resolution, self.channels))

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int | str]:
        index, seed = split_key(key)
        if not -self.num_items <= index < self.num_items:
            raise IndexError(f"index {index} out of range for {self.num_items} images")
        index %= self.num_items
        a, label = draw_shape(index, self.resolution, self.channels)
        x = to_tensor(a)  # (C, H, W)
        if seed is not None:
            x = augment(x, torch.Generator().manual_seed(seed), self.random_flip, self.color_jitter)
        if self.captions:
            return x, self.caption(index)
        return x, (label if self.classes else 0)


# Datasets that need no download, selected by data.path = "builtin:NAME".
BUILTIN_DATASETS = {"shapes": ShapesDataset}
BUILTIN_PREFIX = "builtin:"
