"""Data loader images/s: a JPEG folder decoded on the fly against the uint8 decode cache.

    python bench/loader.py /tmp/cifar10/train --workers 0 2 --batches 100

Each row times difftrain's own loader (``build_loader``: sharded sampler, flips, collation)
over ``--batches`` batches after one warm-up batch, for the dataset read from the folder and
from its decode cache (``data.cache = true``; built once before timing, and the build time is
printed). Compare with the training images/s of bench/train_throughput.py: the target is a
loader at least 5x faster than training consumes.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from difftrain.data import build_dataset, build_loader


def loader_rate(dataset, batch: int, workers: int, batches: int) -> float:
    it = iter(build_loader(dataset, batch, seed=0, start=0, num_workers=workers, device=torch.device("cpu")))
    next(it)  # workers started, first batch ready
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * batch / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path", help="a folder of images, e.g. CIFAR-10's train/ as JPEG")
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--cache-dir", help="where to build the cache (default: a temporary folder)")
    args = p.parse_args()

    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="difftrain-cache-")
    folder = build_dataset(args.path, resolution=args.resolution, channels=3, random_flip=True, color_jitter=0.0, class_conditional=False)
    t0 = time.perf_counter()
    cached = build_dataset(args.path, resolution=args.resolution, channels=3, random_flip=True, color_jitter=0.0, class_conditional=False, cache=True, cache_dir=cache_dir)
    print(f"{len(folder):,} images; decode cache built (or found) in {time.perf_counter() - t0:.1f} s at {cached.path}")
    print(f"CPU cores: {os.cpu_count()}; batch {args.batch}; {args.batches} timed batches\n")
    print("| source | workers | images/s |")
    print("|---|---|---|")
    for workers in args.workers:
        for name, ds in (("JPEG folder", folder), ("decode cache", cached)):
            print(f"| {name} | {workers} | {loader_rate(ds, args.batch, workers, args.batches):,.0f} |", flush=True)


if __name__ == "__main__":
    main()
