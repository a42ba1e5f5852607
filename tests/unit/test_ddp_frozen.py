"""DDP sends no frozen parameter at start-up (issue 41 item 5, ``runtime/distributed.wrap``): on two gloo
processes, wrapping a network whose base is frozen (a LoRA's) broadcasts only what trains, counted at
torch's broadcast of module states; the trainable parameters still start equal on both ranks, and a step
trains them alike."""

from __future__ import annotations

import torch
from multiproc import run_ranks
from torch import nn

from difftrain.runtime import distributed


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))  # a frozen "base" layer, a trainable "adapter"
    net[0].requires_grad_(False)
    return net


def _wrap_and_step(ctx: distributed.DistContext) -> dict:
    import torch.distributed as dist

    sent: list[int] = []
    broadcast = dist._broadcast_coalesced

    def counting(group, tensors, *args, **kwargs):  # DDP's start-up sync of module states
        sent.append(sum(t.numel() * t.element_size() for t in tensors))
        return broadcast(group, tensors, *args, **kwargs)

    dist._broadcast_coalesced = counting
    net = _net()
    with torch.no_grad():  # rank 1 starts elsewhere: the broadcast makes what trains rank 0's
        net[1].weight.add_(float(ctx.rank))
    ddp = distributed.wrap(net, ctx)
    dist._broadcast_coalesced = broadcast
    trainable_after_wrap = net[1].weight.detach().clone()
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(ctx.rank))
    ddp(x).square().mean().backward()
    opt.step()
    return {"sent": sum(sent), "start": trainable_after_wrap, "trained": {k: v.clone() for k, v in net.state_dict().items()},
            "trainable_bytes": sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)}


def test_ddp_broadcasts_only_what_trains_and_trains_alike():
    rank0, rank1 = run_ranks(_wrap_and_step, 2)
    assert rank0["sent"] == rank1["sent"] == rank0["trainable_bytes"]  # not the frozen 64 x 64 base
    assert torch.equal(rank0["start"], rank1["start"])  # what trains still starts as rank 0's
    for name, value in rank0["trained"].items():
        assert torch.equal(value, rank1["trained"][name]), name
