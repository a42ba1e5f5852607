"""Distributed data parallel as a thin layer over torchrun and DDP; a no-op in one process.

``torchrun --nproc-per-node N -m difftrain train ...`` sets ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``; :func:`setup` reads them and joins the process group (NCCL on CUDA, gloo on
the CPU, so the same code is tested on a CPU). Without them every function here does nothing
and the training loop runs its single-process path unchanged.

How a global batch is split: the data sampler gives rank ``r`` the stream positions
``p = r, r + W, r + 2W, ...`` (``W`` = world size), so row ``i`` of rank ``r``'s micro-batch is
row ``r + i * W`` of the global micro-batch. The timesteps and noise of a micro-batch are drawn
for the whole global micro-batch from a generator seeded by (seed, step, micro) and each rank
keeps its rows (:func:`rank_rows`), so a run on W processes at per-device batch B sees the same
images, timesteps and noise as one process at batch W x B, and ends with the same weights up to
float rounding (DDP averages the gradients of the per-rank means).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


@dataclasses.dataclass(frozen=True)
class DistContext:
    """Where this process stands: ``rank`` of ``world_size`` and its ``device``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # this module created the process group and will destroy it

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, writes checkpoints and validation grids."""
        return self.rank == 0


def setup(device: torch.device) -> DistContext:
    """Join torchrun's process group if ``WORLD_SIZE`` > 1; else a single-process context.

    On CUDA each process takes ``cuda:LOCAL_RANK`` (unless the config named an index).
    Multi-node runs need nothing more: torchrun's rendezvous sets the same variables.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistContext(device=device)
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistContext(rank, world_size, local_rank, device, owns)


def teardown(ctx: DistContext) -> None:
    """Leave the process group that :func:`setup` created."""
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: nn.Module, ctx: DistContext) -> nn.Module:
    """``model`` in DistributedDataParallel when distributed, else ``model`` itself.

    Keep a reference to the unwrapped model: it is the one saved (no ``module.`` prefix) and
    averaged by the EMA.
    """
    if not ctx.enabled:
        return model
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # The UNet has GroupNorm, no BatchNorm: no buffers to broadcast every step.
    return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)


def sync_gradients(net: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Context for one micro-step's forward and backward: DDP's ``no_sync`` unless ``sync``,
    so gradients are all-reduced once per optimizer step, on the last micro-step."""
    ddp = getattr(net, "_orig_mod", net)  # under torch.compile, the DDP module it wraps
    if sync or not isinstance(ddp, DistributedDataParallel):
        return contextlib.nullcontext()
    return ddp.no_sync()


def rank_rows(x: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """This rank's rows ``rank, rank + W, ...`` of a global micro-batch tensor (N*W, ...)."""
    if not ctx.enabled:
        return x
    return x[ctx.rank :: ctx.world_size]


def all_reduce_sum_(*tensors: torch.Tensor) -> None:
    """Sum each tensor over ranks, in place (for the metrics of a log step)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for t in tensors:
            dist.all_reduce(t)


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()


def shard(n: int, ctx: DistContext) -> slice:
    """This rank's contiguous share of ``n`` items (sizes differ by at most one)."""
    base, extra = divmod(n, ctx.world_size)
    start = ctx.rank * base + min(ctx.rank, extra)
    return slice(start, start + base + (ctx.rank < extra))


def gather_cat(x: torch.Tensor, ctx: DistContext) -> torch.Tensor | None:
    """Concatenate every rank's CPU tensor, in rank order, on rank 0 (None on the others).

    For sampling spread across ranks: rank r computes the items ``shard(n, ctx)``.
    """
    if not ctx.enabled:
        return x
    parts: list = [None] * ctx.world_size
    dist.all_gather_object(parts, x.cpu())
    return torch.cat(parts) if ctx.is_main else None
