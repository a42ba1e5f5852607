"""FID during training: every ``evaluation.fid_every_steps`` steps, on the EMA model, logged
together with the sample count it was measured on (FID is biased upwards at small counts)."""

from __future__ import annotations

import time

import torch
from torch import nn

from difftrain.config import Config

from .evaluate import fid_result, sample_statistics


class TrainingFID:
    """Call ``fid(step, ema_model)`` after each step; it returns metrics to log at evaluation
    steps and {} otherwise. A disabled one (fid_every_steps = 0) does nothing and loads nothing.

    The Inception network and the reference statistics are loaded at the first evaluation; the
    reference is ``evaluation.fid_ref`` (an .npz or a folder), or else the training data through
    the training preprocessing (cached by content, see evaluation.reference).
    """

    def __init__(self, cfg: Config, alpha_bar: torch.Tensor, device: torch.device):
        self.cfg, self.alpha_bar, self.device = cfg, alpha_bar, device
        self.every = cfg.evaluation.fid_every_steps
        self._inception = None
        self._reference = None

    def _setup(self) -> None:
        from .inception import InceptionFeatures
        from .reference import load_or_compute, reference_statistics

        e, d = self.cfg.evaluation, self.cfg.data
        self._inception = InceptionFeatures(e.inception_path or None).to(self.device)
        if e.fid_ref:
            self._reference = load_or_compute(e.fid_ref, self._inception)
        else:
            self._reference, _, _ = reference_statistics(
                d.path, self._inception, resolution=d.resolution, channels=d.channels,
                num=e.fid_ref_num or None)

    def __call__(self, step: int, ema_model: nn.Module) -> dict[str, float]:
        if not self.every or step % self.every != 0:
            return {}
        start = time.perf_counter()
        if self._inception is None:
            self._setup()
        e, d = self.cfg.evaluation, self.cfg.data
        samples = sample_statistics(
            ema_model, self._inception, alpha_bar=self.alpha_bar, prediction=self.cfg.diffusion.prediction,
            shape=(d.channels, d.resolution, d.resolution), num=e.fid_num_samples, sampler=e.fid_sampler,
            steps=e.fid_steps, seed=e.fid_seed, batch_size=e.fid_batch_size)
        result = fid_result(samples, self._reference, kid=False)
        return {"fid": result["fid"], "fid_num_samples": result["num_samples"],
                "fid_num_reference": result["num_reference"], "fid_steps": e.fid_steps,
                "fid_seconds": time.perf_counter() - start}
