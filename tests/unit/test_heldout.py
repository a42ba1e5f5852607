"""The held-out split and loss: deterministic, disjoint, frozen, stratified."""

from __future__ import annotations

import torch

from difftrain.config import load_config
from difftrain.data import build_dataset
from difftrain.models import build_model
from difftrain.data.split import heldout_indices, split_heldout
from difftrain.diffusion.objective import DDPMObjective, build_objective
from difftrain.training.heldout import HeldOutLoss, bucket_bounds


def test_split_is_deterministic_disjoint_and_complete(tiny_overrides):
    cfg = load_config(None, tiny_overrides + ["data.heldout_fraction=0.1"])
    build = lambda p: None  # noqa: E731
    full = build_dataset("builtin:shapes", resolution=16, channels=3, random_flip=False, color_jitter=0.0, class_conditional=False)
    train_a, held_a = split_heldout(full, cfg.data, cfg.train.seed, build)
    train_b, held_b = split_heldout(full, cfg.data, cfg.train.seed, build)
    assert held_a.indices == held_b.indices
    assert len(held_a) == round(0.1 * len(full))
    assert set(train_a.indices).isdisjoint(held_a.indices)
    assert len(train_a) + len(held_a) == len(full)
    # keys of the training sampler, (index, sample_seed), reach the right image
    x, _ = train_a[(3, 123)]
    y, _ = full[(train_a.indices[3], 123)]
    assert torch.equal(x, y)
    assert heldout_indices(100, 0.2, seed=1) != heldout_indices(100, 0.2, seed=2)


def test_stratified_timesteps_cover_every_bucket_equally():
    objective = DDPMObjective("cosine", 1000, "epsilon", "uniform")
    t = objective.stratified_levels(200, torch.Generator().manual_seed(0))
    assert t.dtype == torch.long and int(t.min()) >= 0 and int(t.max()) < 1000
    counts = torch.bincount(objective.bucket(t, 10), minlength=10)
    assert counts.tolist() == [20] * 10
    bounds = list(bucket_bounds(1000))
    assert bounds[0] == (0, 99) and bounds[-1] == (900, 999)


def test_heldout_loss_is_frozen_and_tracks_the_weights(tiny_overrides):
    cfg = load_config(None, tiny_overrides + ["data.heldout_fraction=0.05", "validation.heldout_max_images=40"])
    full = build_dataset("builtin:shapes", resolution=16, channels=3, random_flip=False, color_jitter=0.0, class_conditional=False)
    _, held = split_heldout(full, cfg.data, cfg.train.seed, lambda p: None)
    objective = build_objective(cfg.diffusion)
    model = build_model(cfg)
    ema = build_model(cfg)
    ev = HeldOutLoss(held, cfg.validation, cfg.data, objective, torch.device("cpu"))
    a, b = ev.evaluate(model, ema), ev.evaluate(model, ema)
    assert a == b  # frozen noise and timesteps: same weights, same numbers
    assert set(a) >= {"heldout/loss", "heldout_raw/loss", "heldout/loss_bucket/0", "heldout/loss_bucket/9"}
    buckets = [a[f"heldout/loss_bucket/{i}"] for i in range(10)]
    assert abs(sum(buckets) / 10 - a["heldout/loss"]) < 1e-5  # equal counts per bucket
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    c = ev.evaluate(model, ema)
    assert c["heldout/loss"] == a["heldout/loss"] and c["heldout_raw/loss"] != a["heldout_raw/loss"]
    assert model.training  # the training mode is restored
