"""The optimizer registry (``optim.name``): how each optimizer is built, the package it needs,
what its state costs per parameter, and the schedule-free train/eval switch.

    optimizer = build_optimizer(cfg.optim, model, device)  # over the parameters that train
    with reading_weights(optimizer):                      # schedule-free: the averaged weights x
        model.state_dict()                                # (a no-op for every other optimizer)
    read = averaged_weights(optimizer)                    # or x one tensor at a time (EMA updates)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from difftrain.config import OptimConfig, OptimizerName
from difftrain.models import weight_normalised_layers
from difftrain.runtime.optional import require

Params = list[torch.Tensor]


def _adamw(params: Params, o: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    # The fused kernel where it exists (CPU and CUDA) skips a non-finite step on the device.
    return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                             fused=device.type in ("cuda", "cpu"))


def _adamw8bit(params: Params, o: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    # bitsandbytes: block-wise 8-bit moments (Dettmers et al. 2022) for tensors of >= 4096
    # elements, 32-bit below; plain uint8/float32 tensors in its state dict (weights_only loads).
    # imported here, by an adamw8bit run only: an optional package (the optim extra), slow to import
    bnb = require("bitsandbytes", "optim", "optim.name='adamw8bit'")
    for p in params:  # its step makes each weight contiguous (no channels_last): at once, so a resume matches
        p.data = p.data.contiguous()
    return bnb.optim.AdamW8bit(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)


def _prodigy(params: Params, o: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    # Prodigy (Mishchenko & Defazio 2023) estimates the step size d; optim.lr multiplies it (1.0).
    prodigyopt = require("prodigyopt", "optim", "optim.name='prodigy'")
    return prodigyopt.Prodigy(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                              d_coef=o.prodigy_d_coef, safeguard_warmup=o.warmup_steps > 0)


def _adafactor(params: Params, o: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    # torch's Adafactor (Shazeer & Stern 2018): factored second moments, no first moment; betas unused.
    return torch.optim.Adafactor(params, lr=o.lr, weight_decay=o.weight_decay)


def _schedulefree(params: Params, o: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    # Schedule-free AdamW (Defazio et al. 2024): the parameters hold y while training and the
    # average x while read (reading_weights); the run's warm-up is optim.warmup_steps.
    schedulefree = require("schedulefree", "optim", "optim.name='schedulefree'")
    optimizer = schedulefree.AdamWScheduleFree(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    optimizer.train()
    return optimizer


def _adam_bytes(shape: torch.Size) -> int:
    return 8 * math.prod(shape) + 4  # exp_avg, exp_avg_sq (fp32) and a float32 step tensor


def _adamw8bit_bytes(shape: torch.Size) -> int:
    n = math.prod(shape)
    if n < 4096:  # bitsandbytes' min_8bit_size: 32-bit moments; its step is a Python int
        return 8 * n
    # two uint8 moments and a float32 absmax per 256-element block of each (its two 256-entry
    # quantization maps are shared by every tensor: ``state_bytes`` adds them once)
    return 2 * n + 2 * 4 * math.ceil(n / 256)


def _prodigy_bytes(shape: torch.Size) -> int:
    # exp_avg, exp_avg_sq, s, p0 (the initial weights), fp32; p0 is one element for a weight all
    # zero at the first step (zero-initialised layers of a fresh model), so this is the bound
    return 16 * math.prod(shape)


def _adafactor_bytes(shape: torch.Size) -> int:
    if len(shape) < 2:  # unfactored: a full second moment
        return 4 * math.prod(shape) + 4
    # row variances (..., rows, 1) and column variances (..., 1, cols) of the last two dims
    return 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) + 4


def _schedulefree_bytes(shape: torch.Size) -> int:
    return 8 * math.prod(shape)  # z and exp_avg_sq (fp32); y or x lives in the parameter itself


@dataclass(frozen=True)
class OptimizerSpec:
    """One ``optim.name``: its builder, the extra with its package (None: torch's own), the
    exact bytes of its state for one fp32 parameter of a shape, whether FSDP was verified, and the
    device types its step has kernels for (None: any device torch runs on)."""

    build: Callable[[Params, OptimConfig, torch.device], torch.optim.Optimizer]
    extra: str | None
    state_bytes: Callable[[torch.Size], int]
    fsdp: bool
    devices: tuple[str, ...] | None = None


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec(_adamw, None, _adam_bytes, fsdp=True),
    # bitsandbytes' 8-bit optimizer kernels: CPU, CUDA and XPU (none for MPS)
    "adamw8bit": OptimizerSpec(_adamw8bit, "optim", _adamw8bit_bytes, fsdp=False, devices=("cpu", "cuda", "xpu")),
    "prodigy": OptimizerSpec(_prodigy, "optim", _prodigy_bytes, fsdp=False),
    "adafactor": OptimizerSpec(_adafactor, None, _adafactor_bytes, fsdp=False),
    "schedulefree": OptimizerSpec(_schedulefree, "optim", _schedulefree_bytes, fsdp=False),
}


def build_optimizer(o: OptimConfig, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """The ``optim`` section ``o``'s optimizer (``optim.name``) over the parameters that train (not a LoRA run's frozen base). A
    model with magnitude-preserving layers (``model.magnitude_preserving``) has their weights put back
    to unit-RMS rows after every step (EDM2's forced weight normalisation). One ValueError when the
    optimizer has no kernels for ``device``."""
    spec = OPTIMIZERS[o.name]
    if spec.devices is not None and device.type not in spec.devices:
        raise ValueError(f"optim.name={o.name!r} runs on {', '.join(spec.devices)}, not on {device.type}: "
                         f"use optim.name='adamw' (or another) there, or train.device one of those")
    optimizer = spec.build([p for p in model.parameters() if p.requires_grad], o, device)
    layers = weight_normalised_layers(model)
    if layers:
        optimizer.register_step_post_hook(lambda *_: _renormalize(layers))
    return optimizer


def _renormalize(layers: list[nn.Module]) -> None:
    """EDM2's forced weight normalisation: each layer's stored rows back to unit RMS."""
    for layer in layers:
        layer.renormalize_()


def state_bytes(name: OptimizerName, shapes: list[torch.Size]) -> int:
    """Bytes of ``name``'s state (after its first step) over fp32 parameters of these shapes."""
    shapes = [torch.Size(s) for s in shapes]
    shared = 2 * 256 * 4 if name == "adamw8bit" and any(math.prod(s) >= 4096 for s in shapes) else 0
    return shared + sum(OPTIMIZERS[name].state_bytes(s) for s in shapes)


def measured_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors an optimizer's state holds now, each storage once (bitsandbytes'
    quantization maps are one pair shared by every parameter)."""
    seen: dict[int, int] = {}
    for s in optimizer.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(seen.values())


def _schedule_free(optimizer: torch.optim.Optimizer) -> bool:
    return callable(getattr(optimizer, "eval", None)) and "train_mode" in optimizer.param_groups[0]


@contextlib.contextmanager
def reading_weights(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """While weights are read (EMA updates, validation, FID, checkpoints and so export), a
    schedule-free optimizer's parameters hold its average x; a no-op for every other optimizer.

    The training iterate y is kept as ``state[p]["y"]`` meanwhile and copied back afterwards
    (recomputing it from x and z would not be bit-exact), so a checkpoint written inside holds x
    as its weights and y in its optimizer state, and a resume continues exactly (``to_training``).
    """
    if not (_schedule_free(optimizer) and optimizer.param_groups[0]["train_mode"]):
        yield
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        optimizer.state[p]["y"] = p.detach().clone()
    optimizer.eval()
    try:
        yield
    finally:
        to_training(optimizer)


def averaged_weights(optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """For a schedule-free optimizer in train mode, a function from one parameter (holding the
    iterate y) to its average x, the value ``optimizer.eval()`` would put there,
    ``x = lerp(y, z, 1 - 1 / beta1)`` (Defazio et al. 2024), computed out of place for that one
    tensor; None for every other optimizer, whose parameters are what an average reads.

    The EMAs read x this way each step (``training/step.py``), so a step copies no parameter:
    :func:`reading_weights` keeps a copy of every y while the parameters hold x.
    """
    if not (_schedule_free(optimizer) and optimizer.param_groups[0]["train_mode"]):
        return None
    weight = {p: 1 - 1 / group["betas"][0] for group in optimizer.param_groups for p in group["params"]}

    def read(p: torch.Tensor) -> torch.Tensor:
        z = optimizer.state[p].get("z") if p in weight else None
        return p if z is None else torch.lerp(p, z, weight[p])  # not trained, or not stepped yet: x = y

    return read


@torch.no_grad()
def to_training(optimizer: torch.optim.Optimizer) -> None:
    """A schedule-free optimizer back in train mode: its parameters the iterate y kept by
    ``reading_weights`` (also one read from a checkpoint), else recomputed from x and z."""
    if not _schedule_free(optimizer):
        return
    kept = [(p, optimizer.state[p].pop("y", None)) for g in optimizer.param_groups for p in g["params"]]
    if any(y is None for _, y in kept):  # nothing kept (a fresh optimizer): y from x and z
        optimizer.train()
        return
    for p, y in kept:
        p.copy_(y)
    for group in optimizer.param_groups:
        group["train_mode"] = True


def resume_mismatch(saved_config: dict, o: OptimConfig) -> str | None:
    """Why a checkpoint written with another optimizer cannot continue this run (its optim section ``o``), or None."""
    saved = saved_config.get("optim", {}).get("name", "adamw")  # before optim.name: AdamW
    if saved == o.name:
        return None
    return (f"it was trained with optim.name={saved!r} and this run sets {o.name!r}; "
            f"an optimizer's state does not carry over to another: resume with optim.name={saved!r}")
