"""Streaming feature statistics (mean, covariance, a kept sample of features) and their files."""

from __future__ import annotations

import json
import os

import numpy as np
import torch


class FeatureStats:
    """Accumulates features batch by batch: float64 mean and covariance, plus a sample for KID.

    Mean and covariance are merged per batch with the pairwise update of Chan, Golub and
    LeVeque (1979), which stays accurate where sum(x x^T) - n mu mu^T would cancel. `cov` is
    the unbiased (n - 1) covariance, as np.cov and pytorch-fid use.

    Up to `max_features` raw features are kept (float32) for KID. Once more have been seen,
    the kept ones are a uniform random sample of all of them (reservoir sampling, Vitter's
    Algorithm R, seeded by `seed`), so a folder sorted by class is not cut to its first
    classes. `max_features=0` keeps none.
    """

    def __init__(self, dim: int = 2048, max_features: int = 10_000, seed: int = 0,
                 metadata: dict | None = None):
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if max_features < 0:
            raise ValueError(f"max_features must be >= 0, got {max_features}")
        self.dim = dim
        self.max_features = max_features
        self.metadata = dict(metadata or {})  # how the features were made; saved as JSON
        self._count: int | None = 0  # None: loaded from a file that did not record it
        self._mean = np.zeros(dim)  # (dim,) float64
        self._m2 = np.zeros((dim, dim))  # sum of (x - mean)(x - mean)^T, float64
        self._kept: list[np.ndarray] = []  # chunks of (k, dim) float32, concatenated lazily
        self._rng = np.random.default_rng(seed)
        # (N,) Laplacian energy of each image, for the confetti share (``confetti.share_against``);
        # set for generated samples, not saved.
        self.energies: np.ndarray = np.zeros(0)

    @property
    def count(self) -> int | None:
        """Number of feature vectors seen (None for stats loaded without a count)."""
        return self._count

    @property
    def mean(self) -> np.ndarray:
        """(dim,) float64 mean."""
        if self._count == 0:
            raise ValueError("no features added yet")
        return self._mean.copy()

    @property
    def cov(self) -> np.ndarray:
        """(dim, dim) float64 unbiased covariance."""
        if self._count is None:  # loaded without a count: _m2 holds sigma itself
            return self._m2.copy()
        if self._count < 2:
            raise ValueError(f"covariance needs at least 2 features, have {self._count}")
        return self._m2 / (self._count - 1)

    @property
    def features(self) -> np.ndarray | None:
        """(k, dim) float32 kept features, k <= max_features; None if none are kept."""
        if not self._kept:
            return None
        if len(self._kept) > 1:
            self._kept = [np.concatenate(self._kept)]
        return self._kept[0]

    def update(self, features: torch.Tensor | np.ndarray) -> None:
        """Add a batch of features, (B, dim)."""
        if self._count is None:
            raise ValueError("cannot add features to statistics loaded without a count")
        if isinstance(features, torch.Tensor):
            features = features.detach().to("cpu", torch.float64).numpy()
        x = np.asarray(features, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"features must be (B, {self.dim}), got shape {x.shape}")
        if not np.isfinite(x).all():
            raise ValueError("features contain NaN or inf")
        nb = x.shape[0]
        if nb == 0:
            return
        # Merge mean and M2 of the batch into the running ones (Chan et al. 1979).
        na = self._count
        n = na + nb
        batch_mean = x.mean(axis=0)
        centred = x - batch_mean
        delta = batch_mean - self._mean
        self._mean += delta * (nb / n)
        self._m2 += centred.T @ centred + np.outer(delta, delta) * (na * nb / n)
        self._keep(x.astype(np.float32), seen_before=na)
        self._count = n

    def _keep(self, x: np.ndarray, seen_before: int) -> None:
        """Reservoir-sample rows of x (B, dim) into the kept features."""
        cap = self.max_features
        kept = sum(len(chunk) for chunk in self._kept)
        free = min(cap - kept, len(x))
        if free > 0:
            self._kept.append(x[:free].copy())
            x, seen_before = x[free:], seen_before + free
        if len(x) == 0:
            return
        # Item number t (0-based) replaces a random slot with probability cap / (t + 1).
        t = seen_before + np.arange(len(x))
        slots = self._rng.integers(0, t + 1)
        reservoir = self.features
        for row in np.nonzero(slots < cap)[0]:
            reservoir[slots[row]] = x[row]

    def save(self, path, include_features: bool = True) -> None:
        """Write an .npz: mu, sigma, count, optionally features, and metadata (JSON string).

        mu and sigma are named as in pytorch-fid's statistics files, so those tools can read
        the mean and covariance too.
        """
        arrays = {
            "mu": self.mean,
            "sigma": self.cov,
            "count": np.int64(-1 if self._count is None else self._count),
            "metadata": np.array(json.dumps(self.metadata, sort_keys=True)),
        }
        if include_features and self.features is not None:
            arrays["features"] = self.features
        if hasattr(path, "write"):  # an open binary file
            np.savez(path, **arrays)
            return
        with open(path, "wb") as f:  # a file object keeps np.savez from appending ".npz"
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike, max_features: int | None = None,
             seed: int = 0) -> FeatureStats:
        """Read a file written by `save`, or a pytorch-fid statistics file (mu, sigma only).

        The result can take further `update`s when the file recorded its count. The kept
        features stay a uniform sample of everything counted: a file saved without features
        keeps none afterwards (max_features becomes 0), and a file holding a sample of its
        count keeps at most that many.
        """
        with np.load(path, allow_pickle=False) as f:
            missing = {"mu", "sigma"} - set(f.files)
            if missing:
                raise ValueError(f"{path} is not a statistics file: no {sorted(missing)}")
            mu = f["mu"].astype(np.float64)
            sigma = f["sigma"].astype(np.float64)
            count = int(f["count"]) if "count" in f.files else -1
            features = f["features"] if "features" in f.files else None
            metadata = json.loads(str(f["metadata"])) if "metadata" in f.files else {}
        if mu.ndim != 1 or sigma.shape != (mu.size, mu.size):
            raise ValueError(f"{path}: mu {mu.shape} and sigma {sigma.shape} do not match")
        if features is None and count != 0:
            max_features = 0
        elif max_features is None:
            max_features = max(10_000, 0 if features is None else len(features))
        if features is not None and count > len(features):  # a reservoir: keep it the sample
            max_features = min(max_features, len(features))
        stats = cls(dim=mu.size, max_features=max_features, seed=seed, metadata=metadata)
        stats._mean = mu
        if count < 0:
            stats._count, stats._m2 = None, sigma
        else:
            stats._count, stats._m2 = count, sigma * max(count - 1, 0)
        if features is not None and max_features > 0:
            if len(features) > max_features:  # a uniform subsample, not the first rows
                rows = np.sort(stats._rng.choice(len(features), max_features, replace=False))
                features = features[rows]
            stats._kept = [features.astype(np.float32)]
        return stats

    def __repr__(self) -> str:
        kept = 0 if self.features is None else len(self.features)
        return f"FeatureStats(dim={self.dim}, count={self._count}, kept_features={kept})"
