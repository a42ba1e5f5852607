"""From a trained network to images: the denoiser wrapper, batched generation, PNG grids.

The samplers themselves are pure functions in :mod:`difftrain.diffusion.samplers`; this module
connects them to a model, fixed seeds and files. Sampling always runs in float32.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from PIL.PngImagePlugin import PngInfo
from torch import nn

from difftrain.networks.conditioning import condition_rows, expand_rows, map_condition
from difftrain.diffusion.objective import Objective
from difftrain.runtime.seeding import derive_seed


def guided_network(
    model: nn.Module,
    condition: torch.Tensor | None = None,
    null_condition: torch.Tensor | None = None,
    guidance_scale: float = 1.0,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Bind a condition and guidance into ``network(x (B,C,H,W), cond (B,)) -> output (B,C,H,W)`` float32.

    condition: class labels (B,) or text embeddings (B, L, D), or None (unconditional).
    null_condition: the null label or the empty caption's embedding, broadcastable to ``condition``.
    With ``guidance_scale != 1`` the output is classifier-free guided (Ho & Salimans 2022):
    ``out_uncond + s * (out_cond - out_uncond)``; every parameterization is linear in the output,
    so guiding it guides the x0 prediction alike.
    """

    guide = guidance_rule(model)

    def network(x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        c = condition_rows(condition, 0, x.shape[0])
        out = model(x, cond, c).float()
        if c is not None and guidance_scale != 1.0:
            null = expand_rows(null_condition, x.shape[0])
            if isinstance(c, dict) and isinstance(null, dict):  # what the null leaves out (an edit family's
                null = c | null  # reference images) is each row's own
            uncond = model(x, cond, null).float()
            out = uncond + guidance_scale * (out - uncond) if guide is None else guide(out, uncond, guidance_scale)
        return out

    return network


def guidance_rule(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None:
    """The network's own rule ``guide_outputs(cond_out, uncond_out, scale)`` where its pipeline guides otherwise than
    plain CFG (a family denoiser's: Qwen-Image's true CFG rescales each token to the conditional output's
    norm), found through the wrappers of a run's network (a LoRA network's ``fsdp_inner()``, torch.compile's
    ``_orig_mod``); None: plain CFG. A network guided by another (autoguidance) keeps plain CFG."""
    seen = 0
    while model is not None and seen < 8:
        rule = getattr(model, "guide_outputs", None)
        if callable(rule):
            return rule
        inner = model.fsdp_inner() if callable(getattr(model, "fsdp_inner", None)) else None
        model, seen = inner if inner is not None else getattr(model, "_orig_mod", None), seen + 1
    return None


class NonFiniteSamples(ValueError):
    """Sampled images that came out NaN or infinite: the network's numbers overflow (finite weights
    whose outputs are not). One line naming what was sampled (:func:`naming_samples`); exit 2."""


@contextlib.contextmanager
def naming_samples(what: str, then: str = "") -> Iterator[None]:
    """Prefix a :class:`NonFiniteSamples` raised inside the block with ``what`` (the adapter,
    checkpoint or run whose samples they are), so that its one line names it; ``then``: what to
    do, added at its end."""
    try:
        yield
    except NonFiniteSamples as e:
        raise NonFiniteSamples(f"{what}: {e}" + (f"; {then}" if then else "")) from None


def initial_noise(num: int, shape: tuple[int, int, int], seed: int) -> torch.Tensor:
    """x_T of shape (num, C, H, W), drawn on the CPU so a seed gives the same noise anywhere."""
    gen = torch.Generator().manual_seed(derive_seed(seed, "initial-noise"))
    return torch.randn((num, *shape), generator=gen)


@torch.no_grad()
def generate(
    model: nn.Module,
    *,
    objective: Objective,
    noise: torch.Tensor,
    sampler: str = "ddim",
    steps: int = 50,
    seed: int = 0,
    condition: torch.Tensor | None = None,
    null_condition: torch.Tensor | None = None,
    guidance_scale: float = 1.0,
    batch_size: int = 256,
    sample_ids: Sequence[int] | None = None,
    progress=None,
    decode: Callable[[torch.Tensor], torch.Tensor] | None = None,
    **sampler_options,
) -> torch.Tensor:
    """Sample images from fixed initial noise.

    Args:
        model: the network, in float32; put in eval mode for the call.
        objective: what the network was trained with; it holds the samplers.
        noise: (N, C, H, W) x_T on the CPU (see :func:`initial_noise`).
        condition: (N,) long labels or (N, L, D) text embeddings, or None (unconditional).
        null_condition: the null label () or empty caption (1, L, D), for ``guidance_scale != 1``.
        sample_ids: (N,) ints naming the samples. Given, row k's sampler noise (DDPM, DDIM with
            eta > 0) comes from its own generator seeded by (seed, sample_ids[k]), so a sample
            is the same whichever batch or process draws it. Without them each batch of
            ``batch_size`` draws from one generator seeded by (seed, batch number).
        progress: an object with ``advance(n)`` told of each finished batch (a progress line).
        decode: maps each batch of samples to images (a latent model's VAE decoder).
    Returns:
        (N, C, H, W) float32 images in [-1, 1] (after ``decode``), on the CPU.
    Raises:
        NonFiniteSamples: a batch's images hold a NaN or an infinity (checked once per batch, on
            the final images: one reduction, read when the batch is copied to the CPU anyway).
    """
    if sample_ids is not None and len(sample_ids) != noise.shape[0]:
        raise ValueError(f"got {len(sample_ids)} sample_ids for {noise.shape[0]} noise rows")
    if sampler not in objective.samplers:
        raise ValueError(f"sampler must be one of {', '.join(objective.samplers)} for {objective.family} models, "
                         f"got {sampler!r}")
    if guidance_scale != 1.0 and not getattr(objective, "guidable", True):
        raise ValueError(f"a {objective.family} model samples unguided (a blend of its outputs is not its guided "
                         f"field's); got guidance scale {guidance_scale}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    try:
        for i, start in enumerate(range(0, noise.shape[0], batch_size)):
            x_T = noise[start : start + batch_size].to(device)
            c = map_condition(lambda t: t.to(device), condition_rows(condition, start, start + batch_size))
            null = map_condition(lambda t: t.to(device), null_condition)
            network = guided_network(model, c, null, guidance_scale)
            if sample_ids is None:
                gen = torch.Generator(device=device).manual_seed(derive_seed(seed, "sampler", i))
            else:
                ids = sample_ids[start : start + batch_size]
                gen = [torch.Generator(device=device).manual_seed(derive_seed(seed, "sample", int(k))) for k in ids]
            x0 = objective.sample(network, x_T, sampler, steps, gen, **sampler_options)
            images = x0 if decode is None else decode(x0)
            finite = torch.isfinite(images).all()  # one reduction per batch, no wait inside the sampler
            out.append(images.cpu())
            if not bool(finite):
                raise NonFiniteSamples(f"samples {start}-{start + x_T.shape[0] - 1} came out not finite (NaN or "
                                       "inf): the network's numbers overflow")
            if progress is not None:
                progress.advance(x_T.shape[0])
    finally:
        model.train(was_training)
    if not out:  # no rows: a rank with no share
        return torch.zeros(noise.shape) if decode is None else torch.zeros((0, *decode(noise[:1].to(device)).shape[1:]))
    return torch.cat(out)


def quantize(images: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) in [-1, 1] -> (N, C, H, W) uint8 tensor, rounded as a PNG stores the image."""
    return ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(N, C, H, W) in [-1, 1] -> (N, H, W, C) uint8 array."""
    return quantize(images).permute(0, 2, 3, 1).cpu().numpy()


def grid_columns(num_images: int) -> int:
    """Columns of a near-square grid of ``num_images``."""
    return max(1, math.ceil(math.sqrt(num_images)))


def grid_class_labels(num_images: int, num_classes: int) -> torch.Tensor | None:
    """(num_images,) long labels with one class per grid row (None when unconditional)."""
    if num_classes == 0:
        return None
    return (torch.arange(num_images) // grid_columns(num_images)) % num_classes


def make_grid(images: np.ndarray, ncols: int | None = None, pad: int = 2) -> np.ndarray:
    """(N, H, W, C) uint8 -> one (H', W', C) uint8 grid, ``ncols`` images per row."""
    n, h, w, c = images.shape
    ncols = ncols or grid_columns(n)
    nrows = math.ceil(n / ncols)
    grid = np.full((nrows * (h + pad) + pad, ncols * (w + pad) + pad, c), 255, dtype=np.uint8)
    for i in range(n):
        r, q = divmod(i, ncols)
        grid[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + q * (w + pad) : pad + q * (w + pad) + w] = images[i]
    return grid


# The grid `difftrain sample` writes among its samples carries this PNG text chunk, so that
# `fid` and `eval`, which read every image of a folder, leave it out (it is not a sample).
GRID_NAME = "grid.png"
GRID_TEXT = ("difftrain", "grid of the samples beside it")


def save_png(image: np.ndarray, path: Path, text: tuple[str, str] | None = None) -> None:
    """Save an (H, W, C) uint8 array (C = 1 or 3) as PNG, with one (key, value) text chunk if given."""
    info = None
    if text is not None:
        info = PngInfo()
        info.add_text(*text)
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(path, pnginfo=info)


def is_sample_grid(path: Path) -> bool:
    """Whether ``path`` is the grid `difftrain sample` wrote (by its name and text chunk)."""
    if path.name != GRID_NAME:
        return False
    try:
        with Image.open(path) as img:
            return img.info.get(GRID_TEXT[0]) == GRID_TEXT[1]
    except OSError:
        return False
