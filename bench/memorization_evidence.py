"""Does a feature space tell copies of training images from new images? Prints, per space, the
near-copy share and median ratio (evaluation/memorization.py) of augmented copies of training
images and of held-out images, and the 1M x D search time (measured on a smaller index and
extrapolated, or measured directly with --search-rows 1000000).

    python bench/memorization_evidence.py --data /tmp/cifar16 --num-train 5000 --num-queries 200 \\
        --spaces pixels inception --inception-train 1000

data: a folder with train/<class>/*.png and test/<class>/*.png (bench/make_cifar16.py makes one).
"""

from __future__ import annotations

import argparse
import io
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from difftrain.evaluation.memorization import NEAR_COPY_RATIO, feature_network, memorization


def load(paths: list[Path]) -> torch.Tensor:
    return torch.stack([torch.from_numpy(np.asarray(Image.open(p).convert("RGB"))).permute(2, 0, 1) for p in paths])


def flip(x: torch.Tensor) -> torch.Tensor:
    return x.flip(-1)


def shift(x: torch.Tensor, px: int = 2) -> torch.Tensor:
    """Shifted right and down by ``px``, the border replicated (as a crop-and-pad would)."""
    padded = torch.nn.functional.pad(x.float(), (px, 0, px, 0), mode="replicate")
    return padded[..., : x.shape[-2], : x.shape[-1]].round().to(torch.uint8)


def jpeg(x: torch.Tensor, quality: int = 75) -> torch.Tensor:
    out = []
    for image in x:
        buf = io.BytesIO()
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(buf, "JPEG", quality=quality)
        out.append(torch.from_numpy(np.asarray(Image.open(buf).convert("RGB"))).permute(2, 0, 1))
    return torch.stack(out)


AUGMENTS = {"flip": flip, "shift 2px": shift, "jpeg q75": jpeg, "flip+shift+jpeg": lambda x: jpeg(shift(flip(x)))}


def features(net, images: torch.Tensor, batch: int = 64) -> torch.Tensor:
    return torch.cat([net(images[i:i + batch]) for i in range(0, len(images), batch)])


def evaluate_space(space: str, train: torch.Tensor, heldout: torch.Tensor, queries: int, seed: int) -> None:
    net = feature_network(space)
    start = time.perf_counter()
    index = features(net, train).numpy().astype(np.float16)
    query = lambda images: torch.cat([net.queries(images[i:i + 64]) for i in range(0, len(images), 64)])
    print(f"\n{space}: {len(train)} training images indexed in {time.perf_counter() - start:.1f} s (dim {net.dim})")
    rng = np.random.default_rng(seed)
    chosen = torch.from_numpy(rng.choice(len(train), queries, replace=False))
    rows = {name: aug(train[chosen]) for name, aug in AUGMENTS.items()}
    rows["held-out (test set)"] = heldout[:queries]
    print(f"{'queries':22s} {'n':>4s} {'near-copy share':>16s} {'median ratio':>13s} {'p5 / p95 ratio':>16s}"
          f" {'NN is the source':>17s}")
    for name, images in rows.items():
        result = memorization(query(images), index)
        r = result.ratio.numpy()
        source = "" if name.startswith("held") else f"{float((result.neighbour == chosen).float().mean()):.0%}"
        print(f"{name:22s} {len(r):4d} {float(result.near_copy.float().mean()):16.1%} {np.median(r):13.3f} "
              f"{np.percentile(r, 5):7.3f} / {np.percentile(r, 95):6.3f} {source:>17s}")


def search_time(rows: int, dim: int, queries: int, chunk: int) -> None:
    """Time of one search of ``queries`` against a random float16 (rows, dim) index in memory."""
    index = np.empty((rows, dim), dtype=np.float16)
    rng = np.random.default_rng(0)
    for start in range(0, rows, 65_536):  # filled in chunks: a float32 copy of 1M x 2048 would be 8 GiB
        block = rng.standard_normal((min(65_536, rows - start), dim), dtype=np.float32)
        index[start:start + len(block)] = block / np.linalg.norm(block, axis=1, keepdims=True)
    q = torch.nn.functional.normalize(torch.randn(queries, dim), dim=1)
    start = time.perf_counter()
    memorization(q, index, NEAR_COPY_RATIO, chunk)
    seconds = time.perf_counter() - start
    per_million = seconds * 1e6 / rows
    print(f"\nsearch: {queries} queries (+ their neighbours' own NN) vs {rows:,} x {dim} float16 in "
          f"{seconds:.2f} s, chunk {chunk}: {per_million:.1f} s per 1M rows "
          f"(peak extra memory about {chunk * dim * 4 / 2**20 + chunk * queries * 4 / 2**20:.0f} MiB)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="/tmp/cifar16")
    p.add_argument("--num-train", type=int, default=5000)
    p.add_argument("--num-queries", type=int, default=200)
    p.add_argument("--spaces", nargs="*", default=["pixels"], help="feature spaces to compare (none: the timing only)")
    p.add_argument("--inception-train", type=int, default=1000, help="training images for the inception space")
    p.add_argument("--search-rows", type=int, default=100_000)
    p.add_argument("--search-dim", type=int, default=2048)
    p.add_argument("--search-queries", type=int, default=64)
    p.add_argument("--chunk", type=int, default=65_536)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.spaces:
        compare(args)
    if args.search_rows:
        search_time(args.search_rows, args.search_dim, args.search_queries, args.chunk)


def compare(args) -> None:
    rng = np.random.default_rng(args.seed)
    train_paths = sorted(Path(args.data, "train").glob("*/*.png"))
    test_paths = sorted(Path(args.data, "test").glob("*/*.png"))
    train_paths = [train_paths[i] for i in rng.choice(len(train_paths), args.num_train, replace=False)]
    test_paths = [test_paths[i] for i in rng.choice(len(test_paths), args.num_queries, replace=False)]
    train, heldout = load(train_paths), load(test_paths)
    for space in args.spaces:
        n = args.inception_train if space != "pixels" else len(train)
        evaluate_space(space, train[:n], heldout, min(args.num_queries, n), args.seed)


if __name__ == "__main__":
    main()
