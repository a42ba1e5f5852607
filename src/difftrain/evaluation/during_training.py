"""FID during training: every ``evaluation.fid_every_steps`` steps, on the EMA model, logged
together with the sample count it was measured on (FID is biased upwards at small counts).

A class-conditional model's samples take labels drawn uniformly, a text model's the captions of
training images drawn uniformly, both guided by ``validation.guidance_scale``; a latent model's
are decoded by the VAE before Inception (see :class:`~.evaluate.FIDConditions`).

Under torchrun the sampling and the Inception features are spread across ranks by whole
batches; batch k's noise, labels and captions depend on (seed, batch size, k) alone and rank 0
folds the gathered features in batch order, so the FID is the one a single process measures.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

from difftrain.checkpoints.checkpoint import is_better
from difftrain.config import Config
from difftrain.generation.autoguidance import ValidationGuide
from difftrain.networks.conditioning import Conditioning
from difftrain.runtime import distributed
from difftrain.runtime.distributed import DistContext
from difftrain.runtime.fsdp import in_lockstep

from .evaluate import DatasetCaptions, FIDConditions, fid_result, num_batches, sample_features, statistics_from_features
from .inception import InceptionFeatures
from .reference import load_or_compute, reference_statistics
from .sample_check import CheckedInception


def sharded_sample_features(
    model: nn.Module, inception: InceptionFeatures, *, num: int, batch_size: int, ctx: DistContext,
    lockstep: bool = False, **options
) -> torch.Tensor | None:
    """(num, D + 1) float32 on rank 0's CPU, None on the others: the Inception features of all
    ``num`` samples, then each one's Laplacian energy (the confetti share's input). Rank r draws the batches ``shard(num_batches, ctx)`` of :func:`sample_features`
    (which ``options`` are passed to, ``conditions`` among them), so the features are those of
    one process, in order. ``lockstep`` (a sharded model, FSDP): every rank samples as many batches, the
    last share padded with a repeated batch whose features are dropped (never seen by a checking
    ``inception``: the padding goes through the FID network alone)."""
    total = num_batches(num, batch_size)
    batches, keep = distributed.padded_shard(total, ctx, lockstep)
    energies: list = []
    features = sample_features(model, inception, num=num, batch_size=batch_size, batches=batches[:keep],
                               energies=energies, **options)
    parts = [f.cpu() for f in features]
    if len(batches) > keep:  # as many forwards as every other rank; results dropped
        plain = inception.inception if isinstance(inception, CheckedInception) else inception
        for _ in sample_features(model, plain, num=num, batch_size=batch_size, batches=batches[keep:], **options):
            pass
    local = torch.cat(parts) if parts else torch.zeros(0, inception.feature_dim)
    # The Laplacian energy of each sample rides along as one more column, gathered in the same order.
    local_energy = torch.from_numpy(np.concatenate(energies)).float()[:, None] if energies else torch.zeros(0, 1)
    return distributed.gather_cat(torch.cat([local, local_energy], dim=1), ctx)


class TrainingFID:
    """Call ``fid(step, ema_model)`` after each step; it returns metrics to log at evaluation
    steps (on rank 0; {} on the others, and at other steps). A disabled one (fid_every_steps =
    0) does nothing and loads nothing. Every rank must call it: each samples its share.

    The Inception network is loaded at the first evaluation, by every rank, and the reference
    statistics by rank 0: ``evaluation.fid_ref`` (an .npz or a folder), or else the training data
    through the training preprocessing (cached by content, see evaluation.reference).

    ``conditioning``: the run's (None: unconditional pixels); ``dataset``: the training set, whose
    captions a text model's samples are drawn from (read when drawn, each once).
    """

    def __init__(self, cfg: Config, objective, device: torch.device, ctx: DistContext | None = None,
                 conditioning=None, dataset=None, check=None):
        self.cfg, self.objective, self.device = cfg, objective, device
        self.ctx = ctx or DistContext()
        self.every = cfg.evaluation.fid_every_steps
        self.conditioning = conditioning or Conditioning(channels=cfg.data.channels, resolution=cfg.data.resolution)
        self.dataset = dataset
        self.check = check  # a SampleCheck: memorization and diversity of the samples' features (Inception space)
        self._conditions: FIDConditions | None = None
        self.guide = ValidationGuide(cfg.validation, cfg.diffusion, self.conditioning)  # autoguidance of the samples (validation.guide)
        self._inception = None
        self._reference = None

    def _setup(self) -> None:
        e, d = self.cfg.evaluation, self.cfg.data
        c = self.conditioning
        self._conditions = FIDConditions(
            c, captions=DatasetCaptions(self.dataset) if c.kind == "text" else None,
            captions_from=f"data.path {d.path}",
            guidance_scale=self.cfg.validation.guidance_scale if c.kind != "none" else 1.0)
        self._inception = InceptionFeatures(e.inception_path or None).to(self.device)
        if not self.ctx.is_main:
            return
        if e.fid_ref:
            self._reference = load_or_compute(e.fid_ref, self._inception)
        else:
            self._reference, _, _ = reference_statistics(
                d.path, self._inception, resolution=d.resolution, channels=d.channels,
                num=e.fid_ref_num or None)

    def due(self, step: int) -> bool:
        """Whether ``step`` is an evaluation step."""
        return bool(self.every) and step % self.every == 0

    def __call__(self, step: int, ema_model: nn.Module) -> dict[str, float]:
        if not self.due(step):
            return {}
        start = time.perf_counter()
        if self._inception is None:
            self._setup()
        e = self.cfg.evaluation
        channels, size = self.conditioning.network_shape()
        tap = self.check.tap(self._inception, self.ctx) if self.check is not None else None  # sees the images
        features = sharded_sample_features(
            self.guide.wrap(ema_model), tap or self._inception, objective=self.objective, shape=(channels, size, size),
            num=e.fid_num_samples, sampler=e.fid_sampler, steps=e.fid_steps, seed=e.fid_seed,
            batch_size=e.fid_batch_size, conditions=self._conditions, ctx=self.ctx, lockstep=in_lockstep(ema_model))
        checked = tap.result(self.ctx, prefix="fid_samples/") if tap is not None else {}
        if features is None:  # not rank 0
            return {}
        features, energies = features[:, :-1], features[:, -1]
        samples = statistics_from_features(
            features.split(e.fid_batch_size), self._inception,
            {"num_images": e.fid_num_samples, "sampler": e.fid_sampler, "steps": e.fid_steps})
        samples.energies = energies.double().numpy()
        result = fid_result(samples, self._reference, kid=False)
        record = self._conditions.record()
        extra = {"fid_confetti_share": result["confetti_share"]} if "confetti_share" in result else {}
        if self.check is not None and tap is None:
            checked = self.check.of_features(features)
        return {**extra, **checked, "fid": result["fid"], "fid_num_samples": result["num_samples"],
                "fid_num_reference": result["num_reference"], "fid_steps": e.fid_steps,
                "fid_conditioned_on": record["conditioned_on"], "fid_guidance_scale": record["guidance_scale"],
                "fid_seconds": time.perf_counter() - start}

    def new_best(self, metrics: dict, ckpt_dir) -> float | None:
        """The FID in ``metrics`` when it is lower than the run's best checkpoint's (so this step is
        saved and becomes ``best``), else None; the same decision on every rank (rank 0 measures:
        the others get NaN for the value, which only rank 0 writes). Every rank must call it."""
        better = int("fid" in metrics and is_better(ckpt_dir, metrics["fid"]))
        if not distributed.max_over_ranks(better, self.ctx):
            return None
        return float(metrics["fid"]) if better else float("nan")
