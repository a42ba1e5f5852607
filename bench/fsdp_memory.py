"""Per-rank memory of the training state and step time, DDP against FSDP, on 2 gloo CPU processes.

    PYTHONPATH=src python bench/fsdp_memory.py                       # the tiny preset
    PYTHONPATH=src python bench/fsdp_memory.py --config configs/ddpm-64.toml --batch 1 --steps 2

Bytes are what rank 0 holds of each part (a DTensor counts its local shard): the weights, the
gradients after a backward (DDP's all-reduce buckets not counted), AdamW's moments and the EMA.
Step time: the median of ``--steps`` steps of the loop's own ``train_step`` on a fixed batch,
after one warm-up step.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from difftrain.config import load_config
from difftrain.diffusion.objective import build_objective
from difftrain.runtime import distributed
from difftrain.training.state import RunState
from difftrain.training.step import StepMetrics, train_step


def _bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _rank(rank: int, port: int, config: str | None, parallel: str, batch: int, steps: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ctx = distributed.setup(torch.device("cpu"))
    overrides = [f"train.parallel={parallel}", f"train.batch_size={batch}", "train.device=cpu",
                 "train.channels_last=off"] + ([] if config else ["model.preset=tiny", "data.resolution=16"])
    cfg = load_config(config, overrides)
    state = RunState.build(cfg, 0, ctx.device)
    state.net = state.parallelize(ctx)
    objective = build_objective(cfg.diffusion)
    r = cfg.data.resolution
    batches = itertools.repeat((torch.rand(batch, cfg.data.channels, r, r) * 2 - 1, torch.zeros(batch, dtype=torch.long)))
    metrics = StepMetrics(ctx.device)
    train_step(state, objective, batches, cfg.optim.lr, metrics, ctx)  # warm-up; creates AdamW's moments
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        train_step(state, objective, batches, cfg.optim.lr, metrics, ctx)
        times.append(time.perf_counter() - start)
    # One more forward and backward, to count the gradients before the step frees them.
    x, _ = next(batches)
    with state.precision.autocast():
        loss = state.net(x, torch.full((batch,), 10)).float().square().mean()
    loss.backward()
    row = {
        "params": sum(p.numel() for p in state.model.parameters()),
        "weights": _bytes(state.model.parameters()),
        "grads": _bytes(p.grad for p in state.model.parameters()),
        "adam": _bytes(v for s in state.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()),
        "ema": _bytes(state.ema.model.parameters()),
        "step_s": statistics.median(times),
        "precision": cfg.train.precision,
    }
    if ctx.is_main:
        torch.save(row, Path(out) / f"{parallel}.pt")
    distributed.teardown(ctx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="a TOML config (default: the tiny preset at 16x16)")
    parser.add_argument("--batch", type=int, default=8, help="images per rank and step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    args = parser.parse_args()
    import socket

    rows = {}
    with tempfile.TemporaryDirectory() as out:
        for parallel in ("ddp", "fsdp"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.start_processes(_rank, (port, args.config, parallel, args.batch, args.steps, out), nprocs=2,
                               start_method="spawn")
            rows[parallel] = torch.load(Path(out) / f"{parallel}.pt")
    mib = 2**20
    print(f"{args.config or 'tiny preset'}: {rows['ddp']['params'] / 1e6:.2f}M parameters, 2 gloo CPU ranks, "
          f"batch {args.batch} per rank, {rows['ddp']['precision']}")
    print("| per rank | weights MiB | gradients MiB | AdamW moments MiB | EMA MiB | total MiB | step s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        total = r["weights"] + r["grads"] + r["adam"] + r["ema"]
        print(f"| {name} | {r['weights'] / mib:.1f} | {r['grads'] / mib:.1f} | {r['adam'] / mib:.1f} | "
              f"{r['ema'] / mib:.1f} | {total / mib:.1f} | {r['step_s']:.3f} |")


if __name__ == "__main__":
    main()
