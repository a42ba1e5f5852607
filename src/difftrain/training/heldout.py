"""The held-out loss: frozen noise and noise levels, overall and per noise-level bucket.

Training loss is noisy (each step draws new t and noise) and is measured on data the model has
seen. The held-out loss is measured on images the model never trains on, with noise and
timesteps drawn once from a fixed seed, so two evaluations differ only through the weights:
the curve is smooth, over-fitting shows as a rise, and runs can be compared number for number.

Under torchrun each rank evaluates its shard of the held-out images; the noise and timestep of
image i are drawn for the whole set and depend on i alone, and the per-image losses are gathered
on rank 0 in order, so the numbers are those of one process (to float rounding).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import Dataset

from difftrain.config import DataConfig, ValidationConfig
from difftrain.data.latents import sample_latents
from difftrain.diffusion.objective import Objective, per_sample_loss
from difftrain.networks.conditioning import Conditioning, condition_rows
from difftrain.runtime import distributed
from difftrain.runtime.distributed import DistContext
from difftrain.runtime.fsdp import in_lockstep
from difftrain.runtime.seeding import derive_seed


class HeldOutLoss:
    """Evaluates the diffusion loss on fixed (x0, t, noise) triples of the held-out images.

    Args:
        dataset: the held-out images (items ``(image (C, H, W) in [-1, 1], label or caption, geometry
            (4,) long)``, the geometry (original size and crop: SDXL's size conditioning) where the dataset
            carries it); the first ``max_images`` are used, unaugmented.
        v: the run's validation section (the held-out options, the seed).
        d: its data section (without ``conditioning``: the images' channels, resolution and classes).
        objective: the run's objective (on ``device``): its stratified noise levels and loss.
        device: where the frozen tensors live and the model runs.
        num_buckets: timestep buckets for the per-bucket losses.
        ctx: the process's place in a distributed run; it keeps and evaluates only its shard
            ``distributed.shard(N, ctx)`` of the N held-out images.
        conditioning: the run's labels or text and frozen parts (default: labels when the data has
            classes); a latent run's held-out items are cached latent moments, evaluated at their mean.
    """

    def __init__(self, dataset: Dataset, v: ValidationConfig, d: DataConfig, objective: Objective, device: torch.device,
                 num_buckets: int = 10, ctx: DistContext | None = None, conditioning: Conditioning | None = None):
        self.ctx = ctx or DistContext()
        if conditioning is None:
            num_classes = getattr(dataset, "num_classes", 0) if d.class_conditional else 0
            conditioning = Conditioning(num_classes, channels=d.channels, resolution=d.resolution)
        channels, resolution = conditioning.network_shape()
        n = min(len(dataset), v.heldout_max_images)
        # This rank's rows, padded to every rank's count: a sharded model (FSDP) evaluates in lockstep.
        rows, self.keep = distributed.padded_shard(n, self.ctx, lockstep=True)
        mine = torch.tensor(rows, dtype=torch.long)
        # Drawn for all N images, whatever this rank keeps: image i's t and noise depend on i alone.
        g = torch.Generator().manual_seed(derive_seed(v.seed, "heldout-noise"))
        t = objective.stratified_levels(n, g)  # (N,) equal counts in every bucket
        noise = torch.randn((n, channels, resolution, resolution), generator=g)  # (N, C, H, W)
        items = [dataset[i] for i in rows]
        self.x0 = torch.stack([it[0] for it in items]).to(device) if items else torch.zeros_like(noise[mine]).to(device)
        if conditioning.codec is not None and items:  # the mean latent of each image
            self.x0 = sample_latents(self.x0, torch.zeros_like(noise[mine]).to(device), conditioning.codec)
        seconds = [it[1] for it in items]
        if conditioning.kind == "class":
            seconds = torch.tensor(seconds, dtype=torch.long)
        carried = items and all(len(it) > 2 for it in items)  # (N_r, 4) long: each image's size and crop
        geometry = torch.stack([it[2] for it in items]) if carried else None
        self.condition = conditioning.condition(seconds, None, device, geometry) if items else None
        self.t = t[mine].to(device)  # (N_r,) this rank's rows
        self.noise = noise[mine].to(device)  # (N_r, C, H, W)
        self.objective = objective
        self.batch_size = v.heldout_batch_size
        self.weights = v.heldout_weights
        self.num_buckets = num_buckets
        self.buckets = objective.bucket(t, num_buckets)  # (N,) on the CPU, for all images

    @torch.no_grad()
    def per_sample(self, model: nn.Module) -> torch.Tensor:
        """(N_r,) float32 loss of each of this rank's held-out triples (all N in one process), in
        eval mode (training mode is restored). A sharded model (FSDP) runs the padded rows too, so that
        every rank runs as many forwards; their losses are dropped."""
        was_training = model.training
        model.eval()
        out = []
        rows = self.x0.shape[0] if in_lockstep(model) else self.keep
        try:
            for s in range(0, rows, self.batch_size):
                e = min(s + self.batch_size, rows)
                x0, t, noise = (a[s:e] for a in (self.x0, self.t, self.noise))
                c = condition_rows(self.condition, s, e)
                out.append(per_sample_loss(self.objective, model, x0, c, t, noise))
        finally:
            model.train(was_training)
        return torch.cat(out)[: self.keep] if out else torch.zeros(0, device=self.x0.device)

    def summarize(self, losses: torch.Tensor, prefix: str) -> dict[str, float]:
        """``{prefix}/loss`` and ``{prefix}/loss_bucket/i`` (empty buckets left out) from the
        (N,) losses of all held-out images."""
        losses = losses.cpu()
        sums = torch.zeros(self.num_buckets).index_add_(0, self.buckets, losses)
        counts = torch.bincount(self.buckets, minlength=self.num_buckets)
        metrics = {f"{prefix}/loss": losses.mean().item()}
        for i, (s, c) in enumerate(zip(sums.tolist(), counts.tolist())):
            if c:
                metrics[f"{prefix}/loss_bucket/{i}"] = s / c
        return metrics

    def evaluate(self, model: nn.Module, ema_model: nn.Module) -> dict[str, float]:
        """Held-out metrics of the EMA (``heldout/...``) and/or raw (``heldout_raw/...``) weights
        on rank 0, {} on the others. Every rank must call it: each evaluates its shard."""
        metrics: dict[str, float] = {}
        for weights, prefix, net in (("ema", "heldout", ema_model), ("raw", "heldout_raw", model)):
            if self.weights in (weights, "both"):
                losses = distributed.gather_cat(self.per_sample(net), self.ctx)  # (N,) on rank 0
                if losses is not None:
                    metrics.update(self.summarize(losses, prefix))
        return metrics


class NoHeldOut:
    """No held-out split: evaluating gives no metrics."""

    def evaluate(self, model: nn.Module, ema_model: nn.Module) -> dict[str, float]:
        return {}


def build_heldout(dataset: Dataset | None, v: ValidationConfig, d: DataConfig, objective: Objective,
                  device: torch.device, ctx: DistContext | None = None, conditioning: Conditioning | None = None):
    """A :class:`HeldOutLoss` on ``dataset`` (this rank's shard of it), or a no-op when there is none."""
    if dataset is None:
        return NoHeldOut()
    return HeldOutLoss(dataset, v, d, objective, device, ctx=ctx, conditioning=conditioning)


def bucket_bounds(num_timesteps: int, num_buckets: int = 10) -> Iterator[tuple[int, int]]:
    """(first, last) timestep of each bucket ``(t * k) // T == i``."""
    for i in range(num_buckets):
        first = -(-i * num_timesteps // num_buckets)
        last = -(-(i + 1) * num_timesteps // num_buckets) - 1
        yield first, last
