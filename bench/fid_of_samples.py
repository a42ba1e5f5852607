"""FID and KID of saved sample arrays (bench/confetti.py --save) against real images: one table.

The reference is ``--ref-num`` images drawn uniformly (seed 0) from ``--ref`` (a folder of images
at the samples' resolution, e.g. the 16-px CIFAR-10 test set of bench/make_cifar16.py); its
statistics are cached next to nothing, recomputed per call. ``--floor DIR`` also scores
``--floor-num`` real images drawn from DIR (the training set): the FID a perfect model would get
at this sample count.

    python bench/fid_of_samples.py --ref /tmp/cifar16/test --floor /tmp/cifar16/train samples/*.npz
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from difftrain.evaluation.confetti import confetti_threshold, laplacian_energy
from difftrain.evaluation.fid import compare, list_images, statistics_from_images
from difftrain.evaluation.inception import InceptionFeatures


def draw_images(folder: Path, num: int, seed: int = 0) -> np.ndarray:
    """(num, H, W, 3) uint8: ``num`` images of ``folder`` drawn uniformly without replacement."""
    paths = list_images(folder)
    order = np.random.default_rng(seed).permutation(len(paths))[:num]
    return np.stack([np.asarray(Image.open(paths[i]).convert("RGB")) for i in sorted(order)])


def stats_of(images: np.ndarray, inception: InceptionFeatures, batch: int = 100):
    """FeatureStats of (N, H, W, 3) uint8 images."""
    x = torch.from_numpy(images).permute(0, 3, 1, 2)
    return statistics_from_images((x[i : i + batch] for i in range(0, len(x), batch)), inception)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("samples", nargs="+", help=".npz files with an 'images' array (N, H, W, 3) uint8")
    p.add_argument("--ref", required=True)
    p.add_argument("--ref-num", type=int, default=2000)
    p.add_argument("--floor", help="folder of real training images for the floor row")
    p.add_argument("--floor-num", type=int, default=1000)
    p.add_argument("--no-kid", action="store_true")
    args = p.parse_args(argv)

    inception = InceptionFeatures()
    reference = draw_images(Path(args.ref), args.ref_num)
    threshold = confetti_threshold(reference)
    ref_stats = stats_of(reference, inception)
    rows = []
    inputs = [(Path(s).stem, np.load(s)["images"]) for s in args.samples]
    if args.floor:
        inputs.append((f"real training images ({args.floor_num})", draw_images(Path(args.floor), args.floor_num, seed=1)))
    for name, images in inputs:
        result = compare(stats_of(images, inception), ref_stats, kid=not args.no_kid)
        share = float((laplacian_energy(images) > threshold).mean())
        rows.append((name, len(images), result["fid"], result.get("kid_mean"), share))
        print(f"{name}: FID {result['fid']:.1f}", flush=True)
    print(f"\nreference: {len(reference)} images of {args.ref}\n")
    print("| samples | n | FID | KID | confetti % |")
    print("|---|---|---|---|---|")
    for name, n, fid, kid, share in rows:
        kid_text = "n/a" if kid is None else f"{kid:.4f}"
        print(f"| {name} | {n} | {fid:.1f} | {kid_text} | {100 * share:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
