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

Control messages go over a second process group, always gloo, so that they stay on the CPU: each
step the ranks agree on whether to stop (:func:`max_over_ranks`, one small all-reduce of a CPU
integer, no device synchronisation); rank 0 shares the outcome of what only it does, such as
writing a checkpoint (:func:`run_on_main`); and CPU tensors are gathered on rank 0
(:func:`gather_cat`).

Faults of the group: every collective waits at most ``train.collective_timeout_s`` (the process
groups' timeout), so a rank that hangs (stopped, stuck in I/O) ends the run instead of leaving
the others waiting forever, and a rank that dies makes the others' next collective fail at
once. :func:`describe_group_fault` turns either error into what can be known about it: which
rank did not answer (rank 0 learns it from a ``monitored_barrier``; the other ranks only that
rank 0, or a rank that rank 0 names, did not), or that a rank's process ended. The loop then
ends with :class:`GroupFault`, exit code :data:`EXIT_GROUP_FAULT`, which ``torchrun
--max-restarts`` answers by restarting the group (the run resumes from its newest checkpoint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import os
import pickle
import re
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

T = TypeVar("T")
TEARDOWN_WAIT_S = 10  # how long a leaving rank waits for the others
STARTUP_WAIT_S = 7 * 24 * 3600  # the timeout of the group that waits for rank 0's start-up work
PROBE_WAIT_S = 30  # after a timed-out collective: how long rank 0 waits to learn which ranks answer
EXIT_GROUP_FAULT = 69  # EX_UNAVAILABLE: a rank died or hung; torchrun --max-restarts restarts the group


class GroupFault(RuntimeError):
    """A rank of the group died or did not answer within ``train.collective_timeout_s``."""


@dataclasses.dataclass(frozen=True)
class DistContext:
    """Where this process stands: ``rank`` of ``world_size`` and its ``device``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # this module created the process group and will destroy it
    control: object | None = None  # a gloo group of all ranks for CPU-side control messages
    timeout_s: float = 600.0  # how long a collective waits for every rank
    startup: object | None = None  # a gloo group that waits STARTUP_WAIT_S, for rank 0's long start-up work

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, writes checkpoints and validation grids."""
        return self.rank == 0


def setup(device: torch.device, timeout_s: float = 600.0) -> DistContext:
    """Join torchrun's process group if ``WORLD_SIZE`` > 1; else a single-process context.

    On CUDA each process takes ``cuda:LOCAL_RANK`` (unless the config named an index).
    Multi-node runs need nothing more: torchrun's rendezvous sets the same variables.
    ``timeout_s`` bounds every collective of both groups (``train.collective_timeout_s``).
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
    timeout = datetime.timedelta(seconds=timeout_s)
    if owns:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    # Stop flags and rank 0's outcomes: CPU tensors on gloo, never a CUDA synchronisation.
    control = dist.new_group(backend="gloo", timeout=timeout)
    startup = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=STARTUP_WAIT_S))
    return DistContext(rank, world_size, local_rank, device, owns, control, timeout_s, startup)


def launch_warnings() -> list[str]:
    """What in torchrun's settings will break this run later: under ``--max-restarts``, the
    rendezvous store that torchrun shares with the workers by default keeps the previous
    group's addresses, and the restarted group fails to connect (PyTorch issue 135712; seen with
    torch 2.13 on gloo). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each restart a new store."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return [f"torchrun --max-restarts {restarts} with its shared rendezvous store: a restarted group fails to "
                "connect (PyTorch issue 135712); set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun"]
    return []


def teardown(ctx: DistContext) -> None:
    """Leave the process groups that :func:`setup` created.

    The ranks first wait for each other on the control group (at most ``TEARDOWN_WAIT_S``, so a
    rank that died cannot hang the others): a rank that destroyed its groups and exited while
    another was still using its connections made that one abort ("terminate called without an
    active exception") on the way out of an error.
    """
    if not dist.is_initialized():
        return
    if ctx.control is not None:
        try:
            dist.monitored_barrier(group=ctx.control, timeout=datetime.timedelta(seconds=TEARDOWN_WAIT_S))
        except RuntimeError:  # another rank is gone already: leave anyway
            pass
    if ctx.owns_group:
        dist.destroy_process_group()
    else:
        for group in (ctx.control, ctx.startup):
            if group is not None:
                dist.destroy_process_group(group)


def wrap(model: nn.Module, ctx: DistContext) -> nn.Module:
    """``model`` in DistributedDataParallel when distributed, else ``model`` itself.

    Keep a reference to the unwrapped model: it is the one saved (no ``module.`` prefix) and
    averaged by the EMA. ``train.parallel = "fsdp"`` shards the model instead, with its EMA and
    optimizer: ``RunState.parallelize`` (training/state.py) calls this or ``runtime/fsdp.py``.

    DDP broadcasts rank 0's parameters to every rank as it wraps: only those that train here. The
    frozen ones (a LoRA's base) are loaded from the same files by every rank, and nothing makes them
    train later, so they are left to DDP's list of names to ignore
    (``_set_params_and_buffers_to_ignore_for_model``): no base sent at start-up (a Flux base: 24 GB
    in bf16, once per rank). Buffers are still synced as they were.
    """
    if not ctx.enabled:
        return model
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    if frozen:
        ignored = frozen | set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(ignored))
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # The UNet has GroupNorm, no BatchNorm: no buffers to broadcast every step.
    # torch 2.13 renamed broadcast_buffers to forward_sync_buffers (and warns on the old name).
    params = inspect.signature(DistributedDataParallel).parameters
    no_sync = {"forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers": False}
    return DistributedDataParallel(model, device_ids=device_ids, **no_sync)


def sync_gradients(net: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Context for one micro-step's forward and backward: DDP's ``no_sync`` unless ``sync``,
    so gradients are all-reduced once per optimizer step, on the last micro-step; under FSDP
    its analogue, ``set_requires_gradient_sync(False)`` (unsharded gradients accumulate on each
    rank and are reduce-scattered on the last micro-step)."""
    ddp = getattr(net, "_orig_mod", net)  # under torch.compile, the DDP module it wraps
    if not sync and isinstance(ddp, FSDPModule):
        return _fsdp_no_sync(ddp)
    if sync or not isinstance(ddp, DistributedDataParallel):
        return contextlib.nullcontext()
    return ddp.no_sync()


@contextlib.contextmanager
def _fsdp_no_sync(net):
    net.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        net.set_requires_gradient_sync(True)


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


def shard(n: int, ctx: DistContext) -> slice:
    """This rank's contiguous share of ``n`` items (sizes differ by at most one)."""
    base, extra = divmod(n, ctx.world_size)
    start = ctx.rank * base + min(ctx.rank, extra)
    return slice(start, start + base + (ctx.rank < extra))


def padded_shard(n: int, ctx: DistContext, lockstep: bool) -> tuple[list[int], int]:
    """(indices, keep): this rank's share of ``n`` items (:func:`shard`), and with ``lockstep`` its
    indices padded to every rank's count, ceil(n / W), by repeating its last item (item 0 where it has
    none): a sharded network (FSDP) runs a collective in each forward, so every rank must run as many.
    The results of ``indices[keep:]`` are dropped."""
    indices = list(range(n)[shard(n, ctx)])
    keep = len(indices)
    if lockstep:
        indices += [indices[-1] if indices else 0] * (-(-n // ctx.world_size) - keep)
    return indices, keep


def gather_cat(x: torch.Tensor, ctx: DistContext) -> torch.Tensor | None:
    """Concatenate every rank's tensor (N_r, ...), in rank order, on rank 0's CPU (None on the
    others); sent over the control group.

    For work spread across ranks: rank r computes the items ``shard(n, ctx)``, so the result
    holds items 0 .. n-1 in order, as one process would have computed them.
    """
    if not ctx.enabled:
        return x
    parts: list | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(x.cpu(), parts, dst=0, group=ctx.control)
    return torch.cat(parts) if ctx.is_main else None


def max_over_ranks(value: int, ctx: DistContext) -> int:
    """The largest ``value`` of any rank, on every rank; ``value`` itself in one process.

    One all-reduce of a CPU integer on the control group: cheap enough to call every step, and
    it never waits for the device. Every rank must call it at the same point of the loop.
    """
    if not ctx.enabled:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.control)
    return int(t.item())


def run_on_main(fn: Callable[[], T], ctx: DistContext, long_wait: bool = False) -> T:
    """Call ``fn()`` on rank 0 only; every rank returns its result or raises its exception.

    The other ranks wait for rank 0's outcome (so this is also a barrier: none of them goes on
    before ``fn`` has finished) and then do the same thing as rank 0, instead of one rank
    leaving the loop on an error while the others wait for it in the next collective. The
    result and the exception are pickled; an exception that can't be is sent as a RuntimeError
    with its message. ``long_wait``: the others wait up to ``STARTUP_WAIT_S`` instead of the
    collective timeout, for start-up work that may take longer (encoding a dataset).
    """
    if not ctx.enabled:
        return fn()
    message: list = [None]
    error = None
    if ctx.is_main:
        try:
            message[0] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - shared with the other ranks, then re-raised
            error = e
            message[0] = ("error", _picklable(e))
    dist.broadcast_object_list(message, src=0, group=ctx.startup if long_wait else ctx.control)
    kind, payload = message[0]
    if error is not None:
        raise error
    if kind == "error":
        raise payload
    return payload


def _picklable(e: Exception) -> Exception:
    """``e`` if it survives pickling, else a RuntimeError carrying its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any failure means: send the text instead
        return RuntimeError(f"on rank 0: {type(e).__name__}: {e}")


_TIMED_OUT = re.compile(r"Timed out waiting \d+ ?ms")
_PEER_GONE = re.compile(r"Connection (?:closed|reset) by peer(?: \[([^\]]+)\])?")
_SILENT = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


def describe_group_fault(e: BaseException, ctx: DistContext) -> str | None:
    """What can be known about a collective that failed because of another rank, or None when
    ``e`` is not such a failure (an error of this rank's own, such as out of memory).

    A rank that did not answer (stopped, stuck in I/O) shows as a timeout: rank 0 then asks every
    rank to answer a ``monitored_barrier`` within :data:`PROBE_WAIT_S` and names those that do
    not; another rank only learns that rank 0 did not answer, since that barrier goes through
    rank 0. A rank whose process ended (killed, crashed) shows as a closed connection, with that
    rank's host address but not its rank (torchrun's log names it, with its exit code).
    NCCL's own watchdog ends a process whose CUDA collective timed out before this is reached;
    the gloo control group, which every step uses too, most often times out first.
    """
    if not ctx.enabled:
        return None
    if isinstance(e, RuntimeError) and _TIMED_OUT.search(str(e)):
        return f"a collective waited train.collective_timeout_s={ctx.timeout_s:g} s: {_silent_ranks(ctx)}"
    return fault_text(e)


def fault_text(e: BaseException) -> str | None:
    """What ``e`` itself says of another rank, without asking the group (which may not exist
    yet, or any more); None when it is not a failed collective."""
    if not isinstance(e, RuntimeError):
        return None
    text = str(e)
    gone = _PEER_GONE.search(text)
    if gone:
        where = f" (its connection from {gone.group(1)} closed)" if gone.group(1) else ""
        return f"a rank's process ended{where}: killed or crashed (torchrun's log names it)"
    if _TIMED_OUT.search(text):
        return "a collective timed out (train.collective_timeout_s): a rank did not answer"
    if isinstance(e, dist.DistError):
        return f"a collective failed: {text.strip().splitlines()[0].rstrip('.') if text.strip() else type(e).__name__}"
    return None


def _silent_ranks(ctx: DistContext) -> str:
    """Which ranks fail to answer a barrier now, as far as this rank can tell."""
    wait = datetime.timedelta(seconds=min(PROBE_WAIT_S, ctx.timeout_s))
    try:
        dist.monitored_barrier(group=ctx.control, timeout=wait, wait_all_ranks=True)
    except RuntimeError as probe:
        silent = _SILENT.search(str(probe))
        if silent and ctx.is_main:
            ranks = [int(r) for r in silent.group(1).replace(",", " ").split()]
            names = ", ".join(map(str, ranks))
            return f"rank{'s' if len(ranks) > 1 else ''} {names} did not answer (hung: stopped, or stuck in I/O)"
        if _PEER_GONE.search(str(probe)):
            return "a rank's process has ended since"
        if not ctx.is_main:
            return "rank 0 did not answer, or another rank did (then rank 0's line names it)"
        return "which rank did not answer is unknown"
    return f"every rank answered within {wait.total_seconds():g} s afterwards: one was slow, not hung"
