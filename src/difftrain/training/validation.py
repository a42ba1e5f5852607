"""Validation grids: the EMA (and raw) weights sampled from fixed noise and fixed conditions (one
class or one prompt per row), spread across ranks; with a text model, the CLIP score and the
Inception Score of the grid's images."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from torch import nn

from difftrain.config import ConfigError, DiffusionConfig, EvaluationConfig, ValidationConfig
from difftrain.evaluation.clip_score import CLIPScorer
from difftrain.evaluation.inception_score import InceptionClassifier, images_inception_score
from difftrain.generation.autoguidance import ValidationGuide
from difftrain.generation.captioned_grid import captioned_grid
from difftrain.generation.sampling import (generate, grid_class_labels, grid_columns, initial_noise, make_grid, naming_samples,
                                           save_png, to_uint8)
from difftrain.networks.conditioning import Conditioning, map_condition
from difftrain.runtime import distributed
from difftrain.runtime.device import is_out_of_memory
from difftrain.runtime.fsdp import in_lockstep

DATA_PROMPTS = 8  # rows of a text model's grid when validation.prompts is empty: captions of the training data


@dataclasses.dataclass
class ValidationPlan:
    """What every validation samples: the same noise and conditions each time."""

    noise: torch.Tensor  # (N, C, H, W) x_T, in the network's space (latents in a latent run)
    condition: torch.Tensor | None  # (N,) labels or (N, L, D) text embeddings, on the CPU; None unconditional
    null: torch.Tensor | None  # the null condition (1,) or (1, L, D), for guidance
    ncols: int  # images per grid row
    prompts: list[str] | None  # a text model's prompt of each row
    guide: ValidationGuide | None = None  # autoguidance (validation.guide); None = none


def validation_plan(v: ValidationConfig, diffusion: DiffusionConfig, batch_size: int, conditioning: Conditioning,
                    dataset=None) -> ValidationPlan:
    """The plan of the validation section ``v``: ``num_images`` from fixed noise; class runs one class per
    row; text runs one prompt per row (``validation.prompts``, else the first distinct captions of
    ``dataset``), each row from the same ``num_images // rows`` noises, so rows differ by prompt only.
    ``diffusion``: the run's (what ``validation.guide`` must match); ``batch_size``: ``train.batch_size``
    (when the noise does not fit in memory, whether a training batch of these images would)."""
    shape = conditioning.network_shape()
    shape = (shape[0], shape[1], shape[1])
    try:
        return dataclasses.replace(_plan(v, shape, conditioning, dataset), guide=ValidationGuide(v, diffusion, conditioning))
    except (MemoryError, RuntimeError) as e:  # the fixed noise of the grid lives through the run
        if not is_out_of_memory(e) or not _fits(batch_size, shape):
            raise  # a training batch of these images does not fit either: the batch or resolution's error
        gib = v.num_images * np.prod(shape) * 4 / 2**30
        raise ConfigError(f"validation.num_images={v.num_images}: its fixed noise ({gib:,.1f} GiB) does not fit in "
                          "memory; a grid needs a few dozen images") from None


def _fits(num: int, shape: tuple[int, int, int]) -> bool:
    """Whether ``num`` float32 images of ``shape`` can be allocated (untouched: no memory used)."""
    try:
        torch.empty((num, *shape))
        return True
    except (MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        return False


def _plan(v, shape: tuple[int, int, int], conditioning: Conditioning, dataset) -> ValidationPlan:
    """The plan of validation config ``v`` for images of ``shape`` (C, H, W)."""
    if conditioning.kind == "text":
        prompts = list(v.prompts) or data_prompts(dataset, min(DATA_PROMPTS, v.num_images))
        ncols = max(1, v.num_images // len(prompts))
        noise = initial_noise(ncols, shape, v.seed).repeat(len(prompts), 1, 1, 1)
        device = next(conditioning.text.parameters()).device
        cpu = lambda t: t.cpu()  # noqa: E731
        condition = map_condition(cpu, conditioning.prompts([p for p in prompts for _ in range(ncols)], device))
        if conditioning.family.references:  # an edit family: each row's reference image(s) (validation.references)
            condition = condition | map_condition(cpu, _reference_rows(v, prompts, ncols, shape, conditioning,
                                                                       getattr(dataset, "references", 1) or 1))
        return ValidationPlan(noise, condition, map_condition(cpu, conditioning.null(1, device)), ncols, prompts)
    noise = initial_noise(v.num_images, shape, v.seed)
    labels = grid_class_labels(v.num_images, conditioning.num_classes)
    null = conditioning.null(1) if labels is not None else None
    return ValidationPlan(noise, labels, null, grid_columns(v.num_images), None)


def _reference_rows(v, prompts: list[str], ncols: int, shape: tuple[int, int, int], conditioning: Conditioning,
                    count: int = 1) -> dict[str, torch.Tensor]:
    """The reference condition of every grid image: ``validation.references`` (one entry per prompt, or one for all;
    each a file, or a list of ``count`` files: the training pairs' references per item, in order), each image
    encoded at the grid's size and repeated over its row's ``ncols`` images; one ValueError without them, or
    with another count than the pairs'."""
    rows = [[r] if isinstance(r, str) else list(r) for r in v.references]
    if len(rows) not in (1, len(prompts)):
        raise ValueError(f"validation.references: the {conditioning.family.name} base samples from a reference image; "
                         f"give one per validation prompt ({len(prompts)}) or one for all, got {len(rows)}")
    for row in rows:
        if len(row) != count:
            raise ValueError(f"validation.references: the training pairs have {count} reference image(s) each, "
                             f"{row} gives {len(row)}; give each prompt a list of {count} files, in the pairs' order")
    factor = conditioning.codec.factor
    grid = lambda t: (t.expand(len(prompts), *t.shape[1:]) if len(rows) == 1 else t).repeat_interleave(ncols, dim=0)
    latents, images = [], []
    for k in range(count):  # reference k of every row: (rows, 3, H, W) pixels, (rows, c, h, w) latents
        pixels = conditioning.reference_images([row[k] for row in rows], (shape[1] * factor, shape[2] * factor))
        latents.append(grid(conditioning.encode_references(pixels)))
        images.append(grid(pixels))
    return conditioning.reference_condition(latents, [p for p in prompts for _ in range(ncols)], images=images)


def data_prompts(dataset, count: int) -> list[str]:
    """Up to ``count`` distinct captions of a captioned dataset, in index order (stable across runs)."""
    prompts: list[str] = []
    for i in range(min(len(dataset), 50 * count)):
        caption = dataset[i][1]
        if caption.strip() and caption not in prompts:
            prompts.append(caption)
            if len(prompts) == count:
                break
    if not prompts:
        raise ValueError("set validation.prompts: the training data has no non-empty captions to validate with")
    return prompts


def sample_images(
    model: nn.Module, v: ValidationConfig, plan: ValidationPlan, conditioning: Conditioning, objective,
    ctx: distributed.DistContext,
) -> np.ndarray | None:
    """(N, H, W, C) uint8 samples of ``model`` from the plan on rank 0, None on the others.

    Rank r samples the rows ``shard(N, ctx)``, and the sampler noise of row i is seeded by
    (validation.seed, i), so the images are the same on any number of processes. A sharded model
    (FSDP) samples in lockstep: every rank as many rows, the last share padded with a repeated row
    whose image is dropped (``distributed.padded_shard``). ``v``: the validation section (sampler, steps, seed).
    """
    rows, keep = distributed.padded_shard(plan.noise.shape[0], ctx, in_lockstep(model))
    mine = torch.tensor(rows, dtype=torch.long)
    images = generate(
        model if plan.guide is None else plan.guide.wrap(model),
        objective=objective,
        noise=plan.noise[mine],
        sampler=v.sampler,
        steps=v.steps,
        seed=v.seed,
        condition=map_condition(lambda t: t[mine], plan.condition),
        null_condition=plan.null,
        guidance_scale=v.guidance_scale,
        sample_ids=rows,
        decode=conditioning.decode if conditioning.codec is not None else None,
        clip=conditioning.codec is None,  # latents are not bounded to [-1, 1]
    )
    images = distributed.gather_cat(images[:keep], ctx)  # (N, C, H, W) on rank 0, None elsewhere
    return None if images is None else to_uint8(images)


def grid(images: np.ndarray, plan: ValidationPlan) -> np.ndarray:
    """The grid of a plan's images: a text model's with each row's prompt under it."""
    if plan.prompts is None:
        return make_grid(images, plan.ncols)
    return captioned_grid(images, plan.prompts, plan.ncols)


def validation_grids(
    model: nn.Module, ema_model: nn.Module, v: ValidationConfig, plan: ValidationPlan, conditioning: Conditioning,
    objective, ctx: distributed.DistContext,
) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """(``{"samples/ema": grid}`` plus ``"samples/raw"`` with ``validation.raw_grid``, the EMA
    images (N, H, W, C) uint8) on rank 0; ``({}, None)`` on the others. Every rank must call it. Samples
    that come out NaN or infinite raise ``NonFiniteSamples`` naming the weights."""
    with naming_samples("the validation grid of the EMA weights"):
        ema_images = sample_images(ema_model, v, plan, conditioning, objective, ctx)
    grids = {}
    if ema_images is not None:
        grids["samples/ema"] = grid(ema_images, plan)
    if v.raw_grid:
        with naming_samples("the validation grid of the raw weights"):
            raw = sample_images(model, v, plan, conditioning, objective, ctx)
        if raw is not None:
            grids["samples/raw"] = grid(raw, plan)
    return grids, ema_images


class ValidationScores:
    """The CLIP score (``evaluation.clip_model``) and the Inception Score
    (``evaluation.is_inception_path``) of the validation images, each logged with its image count.
    Networks load on first use, on rank 0 only; no-ops when neither is set."""

    def __init__(self, e: EvaluationConfig, device: torch.device):
        self.e, self.device = e, device  # the evaluation section
        self._clip = self._inception = None

    @property
    def enabled(self) -> bool:
        return bool(self.e.clip_model or self.e.is_inception_path)

    def __call__(self, images: np.ndarray, plan: ValidationPlan) -> dict[str, float]:
        """images: (N, H, W, C) uint8 of the plan (EMA weights)."""
        e, out = self.e, {}
        if images.shape[-1] == 1:
            images = np.repeat(images, 3, axis=-1)
        if e.clip_model and plan.prompts is not None:
            if self._clip is None:
                self._clip = CLIPScorer.from_path(e.clip_model).to(self.device)
            prompts = [p for p in plan.prompts for _ in range(plan.ncols)]
            scores = self._clip.score(images, prompts)
            out.update({"clip_score": float(scores.mean()), "clip_score_images": len(prompts)})
        if e.is_inception_path:
            if self._inception is None:
                self._inception = InceptionClassifier.from_path(e.is_inception_path).to(self.device)
            splits = max(1, min(10, len(images) // 100))  # the usual 10 splits need hundreds of images each
            mean, std, n = images_inception_score(images, self._inception, batch_size=64, device=self.device,
                                                  splits=splits)
            out.update({"inception_score": mean, "inception_score_std": std, "inception_score_images": n})
        return out


def save_grids(grids: dict[str, np.ndarray], run_dir: Path, step: int, trackers) -> None:
    """Write ``samples/step_N.png`` (EMA) and ``samples/raw/step_N.png``; log each by name."""
    folders = {"samples/ema": run_dir / "samples", "samples/raw": run_dir / "samples" / "raw"}
    for name, image in grids.items():
        folders[name].mkdir(parents=True, exist_ok=True)
        save_png(image, folders[name] / f"step_{step:08d}.png")
        trackers.log_image(step, name, image)
