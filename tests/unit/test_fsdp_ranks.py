"""FSDP's optimizer step on 2 gloo CPU processes: a non-finite gradient in one rank's shard
skips the step on every rank, as DDP's all-reduced gradients make it do."""

from __future__ import annotations

import torch

from conftest import TINY_OVERRIDES
from multiproc import run_ranks

from difftrain.config import load_config
from difftrain.runtime import distributed, fsdp
from difftrain.runtime.precision import Precision
from difftrain.training.state import RunState


def _step_with_nan_on_rank_1(ctx: distributed.DistContext) -> dict:
    cfg = load_config(None, TINY_OVERRIDES + ["train.device=cpu", "train.parallel=fsdp", "train.channels_last=off"])
    state = RunState.build(cfg, 0, ctx.device)
    net = state.parallelize(ctx)
    assert fsdp.is_sharded(net)
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(ctx.rank))
    net(x, torch.full((4,), 10)).square().mean().backward()
    if ctx.rank == 1:
        next(p for p in net.parameters() if p.grad is not None).grad.to_local().view(-1)[0] = float("nan")
    before = [p.to_local().clone() for p in net.parameters()]
    precision: Precision = state.precision
    grad_norm, finite = precision.step(state.optimizer, net.parameters(), 1.0, torch.tensor(1.0))
    moved = any(not torch.equal(a, p.to_local()) for a, p in zip(before, net.parameters()))
    return {"finite": bool(finite), "norm_finite": bool(torch.isfinite(grad_norm)), "moved": moved}


def test_a_nan_in_one_ranks_gradient_shard_skips_the_step_on_every_rank():
    rank0, rank1 = run_ranks(_step_with_nan_on_rank_1, 2)
    assert rank0 == rank1 == {"finite": False, "norm_finite": False, "moved": False}  # the global norm is NaN
