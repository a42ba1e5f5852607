"""Write a folder of generated images in the shapes of a real photo collection and print its bucket table.

    python scripts/bucket_table.py [--resolution 1024] [--multiple 8] [--batch 4] [--keep DIR]

The images are flat colours (nothing is downloaded, nothing committed): phone photos 4:3 and 3:4, camera
photos 3:2 and 2:3, screenshots and video frames 16:9 and 9:16, squares, a few small web images, a
panorama and a 1x20000 sliver. It runs ``difftrain data check --buckets`` on them, the table docs/buckets.md
shows.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

# (width, height, count): the shapes of a mixed collection, scaled down 4x where the size does not
# change the bucket (the table depends on the aspect and on whether an image covers its bucket).
SHAPES = [
    (4032, 3024, 9), (3024, 4032, 7),  # phone 4:3 / 3:4
    (1536, 1024, 8), (1024, 1536, 6),  # camera 3:2 / 2:3
    (1920, 1080, 6), (1080, 1920, 3),  # 16:9 / 9:16
    (1024, 1024, 5), (2048, 2048, 2),  # squares
    (800, 600, 3), (640, 480, 2),  # small web images: smaller than their bucket, never upscaled
    (3000, 1000, 1),  # a 3:1 panorama
    (1, 20000, 1),  # a sliver: no bucket
]


def write_folder(root: Path) -> int:
    """Write the images of :data:`SHAPES` into ``root``; returns how many."""
    root.mkdir(parents=True, exist_ok=True)
    n = 0
    for w, h, count in SHAPES:
        for _ in range(count):
            Image.new("RGB", (w, h), (n * 37 % 256, 90, 160)).save(root / f"{n:03d}_{w}x{h}.png", compress_level=1)
            n += 1
    return n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--multiple", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--keep", help="write the folder here (default: a temporary folder, removed)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep) if args.keep else Path(tmp) / "mixed"
        n = write_folder(root)
        print(f"{n} images in {root}", file=sys.stderr)
        command = [sys.executable, "-m", "difftrain", "data", "check", str(root), "--buckets", "--workers", "0",
                   "--resolution", str(args.resolution), "--multiple", str(args.multiple), "--batch", str(args.batch)]
        return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
