"""The memorization and diversity check of a run's validation images (and of its FID samples in the
Inception space): called by the loop at each validation on rank 0, by ``difftrain eval``
on its samples. A disabled one (``validation.memorization = "off"``) does nothing and loads nothing.

The default, ``"auto"``, checks where it is cheap: in the ``pixels`` space when the training set
holds at most ``validation.memorization_auto_max_images`` (5,000) images, off otherwise. Small
sets (a DreamBooth subject, a fine-tuning folder) are where samples copy training images, and
their index costs one decode per image, once; the built-in shapes (20,000 images) and large
folders stay off unless asked for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from difftrain.config import Config, EvaluationConfig, ValidationConfig
from difftrain.generation.sampling import save_png
from difftrain.runtime import distributed
from difftrain.runtime.optional import require

from .diversity import data_features, diversity
from .inception import find_inception_weights
from .memorization import (FeatureNetwork, Memorization, TrainingIndex, feature_network, memorization, neighbour_grid,
                           training_index)


class SampleCheck:
    """``check(step, images, groups, run_dir, trackers)`` -> metrics: the share of near-copies,
    the median ratio, the Vendi score beside the data's; writes ``samples/neighbours/step_N.png``
    (each sample beside its nearest training image) and logs it as ``samples/neighbours``.

    ``dataset``: the training images (pixels, unaugmented items in [-1, 1]); the index of their
    features is built on first use and cached (evaluation/memorization.py)."""

    def __init__(self, cfg: Config, dataset, device: torch.device | str = "cpu"):
        self.cfg, self.dataset, self.device = cfg, dataset, device
        self.space = resolve_space(cfg.validation, dataset)
        self._net: FeatureNetwork | None = None
        self._index: TrainingIndex | None = None
        check_available(cfg.validation, cfg.evaluation)  # before training: a missing network is one line now, not at the first validation

    @property
    def enabled(self) -> bool:
        return self.space != "off"

    def setup(self) -> None:
        """Load the feature network and the training index (built once, then from the cache)."""
        if self._index is None:
            e = self.cfg.evaluation
            self._net = feature_network(self.space, inception_path=e.inception_path, clip_model=e.clip_model,
                                        device=self.device)
            self._index = training_index(self.dataset, self._net, folder=_cache_folder(self.cfg.data.cache_dir))

    def features(self, images: np.ndarray) -> torch.Tensor:
        """(N, H, W, C) uint8 -> (N, V, D) query views."""
        x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2)
        return torch.cat([self._net.queries(x[i:i + 64]) for i in range(0, len(x), 64)])

    def __call__(self, step: int, images: np.ndarray, groups: list[int] | None = None,
                 run_dir: Path | None = None, trackers=None) -> dict[str, float]:
        if not self.enabled or images is None:
            return {}
        self.setup()
        queries = self.features(images)
        result = memorization(queries, self._index.features, self.cfg.validation.near_copy_ratio,
                              device=self.device)
        out = result.metrics()
        reference = data_features(self._index.features, len(images), seed=self.cfg.validation.seed)
        out.update(diversity(queries[:, 0], reference, groups))
        pairs = self.cfg.validation.memorization_pairs
        if pairs and run_dir is not None:
            grid = neighbour_grid(images, self.dataset, result, pairs)
            folder = run_dir / "samples" / "neighbours"
            folder.mkdir(parents=True, exist_ok=True)
            save_png(grid, folder / f"step_{step:08d}.png")
            if trackers is not None:
                trackers.log_image(step, "samples/neighbours", grid)
        return out

    def of_features(self, features: torch.Tensor, prefix: str = "fid_samples") -> dict[str, float]:
        """Memorization and diversity of FID samples given as Inception features (N, 2048), in the
        Inception space only ({} in the others: :class:`CheckedInception` sees their images)."""
        if self.space != "inception":
            return {}
        self.setup()
        q = torch.nn.functional.normalize(features.float(), dim=1)
        result = memorization(q, self._index.features, self.cfg.validation.near_copy_ratio, device=self.device)
        out = result.metrics(f"{prefix}/memorization")
        out.update(diversity(q, data_features(self._index.features, len(q)), prefix=f"{prefix}/diversity"))
        return out

    def tap(self, inception, ctx=None):
        """The FID network, checking the samples it sees in this (non-Inception) space; None when the
        check is off or in the Inception space (:meth:`of_features` then uses the FID features).
        Every rank must call it: rank 0 builds the index first, the others then read its cache."""
        if not self.enabled or self.space == "inception":
            return None
        if ctx is not None and ctx.enabled:
            distributed.run_on_main(self.setup, ctx)
        return CheckedInception(inception, self)


class CheckedInception:
    """The FID network, checking each batch of samples it sees (``difftrain eval``): the samples'
    memorization and diversity are gathered batch by batch, so memory stays at one batch plus a
    few numbers per sample. Call ``result()`` once every batch is through."""

    def __init__(self, inception, check: SampleCheck):
        self.inception, self.check = inception, check
        self.parts: list = []
        self.centre: list[torch.Tensor] = []
        check.setup()

    def __getattr__(self, name):  # feature_dim, metadata, to(): the network's own
        return getattr(self.inception, name)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """images: (B, C, H, W) uint8 -> the network's features, after checking them."""
        features = self.inception(images)
        if self.check.space == "inception":
            queries = torch.nn.functional.normalize(features.float().cpu(), dim=1)[:, None]
        else:
            queries = self.check.features(images.cpu().permute(0, 2, 3, 1).numpy())
        v = self.check.cfg.validation
        self.parts.append(memorization(queries, self.check._index.features, v.near_copy_ratio,
                                       device=self.check.device))
        self.centre.append(queries[:, 0])
        return features

    def result(self, ctx=None, prefix: str = "") -> dict[str, float]:
        """The metrics of every sample seen (under torchrun: of every rank's, on rank 0; {} on the
        others; every rank must call it). Resets the tap for the next evaluation."""
        dim = self.check._index.features.shape[1]
        parts, centre, self.parts, self.centre = self.parts, self.centre, [], []
        local = [torch.cat([getattr(p, k) for p in parts]) if parts else torch.zeros(0, dtype=dtype)
                 for k, dtype in (("neighbour", torch.int64), ("distance", torch.float32), ("ratio", torch.float32))]
        local.append(torch.cat(centre) if centre else torch.zeros(0, dim))
        if ctx is not None and ctx.enabled:
            local = [distributed.gather_cat(t, ctx) for t in local]
            if not ctx.is_main:
                return {}
        neighbour, distance, ratio, features = local
        merged = Memorization(neighbour, distance, ratio, self.check.cfg.validation.near_copy_ratio)
        out = merged.metrics(f"{prefix}memorization")
        out.update(diversity(features, data_features(self.check._index.features, len(features)),
                             prefix=f"{prefix}diversity"))
        return out


def resolve_space(v: ValidationConfig, dataset) -> str:
    """The feature space ``validation.memorization`` (of the validation section ``v``) names for the training
    set ``dataset``: "auto" is "pixels" for 2 to ``validation.memorization_auto_max_images`` images, else "off"
    (and off for images in aspect-ratio buckets, whose shapes differ from the square samples')."""
    if v.memorization != "auto":
        return v.memorization
    if getattr(dataset, "bucket_shapes", None) is not None or getattr(dataset, "masks", False) or getattr(
            dataset, "references", 0):
        return "off"
    n = len(dataset) if dataset is not None else 0
    return "pixels" if 2 <= n <= v.memorization_auto_max_images else "off"


def check_available(v: ValidationConfig, e: EvaluationConfig) -> None:
    """Raise the one line naming what to install when ``validation.memorization``'s network (of the
    validation section ``v``; its files named by the evaluation section ``e``) is missing: the FID
    Inception file (FileNotFoundError), transformers for CLIP (MissingDependency)."""
    space = v.memorization
    if space == "inception":
        find_inception_weights(e.inception_path or None)
    elif space == "clip":
        require("transformers", "text", f"validation.memorization='clip' (evaluation.clip_model={e.clip_model})")


def _cache_folder(cache_dir: str) -> str | None:
    """data.cache_dir/memorization when data.cache_dir (``cache_dir``) is set, else the default cache folder."""
    return str(Path(cache_dir) / "memorization") if cache_dir else None


def plan_groups(plan) -> list[int] | None:
    """A text plan's row sizes (one prompt per row), for per-prompt diversity; None otherwise."""
    if plan is None or plan.prompts is None:
        return None
    return [plan.ncols] * len(plan.prompts)
