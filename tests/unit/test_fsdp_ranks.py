"""FSDP's optimizer step on 2 gloo CPU processes: a non-finite gradient in one rank's shard
skips the step on every rank, as DDP's all-reduced gradients make it do; a LoRA network's frozen
base is sharded beside its adapter and stays as it was."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

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


def _lora_steps(ctx: distributed.DistContext, base: str) -> dict:
    """Two optimizer steps and EMA updates of a sharded LoRA network on difftrain's tiny UNet."""
    cfg = load_config(None, TINY_OVERRIDES + ["train.device=cpu", "train.parallel=fsdp", "train.channels_last=off",
                                              f"model.init_from={base}", "lora.rank=2", "lora.include_conv=true"])
    state = RunState.build(cfg, 0, ctx.device)
    adapter = {k: v.clone() for k, v in state.model.state_dict().items()}
    net = state.parallelize(ctx)
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(ctx.rank))
    for _ in range(2):
        net(x, torch.full((4,), 10)).square().mean().backward()
        state.precision.step(state.optimizer, net.parameters(), 1.0, torch.tensor(1.0))
        state.optimizer.zero_grad(set_to_none=True)
        state.ema.update(state.model)
    frozen = [p for p in net.parameters() if not p.requires_grad]
    ema_params = {id(p) for p in state.ema.model.parameters()}
    whole, ema = state.gathered_models()  # gathered: the base and the adapter
    return {
        "all_sharded": all(isinstance(p, DTensor) for p in [*net.parameters(), *state.ema.model.parameters()]),
        "frozen_shared_with_ema": all(id(p) in ema_params for p in frozen),
        "optimizer_holds_adapter": len(state.optimizer.param_groups[0]["params"]) == len(adapter),
        "base": {k: v for k, v in nn.Module.state_dict(whole).items() if "lora_" not in k},
        "adapter": whole.state_dict(), "ema": ema.state_dict(), "start": adapter,
    }


def test_lora_under_fsdp_trains_the_adapter_shards_alone(tmp_path):
    """The frozen base is sharded with the adapter in the same units and never moves; the EMA
    shares its shards; the ranks agree on the gathered weights."""
    from difftrain.checkpoints.weights_file import save_weights_file

    cfg = load_config(None, TINY_OVERRIDES + ["train.device=cpu"])
    base_state = RunState.build(cfg, 0, torch.device("cpu")).state_dict()
    plain = base_state["ema"]["model"]  # what the weights file holds
    torch.manual_seed(0)
    for v in plain.values():  # not the zero-initialised output layer, which lets no gradient through
        if v.is_floating_point():
            v.add_(0.01 * torch.randn_like(v))
    base = save_weights_file({**base_state, "path": "base"}, tmp_path / "base.safetensors")
    rank0, rank1 = run_ranks(_lora_steps, 2, str(base))
    for r in (rank0, rank1):
        assert r["all_sharded"] and r["frozen_shared_with_ema"] and r["optimizer_holds_adapter"]
    assert rank0["base"].keys() and all(torch.equal(v, plain[k.replace(".base_layer.", ".").removeprefix("base.")])
                                        for k, v in rank0["base"].items())
    moved = [k for k in rank0["adapter"] if not torch.equal(rank0["adapter"][k], rank0["start"][k])]
    assert any("lora_B" in k for k in moved)  # B starts at 0: it trained
    for key in ("adapter", "ema"):
        assert all(torch.equal(rank0[key][k], rank1[key][k]) for k in rank0[key])
