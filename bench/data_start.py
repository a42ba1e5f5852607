"""The start-up of a run's data: ``prepare_training_data`` on a folder with the decode cache on, timed at the run's
first start (scan, check, file list, cache build) and at a resume (the saved file list, the cache found).

    PYTHONPATH=src OMP_NUM_THREADS=1 taskset -c 0 python bench/data_start.py --data /tmp/cifar16/train

Prints one table row per repeat (seconds). To compare two trees, run it with each tree's ``src`` on
``PYTHONPATH``, one core each, at the same time (docs/benchmarks.md, "The data's start-up").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a folder of images (bench/make_cifar16.py makes one)")
    p.add_argument("--resolution", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="difftrain-bench-data-"))
    os.environ["DIFFTRAIN_CACHE"] = str(work / "difftrain-cache")  # the shared scan and decode caches, afresh
    from difftrain.config import load_config
    from difftrain.data.prepare import prepare_training_data

    tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(prepare_training_data.__code__.co_filename).parent).stdout.strip()
    cfg = load_config(None, [f"data.path={args.data}", f"data.resolution={args.resolution}", "data.cache=true",
                             "data.num_workers=0", "model.preset=tiny"])
    print("| tree | repeat | images | first start (s) | resume (s) |")
    print("|---|---|---|---|---|")
    for repeat in range(args.repeats):
        os.environ["DIFFTRAIN_CACHE"] = str(work / f"difftrain-cache-{repeat}")
        run = work / f"run-{repeat}"
        t = time.perf_counter()
        data = prepare_training_data(cfg, run)
        first = time.perf_counter() - t
        (run / "checkpoints").mkdir()
        (run / "checkpoints" / "step_00000002.pt").write_bytes(b"")  # what makes the next start a resume
        t = time.perf_counter()
        prepare_training_data(cfg, run)
        again = time.perf_counter() - t
        print(f"| {tree} | {repeat} | {len(data.train):,} | {first:.1f} | {again:.1f} |", flush=True)


if __name__ == "__main__":
    main()
