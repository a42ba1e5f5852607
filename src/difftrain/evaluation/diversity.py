"""Diversity of a set of images in a feature space, beside the training images' own.

The Vendi score (Friedman and Dieng 2023): exp of the entropy of the eigenvalues of K / n, where
K is the cosine-similarity matrix of n unit feature vectors. It is the effective number of
distinct images: n for n orthogonal features, 1 for n copies of one image. It grows with n, so
the data's figure is taken over the same number of training images (drawn with a fixed seed),
and the logged ``diversity/ratio`` (samples / data) is comparable from step to step.

Memory is bounded at any n (eval's 10,000 samples and beyond): nothing n x n is formed. The
Vendi score's kernel is linear (cosine of unit vectors), so the non-zero eigenvalues of
K / n = X X^T / n are those of the D x D matrix X^T X / n, accumulated ``CHUNK`` rows at a time
(exact: the same eigenvalues, float64). The mean pairwise distance (not squared: no closed form)
is summed over ``CHUNK`` x ``CHUNK`` tiles of the distance matrix in float64; it equals the
whole-matrix figure to float64 rounding (relative 1e-9 measured in tests/unit/test_diversity.py).
Extra memory: a D x D and a CHUNK x CHUNK float64 matrix (at most 32 MiB for D = 2048) plus one
chunk of rows, whatever n is; time stays O(n^2 D) for the distances.
"""

from __future__ import annotations

import numpy as np
import torch


CHUNK = 1024  # rows per block of X^T X and side of the distance tiles


def vendi_score(features: torch.Tensor, chunk: int = CHUNK) -> float:
    """features: (n, D) unit vectors -> the Vendi score in [1, n], from the eigenvalues of the
    smaller of X X^T / n (n x n) and X^T X / n (D x D), which share their non-zero eigenvalues."""
    n, dim = features.shape
    if n == 0:
        return 0.0
    if n <= dim:
        x = features.double()
        gram = x @ x.T
    else:
        gram = torch.zeros(dim, dim, dtype=torch.float64)
        for start in range(0, n, chunk):
            x = features[start:start + chunk].double()
            gram += x.T @ x
    eig = torch.linalg.eigvalsh(gram / n).clamp_min(0)
    eig = eig[eig > 1e-12]
    return float(torch.exp(-(eig * eig.log()).sum()))


def mean_pairwise_distance(features: torch.Tensor, chunk: int = CHUNK) -> float:
    """features: (n, D) -> their mean Euclidean distance over ordered pairs i != j (0 for n < 2),
    summed over ``chunk`` x ``chunk`` tiles in float64 (the diagonal's zeros included, as in the
    whole matrix)."""
    n = features.shape[0]
    if n < 2:
        return 0.0
    total = 0.0
    for i in range(0, n, chunk):
        a = features[i:i + chunk].double()
        for j in range(0, n, chunk):
            tile = torch.cdist(a, features[j:j + chunk].double())  # (chunk, chunk)
            if i == j:
                tile.fill_diagonal_(0)  # a point's distance to itself, exactly
            total += float(tile.sum())
    return total / (n * (n - 1))


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
