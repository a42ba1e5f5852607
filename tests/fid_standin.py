"""A stand-in for the FID Inception network in tests: the real one runs at a few images per
second on a CPU. It sees what Inception would, (B, 3, 299, 299) in [-1, 1], pools it to 3x8x8 and
maps that to ``dim`` features with a fixed random matrix; saved as TorchScript, as the real one is."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from difftrain.evaluation import InceptionFeatures, WEIGHTS_ENV_VAR
from difftrain.evaluation import inception as inception_module


class StandInFeatures(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(192, dim, generator=torch.Generator().manual_seed(0)) / 14)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.adaptive_avg_pool2d(x, 8).reshape(x.shape[0], 192)
        return torch.tanh(pooled @ self.weight)


def write_standin(path: Path, dim: int) -> Path:
    """Save the stand-in of ``dim`` features as TorchScript at ``path``."""
    torch.jit.script(StandInFeatures(dim)).save(str(path))
    return path


def use_standin(monkeypatch, weights: Path, dim: int, cache: Path) -> None:
    """Make difftrain load the stand-in ``weights`` as its FID network (``dim`` features), with
    its caches in ``cache``."""
    monkeypatch.setattr(inception_module, "FEATURE_DIM", dim)
    monkeypatch.setattr(InceptionFeatures, "feature_dim", dim)
    monkeypatch.setenv(WEIGHTS_ENV_VAR, str(weights))
    monkeypatch.setenv("DIFFTRAIN_CACHE", str(cache))
