"""training/distributed.py on two real gloo processes: control messages, and work spread across
ranks (held-out loss, validation grid, FID features, of a class-conditional model too) that must
equal one process's."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_OVERRIDES
from multiproc import run_ranks

from difftrain.config import load_config
from difftrain.data import build_dataset
from difftrain.evaluation.during_training import sharded_sample_features
from difftrain.evaluation.evaluate import FIDConditions
from difftrain.checkpoints import checkpoint as ckpt
from difftrain.runtime import distributed
from difftrain.models import build_model
from difftrain.data.split import split_heldout
from difftrain.diffusion.objective import build_objective
from difftrain.training.heldout import HeldOutLoss
from difftrain.networks.conditioning import Conditioning
from difftrain.training.validation import grid, sample_images, validation_plan

# ---- Control messages --------------------------------------------------------------------------


def _control(ctx: distributed.DistContext, tmp_path) -> dict:
    out = {"max": distributed.max_over_ranks(15 if ctx.rank == 1 else 0, ctx)}  # a signal on rank 1 only
    out["shared"] = distributed.run_on_main(lambda: f"computed by rank {ctx.rank}", ctx)
    blocked = tmp_path / "a-file"  # a checkpoint folder under a file: the write fails on rank 0
    blocked.write_text("")
    save = lambda policy: ckpt.save_or_report({"step": 4}, blocked / "checkpoints", 4, 1, 0, policy)  # noqa: E731
    try:
        distributed.run_on_main(lambda: save("stop"), ctx)
    except ckpt.CheckpointWriteError as e:
        out["stop"] = str(e)
    out["continue"] = distributed.run_on_main(lambda: save("continue"), ctx)
    out["gathered"] = distributed.gather_cat(torch.arange(ctx.rank + 1) + 10 * ctx.rank, ctx)
    return out


def test_control_messages_reach_every_rank(tmp_path):
    rank0, rank1 = run_ranks(_control, 2, tmp_path)
    assert rank0["max"] == rank1["max"] == 15  # rank 0 learns of rank 1's signal
    assert rank0["shared"] == rank1["shared"] == "computed by rank 0"
    # Rank 0's failed write is every rank's error, so none of them waits for it at a barrier.
    assert rank0["stop"] == rank1["stop"] and "cannot write the checkpoint of step 4" in rank1["stop"]
    assert rank0["continue"] is None and rank1["continue"] is None
    assert rank0["gathered"].tolist() == [0, 10, 11] and rank1["gathered"] is None


def _slow_start_then_hang(ctx: distributed.DistContext) -> dict:
    import time

    def slow():  # rank 0's start-up work, twice as long as the collective timeout
        time.sleep(2 * ctx.timeout_s)
        return "encoded"

    out = {"long": distributed.run_on_main(slow, ctx, long_wait=True)}
    try:  # the same wait without long_wait times out on the other rank
        out["short"] = distributed.run_on_main(slow, ctx)
    except RuntimeError as e:
        out["short"] = distributed.describe_group_fault(e, ctx)
    return out


@pytest.mark.slow  # about 12 s: two spawned ranks and a 4 s wait
def test_rank_0s_long_start_up_work_outlasts_the_collective_timeout_only_when_asked():
    rank0, rank1 = run_ranks(_slow_start_then_hang, 2, collective_timeout_s=2.0)
    assert rank0["long"] == rank1["long"] == "encoded"
    assert "collective_timeout_s=2 s: rank 0 did not answer" in rank1["short"], rank1["short"]


# ---- Work spread across ranks equals one process's -----------------------------------------------

OVERRIDES = TINY_OVERRIDES + [
    "data.heldout_fraction=0.05",
    "validation.heldout_max_images=7",  # odd, and batches of 3: the ranks' batches differ from one process's
    "validation.heldout_batch_size=3",
    "validation.num_images=5",
    "validation.sampler=ddpm",  # draws noise at every step
    "validation.steps=3",
]
FID = {"num": 7, "batch_size": 2, "sampler": "ddpm", "steps": 2, "seed": 3}


class _Features:
    """Stands in for the Inception network: 8 features from a fixed projection of the pixels."""

    feature_dim = 8
    metadata: dict = {}

    def __init__(self, pixels: int):
        self.weight = torch.randn(pixels, self.feature_dim, generator=torch.Generator().manual_seed(0))

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return images.float().flatten(1) @ self.weight / 255


def _perturbed_model(cfg, seed: int, num_classes: int = 0) -> torch.nn.Module:
    """The tiny UNet with every weight moved randomly, so that no output is trivially zero."""
    torch.manual_seed(seed)
    model = build_model(cfg, num_classes)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _spread_work(ctx: distributed.DistContext) -> dict:
    """The held-out loss, the validation grid and the FID features, as ``ctx``'s rank sees them."""
    cfg = load_config(None, OVERRIDES)
    objective = build_objective(cfg.diffusion)
    model, ema_model = _perturbed_model(cfg, 0), _perturbed_model(cfg, 1)
    d = cfg.data
    shape = (d.channels, d.resolution, d.resolution)
    _, held = split_heldout(build_dataset(d.path, resolution=d.resolution, channels=d.channels, random_flip=False, color_jitter=0.0, class_conditional=False), cfg.data, cfg.train.seed, None)
    heldout = HeldOutLoss(held, cfg.validation, cfg.data, objective, torch.device("cpu"), ctx=ctx).evaluate(model, ema_model)
    conditioning = Conditioning(channels=d.channels, resolution=d.resolution)
    plan = validation_plan(cfg.validation, cfg.diffusion, cfg.train.batch_size, conditioning)
    images = sample_images(ema_model, cfg.validation, plan, conditioning, objective, ctx)
    inception = _Features(d.resolution**2 * d.channels)
    features = sharded_sample_features(ema_model, inception, objective=objective, shape=shape, ctx=ctx, **FID)
    # A class-conditional model: batch k's labels are drawn from (seed, k) on whichever rank draws it.
    classes = FIDConditions(Conditioning(3, channels=d.channels, resolution=d.resolution), guidance_scale=2.0)
    class_features = sharded_sample_features(_perturbed_model(cfg, 2, num_classes=3), inception, objective=objective,
                                             shape=shape, ctx=ctx, conditions=classes, **FID)
    return {"heldout": heldout, "grid": None if images is None else grid(images, plan), "features": features,
            "class_features": class_features}


@pytest.fixture(scope="module")
def one_and_two():
    """(one process's results, [rank 0's, rank 1's] of two processes)."""
    return _spread_work(distributed.DistContext()), run_ranks(_spread_work, 2)


def test_heldout_loss_on_two_ranks_equals_one_process(one_and_two):
    one, (rank0, rank1) = one_and_two
    assert rank1["heldout"] == {}  # rank 0 logs
    assert rank0["heldout"].keys() == one["heldout"].keys() and "heldout_raw/loss" in one["heldout"]
    for key, value in one["heldout"].items():
        assert rank0["heldout"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_validation_grid_on_two_ranks_equals_one_process(one_and_two):
    one, (rank0, rank1) = one_and_two
    assert rank1["grid"] is None
    assert rank0["grid"].shape == one["grid"].shape
    # uint8 pixels: at most one level of rounding apart, nearly all of them equal.
    diff = (rank0["grid"].astype(int) - one["grid"].astype(int))
    assert abs(diff).max() <= 1 and (diff != 0).mean() < 1e-3


def test_fid_features_on_two_ranks_equal_one_process(one_and_two):
    one, (rank0, rank1) = one_and_two
    assert rank1["features"] is None
    assert one["features"].shape == (FID["num"], 8 + 1)  # the features, then the Laplacian energy
    torch.testing.assert_close(rank0["features"], one["features"], rtol=1e-5, atol=1e-5)


def test_class_conditional_fid_features_on_two_ranks_equal_one_process(one_and_two):
    one, (rank0, rank1) = one_and_two
    assert rank1["class_features"] is None
    assert one["class_features"].shape == (FID["num"], 8 + 1)
    torch.testing.assert_close(rank0["class_features"], one["class_features"], rtol=1e-5, atol=1e-5)
