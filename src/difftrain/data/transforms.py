"""Image transforms as pure functions: decode any mode, resize and crop, to tensor, augment."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

# Alpha is composited onto this background. Transparent pixels of PNG/WebP files hold
# arbitrary colours (often black, sometimes garbage left by the editor), so dropping alpha
# would show them; white matches how the images look in a viewer or on a web page.
ALPHA_BACKGROUND = (255, 255, 255)

_HIGH_DEPTH_MODES = ("I", "F", "I;16", "I;16L", "I;16B", "I;16N")
_ALPHA_MODES = ("LA", "La", "PA", "RGBA", "RGBa")

# ITU-R BT.601 luma weights, as used by PIL's convert("L").
_LUMA = (0.299, 0.587, 0.114)


def _high_depth_to_l(img: Image.Image) -> Image.Image:
    """Scale a 16-bit, 32-bit integer or float single-channel image to 8-bit "L".

    PIL's own convert() clips these to [0, 255], which turns a 16-bit image white. The full
    scale is taken from the mode where it is known (I;16*: 65535), else from the data: the
    smallest of 1.0 (float images only), 255 and 65535 that holds every value, else the
    image's own min..max. Negative values clip to 0.
    """
    if img.mode.startswith("I;16"):
        # A table lookup on the uint16 values: one byte per pixel of working memory, where a
        # float64 copy took 8 and its temporaries more (4.5 GB for a 13000x13000 image).
        return Image.fromarray(_U16_TO_U8[np.asarray(img)], mode="L")
    a = np.asarray(img).astype(np.float64)
    finite = a[np.isfinite(a)]
    amin = float(finite.min()) if finite.size else 0.0
    amax = float(finite.max()) if finite.size else 0.0
    scales = ([1.0] if img.mode == "F" else []) + [255.0, 65535.0]
    fits = [s for s in scales if amin >= 0.0 and amax <= s]
    lo, hi = (0.0, fits[0]) if fits else (amin, max(amax, amin + 1e-12))
    a = np.nan_to_num(a, nan=lo, posinf=hi, neginf=lo)
    a = np.clip((a - lo) / (hi - lo), 0.0, 1.0)
    return Image.fromarray(np.round(a * 255.0).astype(np.uint8), mode="L")


# round(v / 65535 * 255) for every 16-bit value v: the same numbers as the float path gave.
_U16_TO_U8 = np.round(np.arange(65536, dtype=np.float64) / 65535.0 * 255.0).astype(np.uint8)


def check_image_options(resolution: int, channels: int, color_jitter: float, min_resolution: int = 1) -> None:
    """Raise ValueError naming the data option that a dataset cannot use."""
    if channels not in (1, 3):
        raise ValueError(f"data.channels must be 1 or 3, got {channels}")
    if resolution < min_resolution:
        raise ValueError(f"data.resolution must be >= {min_resolution}, got {resolution}")
    if color_jitter < 0:
        raise ValueError(f"data.color_jitter must be >= 0, got {color_jitter}")


def load_image(path: str | Path, channels: int, min_size: int | None = None) -> Image.Image:
    """Open an image file as 8-bit "RGB" (channels == 3) or "L" (channels == 1).

    Applies the EXIF orientation. Handles every PIL mode: 1, L, P, RGB, CMYK, YCbCr, LAB, HSV;
    16/32-bit integer and float images are scaled to 8 bits (not clipped, see
    ``_high_depth_to_l``); alpha (LA, PA, RGBA, P or L or RGB with a transparency key) is
    composited onto white (``ALPHA_BACKGROUND``). Animated files give their first frame.

    ``min_size`` lets a JPEG be decoded at 1/2, 1/4 or 1/8 scale (in the DCT domain, a
    filtered reduction, several times faster) while both sides stay >= ``min_size`` pixels.
    Other formats ignore it.
    """
    return load_image_sized(path, channels, min_size)[0]


def load_image_sized(path: str | Path, channels: int, min_size: int | None = None
                     ) -> tuple[Image.Image, tuple[int, int]]:
    """:func:`load_image` and the file's own (W, H) after its EXIF rotation, which a JPEG decoded at a
    reduced scale (``min_size``) no longer has: what SDXL's size conditioning calls the original size."""
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    with open_image(path) as img:
        try:
            width, height = img.size  # the header's, before a reduced decode
            try:
                orientation = img.getexif().get(0x0112, 1)
            except Exception:  # noqa: BLE001 - a broken EXIF block: exif_transpose decides below
                orientation = 1
            if min_size is not None:
                img.draft(None, (min_size, min_size))
            img.load()
            ImageOps.exif_transpose(img, in_place=True)
        except Exception as e:  # noqa: BLE001 - see open_image
            raise BadImage(path, _reason(e)) from e
        size = (height, width) if orientation in _SWAPPING_ORIENTATIONS else (width, height)
        return _to_8bit(img, channels), size  # a new image, detached from the file


class BadImage(OSError):
    """A file that is not a readable image; the message names it, ``reason`` says why."""

    def __init__(self, path: str | Path, reason: str):
        super().__init__(f"cannot read image {printable(str(path))}: {reason}")
        self.path, self.reason = path, reason


def open_image(path: str | Path) -> Image.Image:
    """``Image.open``, raising :class:`BadImage` naming ``path`` for any file it cannot open.

    A hostile file makes PIL's decoders raise more than OSError: ValueError (a PNG text chunk
    that inflates past ``MAX_TEXT_CHUNK``), SyntaxError ("broken PNG file"),
    DecompressionBombError (a header declaring over ~179M pixels), struct.error, EOFError...
    Any of them is a bad file, not a reason to stop.
    """
    try:
        return Image.open(path)
    except FileNotFoundError as e:
        raise BadImage(path, "the file is gone") from e
    except Exception as e:  # noqa: BLE001 - whatever a decoder raises on hostile data
        raise BadImage(path, _reason(e)) from e


def _reason(e: BaseException) -> str:
    """An exception as one printable line, with its type where the message alone is unclear."""
    text = printable(str(e)) or "?"
    if isinstance(e, (OSError, ValueError)) and not isinstance(e, Image.DecompressionBombError):
        return text
    return f"{type(e).__name__}: {text}"


def printable(text: str) -> str:
    """``text`` with control characters (a newline in a file name) and bytes that are not
    UTF-8 (kept by Python as lone surrogates) written as escapes, so one name is one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _to_8bit(img: Image.Image, channels: int) -> Image.Image:
    """Convert an image of any mode to "RGB" (channels == 3) or "L", as ``load_image`` says."""
    if img.mode in _HIGH_DEPTH_MODES:
        img = _high_depth_to_l(img)
    if img.mode in _ALPHA_MODES or "transparency" in img.info:
        rgba = img.convert("RGBA")
        img = Image.new("RGB", rgba.size, ALPHA_BACKGROUND)
        img.paste(rgba, mask=rgba.getchannel("A"))
    if img.mode not in ("RGB", "L", "1", "P"):  # CMYK, YCbCr, LAB, HSV, RGBX: go through RGB
        img = img.convert("RGB")
    return img.convert("RGB" if channels == 3 else "L")


def resize_center_crop(img: Image.Image, resolution: int) -> Image.Image:
    """Resize the short side to ``resolution`` (antialiased bicubic) and center-crop a square.

    Done as one resampling of the central square of the source, so no pixel is lost to an
    intermediate rounding. ``reducing_gap`` first box-reduces large images by an integer
    factor (fast) with a result practically indistinguishable from a full bicubic filter.
    """
    w, h = img.size
    if (w, h) == (resolution, resolution):
        return img.copy()
    side = min(w, h)
    left, top = (w - side) / 2, (h - side) / 2
    return img.resize(
        (resolution, resolution),
        Image.Resampling.BICUBIC,
        box=(left, top, left + side, top + side),
        reducing_gap=3.0,
    )


def crop_geometry(size: tuple[int, int], shape: tuple[int, int]
                  ) -> tuple[tuple[float, float, float, float], tuple[int, int, int, int]]:
    """The centre crop of an image of ``size`` (W, H) resized to cover ``shape`` (h, w).

    Returns (box, geometry): ``box`` (left, top, right, bottom) in the image's pixels, what
    ``Image.resize(..., box=box)`` reads; ``geometry`` (orig_h, orig_w, crop_top, crop_left), the crop in
    the resized image's pixels (SDXL's ``original_size`` and ``crops_coords_top_left``, as diffusers'
    SDXL training script computes them).
    """
    width, height = size
    h, w = shape
    scale = max(h / height, w / width)
    cw, ch = w / scale, h / scale  # the crop in the image's pixels
    left, top = (width - cw) / 2, (height - ch) / 2
    geometry = (height, width, int(round((height * scale - h) / 2)), int(round((width * scale - w) / 2)))
    return (left, top, left + cw, top + ch), geometry


def square_geometry(size: tuple[int, int], resolution: int) -> tuple[int, int, int, int]:
    """(orig_h, orig_w, crop_top, crop_left) of :func:`resize_center_crop` of an image of ``size`` (W, H)
    at ``resolution``, as :func:`crop_geometry` gives it (an unknown size, (0, 0): uncropped at
    ``resolution``)."""
    if min(size) < 1:
        return (resolution, resolution, 0, 0)
    return crop_geometry(tuple(size), (resolution, resolution))[1]


def resize_crop(img: Image.Image, shape: tuple[int, int], original: tuple[int, int] | None = None
                ) -> tuple[Image.Image, tuple[int, int, int, int]]:
    """Resize ``img`` to cover ``shape`` (h, w) and centre-crop it, in one antialiased bicubic resampling.

    ``original``: the (W, H) of the file (after EXIF rotation) when ``img`` was decoded at a reduced
    scale (a JPEG draft); the geometry is reported in its terms. Returns (image (w x h), geometry
    (orig_h, orig_w, crop_top, crop_left)), see :func:`crop_geometry`.
    """
    box, geometry = crop_geometry(img.size, shape)
    if original is not None and tuple(original) != img.size:
        geometry = crop_geometry(tuple(original), shape)[1]
    h, w = shape
    if img.size == (w, h):
        return img.copy(), geometry
    return img.resize((w, h), Image.Resampling.BICUBIC, box=box, reducing_gap=3.0), geometry


# EXIF orientations that swap width and height (5-8: transposed, rotated 90 or 270 degrees).
_SWAPPING_ORIENTATIONS = (5, 6, 7, 8)


def image_size(path: str | Path) -> tuple[int, int]:
    """(W, H) of an image file after its EXIF rotation, from its header (no decode); :class:`BadImage`."""
    with open_image(path) as img:
        try:
            orientation = img.getexif().get(0x0112, 1)
        except Exception:  # noqa: BLE001 - a broken EXIF block: load_image's exif_transpose decides
            orientation = 1
        w, h = img.size
    return (h, w) if orientation in _SWAPPING_ORIENTATIONS else (w, h)


def to_tensor(img: Image.Image | np.ndarray) -> torch.Tensor:
    """An 8-bit image (PIL, or uint8 array (H, W) / (H, W, C)) as (C, H, W) float32 in [-1, 1]."""
    a = np.asarray(img, dtype=np.uint8)
    if a.ndim == 2:
        a = a[:, :, None]
    x = torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1), dtype=np.float32))  # a copy
    return x.div_(127.5).sub_(1.0)


def flip_decision(sample_seed: int) -> bool:
    """Whether :func:`augment` with ``random_flip`` and a generator seeded by ``sample_seed`` mirrors the
    image: its first of four uniform draws is below 0.5 (a mask follows its image by this)."""
    u = torch.rand(4, generator=torch.Generator().manual_seed(sample_seed)).tolist()
    return u[0] < 0.5


MASK_SUFFIX = ".mask.png"  # NAME.mask.png beside NAME.jpg: the image's loss mask (data.masks), never a training image


def mask_path(path: str | Path) -> Path:
    """Where the mask file of image ``path`` would be: ``NAME.mask.png`` beside ``NAME.EXT``."""
    path = Path(path)
    return path.with_name(path.stem + MASK_SUFFIX)


def load_mask(path: str | Path) -> Image.Image | None:
    """The loss mask of image ``path`` as 8-bit "L" (255 = trained, 0 = ignored), after the EXIF
    rotation: its ``NAME.mask.png`` (any mode, as grey), else its alpha channel, else None (all trained).
    :class:`BadImage` naming the file it cannot read."""
    file = mask_path(path)
    if file.is_file():
        return load_image(file, 1)
    with open_image(path) as img:
        if img.mode not in _ALPHA_MODES and "transparency" not in img.info:
            return None
        try:
            img.load()
            img = ImageOps.exif_transpose(img)
            return img.convert("RGBA").getchannel("A")
        except Exception as e:  # noqa: BLE001 - see open_image
            raise BadImage(path, _reason(e)) from e


def _jitter_factor(u: float, strength: float) -> float:
    """Map a uniform draw in [0, 1) to a factor uniform in [max(0, 1 - s), 1 + s]."""
    lo = max(0.0, 1.0 - strength)
    return lo + u * (1.0 + strength - lo)


def augment(
    x: torch.Tensor, generator: torch.Generator, random_flip: bool, color_jitter: float
) -> torch.Tensor:
    """Randomly flip and colour-jitter one image; all randomness comes from ``generator``.

    Args:
        x: (C, H, W) float in [-1, 1] on the CPU, C = 1 or 3; not modified.
        generator: seeded per sample (by ``sample_seed``), so the result is reproducible.
        random_flip: mirror left-right with probability 0.5.
        color_jitter: relative strength s of brightness, contrast and saturation jitter, each a
            factor uniform in [max(0, 1 - s), 1 + s], applied in that order (0 = off),
            in the manner of torchvision's ColorJitter.

    Returns (C, H, W) float32 clamped to [-1, 1]. The same four numbers are drawn whatever the
    flags, so turning one augmentation on does not change the draws of another.
    """
    u = torch.rand(4, generator=generator).tolist()
    # The arithmetic runs in NumPy: on one small image its per-call overhead is a tenth of
    # torch's, which is most of the cost here.
    a = x.detach().cpu().numpy().astype(np.float32, copy=False)
    if random_flip and u[0] < 0.5:
        a = a[:, :, ::-1]
    if color_jitter > 0:
        brightness, contrast, saturation = (_jitter_factor(v, color_jitter) for v in u[1:])
        # In [0, 1], clamped after each step as a real image would be.
        y = np.clip((a + 1.0) * (0.5 * brightness), 0.0, 1.0)  # brightness
        m = _to_gray(y).mean()
        y = np.clip((y - m) * contrast + m, 0.0, 1.0)  # contrast about the mean luma
        if y.shape[0] == 3:
            gray = _to_gray(y)
            y = (y - gray) * saturation + gray  # saturation about each pixel's luma
        a = y * 2.0 - 1.0
    return torch.from_numpy(np.ascontiguousarray(np.clip(a, -1.0, 1.0), dtype=np.float32))


def _to_gray(y: np.ndarray) -> np.ndarray:
    """Luma of (C, H, W) as (1, H, W); a 1-channel image is its own luma."""
    if y.shape[0] == 1:
        return y
    return y[0:1] * _LUMA[0] + y[1:2] * _LUMA[1] + y[2:3] * _LUMA[2]
