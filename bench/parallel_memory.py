"""Memory per rank of weights, gradients, AdamW state and EMA under DDP and FSDP, at 1, 2 and 8
ranks, for the 88M ddpm-64 preset and an SDXL-sized UNet2DConditionModel (2.6B parameters).

    python bench/parallel_memory.py                # the table; then ddpm-64 measured on 1 and 2 gloo processes
    python bench/parallel_memory.py --no-measure   # the table alone

The table is ``difftrain estimate --parallel P --world-size N``'s accounting
(``difftrain.tools.parallel_memory``). For ddpm-64 it takes the tensors of one real optimizer
step of the preset (``configs/ddpm-64.toml``, bf16 compute); the SDXL-sized UNet
(``bench/sdxl_unet_config.json``: stabilityai/stable-diffusion-xl-base-1.0's UNet config) is
built on the meta device and counted from its shapes, with bf16 compute, as FSDP's mixed
precision would run it. Transient: FSDP's largest unit all-gathered with its gradients, x2 for
prefetch; DDP's gradient buckets. Activations are left out (``difftrain estimate`` measures them
per batch).

The measurement spawns 1 and 2 gloo processes on the CPU, wraps ddpm-64 in DDP or in
``fully_shard`` (fp32, no mixed precision), takes one AdamW step at batch 1 and sums the local
storage bytes (``DTensor.to_local()``) of weights, gradients, AdamW state and an EMA made as a
copy of the local weights, on each rank. The units are training's (``runtime.fsdp.blocks``):
difftrain's UNet per ResBlock, attention block and resampler, not per level (its levels push and
pop a list of skip tensors, which FSDP2's forward hook copies); a diffusers UNet per ResNet,
transformer and resampler. The shards do not depend on the grouping; only the transient does.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SDXL_CONFIG = ROOT / "bench" / "sdxl_unet_config.json"
RANKS = (1, 2, 8)
MiB, GiB = 2**20, 2**30


def estimated_rows() -> list[tuple]:
    """(model, parallel, ranks, RankMemory, how) for both models, both parallelisms, RANKS."""
    from difftrain.config import load_config
    from difftrain.tools.common import build_setup
    from difftrain.tools.estimate import state_after_one_step
    from difftrain.tools.parallel_memory import PARALLELISMS, counted_memory, meta_condition_unet, rank_memory

    rows = []
    cfg = load_config(str(ROOT / "configs" / "ddpm-64.toml"), ["data.path=/nonexistent", "data.num_workers=0"])
    setup = build_setup(cfg, need_data=False)
    state, ema = state_after_one_step(setup, 1)
    n = sum(p.numel() for p in setup.model.parameters())
    for parallel in PARALLELISMS:
        for ranks in RANKS:
            rows.append((f"ddpm-64 ({n / 1e6:.0f}M)", parallel, ranks,
                         rank_memory(setup.model, state, ema, parallel, ranks, cfg.train.precision),
                         "tensors of a real step"))
    sdxl_cfg = load_config(None, ["train.precision=bf16"])
    model = meta_condition_unet(SDXL_CONFIG)
    n = sum(p.numel() for p in model.parameters())
    for parallel in PARALLELISMS:
        for ranks in RANKS:
            rows.append((f"SDXL-sized ({n / 1e9:.2f}B)", parallel, ranks,
                         counted_memory(model, sdxl_cfg, parallel, ranks), "counted on meta"))
    return rows


def print_table(rows: list[tuple]) -> None:
    print("| model | parallel | ranks | params | grads | optimizer | EMA | transient | total per rank | figures |")
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|---|")
    for model, parallel, ranks, m, how in rows:
        sizes = " | ".join(f"{v / GiB:.2f}" for v in (m.params, m.grads, m.optimizer, m.ema, m.transient, m.total))
        unit = f", {m.largest_unit}" if m.largest_unit else ""
        print(f"| {model} | {parallel.upper()} | {ranks} | {sizes} | {how}{unit} |")
    print("(GiB per rank, rank 0; transient: FSDP's largest unit all-gathered in bf16 with its gradients, x2 for "
          "prefetch; DDP's gradient buckets)")


# -- measured: ddpm-64 on gloo processes ---------------------------------------------------------


def _local_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors by their local shards)."""
    storages = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def _measure_rank(rank: int, world_size: int, port: int, parallel: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from difftrain.models import build_unet
    from difftrain.runtime.fsdp import blocks

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = build_unet("ddpm-64", resolution=64, in_channels=3)
    if parallel == "ddp":
        net = DistributedDataParallel(model)
    else:
        for m in blocks(model):  # the units training shards
            fully_shard(m)
        net = fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    start = time.perf_counter()
    net(torch.randn(1, 3, 64, 64), torch.tensor([500])).square().mean().backward()
    opt.step()
    params = list(model.parameters())
    ema = [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in params]
    sizes = dict(params=_local_bytes(params), grads=_local_bytes(p.grad for p in params),
                 optimizer=_local_bytes(v for s in opt.state.values() for v in s.values()), ema=_local_bytes(ema),
                 step_s=time.perf_counter() - start)
    torch.save(sizes, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def measure(parallel: str, world_size: int) -> list[dict]:
    """Each rank's local bytes after one step of ddpm-64 under ``parallel`` on ``world_size`` processes."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_measure_rank, (world_size, port, parallel, out_dir), nprocs=world_size,
                           start_method="spawn")
        return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world_size)]


def print_measured(rows: list[tuple]) -> None:
    estimated = {(parallel, ranks): m for model, parallel, ranks, m, _ in rows if model.startswith("ddpm-64")}
    keys = ("params", "grads", "optimizer", "ema")
    print("\n| ddpm-64, fp32 on CPU | rank | params | grads | optimizer | EMA | bytes = estimate | step s |")
    print("|---|--:|--:|--:|--:|--:|---|--:|")
    for parallel in ("ddp", "fsdp"):
        for world_size in (1, 2):
            e = estimated[(parallel, world_size)]
            print(f"| {parallel.upper()} x{world_size}, estimated | 0 | "
                  + " | ".join(f"{getattr(e, k) / MiB:.2f}" for k in keys) + " | | |")
            for rank, r in enumerate(measure(parallel, world_size)):
                same = [k for k in keys if r[k] == getattr(e, k)]
                print(f"| {parallel.upper()} x{world_size}, measured | {rank} | "
                      + " | ".join(f"{r[k] / MiB:.2f}" for k in keys)
                      + f" | {'all four' if len(same) == 4 else ', '.join(same) or 'none'} | {r['step_s']:.1f} |",
                      flush=True)
    print("(MiB per rank; estimated: rank 0's, which holds the largest chunk of every tensor)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-measure", action="store_true", help="print the estimated table alone")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores; `python {' '.join(sys.argv)}`\n")
    rows = estimated_rows()
    print_table(rows)
    if not args.no_measure:
        print_measured(rows)


if __name__ == "__main__":
    main()
