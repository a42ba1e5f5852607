"""Memory estimate of a training step, measured by a real forward and backward pass.

Parameters, gradients, optimizer state and the EMA copy are counted from the real tensors
after one real optimizer step. Activations are the tensors autograd saves for the backward
pass, counted by storage as the forward pass saves them (``saved_tensors_hooks``), at two
batch sizes, so the per-image slope and the fixed part both come from measurement; on CUDA the
peak allocated memory of the step is reported beside them. The largest batch that fits follows
from the slope and the memory available on the device.

Under ``--parallel`` and ``--world-size`` the weights, gradients, optimizer state and EMA are
those one rank holds (``parallel_memory``: whole under DDP, sharded under FSDP), and the largest
batch is per rank.
"""

from __future__ import annotations

import math
import os

import torch

from difftrain.config import Config
from difftrain.diffusion.objective import per_sample_loss
from difftrain.runtime.distributed import DistContext
from difftrain.tools.common import RandomImages, Setup, build_setup, fetch_batch
from difftrain.tools.parallel_memory import format_per_rank, optimizer_note, rank_memory, resolve_parallel
from difftrain.training.optimizers import OPTIMIZERS
from difftrain.training.step import StepMetrics, draw_micro_batch, train_step

MiB = 2**20


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            key = (t.untyped_storage().data_ptr(), t.device)
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def activation_bytes(setup: Setup, batch_size: int) -> tuple[int, int]:
    """(bytes saved for backward, peak CUDA bytes allocated or 0) of one training forward and
    backward pass at ``batch_size``; parameters saved by reference are not counted."""
    params = {p.untyped_storage().data_ptr() for p in setup.model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    x0, labels = fetch_batch(setup, batch_size, seed=0)
    cuda = setup.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(setup.device)
        torch.cuda.reset_peak_memory_stats(setup.device)
        base = torch.cuda.memory_allocated(setup.device)
    b = draw_micro_batch(setup.state, setup.objective, x0, labels, 0, DistContext(device=setup.device))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = per_sample_loss(setup.objective, setup.model, b.x0, b.condition, b.levels, b.noise,
                               setup.state.precision.autocast()).mean()
    loss.backward()
    peak = torch.cuda.max_memory_allocated(setup.device) - base if cuda else 0
    setup.model.zero_grad(set_to_none=True)
    return sum(saved.values()), peak


def state_after_one_step(setup: Setup, batch_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the optimizer's state tensors, the EMAs' weights) after one real optimizer step (the
    training loop's ``train_step``, which creates the optimizer's state) at ``batch_size``.

    The EMA and the power EMAs of ``ema.posthoc_std`` are one copy of the trained weights each;
    a frozen base is shared with the model, not copied, and not among them.
    """
    batches = iter([fetch_batch(setup, batch_size, seed=1)] * setup.cfg.train.grad_accum_steps)
    train_step(setup.state, setup.objective, batches, setup.cfg.optim.lr, StepMetrics(setup.device))
    optimizer = setup.state.optimizer
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    own = {p.untyped_storage().data_ptr() for p in setup.model.parameters()}
    ema = [p for m in (setup.state.ema.model, *setup.state.posthoc.models) for p in m.parameters()
           if p.untyped_storage().data_ptr() not in own]
    return state, ema


def available_bytes(device: torch.device) -> int:
    """Free memory on ``device``: CUDA's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def estimate(
    cfg: Config,
    batch_size: int | None = None,
    target_batch: int | None = None,
    memory_gib: float | None = None,
    scale_lr: bool = False,
    headroom: float = 0.9,
    parallel: str | None = None,
    world_size: int = 1,
) -> dict:
    """Measure the memory of ``cfg`` at ``batch_size`` (default ``train.batch_size``).

    ``target_batch``: the effective batch wanted; gives the gradient accumulation steps and,
    with ``scale_lr``, the learning rate scaled by the linear rule from ``optim.base_batch``.
    ``memory_gib``: the memory budget (default: what the device has free now); only
    ``headroom`` of it is planned for. ``parallel`` (``"ddp"`` or ``"fsdp"``; default the
    config's) and ``world_size``: what one rank holds, in ``per_rank``. Returns a JSON-ready
    dict, sizes in MiB.
    """
    b = batch_size or cfg.train.batch_size
    if b < 1:
        raise ValueError(f"--batch-size must be >= 1, got {b}")
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    parallel = resolve_parallel(cfg.train, parallel)
    if parallel == "fsdp" and not OPTIMIZERS[cfg.optim.name].fsdp:
        raise ValueError(f"--parallel fsdp: optim.name={cfg.optim.name!r} is not verified under FSDP (adamw is)")
    setup = build_setup(cfg, need_data=False)  # only shapes matter; random images stand in if data.path is absent
    model = setup.model
    params = _tensor_bytes(model.parameters())
    buffers = _tensor_bytes(model.buffers())
    state_tensors, ema_tensors = state_after_one_step(setup, min(b, 2))
    # Gradients take what the trained weights take (one per parameter, in its dtype; none for
    # a LoRA run's frozen base).
    trained = [p for p in model.parameters() if p.requires_grad]
    grads = _tensor_bytes(trained)
    opt_state = _tensor_bytes(state_tensors)
    ema = _tensor_bytes(ema_tensors)
    rank = rank_memory(model, state_tensors, ema_tensors, parallel, world_size, cfg.train.precision)
    # Activations at b and 2b: the slope per image and the part that does not grow with b.
    act_b, peak_b = activation_bytes(setup, b)
    act_2b, _ = activation_bytes(setup, 2 * b)
    per_image = max(act_2b - act_b, 1) / b
    act_fixed = max(act_b - per_image * b, 0)
    fixed = buffers + rank.total + act_fixed  # what one rank holds (DDP on 1 rank: params + grads + opt_state + ema)
    budget = memory_gib * 2**30 if memory_gib else available_bytes(setup.device)
    max_batch = max(0, math.floor((headroom * budget - fixed) / per_image))
    result = {
        "device": str(setup.device),
        "data": "random stand-in (data.path not found)" if isinstance(setup.dataset, RandomImages) else cfg.data.path,
        "batch_size": b,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trained_parameters": sum(p.numel() for p in trained),
        "params_mib": params / MiB,
        "buffers_mib": buffers / MiB,
        "grads_mib": grads / MiB,
        "optimizer_mib": opt_state / MiB,
        "optimizer": cfg.optim.name,
        "ema_mib": ema / MiB,
        "activations_mib": act_b / MiB,
        "activations_per_image_mib": per_image / MiB,
        "total_mib": (fixed - act_fixed + act_b) / MiB,
        "cuda_step_peak_mib": peak_b / MiB if peak_b else None,
        "budget_mib": budget / MiB,
        "max_batch_size": max_batch,
        "precision": cfg.train.precision,
        "gradient_checkpointing": cfg.model.gradient_checkpointing,
        "per_rank": rank.as_mib(),
    }
    if target_batch:
        per_step = min(b, max_batch) if max_batch else b
        accum = math.ceil(target_batch / per_step)
        per_step = math.ceil(target_batch / accum)  # spread evenly over the micro-batches
        result.update(target_batch=target_batch, micro_batch=per_step, grad_accum_steps=accum,
                      effective_batch=per_step * accum)
        lr = cfg.optim.lr * per_step * accum / cfg.optim.base_batch if scale_lr else cfg.optim.lr
        result["lr"] = lr
        result["set"] = (f"--set train.batch_size={per_step} --set train.grad_accum_steps={accum} "
                         f"--set optim.lr={lr:.3g}")
    return result


def format_estimate(r: dict) -> str:
    """The estimate as an aligned table of lines."""
    rows = [
        ("device", r["device"]),
        ("data", r["data"]),
        ("parameters", f"{r['parameters']:,}" + (f" ({r['trained_parameters']:,} trained)"
                                                  if r["trained_parameters"] < r["parameters"] else "")),
        ("weights", f"{r['params_mib']:.1f} MiB (+ buffers {r['buffers_mib']:.1f})"),
        ("gradients", f"{r['grads_mib']:.1f} MiB"),
        ("optimizer state", f"{r['optimizer_mib']:.1f} MiB ({optimizer_note(r['optimizer'])})"),
        ("EMA weights", f"{r['ema_mib']:.1f} MiB"),
        (f"activations @ {r['batch_size']}", f"{r['activations_mib']:.1f} MiB "
                                            f"({r['activations_per_image_mib']:.2f} MiB per image, measured)"),
    ]
    one_rank = (r["per_rank"]["parallel"], r["per_rank"]["world_size"]) == ("ddp", 1)
    if not one_rank:
        rows += format_per_rank(r)
    rows.append(("total" if one_rank else "total per rank", f"{r['total_mib']:.1f} MiB"
                 + ("" if one_rank else " (with activations and buffers)")))
    if r.get("cuda_step_peak_mib"):
        rows.append(("CUDA peak of a step", f"{r['cuda_step_peak_mib']:.1f} MiB above the weights"))
    rows.append(("largest batch", f"{r['max_batch_size']:,} (90% of {r['budget_mib']:,.0f} MiB)"))
    if "target_batch" in r:
        rows.append(("target batch", f"{r['target_batch']} = {r['micro_batch']} x {r['grad_accum_steps']} "
                                     f"accumulation steps (effective {r['effective_batch']})"))
        rows.append(("use", r["set"]))
    return "\n".join(f"{k:22s} {v}" for k, v in rows)
