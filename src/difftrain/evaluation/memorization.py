"""Memorization: each sample's nearest training image in a feature space, and how near it is
compared with that training image's own nearest training neighbour.

For a sample q with nearest training image j (distance d(q, j)), the **ratio** is
``d(q, j) / d_train(j)``, where ``d_train(j)`` is the distance from j to its nearest *distinct*
training image. The denominator calibrates the threshold on the training set itself: a ratio of
1 is as near as the data's own neighbours are to one another; a sample is a **near-copy** when
its ratio is below ``NEAR_COPY_RATIO`` (0.5: twice as near as the data's own nearest
neighbour). In the ``pixels`` space, held-out CIFAR-10 images (16 px) have a median ratio of 1.02
(none below 0.5) and copies of training images a median of 0.00 (flipped, or shifted 2 px) to
0.26 (JPEG q=75; 97% below 0.5); see docs/monitoring.md for the measurement and where it fails.

**Duplicates.** Training sets hold duplicates (the same photo twice, an image and its mirror,
a re-saved copy), and duplicates are where memorization concentrates. A duplicate of j is not a
neighbour that says how dense the data is around j: it is j again, at distance ~0, and taking it
as ``d_train(j)`` would make every copy of j look far (ratio -> infinity: never flagged). So
training images within ``DUPLICATE_DISTANCE`` (0.03) of each other count as one image, and
``d_train(j)`` is the distance from j to its nearest training image *farther than that*. 0.03 is
1.5% of the unit sphere's diameter: above what makes one image's descriptors differ (float16
storage <= 3e-4; a mirror 1e-6 in the flip-invariant ``pixels`` space; JPEG q >= 90 of an image
of 64 px or more <= 0.024), below the nearest distinct neighbours of real data (CIFAR-10 at 16 px
and smooth random images: >= 0.49 in 99.9% of images). Distinct images nearer than that are
treated as one; copies of them are then judged against the next distinct neighbour. An image
whose every training neighbour is such a duplicate (a data set of one picture) has no scale: its
``d_train`` is the floor itself.

Feature spaces (:data:`FEATURE_SPACES`), all L2-normalised so distances lie in [0, 2]:

- ``pixels`` (the default to check copies with): a copy-detection style descriptor: the image
  area-resized to 16x16, its centre 12x12 averaged to 8x8 (which blurs away JPEG noise), each
  channel less its mean, made mirror-invariant by adding the descriptor of the flipped image,
  unit norm. A sample is searched at all 25 crop offsets, so a copy shifted by up to 2 px (at
  16 px) matches its original exactly. No network: indexing costs the decoding of the images.
- ``inception``: the FID Inception pool3 features (2048-d; evaluation.inception_path).
- ``clip``: the image tower of ``evaluation.clip_model``.

The training features are computed once and cached (:func:`training_index`) under a key of the
dataset (data/latents.py's fingerprint) and the feature network; a cache file that does not
hold what the key promises (truncated, another shape, non-finite) is rebuilt with one line. The
search is chunked matrix products over the float16 index read from a memory-mapped file: memory
is bounded by ``chunk x queries``, and the training images' own nearest-neighbour distances are
searched only for the training images that are some sample's nearest neighbour (no N x N search).
The distances reported are recomputed from the rows found (float32), not from the similarities
of the search (float16 on a GPU), so an exact copy is at distance ~0, below the floor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from difftrain.data.latents import dataset_fingerprint
from difftrain.generation.sampling import make_grid, quantize, to_uint8
from difftrain.runtime.files import atomic_write, atomic_write_bytes, cache_dir

from .clip_score import CLIPScorer
from .inception import InceptionFeatures

NEAR_COPY_RATIO = 0.5  # a sample is a near-copy when d(sample, NN) < this x d_train(NN)
CHUNK_ROWS = 65_536  # training features per matrix product in the search
PIXEL_SIZE = 8  # side of the pixel descriptor's image
SHIFT_SIZE = 16  # side at which a query's shifted views are taken (images are area-resized to it first)
MAX_SHIFT = 2  # pixels at SHIFT_SIZE: a query is also searched shifted by up to this in x and y
DUPLICATE_DISTANCE = 0.03  # training images nearer than this are one image (exact, mirrored or re-saved duplicates)
MAX_DUPLICATES = 4096  # duplicates of one image searched through for its nearest distinct neighbour


def pixel_descriptor(images: torch.Tensor, offset: tuple[int, int] = (MAX_SHIFT, MAX_SHIFT)) -> torch.Tensor:
    """(B, C, H, W) uint8 -> (B, C * 64) float32 unit vectors, the same for an image and its mirror.

    The image is area-resized to SHIFT_SIZE, cropped to SHIFT_SIZE - 2 MAX_SHIFT at ``offset``
    (the centre by default: the index), averaged to 8x8, each channel less its mean."""
    x = images.float() / 255
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    x = F.adaptive_avg_pool2d(x, SHIFT_SIZE)
    crop = SHIFT_SIZE - 2 * MAX_SHIFT
    x = x[..., offset[0]:offset[0] + crop, offset[1]:offset[1] + crop]
    x = F.adaptive_avg_pool2d(x, PIXEL_SIZE)
    x = x - x.mean(dim=(2, 3), keepdim=True)
    x = x + x.flip(-1)  # mirror-invariant: an image and its flip share one descriptor
    return F.normalize(x.reshape(x.shape[0], -1), dim=1)


def pixel_queries(images: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) uint8 -> (B, V, C * 64): the descriptor of every crop offset, so a copy shifted
    by up to MAX_SHIFT (at SHIFT_SIZE) matches its original's centre crop exactly (centre first)."""
    m = MAX_SHIFT
    offsets = [(m, m)] + [(y, x) for y in range(2 * m + 1) for x in range(2 * m + 1) if (y, x) != (m, m)]
    return torch.stack([pixel_descriptor(images, o) for o in offsets], 1)


class FeatureNetwork:
    """A feature space: ``name``, ``identity`` (what the cache key holds) and ``__call__``
    mapping (B, C, H, W) uint8 images to (B, D) unit vectors; ``queries`` maps them to the views
    a sample is searched with, (B, V, D) (V = 1 but in the pixel space, which tries crop offsets)."""

    def __init__(self, name: str, identity: str, fn: Callable[[torch.Tensor], torch.Tensor], dim: int,
                 views: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.name, self.identity, self.fn, self.dim, self.views = name, identity, fn, dim, views

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.fn(images).float().cpu(), dim=1)

    @torch.no_grad()
    def queries(self, images: torch.Tensor) -> torch.Tensor:
        if self.views is None:
            return self(images)[:, None]
        return F.normalize(self.views(images).float().cpu(), dim=-1)


def feature_network(space: str, *, inception_path: str = "", clip_model: str = "",
                    device: torch.device | str = "cpu") -> FeatureNetwork:
    """The feature network of ``space`` ("pixels", "inception", "clip"). A missing Inception
    file or CLIP package stops with the one line that says what to install."""
    if space == "pixels":
        return FeatureNetwork("pixels", f"pixels-{SHIFT_SIZE}-{MAX_SHIFT}-{PIXEL_SIZE}-mirror-v1",
                              pixel_descriptor, 3 * PIXEL_SIZE**2, views=pixel_queries)
    if space == "inception":
        net = InceptionFeatures(inception_path or None).to(device)
        return FeatureNetwork("inception", "inception-" + net.metadata["weights_sha1"], net, net.feature_dim)
    if space == "clip":
        if not clip_model:
            raise ValueError("validation.memorization='clip' needs evaluation.clip_model (a local CLIP folder)")
        scorer = CLIPScorer.from_path(clip_model).to(device)
        return FeatureNetwork("clip", "clip-" + str(Path(clip_model).expanduser().resolve()),
                              lambda images: scorer.image_embeddings(images.permute(0, 2, 3, 1)),
                              scorer.model.config.projection_dim)
    raise ValueError(f"unknown memorization feature space {space!r}; choose from {FEATURE_SPACES}")


FEATURE_SPACES = ("pixels", "inception", "clip")


@dataclasses.dataclass
class TrainingIndex:
    """The unit feature vectors of every training image: ``features`` (N, D) float16 (a memory
    map when loaded from the cache), and where they came from."""

    features: np.ndarray
    space: str
    path: Path | None = None

    def __len__(self) -> int:
        return self.features.shape[0]


def build_features(dataset, net: FeatureNetwork, batch_size: int = 256, indices=None) -> np.ndarray:
    """(N, D) float16 features of ``dataset``'s unaugmented items (``dataset[i][0]`` in [-1, 1])."""
    indices = range(len(dataset)) if indices is None else indices
    out = np.empty((len(indices), net.dim), dtype=np.float16)
    for start in range(0, len(indices), batch_size):
        batch = torch.stack([dataset[int(i)][0] for i in indices[start:start + batch_size]])
        out[start:start + len(batch)] = net(quantize(batch)).numpy().astype(np.float16)
    return out


def index_key(dataset, net: FeatureNetwork) -> str:
    """Cache key of the features of ``dataset`` in ``net``'s space (the latent cache's fingerprint)."""
    h = hashlib.sha256(f"memorization-v1|{net.identity}|{len(dataset)}|".encode())
    h.update(dataset_fingerprint(dataset).encode())
    return h.hexdigest()[:32]


def training_index(dataset, net: FeatureNetwork, *, folder: str | Path | None = None,
                   batch_size: int = 256) -> TrainingIndex:
    """The features of every training image, from the cache or computed once and cached
    (atomically: a reader never sees half a file)."""
    key = index_key(dataset, net)
    path = cache_dir("memorization", folder) / f"{key}.npy"
    if path.is_file():
        features, problem = load_index(path, len(dataset), net.dim)
        if features is not None:
            return TrainingIndex(features, net.name, path)
        print(f"difftrain: warning: memorization index {path} {problem}; rebuilding it", file=sys.stderr)
    features = build_features(dataset, net, batch_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        np.save(f, features)
    atomic_write_bytes(path.with_suffix(".json"), json.dumps(
        {"space": net.identity, "num_images": len(features), "dim": net.dim}).encode())
    return TrainingIndex(np.load(path, mmap_mode="r"), net.name, path)


def load_index(path: Path, num_images: int, dim: int, chunk: int = CHUNK_ROWS) -> tuple[np.ndarray | None, str]:
    """(the memory-mapped (num_images, dim) float16 index of ``path``, "") when the file holds
    exactly that, all finite; else (None, what is wrong with it). Never unpickles (numpy's
    allow_pickle is off): a crafted, truncated or mis-sized file is a reason, not an exception."""
    try:
        features = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:  # truncated, a header that lies about the size, not a .npy
        return None, f"cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'empty'})"
    want = (num_images, dim)
    if not isinstance(features, np.ndarray) or features.dtype != np.float16 or features.shape != want:
        got = f"{features.dtype} {features.shape}" if isinstance(features, np.ndarray) else type(features).__name__
        return None, f"holds {got}, not float16 {want}"
    for start in range(0, num_images, chunk):
        if not np.isfinite(features[start:start + chunk]).all():
            return None, "holds non-finite values"
    return features, ""


@torch.no_grad()
def nearest(queries: torch.Tensor, index: np.ndarray, k: int = 1, chunk: int = CHUNK_ROWS,
            device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` nearest rows of ``index`` (N, D) for each of ``queries`` (Q, D), all unit vectors:
    (distances (Q, k) float32, indices (Q, k) int64), nearest first. Chunks of ``chunk`` rows of
    the index at a time, so memory is O(chunk x Q) whatever N is. The rows are ranked by cosine
    similarity; their distances are then recomputed from the rows themselves in float32."""
    q = queries.to(device, torch.float32)
    k = min(k, index.shape[0])
    best_sim = torch.full((q.shape[0], k), -2.0, device=device)
    best_idx = torch.zeros((q.shape[0], k), dtype=torch.int64, device=device)
    dtype = torch.float16 if torch.device(device).type == "cuda" else torch.float32
    for start in range(0, index.shape[0], chunk):
        rows = torch.from_numpy(np.array(index[start:start + chunk])).to(device).to(dtype)  # a copy: the memmap is read-only
        sim = (q.to(dtype) @ rows.T).float()  # cosine similarity, (Q, chunk)
        top_sim, top_idx = sim.topk(min(k, sim.shape[1]), dim=1)
        merged_sim = torch.cat([best_sim, top_sim], 1)
        merged_idx = torch.cat([best_idx, top_idx + start], 1)
        best_sim, order = merged_sim.topk(k, dim=1)
        best_idx = merged_idx.gather(1, order)
    best_idx = best_idx.cpu()
    rows = torch.from_numpy(np.asarray(index[best_idx.flatten().numpy()], dtype=np.float32)).view(*best_idx.shape, -1)
    distance = (queries.float().cpu()[:, None] - rows).norm(dim=-1)  # (Q, k): exact, not through the similarity
    distance, order = distance.sort(dim=1)
    return distance, best_idx.gather(1, order)


def distinct_neighbour_distance(rows: np.ndarray, index: np.ndarray, floor: float = DUPLICATE_DISTANCE,
                                chunk: int = CHUNK_ROWS, device: torch.device | str = "cpu") -> torch.Tensor:
    """(R,) float32: for each of the training rows ``rows`` (R,) int64, the distance to its nearest
    row of ``index`` (N, D) farther than ``floor``: the rows within the floor (itself, its
    duplicates) are skipped. The search starts at 8 neighbours and widens 8-fold for the rows
    whose neighbours so far are all duplicates, up to MAX_DUPLICATES; a row with no distinct
    neighbour within that gets ``floor``."""
    own = torch.from_numpy(np.asarray(index[rows], dtype=np.float32))
    out = torch.full((len(rows),), float(floor))
    todo, k = torch.arange(len(rows)), 8
    while todo.numel():
        distance, _ = nearest(own[todo], index, k, chunk, device)
        far = distance > floor
        found = far.any(dim=1)
        first = far.int().argmax(dim=1)  # the first neighbour beyond the floor (distances sorted)
        out[todo[found]] = distance[found, first[found]]
        todo = todo[~found]
        if k >= min(index.shape[0], MAX_DUPLICATES):
            break
        k *= 8
    return out


@dataclasses.dataclass
class Memorization:
    """Per sample: the nearest training image, the distance to it and the ratio to that image's
    own nearest-neighbour distance."""

    neighbour: torch.Tensor  # (Q,) int64 index into the training set
    distance: torch.Tensor  # (Q,) float32
    ratio: torch.Tensor  # (Q,) float32
    threshold: float = NEAR_COPY_RATIO

    @property
    def near_copy(self) -> torch.Tensor:
        return self.ratio < self.threshold

    def metrics(self, prefix: str = "memorization") -> dict[str, float]:
        return {f"{prefix}/near_copy_share": float(self.near_copy.float().mean()),
                f"{prefix}/median_ratio": float(self.ratio.median()),
                f"{prefix}/median_distance": float(self.distance.median()),
                f"{prefix}/num_samples": int(self.ratio.numel())}


def memorization(queries: torch.Tensor, index: np.ndarray, threshold: float = NEAR_COPY_RATIO,
                 chunk: int = CHUNK_ROWS, device: torch.device | str = "cpu",
                 duplicate_distance: float = DUPLICATE_DISTANCE) -> Memorization:
    """Nearest training image and ratio of each query against ``index`` (N, D), N >= 2.

    queries: (Q, D), or (Q, V, D) views of each query (shifts; the nearest view counts).
    The denominators ``d_train(j)`` are searched for the distinct neighbours j only: the distance
    from j's row to its nearest row farther than ``duplicate_distance`` (j itself and its
    duplicates are one image; see the module's docstring)."""
    if index.shape[0] < 2:
        raise ValueError("the memorization check needs at least 2 training images")
    if queries.ndim == 2:
        queries = queries[:, None]
    q, v = queries.shape[:2]
    distance, idx = nearest(queries.flatten(0, 1), index, 1, chunk, device)
    distance, view = distance[:, 0].reshape(q, v).min(dim=1)
    idx = idx[:, 0].reshape(q, v).gather(1, view[:, None])[:, 0]
    unique, inverse = idx.unique(return_inverse=True)
    d_train = distinct_neighbour_distance(unique.numpy(), index, duplicate_distance, chunk, device)[inverse]
    ratio = distance / d_train.clamp_min(1e-6)
    return Memorization(idx, distance, ratio, threshold)


def neighbour_grid(samples: np.ndarray, dataset, result: Memorization, max_pairs: int = 32) -> np.ndarray:
    """(H', W', C) uint8: each sample beside its nearest training image, pairs nearest first, a
    red bar under the near-copies. samples: (Q, H, W, C) uint8."""
    order = result.ratio.argsort()[:max_pairs]
    tiles = []
    for i in order.tolist():
        train = to_uint8(dataset[int(result.neighbour[i])][0][None])[0]
        sample = samples[i]
        if train.shape != sample.shape:  # a grayscale side, or another resolution
            train = np.broadcast_to(train, sample.shape) if train.shape[:2] == sample.shape[:2] else \
                np.zeros_like(sample)
        pair = np.concatenate([sample, train], axis=1)
        if result.near_copy[i]:
            pair = pair.copy()
            pair[-1, :, :] = 0
            pair[-1, :, 0] = 255
        tiles.append(pair)
    return make_grid(np.stack(tiles), ncols=4)
