"""Evaluation during training on the sharded model, in lockstep, on 2 gloo CPU processes: the
validation images, the held-out losses and the FID features of the EMA and raw weights equal those
of the whole copies gathered onto every rank before (same seeds; shares of 3, 5 and 3 batches, so the
second rank pads), and a rank's peak memory while evaluating stays under one whole copy of the
weights (the gathered path holds two)."""

from __future__ import annotations

import torch

from conftest import TINY_OVERRIDES
from multiproc import reset_peak, run_ranks, status_bytes

from difftrain.config import load_config

RUN = [*TINY_OVERRIDES, "train.device=cpu", "train.batch_size=2", "train.channels_last=off", "train.parallel=fsdp",
       "validation.num_images=3", "validation.steps=2", "validation.raw_grid=true", "validation.heldout_batch_size=2",
       "validation.heldout_weights=both", "model.base_channels=128"]


class _Features:
    """A stand-in FID network: 4 numbers of each (B, C, H, W) uint8 batch."""

    feature_dim = 4

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels.float().flatten(1)[:, :4]


def _evaluations(ctx) -> dict:
    """One step (so the EMA differs from the weights), then every evaluation of the loop on the sharded
    model in lockstep and on the gathered whole copies; each one's results and peak RSS above its start."""
    from difftrain.diffusion.objective import build_objective
    from difftrain.evaluation.during_training import sharded_sample_features
    from difftrain.runtime.fsdp import in_lockstep
    from difftrain.training.heldout import HeldOutLoss
    from difftrain.training.state import RunState
    from difftrain.training.validation import validation_grids, validation_plan

    cfg = load_config(None, RUN)
    state = RunState.build(cfg, 0, ctx.device, dctx=ctx)
    net = state.parallelize(ctx)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(ctx.rank))
    net(x, torch.full((2,), 10)).square().mean().backward()
    state.precision.step(state.optimizer, net.parameters(), 1.0, torch.tensor(1.0))
    state.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():  # an EMA unlike the weights (the same perturbation of each shard on any world size)
        for name, p in state.ema.model.named_parameters():
            local = p.to_local()
            local.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)))
                       .chunk(ctx.world_size)[ctx.rank].reshape(local.shape))
    objective, conditioning = build_objective(cfg.diffusion), state.conditioning
    plan = validation_plan(cfg.validation, cfg.diffusion, cfg.train.batch_size, conditioning)
    g = torch.Generator().manual_seed(3)
    heldout = HeldOutLoss([(torch.rand(3, 16, 16, generator=g) * 2 - 1, 0) for _ in range(5)], cfg.validation, cfg.data, objective,
                          ctx.device, ctx=ctx, conditioning=conditioning)

    def evaluate(models) -> dict:
        model, ema = models
        grids, images = validation_grids(model, ema, cfg.validation, plan, conditioning, objective, ctx)
        features = sharded_sample_features(ema, _Features(), objective=objective, shape=(3, 16, 16), num=5,
                                           batch_size=2, sampler="ddim", steps=2, seed=0, ctx=ctx,
                                           lockstep=in_lockstep(ema))
        return {"grids": grids, "images": images, "heldout": heldout.evaluate(model, ema), "features": features}

    out = {}
    for name, models in (("lockstep", state.evaluation_models), ("gathered", state.gathered_models)):
        start = reset_peak(give_back=True)
        out[name] = evaluate(models())
        out[f"{name}_peak"] = status_bytes("VmHWM") - start
    out["params"] = sum(p.numel() for p in state.template.parameters())
    return out


def test_evaluation_runs_on_the_sharded_model_in_lockstep_as_on_whole_copies(monkeypatch):
    """The tiny UNet at 128 channels (12.3M parameters, 47 MiB of fp32 weights). Each rank's peak RSS
    while evaluating, with glibc's mmap threshold fixed (its default rises with each large block freed,
    after which freed blocks stay resident and the peak counts them: 74-117 MiB then, not live memory):
    31 MiB in lockstep, 141 MiB with the gathered copies (measured on a busy 2-core CPU)."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")  # large blocks mapped and unmapped: RSS is what is live
    for rank, r in enumerate(run_ranks(_evaluations, 2)):
        new, old = r["lockstep"], r["gathered"]
        if rank == 0:
            assert new["images"].shape[0] == 3 and new["features"].shape[0] == 5
            assert (new["images"] == old["images"]).all() and set(new["grids"]) == {"samples/ema", "samples/raw"}
            assert all((new["grids"][k] == old["grids"][k]).all() for k in old["grids"])
            torch.testing.assert_close(new["features"], old["features"], rtol=0, atol=0)
            assert new["heldout"].keys() == old["heldout"].keys() and "heldout_raw/loss" in new["heldout"]
            assert all(abs(new["heldout"][k] - old["heldout"][k]) <= 1e-6 * abs(old["heldout"][k])
                       for k in old["heldout"])
            assert new["heldout"]["heldout/loss"] != new["heldout"]["heldout_raw/loss"]  # the EMA is not the weights
        else:
            assert new["images"] is None and new["features"] is None and new["heldout"] == {}
        whole_weights = 4 * r["params"]  # fp32; the gathered path holds the model's and the EMA's
        assert r["lockstep_peak"] < whole_weights < 2 * whole_weights < r["gathered_peak"], \
            (r["lockstep_peak"], whole_weights, r["gathered_peak"])
