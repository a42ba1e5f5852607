"""Diversity of a set of images in a feature space, beside the training images' own.

The Vendi score (Friedman and Dieng 2023): exp of the entropy of the eigenvalues of K / n, where
K is the cosine-similarity matrix of n unit feature vectors. It is the effective number of
distinct images: n for n orthogonal features, 1 for n copies of one image. It grows with n, so
the data's figure is taken over the same number of training images (drawn with a fixed seed),
and the logged ``diversity/ratio`` (samples / data) is comparable from step to step.
"""

from __future__ import annotations

import numpy as np
import torch


def vendi_score(features: torch.Tensor) -> float:
    """features: (n, D) unit vectors -> the Vendi score in [1, n]."""
    x = features.double()
    n = x.shape[0]
    if n == 0:
        return 0.0
    # The non-zero eigenvalues of X X^T / n are those of X^T X / n: take the smaller matrix.
    gram = x @ x.T if n <= x.shape[1] else x.T @ x
    eig = torch.linalg.eigvalsh(gram / n).clamp_min(0)
    eig = eig[eig > 1e-12]
    return float(torch.exp(-(eig * eig.log()).sum()))


def mean_pairwise_distance(features: torch.Tensor) -> float:
    """features: (n, D) unit vectors -> their mean Euclidean distance over pairs (0 for n < 2)."""
    n = features.shape[0]
    if n < 2:
        return 0.0
    d = torch.cdist(features.double(), features.double())
    return float(d.sum() / (n * (n - 1)))


def data_features(index: np.ndarray, n: int, seed: int = 0) -> torch.Tensor:
    """(n, D) float32: ``n`` rows of the training index drawn without replacement with ``seed``."""
    rows = np.sort(np.random.default_rng(seed).choice(index.shape[0], min(n, index.shape[0]), replace=False))
    return torch.from_numpy(index[rows].astype(np.float32))


def diversity(features: torch.Tensor, reference: torch.Tensor, groups: list[int] | None = None,
              prefix: str = "diversity") -> dict[str, float]:
    """The Vendi score and mean pairwise distance of ``features`` (n, D) beside ``reference``'s
    (the same count of training images), and their ratio. ``groups``: sizes of consecutive
    groups (a text run's rows, one prompt each): each group's Vendi score is logged as
    ``{prefix}/prompt_i`` and their mean as ``{prefix}/per_prompt``."""
    out = {f"{prefix}/vendi": vendi_score(features), f"{prefix}/vendi_data": vendi_score(reference),
           f"{prefix}/pairwise": mean_pairwise_distance(features),
           f"{prefix}/pairwise_data": mean_pairwise_distance(reference)}
    out[f"{prefix}/ratio"] = out[f"{prefix}/vendi"] / max(out[f"{prefix}/vendi_data"], 1e-12)
    if groups and len(groups) > 1:
        scores, start = [], 0
        for i, size in enumerate(groups):
            scores.append(vendi_score(features[start:start + size]))
            out[f"{prefix}/prompt_{i}"] = scores[-1]
            start += size
        out[f"{prefix}/per_prompt"] = float(np.mean(scores))
    return out
