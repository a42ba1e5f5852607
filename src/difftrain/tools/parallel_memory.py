"""Per-rank memory of weights, gradients, optimizer state and EMA under DDP and FSDP, from tensor shapes.

Under DDP every rank holds everything, and DDP's gradient buckets hold a second copy of the
gradients (``gradient_as_bucket_view`` is off). Under FSDP2 (``fully_shard`` on each UNet block,
then on the root) each parameter is split on dim 0 into ``world_size`` chunks, padded to a
multiple of ``world_size``; gradients, AdamW's ``exp_avg`` / ``exp_avg_sq`` and the EMA follow
the parameters' sharding, so rank 0 (which holds the largest chunk of every tensor) holds
``ceil(dim0 / N) * (numel / dim0)`` elements of each. Beside the shards, the block being
computed is all-gathered in the compute dtype, and its gradients are unsharded until they are
reduce-scattered; with the next block prefetched, about twice that: the ``transient`` figure.

The same functions count a model built on the ``meta`` device (``count_unet_config``), for
networks too large to build here: those figures are counted, not measured.
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from difftrain.config import Parallel
from difftrain.families.sd import ConditionUNet, unet_folder
from difftrain.runtime.fsdp import blocks
from difftrain.training.optimizers import OPTIMIZERS, state_bytes

PARALLELISMS = typing.get_args(Parallel)  # train.parallel's values; the first is the default
# Bytes per element of the compute dtype of train.precision (FSDP's MixedPrecisionPolicy param_dtype).
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Unsharded copies of the largest FSDP unit alive at once: the block computed and the one prefetched.
PREFETCH_FACTOR = 2
MiB, GiB = 2**20, 2**30


def resolve_parallel(tc, parallel: str | None) -> str:
    """``parallel`` if given, else the train section ``tc``'s ``train.parallel``."""
    parallel = parallel if parallel is not None else tc.parallel
    if parallel not in PARALLELISMS:
        raise ValueError(f"--parallel must be one of {', '.join(PARALLELISMS)}, got {parallel!r}")
    return parallel


def fsdp_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules ``fully_shard`` wraps one by one before the root, as (qualified name, module):
    the units of ``runtime.fsdp.blocks``, which training shards. Empty: the root alone."""
    names = {id(m): name for name, m in model.named_modules()}
    return [(names[id(b)], b) for b in blocks(model)]


def shard_numel(t: torch.Tensor, world_size: int) -> int:
    """Elements of rank 0's shard of ``t`` under FSDP2: ``ceil(dim0 / N)`` rows (a 0-d tensor,
    such as AdamW's ``step``, is not sharded)."""
    if t.dim() == 0:
        return 1
    return math.ceil(t.shape[0] / world_size) * (t.numel() // t.shape[0] if t.shape[0] else 0)


def rank_bytes(tensors, parallel: str, world_size: int) -> int:
    """Bytes of ``tensors`` held by rank 0: all of them under DDP, rank 0's shards under FSDP."""
    if parallel == "ddp":
        return sum(t.numel() * t.element_size() for t in tensors)
    return sum(shard_numel(t, world_size) * t.element_size() for t in tensors)


def fsdp_units(model: nn.Module, world_size: int) -> list[tuple[str, int]]:
    """(name, elements all-gathered) of each FSDP unit: every block of :func:`fsdp_blocks`, then
    the root (``"root"``: the parameters in no block), each parameter padded on dim 0 to a
    multiple of ``world_size``."""
    owned, units = set(), []
    for name, block in fsdp_blocks(model):
        params = [p for p in block.parameters() if id(p) not in owned]
        owned.update(id(p) for p in params)
        units.append((name, sum(shard_numel(p, world_size) * world_size for p in params)))
    rest = [p for p in model.parameters() if id(p) not in owned]
    units.append(("root", sum(shard_numel(p, world_size) * world_size for p in rest)))
    return units


@dataclass
class RankMemory:
    """Bytes held by one rank (rank 0, the largest) outside activations."""

    parallel: str
    world_size: int
    params: int  # weights as held (fp32 master weights; a bf16/fp16 LoRA run's frozen base in that dtype)
    grads: int  # gradients of the trained parameters, in their dtype
    optimizer: int  # AdamW's exp_avg, exp_avg_sq and step
    ema: int  # the EMA and the post-hoc EMAs
    transient: int  # FSDP: largest unit unsharded (x PREFETCH_FACTOR); DDP: its gradient buckets
    largest_unit: str  # FSDP: the unit that sets `transient`; DDP: ""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.ema + self.transient

    def as_mib(self) -> dict:
        """A JSON-ready dict, sizes in MiB."""
        sizes = {k: getattr(self, k) / MiB for k in ("params", "grads", "optimizer", "ema", "transient", "total")}
        return {"parallel": self.parallel, "world_size": self.world_size, "largest_unit": self.largest_unit,
                **{f"{k}_mib": v for k, v in sizes.items()}}


def rank_memory(
    model: nn.Module,
    optimizer_state: list[torch.Tensor],
    ema: list[torch.Tensor],
    parallel: str,
    world_size: int,
    precision: str = "fp32",
) -> RankMemory:
    """What rank 0 holds of ``model`` (its parameters; gradients for those with ``requires_grad``),
    the optimizer's state tensors and the EMA's parameters, under ``parallel`` on ``world_size``
    ranks, computing in ``precision`` (``train.precision``)."""
    if parallel not in PARALLELISMS:
        raise ValueError(f"parallel must be one of {', '.join(PARALLELISMS)}, got {parallel!r}")
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    grads = rank_bytes(trained, parallel, world_size)
    if parallel == "ddp":
        # DDP's buckets: a flat copy of every gradient for the all-reduce (none on one rank: no wrapper).
        transient, largest = (grads if world_size > 1 else 0), ""
    else:
        largest, numel = max(fsdp_units(model, world_size), key=lambda u: u[1])
        # The unit's weights all-gathered and its gradients before the reduce-scatter, in the compute dtype.
        transient = PREFETCH_FACTOR * 2 * numel * COMPUTE_BYTES[precision]
    return RankMemory(parallel, world_size, rank_bytes(params, parallel, world_size), grads,
                      rank_bytes(optimizer_state, parallel, world_size), rank_bytes(ema, parallel, world_size),
                      transient, largest)


# -- a network too large to build: counted on the meta device -------------------------------------


def meta_condition_unet(unet_config: str | Path) -> nn.Module:
    """The ConditionUNet of a UNet2DConditionModel ``config.json`` (or a folder holding one, or
    its ``unet/``), built on the meta device: shapes and dtypes, no memory, no weights."""
    path = Path(unet_config).expanduser()
    path = path if path.is_file() else unet_folder(path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--unet-config {path}: unreadable ({e})") from None
    with torch.device("meta"):
        return ConditionUNet.from_config(config)


def adamw_state(trained: list[torch.Tensor]) -> list[torch.Tensor]:
    """Meta stand-ins of AdamW's state for ``trained``: exp_avg and exp_avg_sq like each
    parameter, and a 0-d float32 step."""
    out = []
    for p in trained:
        out += [torch.empty_like(p, device="meta"), torch.empty_like(p, device="meta"),
                torch.empty((), dtype=torch.float32, device="meta")]
    return out


def optimizer_state(trained: list[torch.Tensor], name: str, parallel: str) -> list[torch.Tensor]:
    """Meta stand-ins of ``optim.name``'s state for ``trained``: AdamW's own shapes (sharded as
    FSDP shards them), or one byte tensor per parameter of the registry's exact count
    (``training/optimizers.py``; those optimizers run under DDP only)."""
    if name == "adamw":
        return adamw_state(trained)
    if parallel == "fsdp" and not OPTIMIZERS[name].fsdp:
        raise ValueError(f"--parallel fsdp: optim.name={name!r} is not verified under FSDP (adamw is)")
    per_tensor = [OPTIMIZERS[name].state_bytes(p.shape) for p in trained]
    shared = state_bytes(name, [p.shape for p in trained]) - sum(per_tensor)  # bitsandbytes' quantization maps
    return [torch.empty(n, dtype=torch.uint8, device="meta") for n in (*per_tensor, shared) if n]


def counted_memory(model: nn.Module, cfg, parallel: str, world_size: int) -> RankMemory:
    """:func:`rank_memory` of a model on any device (the meta device included), with
    ``optim.name``'s state and ``cfg``'s EMAs (the EMA and each post-hoc EMA: a copy of the
    trained weights) counted from the parameters' shapes rather than taken from a step."""
    trained = [p for p in model.parameters() if p.requires_grad]
    ema = trained * (1 + len(cfg.ema.posthoc_std))
    state = optimizer_state(trained, cfg.optim.name, parallel)
    return rank_memory(model, state, ema, parallel, world_size, cfg.train.precision)


def count_unet_config(cfg, unet_config: str | Path, parallel: str | None = None, world_size: int = 1) -> dict:
    """Per-rank memory of training the UNet2DConditionModel of ``unet_config`` with ``cfg``'s
    precision and EMAs, counted from shapes on the meta device (no step, no activations).
    Returns a JSON-ready dict, sizes in MiB."""
    parallel = resolve_parallel(cfg.train, parallel)
    model = meta_condition_unet(unet_config)
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    whole = counted_memory(model, cfg, "ddp", 1)
    rank = counted_memory(model, cfg, parallel, world_size)
    return {
        "device": "meta (counted from shapes, not measured)",
        "unet_config": str(unet_config),
        "parameters": sum(p.numel() for p in params),
        "trained_parameters": sum(p.numel() for p in trained),
        "params_mib": whole.params / MiB,
        "grads_mib": whole.grads / MiB,
        "optimizer_mib": whole.optimizer / MiB,
        "optimizer": cfg.optim.name,
        "ema_mib": whole.ema / MiB,
        "precision": cfg.train.precision,
        "per_rank": rank.as_mib(),
    }


def optimizer_note(name: str) -> str:
    """What the optimizer state row counts, for ``optim.name``."""
    return {"adamw": "AdamW exp_avg, exp_avg_sq", "adamw8bit": "8-bit AdamW moments, block scales",
            "prodigy": "Prodigy exp_avg, exp_avg_sq, s, p0", "adafactor": "Adafactor factored second moments",
            "schedulefree": "schedule-free z, exp_avg_sq"}[name]


def format_per_rank(r: dict) -> list[tuple[str, str]]:
    """Rows of ``format_estimate`` for the per-rank figures of ``r["per_rank"]``."""
    p = r["per_rank"]
    where = f"{p['parallel'].upper()}, {p['world_size']} rank{'s' if p['world_size'] > 1 else ''}"
    if p["parallel"] == "fsdp":
        transient = (f"{p['transient_mib']:.1f} MiB ({p['largest_unit']} all-gathered in {r['precision']} "
                     f"with its gradients, x{PREFETCH_FACTOR} for prefetch)")
    else:
        transient = f"{p['transient_mib']:.1f} MiB (gradient buckets)"
    return [
        ("per rank", f"{where}: weights {p['params_mib']:.1f}, gradients {p['grads_mib']:.1f}, "
                     f"optimizer {p['optimizer_mib']:.1f}, EMA {p['ema_mib']:.1f} MiB"),
        ("  transient", transient),
    ]


def format_counted(r: dict) -> str:
    """``count_unet_config``'s result as aligned lines."""
    rows = [
        ("device", r["device"]),
        ("unet config", r["unet_config"]),
        ("parameters", f"{r['parameters']:,}"),
        ("weights", f"{r['params_mib']:.1f} MiB"),
        ("gradients", f"{r['grads_mib']:.1f} MiB"),
        ("optimizer state", f"{r['optimizer_mib']:.1f} MiB ({optimizer_note(r['optimizer'])})"),
        ("EMA weights", f"{r['ema_mib']:.1f} MiB"),
        *format_per_rank(r),
        ("total per rank", f"{r['per_rank']['total_mib']:.1f} MiB"),
        ("activations", "not counted (no step on the meta device)"),
    ]
    return "\n".join(f"{k:22s} {v}" for k, v in rows)
