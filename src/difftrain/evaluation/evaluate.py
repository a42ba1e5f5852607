"""FID and KID of a model's samples: generated in batches, fed to Inception, never kept on disk.

An FID means little without how it was made, so every result carries the number of samples
and reference images, the sampler, its steps and network evaluations, EMA or raw weights, the
seed and the checkpoint step, and :func:`describe` never prints the number without them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from difftrain.sampling import generate, initial_noise
from difftrain.runtime.seeding import derive_seed

from .fid import compare
from .inception import InceptionFeatures
from .reference import reference_statistics
from .stats import FeatureStats


def sample_features(
    model: nn.Module,
    inception: InceptionFeatures,
    *,
    objective,
    shape: tuple[int, int, int],
    num: int,
    sampler: str,
    steps: int,
    seed: int = 0,
    batch_size: int = 256,
    batches: Iterable[int] | None = None,
    **sampler_options,
) -> Iterator[torch.Tensor]:
    """Inception features, (n_k, D) float32, of batch k of ``num`` samples of ``model``
    (unconditional, shape (C, H, W)) for each k of ``batches`` in turn (all of them by default).

    Batch k holds samples ``k * batch_size`` onwards and starts from initial noise seeded by
    (seed, k), so its samples depend on (seed, batch_size, k) alone: any process can draw any
    batch. Samples are rounded to uint8, as a PNG would store them, before Inception sees them.
    """
    for k in range(num_batches(num, batch_size)) if batches is None else batches:
        n = min(batch_size, num - k * batch_size)
        noise = initial_noise(n, shape, derive_seed(seed, "fid-batch", k))
        images = generate(model, objective=objective, noise=noise,
                          sampler=sampler, steps=steps, seed=derive_seed(seed, "fid-sampler", k),
                          batch_size=batch_size, **sampler_options)
        yield inception(((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8))


def num_batches(num: int, batch_size: int) -> int:
    """Batches of at most ``batch_size`` that ``num`` samples take."""
    return -(-num // batch_size)


def statistics_from_features(features: Iterable[torch.Tensor], inception: InceptionFeatures,
                             metadata: dict) -> FeatureStats:
    """FeatureStats of feature batches (B, D), in order, with the network's metadata attached."""
    stats = FeatureStats(dim=inception.feature_dim, metadata={**inception.metadata, **metadata})
    for batch in features:
        stats.update(batch)
    return stats


def sample_statistics(
    model: nn.Module, inception: InceptionFeatures, *, num: int, sampler: str, steps: int, **options
) -> FeatureStats:
    """Inception statistics of ``num`` samples of ``model`` (unconditional).

    The samples are those of :func:`sample_features` (``options``: its other keywords, objective,
    shape, seed, batch_size and the sampler's options), so a result depends on
    (seed, batch_size), and memory stays at one batch.
    """
    if num < 2:
        raise ValueError(f"the number of samples must be >= 2 for a covariance, got {num}")
    features = sample_features(model, inception, num=num, sampler=sampler, steps=steps, **options)
    return statistics_from_features(features, inception,
                                    {"num_images": num, "sampler": sampler, "steps": steps})


def fid_result(samples: FeatureStats, reference: FeatureStats, /, *, kid: bool = True, **context) -> dict:
    """FID (and KID) of ``samples`` against ``reference``, with counts and ``context`` attached."""
    scores = compare(samples, reference, kid=kid)
    result = {"fid": scores["fid"], "num_samples": scores["count_a"], "num_reference": scores["count_b"]}
    if "kid_mean" in scores:
        result.update(kid_mean=scores["kid_mean"], kid_std=scores["kid_std"])
    return {**result, **context}


def describe(result: dict, a: str = "samples", b: str = "reference images") -> str:
    """One line: the FID with everything needed to read it; ``a`` and ``b`` name the two sides."""
    parts = [f"FID {result['fid']:.3f}"]
    if "kid_mean" in result:
        parts.append(f"KID {result['kid_mean'] * 1e3:.3f}e-3 +- {result['kid_std'] * 1e3:.3f}e-3")
    text = ", ".join(parts) + f" from {result['num_samples']:,} {a} vs {result['num_reference']:,} {b}"
    if "sampler" in result:
        weights = "EMA" if result.get("ema") else "raw"
        text += (f"; {result['sampler']} {result['steps']} steps ({result['nfe']} NFE), {weights} weights, "
                 f"seed {result['seed']}")
    if "checkpoint_step" in result:
        text += f", checkpoint step {result['checkpoint_step']}"
    return text


def evaluate_checkpoint(
    checkpoint: str | Path,
    *,
    num: int,
    sampler: str | None,
    steps: int,
    seed: int = 0,
    use_ema: bool = True,
    ref: str | None = None,
    ref_num: int | None = None,
    batch_size: int = 256,
    device: str = "auto",
    inception_path: str | None = None,
    kid: bool = True,
    progress: bool = False,
    **sampler_options,
) -> dict:
    """FID/KID of a checkpoint's samples against ``ref`` (an .npz or a folder), or, when ``ref``
    is None, against its training data through the training preprocessing (cached; ``ref_num``
    images, all by default). ``sampler`` None: the run's ``evaluation.fid_sampler``. With
    ``progress``, progress lines on stderr. Returns the JSON-able result (see :func:`describe`)."""
    from difftrain.inference import load_model
    from difftrain.runtime.progress import CountProgress

    start = time.perf_counter()
    loaded = load_model(checkpoint, use_ema=use_ema, device=device)
    sampler = sampler or loaded.cfg.evaluation.fid_sampler
    if loaded.num_classes:
        raise ValueError("eval samples unconditionally; class-conditional models are not supported yet")
    d = loaded.cfg.data
    inception = InceptionFeatures(inception_path).to(next(loaded.model.parameters()).device)
    if ref is not None and Path(ref).expanduser().is_file():
        reference, ref_source = FeatureStats.load(Path(ref).expanduser()), str(ref)
    elif ref is not None:
        reference, _, _ = reference_statistics(ref, inception, num=ref_num, progress=progress)
        ref_source = str(ref)
    else:
        reference, _, _ = reference_statistics(d.path, inception, resolution=d.resolution, channels=d.channels,
                                               num=ref_num, progress=progress)
        ref_source = f"{d.path} (training preprocessing, {d.resolution}px, {d.channels} channel(s))"
    samples = sample_statistics(
        loaded.model, inception, objective=loaded.objective,
        shape=(d.channels, d.resolution, d.resolution), num=num, sampler=sampler, steps=steps, seed=seed,
        batch_size=batch_size, progress=CountProgress("eval: samples", num, enabled=progress), **sampler_options)
    return fid_result(
        samples, reference, kid=kid, sampler=sampler, steps=steps, nfe=loaded.objective.sampler_nfe[sampler](steps),
        sampler_options=sampler_options, ema=use_ema, seed=seed, batch_size=batch_size,
        checkpoint=loaded.path, checkpoint_step=loaded.step, reference=ref_source,
        inception=inception.metadata, seconds=round(time.perf_counter() - start, 1))
