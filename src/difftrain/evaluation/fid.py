"""FID and KID between two sets of Inception features, and the drivers that extract them."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from difftrain.generation.sampling import is_sample_grid

from .confetti import REFERENCE_PERCENTILE, THRESHOLD_KEY, laplacian_energy
from .inception import InceptionFeatures
from .stats import FeatureStats

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")  # read by image_folder_statistics
_METADATA_KEYS_THAT_MUST_MATCH = ("network", "weights_sha1", "resize", "preprocessing")
_EPS64 = np.finfo(np.float64).eps


def _trace_sqrt_product(sigma1: np.ndarray, sigma2: np.ndarray) -> float:
    """tr sqrt(sigma1 sigma2) for symmetric PSD sigmas (d, d).

    Factor sigma1 = u u^T with u = V sqrt(W) (d, r) from its eigendecomposition, keeping the
    r eigenvalues above round-off. The non-zero eigenvalues of sigma1 sigma2 = u (u^T sigma2)
    are those of the symmetric PSD (r, r) matrix u^T sigma2 u, so tr sqrt(sigma1 sigma2) is
    the sum of their square roots. Eigenvalues below the round-off tolerance
    d * eps * |sigma1| * |sigma2| count as 0: they cannot be told from 0 in float64, and
    dropping them keeps the d - n noise eigenvalues of a rank-n covariance from adding up.
    An eigenvalue clearly below 0 means a sigma is not a covariance, which raises.
    """
    # torch.linalg (LAPACK from MKL in the CPU wheels) is several times faster than
    # numpy's OpenBLAS here for d = 2048; both run in float64.
    d = sigma1.shape[0]
    a, b = torch.from_numpy(sigma1), torch.from_numpy(sigma2)
    w1, v1 = torch.linalg.eigh(a)
    scale1 = max(float(w1.abs().max()), np.finfo(np.float64).tiny)
    _check_eigenvalues(w1, scale1, "sigma1")
    keep = w1 > d * _EPS64 * scale1
    u = v1[:, keep] * w1[keep].sqrt()  # (d, r), sigma1 = u u^T
    m = u.T @ b @ u  # (r, r); for a rank-deficient sigma1 this is the small problem
    w = torch.linalg.eigvalsh((m + m.T) / 2)
    scale = scale1 * max(float(torch.linalg.norm(b)), np.finfo(np.float64).tiny)
    if len(w) == 0:  # sigma1 == 0
        return 0.0
    _check_eigenvalues(w, scale, "sigma2")  # by Sylvester's law of inertia when sigma1 is PD
    return float(w[w > d * _EPS64 * scale].sqrt().sum())


def _check_eigenvalues(w: torch.Tensor, scale: float, name: str) -> None:
    """Raise if an eigenvalue is negative beyond round-off (relative to scale)."""
    if not torch.isfinite(w).all():
        raise np.linalg.LinAlgError(f"non-finite eigenvalues for {name}")
    if float(w.min()) < -1e-8 * scale:
        raise ValueError(f"{name} is not positive semi-definite (eigenvalue {float(w.min()):.3g} "
                         f"against a largest of {scale:.3g})")


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray,
                     sigma2: np.ndarray, eps: float = 1e-6) -> float:
    """Frechet distance between N(mu1, sigma1) and N(mu2, sigma2), in float64.

    d^2 = |mu1 - mu2|^2 + tr(sigma1) + tr(sigma2) - 2 tr sqrt(sigma1 sigma2)
    (Dowson and Landau 1982; FID, Heusel et al. 2017). mu: (d,), sigma: (d, d).

    The trace term is computed from the eigenvalues of a symmetric PSD matrix similar to
    sigma1 sigma2 restricted to the range of sigma1 (see `_trace_sqrt_product`) instead of
    a general sqrtm of the non-symmetric product (pytorch-fid's scipy.linalg.sqrtm), so
    singular covariances (fewer samples than dimensions) need no offset: eigenvalues under
    the round-off tolerance count as 0. As pytorch-fid does when its sqrtm is not finite,
    `eps * I` is added to both covariances (in the cross term only) and the trace
    recomputed if the eigendecomposition fails or yields a non-finite value.
    """
    mu1 = np.atleast_1d(np.asarray(mu1, np.float64))
    mu2 = np.atleast_1d(np.asarray(mu2, np.float64))
    sigma1 = np.atleast_2d(np.asarray(sigma1, np.float64))
    sigma2 = np.atleast_2d(np.asarray(sigma2, np.float64))
    d = mu1.shape[0]
    if mu1.shape != (d,) or mu2.shape != (d,) or sigma1.shape != (d, d) or sigma2.shape != (d, d):
        raise ValueError(f"shapes do not match: mu1 {mu1.shape}, sigma1 {sigma1.shape}, "
                         f"mu2 {mu2.shape}, sigma2 {sigma2.shape}")
    for name, a in (("mu1", mu1), ("sigma1", sigma1), ("mu2", mu2), ("sigma2", sigma2)):
        if not np.isfinite(a).all():
            raise ValueError(f"{name} contains NaN or inf")
    for name, sigma in (("sigma1", sigma1), ("sigma2", sigma2)):
        if np.abs(sigma - sigma.T).max() > 1e-8 * max(float(np.abs(sigma).max()), 1e-300):
            raise ValueError(f"{name} is not symmetric")
    try:
        tr_covmean = _trace_sqrt_product(sigma1, sigma2)
    except (np.linalg.LinAlgError, torch.linalg.LinAlgError):
        tr_covmean = float("nan")
    if not np.isfinite(tr_covmean):
        offset = np.eye(d) * eps
        tr_covmean = _trace_sqrt_product(sigma1 + offset, sigma2 + offset)
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * tr_covmean)


def _as_float64(features: torch.Tensor | np.ndarray, name: str) -> torch.Tensor:
    """(n, d) features as a float64 CPU tensor."""
    x = torch.as_tensor(features).detach().to("cpu", torch.float64)
    if x.ndim != 2:
        raise ValueError(f"{name} must be (n, d), got shape {x.shape}")
    return x


def kernel_inception_distance(feats1: torch.Tensor | np.ndarray,
                              feats2: torch.Tensor | np.ndarray, subset_size: int = 1000,
                              num_subsets: int = 100, seed: int = 0) -> tuple[float, float]:
    """KID (Binkowski et al. 2018): unbiased MMD^2 with the kernel k(x, y) = (x.y / d + 1)^3.

    feats1: (n1, d), feats2: (n2, d). For each of `num_subsets` rounds, m rows are drawn
    without replacement from each set and the unbiased MMD^2 estimate is taken:
      sum_{i!=j} k(x_i, x_j) / (m(m-1)) + sum_{i!=j} k(y_i, y_j) / (m(m-1))
      - 2 sum_{i,j} k(x_i, y_j) / m^2.
    Returns (mean, std) over the rounds (std with ddof=0, as torch-fidelity and clean-fid).
    m = min(subset_size, n1, n2): like clean-fid and StyleGAN2-ADA, the subset is clipped to
    the smaller set rather than refused. Subsets come from np.random.default_rng(seed).
    The unbiased estimate can be slightly negative when the distributions match.
    """
    x, y = _as_float64(feats1, "feats1"), _as_float64(feats2, "feats2")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"feature sizes differ: {x.shape[1]} and {y.shape[1]}")
    if subset_size < 2 or num_subsets < 1:
        raise ValueError(f"need subset_size >= 2 and num_subsets >= 1, got {subset_size}, "
                         f"{num_subsets}")
    m = min(subset_size, len(x), len(y))
    if m < 2:
        raise ValueError(f"KID needs at least 2 features on each side, got {len(x)} and {len(y)}")
    d = x.shape[1]
    rng = np.random.default_rng(seed)
    mmd2 = np.empty(num_subsets)
    for i in range(num_subsets):
        xs = x[torch.from_numpy(rng.choice(len(x), m, replace=False))]
        ys = y[torch.from_numpy(rng.choice(len(y), m, replace=False))]
        k_xx = (xs @ xs.T / d + 1) ** 3
        k_yy = (ys @ ys.T / d + 1) ** 3
        k_xy = (xs @ ys.T / d + 1) ** 3
        within = (k_xx.sum() - k_xx.trace() + k_yy.sum() - k_yy.trace()) / (m * (m - 1))
        mmd2[i] = float(within - 2 * k_xy.sum() / (m * m))
    return float(mmd2.mean()), float(mmd2.std())


def statistics_from_images(batches: Iterable[torch.Tensor], inception: InceptionFeatures,
                           max_features: int = 10_000, seed: int = 0,
                           metadata: dict | None = None) -> FeatureStats:
    """Feature statistics of images given as batches, e.g. generated samples.

    batches: iterable of (B, 3 or 1, H, W) uint8 (or float in [0, 255]) tensors, any size;
    they are moved to the inception network's device. max_features / seed: the KID sample
    kept by FeatureStats.
    """
    stats = FeatureStats(dim=inception.feature_dim, max_features=max_features, seed=seed,
                         metadata={**inception.metadata, **(metadata or {})})
    energies = []  # the confetti threshold of these (real) images, kept in the metadata
    for images in batches:
        stats.update(inception(images))
        if images.dtype == torch.uint8:
            energies.append(laplacian_energy(images))
    if stats.count == 0:
        raise ValueError("no images were given")
    if energies:
        stats.metadata[THRESHOLD_KEY] = float(np.percentile(np.concatenate(energies), REFERENCE_PERCENTILE))
    return stats


class _ImageFiles(torch.utils.data.Dataset):
    """Image files as (3, H, W) uint8 tensors, read with Pillow and converted to RGB."""

    def __init__(self, paths: list[Path]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        with Image.open(self.paths[i]) as image:
            if image.mode.startswith(("I", "F")):  # Pillow's RGB conversion clips these to 255
                raise ValueError(f"{self.paths[i]} is a {image.mode} (16/32-bit) image; FID "
                                 "reads 8-bit images, so convert it to 8 bits first")
            array = np.asarray(image.convert("RGB"))  # (H, W, 3) uint8
        return torch.from_numpy(array.copy()).permute(2, 0, 1)


def list_images(folder: str | os.PathLike) -> list[Path]:
    """Image files under folder (recursively), sorted, with an extension in IMAGE_EXTENSIONS.

    Names starting with "." are skipped, files and folders alike (macOS "._x.png" forks,
    .ipynb_checkpoints), as difftrain.data does for training images; so is the grid that
    ``difftrain sample`` writes among its samples (``grid.png`` with its text chunk).
    """
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist or is not a folder")
    return sorted(p for p in root.rglob("*")
                  if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(root).parts)
                  and not is_sample_grid(p))


def _same_size_runs(images: list[torch.Tensor]) -> Iterable[torch.Tensor]:
    """Stack consecutive images of equal size into batches, keeping their order."""
    start = 0
    for end in range(1, len(images) + 1):
        if end == len(images) or images[end].shape != images[start].shape:
            yield torch.stack(images[start:end])
            start = end


def image_folder_statistics(folder: str | os.PathLike, inception: InceptionFeatures,
                            batch_size: int = 50, device: torch.device | str | None = None,
                            num_workers: int = 0, max_features: int = 10_000,
                            seed: int = 0) -> FeatureStats:
    """Feature statistics of every image under folder (png, jpg, jpeg, webp, bmp; recursive).

    Images are read with Pillow, converted to RGB and fed as uint8 at their native size; the
    network resizes them (see inception.preprocess_for_inception). Images of mixed sizes are
    allowed; 16- and 32-bit images raise (Pillow's RGB conversion would clip them).
    device: moves `inception` there first (in place) if given. The folder path and image
    count are added to the metadata.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    paths = list_images(folder)
    if not paths:
        raise ValueError(f"image folder {folder} holds 0 images "
                         f"(looked for {', '.join(IMAGE_EXTENSIONS)})")
    if device is not None:
        inception.to(device)
    loader = torch.utils.data.DataLoader(_ImageFiles(paths), batch_size=batch_size,
                                         num_workers=num_workers, collate_fn=list)
    batches = (run for images in loader for run in _same_size_runs(images))
    return statistics_from_images(batches, inception, max_features=max_features, seed=seed,
                                  metadata={"source": str(Path(folder).resolve()),
                                            "num_images": len(paths)})


def compare(a: FeatureStats, b: FeatureStats, kid: bool = True, subset_size: int = 1000,
            num_subsets: int = 100, seed: int = 0) -> dict:
    """FID (and KID when both sides kept features) between two sets of statistics.

    Returns {"fid", "count_a", "count_b"} plus "kid_mean" and "kid_std" when `kid` is set
    and both a and b have features. KID with the defaults (100 subsets of 1000 in 2048-d)
    costs tens of seconds on a 2-core CPU (kid=False skips it); FID, one 2048 x 2048
    eigendecomposition, a few seconds. Raises if both record how their
    features were made and the records differ (another network, resize or preprocessing
    gives numbers that are not comparable).
    """
    for key in _METADATA_KEYS_THAT_MUST_MATCH:
        if key in a.metadata and key in b.metadata and a.metadata[key] != b.metadata[key]:
            raise ValueError(f"statistics were made differently ({key}: "
                             f"{a.metadata[key]!r} vs {b.metadata[key]!r}); FID would not be "
                             "comparable")
    result = {"fid": frechet_distance(a.mean, a.cov, b.mean, b.cov),
              "count_a": a.count, "count_b": b.count}
    if kid and a.features is not None and b.features is not None:
        result["kid_mean"], result["kid_std"] = kernel_inception_distance(
            a.features, b.features, subset_size=subset_size, num_subsets=num_subsets,
            seed=seed)
    return result
