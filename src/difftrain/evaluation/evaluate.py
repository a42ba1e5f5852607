"""FID and KID of a model's samples: generated in batches, fed to Inception, never kept on disk.

An FID means little without how it was made, so every result carries the number of samples
and reference images, the sampler, its steps and network evaluations, EMA or raw weights, the
seed, the checkpoint step and what the samples were conditioned on (labels, captions, guidance),
and :func:`describe` never prints the number without them.

A class-conditional model's samples take labels drawn uniformly; a text model's take the captions
of training images drawn uniformly (the reference statistics are of those images, so their
captions give the same distribution); a latent model's are decoded by its VAE before Inception.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from difftrain.data.prepare import dataset_from_config
from difftrain.generation.autoguidance import with_guide
from difftrain.generation.inference import load_model, sampled_from
from difftrain.generation.sampling import generate, initial_noise, naming_samples, quantize
from difftrain.networks.conditioning import map_condition
from difftrain.runtime.progress import CountProgress
from difftrain.runtime.seeding import derive_seed

from .confetti import laplacian_energy, share_against
from .fid import compare
from .inception import InceptionFeatures
from .reference import reference_statistics
from .sample_check import CheckedInception, SampleCheck
from .stats import FeatureStats


class DatasetCaptions:
    """The captions of a captioned dataset (items ``(image or latent moments, caption)``) as a
    sequence, each read on first use and kept: a latent cache's from its targets, a dataset with a
    ``caption(i)`` method from it, any other from its item."""

    def __init__(self, dataset):
        self.dataset = dataset
        self._read: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> str:
        if i not in self._read:
            self._read[i] = self._caption(self.dataset, i)
        return self._read[i]

    @classmethod
    def _caption(cls, dataset, i: int) -> str:
        inner = getattr(dataset, "indices", None)  # a held-out split's IndexSubset
        if inner is not None and hasattr(dataset, "dataset"):
            return cls._caption(dataset.dataset, inner[i])
        targets = getattr(dataset, "targets", None)  # a LatentDataset: no moments read
        if isinstance(targets, list):
            return targets[i]
        if callable(getattr(dataset, "caption", None)):
            return dataset.caption(i)
        return dataset[i][1]


class FIDConditions:
    """What FID samples are conditioned on, drawn per batch from a generator seeded by (seed, k)
    alone, so any process draws batch k alike: nothing (unconditional), labels uniform over the
    classes, or the captions of training images drawn uniformly; with classifier-free guidance
    ``guidance_scale`` (1 = none). Latent models' samples are decoded by the conditioning's VAE.

    Args:
        conditioning: the run's :class:`~difftrain.networks.conditioning.Conditioning`.
        captions: a text model's captions to draw from (a sequence of str, e.g. :class:`DatasetCaptions`).
        captions_from: where they are from, for the record ("data.path builtin:shapes", a file).
    """

    def __init__(self, conditioning, *, captions: Sequence[str] | None = None, captions_from: str = "",
                 guidance_scale: float = 1.0):
        if conditioning.kind == "text" and (captions is None or len(captions) == 0):
            raise ValueError("FID of a text model needs captions to sample with: the training data's, or a file")
        if guidance_scale < 0:
            raise ValueError(f"the guidance scale must be >= 0, got {guidance_scale:g}")
        if conditioning.kind == "none" and guidance_scale != 1.0:
            raise ValueError(f"guidance scale {guidance_scale:g} given, but the model is unconditional")
        self.conditioning, self.captions, self.captions_from = conditioning, captions, captions_from
        self.guidance_scale = guidance_scale

    def draw(self, n: int, seed: int, k: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(condition, null condition) of batch k's ``n`` samples, on the CPU: labels (n,) and the
        null label (1,), text embeddings (n, L, D) and the empty caption's (1, L, D), or (None, None)."""
        c = self.conditioning
        gen = torch.Generator().manual_seed(derive_seed(seed, "fid-condition", k))
        if c.kind == "class":
            return torch.randint(c.num_classes, (n,), generator=gen), c.null(1)
        if c.kind == "text":
            device = next(c.text.parameters()).device
            rows = torch.randint(len(self.captions), (n,), generator=gen).tolist()
            cpu = lambda t: t.cpu()  # noqa: E731
            return (map_condition(cpu, c.prompts([self.captions[i] for i in rows], device)),
                    map_condition(cpu, c.null(1, device)))
        return None, None

    def generate_options(self) -> dict:
        """The keywords of :func:`difftrain.generation.sampling.generate` that decode a latent model's samples."""
        if self.conditioning.codec is None:
            return {}
        return {"decode": self.conditioning.decode, "clip": False}  # latents are not bounded to [-1, 1]

    def record(self) -> dict:
        """{"conditioned_on": ..., "guidance_scale": ...}: what a result must carry."""
        c = self.conditioning
        if c.kind == "class":
            what = f"labels uniform over {c.num_classes} classes"
        elif c.kind == "text":
            what = f"captions of {self.captions_from or 'the training data'} ({len(self.captions):,}), drawn uniformly"
        else:
            what = "nothing (unconditional)"
        out = {"conditioned_on": what, "guidance_scale": self.guidance_scale}
        if c.codec is not None:
            out["decoded_by"] = c.codec.source
        return out


def sample_pixels(
    model: nn.Module,
    *,
    objective,
    shape: tuple[int, int, int],
    num: int,
    sampler: str,
    steps: int,
    seed: int = 0,
    batch_size: int = 256,
    batches: Iterable[int] | None = None,
    conditions: FIDConditions | None = None,
    **sampler_options,
) -> Iterator[torch.Tensor]:
    """Batch k of ``num`` samples of ``model``, (n_k, C, H, W) uint8 as a PNG would store them,
    for each k of ``batches`` in turn (all of them by default). ``shape``: (C, H, W) the network
    works at (latents in a latent run); ``conditions``: what the samples are conditioned on and
    how they are decoded (None: unconditional pixels).

    Batch k holds samples ``k * batch_size`` onwards; its initial noise, its labels or captions
    and its sampler noise are seeded by (seed, k), so its samples depend on (seed, batch_size, k)
    alone: any process can draw any batch.
    """
    for k in range(num_batches(num, batch_size)) if batches is None else batches:
        n = min(batch_size, num - k * batch_size)
        noise = initial_noise(n, shape, derive_seed(seed, "fid-batch", k))
        condition, null, options = None, None, {}
        if conditions is not None:
            condition, null = conditions.draw(n, seed, k)
            options = {**conditions.generate_options(), "guidance_scale": conditions.guidance_scale}
        images = generate(model, objective=objective, noise=noise,
                          sampler=sampler, steps=steps, seed=derive_seed(seed, "fid-sampler", k),
                          condition=condition, null_condition=null,
                          batch_size=batch_size, **options, **sampler_options)
        yield quantize(images)


def sample_features(
    model: nn.Module,
    inception: InceptionFeatures,
    *,
    energies: list | None = None,
    keep: list | None = None,
    **options,
) -> Iterator[torch.Tensor]:
    """Inception features, (n_k, D) float32, of each batch of :func:`sample_pixels` (``options``:
    its keywords), the samples rounded to uint8 before Inception sees them. ``energies``: a list
    that gets each batch's Laplacian energies, (n_k,) float64 (``confetti.laplacian_energy``),
    for the confetti share; ``keep``: a list that gets each batch's pixels, on the CPU.
    """
    for pixels in sample_pixels(model, **options):
        if keep is not None:
            keep.append(pixels.cpu())
        if energies is not None:
            energies.append(laplacian_energy(pixels))
        yield inception(pixels)


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
    """Inception statistics of ``num`` samples of ``model``.

    The samples are those of :func:`sample_features` (``options``: its other keywords, objective,
    shape, seed, batch_size, conditions, ``keep`` and the sampler's options), so a result depends
    on (seed, batch_size), and memory stays at one batch unless ``keep`` asks for the samples.
    """
    if num < 2:
        raise ValueError(f"the number of samples must be >= 2 for a covariance, got {num}")
    energies: list = []
    features = sample_features(model, inception, num=num, sampler=sampler, steps=steps, energies=energies, **options)
    stats = statistics_from_features(features, inception, {"num_images": num, "sampler": sampler, "steps": steps})
    stats.energies = np.concatenate(energies)  # (num,) Laplacian energy of each sample
    return stats


def fid_result(samples: FeatureStats, reference: FeatureStats, /, *, kid: bool = True, **context) -> dict:
    """FID (and KID) of ``samples`` against ``reference``, with counts and ``context`` attached."""
    scores = compare(samples, reference, kid=kid)
    result = {"fid": scores["fid"], "num_samples": scores["count_a"], "num_reference": scores["count_b"]}
    share = share_against(samples.energies, reference.metadata)
    if share is not None:  # samples above the real images' 99th percentile of Laplacian energy
        result["confetti_share"] = share
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
    if "conditioned_on" in result:
        text += f"; conditioned on {result['conditioned_on']}"
        if result["conditioned_on"] != "nothing (unconditional)":
            text += f", guidance {result['guidance_scale']:g}"
    if "guide" in result:
        text += f"; autoguided by {result['guide']} (step {result['guide_step']}), weight {result['guide_weight']:g}"
    if "confetti_share" in result:
        text += f"; confetti {100 * result['confetti_share']:.1f}% (real images: 1%)"
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
    guidance_scale: float = 1.0,
    captions: str | Path | None = None,
    text_encoder: str | None = None,
    vae: str | None = None,
    memorization: str | None = None,
    guide: str | Path | None = None,
    guide_step: int | None = None,
    guide_weight: float = 2.0,
    **sampler_options,
) -> dict:
    """FID/KID of a checkpoint's samples against ``ref`` (an .npz or a folder), or, when ``ref``
    is None, against its training data through the training preprocessing (cached; ``ref_num``
    images, all by default). ``sampler`` None: the run's ``evaluation.fid_sampler``. With
    ``progress``, progress lines on stderr. Returns the JSON-able result (see :func:`describe`).

    A class-conditional model samples labels drawn uniformly; a text model the captions of its
    training data (``data.path`` of its config), or of ``captions`` (a file, one caption a line),
    drawn uniformly; both guided by ``guidance_scale``. A latent model's samples are decoded by its VAE.

    ``memorization`` ("pixels", "inception" or "clip"): also each sample's nearest training image
    in that space (the near-copy share, the median ratio) and the samples' diversity beside the
    training data's (evaluation/memorization.py, diversity.py), as ``result["memorization"]``.

    ``guide`` / ``guide_step``: autoguidance by that checkpoint or run, or by the checkpoint of that
    step of this run, with weight ``guide_weight`` (autoguidance.py); the result names the guide,
    and its ``nfe`` counts both networks."""
    start = time.perf_counter()
    loaded = load_model(checkpoint, use_ema=use_ema, device=device, text_encoder=text_encoder, vae=vae)
    loaded = with_guide(loaded, guide, guide_weight, guide_step=guide_step, use_ema=use_ema)
    guided = {} if loaded.guide is None else {"guide": loaded.guide, "guide_step": loaded.guide_step,
                                              "guide_weight": loaded.guide_weight}
    sampler = sampler or loaded.cfg.evaluation.fid_sampler
    d = loaded.cfg.data
    conditions = checkpoint_conditions(loaded, guidance_scale, captions)
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
    checked = _checked(inception, loaded, memorization)
    channels, size = loaded.conditioning.network_shape()
    with naming_samples(sampled_from(loaded)):  # NaN or inf samples: one line naming the checkpoint, no FID
        samples = sample_statistics(
            loaded.model, checked or inception, objective=loaded.objective, shape=(channels, size, size), num=num,
            sampler=sampler, steps=steps, seed=seed, batch_size=batch_size, conditions=conditions,
            progress=CountProgress("eval: samples", num, enabled=progress), **sampler_options)
    return fid_result(
        samples, reference, kid=kid, sampler=sampler, steps=steps, **guided,
        nfe=loaded.objective.sampler_nfe[sampler](steps) * (2 if guided and loaded.guide_weight not in (0, 1) else 1),
        sampler_options=sampler_options, ema=use_ema, seed=seed, batch_size=batch_size, **conditions.record(),
        checkpoint=loaded.path, checkpoint_step=loaded.step, reference=ref_source,
        inception=inception.metadata, seconds=round(time.perf_counter() - start, 1),
        **({"memorization": {**checked.result(), "memorization/space": memorization}} if checked else {}))


def _checked(inception: InceptionFeatures, loaded, space: str | None):
    """The FID network checking each sample against the training images in ``space``; None for no check."""
    if not space:
        return None
    cfg = dataclasses.replace(loaded.cfg, validation=dataclasses.replace(loaded.cfg.validation, memorization=space))
    dataset = dataset_from_config(_unmasked(loaded.cfg.data), augment=False)
    return CheckedInception(inception, SampleCheck(cfg, dataset, next(loaded.model.parameters()).device))


def _unmasked(data):
    """A run's ``DataConfig`` without ``data.masks``: evaluation reads its images (or captions), not their masks."""
    return dataclasses.replace(data, masks=False, references="", reference_column="")  # nor their reference images


def checkpoint_conditions(loaded, guidance_scale: float = 1.0, captions: str | Path | None = None) -> FIDConditions:
    """The :class:`FIDConditions` of a loaded model: a text model's captions from the file
    ``captions`` (one a line, blank lines skipped) or else from its training data."""
    c = loaded.conditioning
    if c.kind != "text":
        if captions is not None:
            raise ValueError("--captions given, but the model is not text-conditioned")
        return FIDConditions(c, guidance_scale=guidance_scale)
    if captions is not None:
        lines = [line.strip() for line in Path(captions).expanduser().read_text(encoding="utf-8").splitlines()]
        lines = [line for line in lines if line]
        if not lines:
            raise ValueError(f"--captions {captions} holds no captions (one per line)")
        return FIDConditions(c, captions=lines, captions_from=str(captions), guidance_scale=guidance_scale)
    dataset = dataset_from_config(_unmasked(loaded.cfg.data), augment=False)
    return FIDConditions(c, captions=DatasetCaptions(dataset), captions_from=f"data.path {loaded.cfg.data.path}",
                         guidance_scale=guidance_scale)
