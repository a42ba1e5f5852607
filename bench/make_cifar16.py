"""CIFAR-10 at 16x16, made once: the data of the CPU-mode benchmarks (time_to_fid, confetti).

Reads the JPEG tarball of ../shared/datasets (or an extracted folder with train/ and test/),
downscales each 32x32 image to 16x16 with PIL's box filter (the mean of each 2x2 block) and
writes lossless PNGs as OUT/{train,test}/<class>/<name>.png, so that no trainer resizes. Never
commit the output: it is made from the dataset.

    python bench/make_cifar16.py ../shared/datasets/cifar10-jpeg.tar.gz /tmp/cifar16
"""

from __future__ import annotations

import argparse
import io
import sys
import tarfile
from pathlib import Path

from PIL import Image

SIZE = 16


def _members(source: Path):
    """(split, class, stem, bytes) for every image of ``source`` (a .tar.gz or a folder)."""
    if source.is_dir():
        for path in sorted(source.glob("*/*/*.jpg")):
            yield path.parts[-3], path.parts[-2], path.stem, path.read_bytes()
        return
    with tarfile.open(source) as tar:
        for member in tar:
            parts = Path(member.name).parts
            if member.isfile() and member.name.endswith(".jpg") and len(parts) >= 3 and parts[-3] in ("train", "test"):
                yield parts[-3], parts[-2], Path(parts[-1]).stem, tar.extractfile(member).read()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("source", help="cifar10-jpeg.tar.gz or a folder with train/ and test/")
    p.add_argument("out", help="output folder")
    args = p.parse_args(argv)
    out = Path(args.out)
    done = out / ".complete"
    if done.exists():
        print(f"{out}: already made")
        return 0
    counts = {"train": 0, "test": 0}
    for split, cls, stem, data in _members(Path(args.source)):
        image = Image.open(io.BytesIO(data)).convert("RGB").resize((SIZE, SIZE), Image.Resampling.BOX)
        target = out / split / cls / f"{stem}.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        image.save(target)
        counts[split] += 1
    if not counts["train"] or not counts["test"]:
        print(f"{args.source}: no train/ or test/ JPEG images found", file=sys.stderr)
        return 1
    done.write_text(f"{counts}\n")
    print(f"{out}: {counts['train']} train, {counts['test']} test images at {SIZE}x{SIZE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
