"""Data loader images/s: a JPEG folder, its decode cache, its tar shards and a HF dataset of it.

    python bench/loader.py /tmp/cifar10/train --workers 0 2 --batches 100

Each row times difftrain's own loader (``build_loader``: sharded sampler, flips, collation)
over ``--batches`` batches after one warm-up batch, for the same images read from the folder,
from its decode cache (``data.cache = true``), from WebDataset-style tar shards of its files
(``--shard-size`` images each) and from a Hugging Face dataset of them (``save_to_disk``; a row
only where the datasets package is installed). The cache, the shards and the dataset are made
in a temporary folder before timing, and the time each took (the shards' index included) is
printed. Compare with the training images/s of bench/train_throughput.py: the target is a
loader at least 5x faster than training consumes.
"""

from __future__ import annotations

import argparse
import io
import os
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from difftrain.data import build_dataset, build_loader


def write_shards(folder, out: Path, shard_size: int) -> str:
    """The folder dataset's files as tar shards of ``shard_size`` samples (KEY.jpg + KEY.cls); the pattern."""
    files, labels = folder.files, folder.labels
    out.mkdir(parents=True, exist_ok=True)
    count = (len(files) + shard_size - 1) // shard_size
    for s in range(count):
        with tarfile.open(out / f"train-{s:06d}.tar", "w") as tar:
            for rel, label in zip(files[s * shard_size : (s + 1) * shard_size], labels[s * shard_size :]):
                key, _ = os.path.splitext(rel)
                tar.add(folder.root / rel, arcname=rel)
                info = tarfile.TarInfo(key + ".cls")
                info.size = len(str(label))
                tar.addfile(info, io.BytesIO(str(label).encode()))
    return str(out / f"train-{{000000..{count - 1:06d}}}.tar")


def write_hf_dataset(folder, out: Path) -> str | None:
    """The folder dataset's files as a Hugging Face dataset saved to ``out``; None without datasets."""
    try:
        import datasets
    except ImportError:
        return None
    rows = {"image": [{"bytes": p.read_bytes(), "path": p.name} for p in folder.paths], "label": folder.labels}
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(out))
    return str(out)


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
    p.add_argument("--shard-size", type=int, default=1000, help="images per tar shard")
    p.add_argument("--cache-dir", help="where to build the cache (default: a temporary folder)")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="difftrain-bench-loader-"))
    os.environ["DIFFTRAIN_CACHE"] = str(work / "difftrain-cache")  # the shard index is built, and timed, afresh
    cache_dir = args.cache_dir or str(work / "cache")
    options = dict(resolution=args.resolution, channels=3, random_flip=True, color_jitter=0.0, class_conditional=False)
    folder = build_dataset(args.path, **options)
    t0 = time.perf_counter()
    cached = build_dataset(args.path, **options, cache=True, cache_dir=cache_dir)
    print(f"{len(folder):,} images; decode cache built (or found) in {time.perf_counter() - t0:.1f} s at {cached.path}")
    t0 = time.perf_counter()
    pattern = write_shards(folder, work / "shards", args.shard_size)
    t1 = time.perf_counter()
    shards = build_dataset(pattern, **options)
    print(f"tar shards written in {t1 - t0:.1f} s, indexed in {time.perf_counter() - t1:.2f} s: {pattern}")
    sources = [("JPEG folder", folder), ("decode cache", cached), (f"tar shards ({len(shards.shards)})", shards)]
    t0 = time.perf_counter()
    saved = write_hf_dataset(folder, work / "hf")
    if saved is not None:
        sources.append(("HF dataset (save_to_disk)", build_dataset(saved, **options)))
        print(f"HF dataset saved and opened in {time.perf_counter() - t0:.1f} s: {saved}")
    print(f"CPU cores: {os.cpu_count()}; batch {args.batch}; {args.batches} timed batches\n")
    print("| source | workers | images/s |")
    print("|---|---|---|")
    for workers in args.workers:
        for name, ds in sources:
            print(f"| {name} | {workers} | {loader_rate(ds, args.batch, workers, args.batches):,.0f} |", flush=True)


if __name__ == "__main__":
    main()
