"""Memory soak: train the tiny preset for many steps on the CPU and sample resident memory.

    OMP_NUM_THREADS=1 python scripts/soak.py --steps 5000 --run-dir /tmp/difftrain-soak

Starts ``difftrain train`` as a real subprocess (16x16 tiny overrides, a small batch),
reads its resident set size (VmRSS in /proc/PID/status) every ``--interval-s`` seconds
together with the step of the last line of metrics.jsonl, then prints the samples and the
growth of RSS after warm-up (the first ``--warmup-frac`` of the steps). Exits 1 when RSS
grows by more than ``--max-growth-mib`` after warm-up. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

OVERRIDES = [
    "data.resolution=16",
    "data.num_workers=0",
    "model.attention_resolutions=[8]",
    "diffusion.num_timesteps=100",
    "optim.warmup_steps=100",
    "train.batch_size=4",
    "train.log_every_steps=50",
    "train.progress_bar=false",
    "checkpoint.every_steps=1000",
    "checkpoint.keep_last=2",
    "validation.every_steps=1000",
    "validation.num_images=4",
    "validation.steps=5",
]


def rss_mib(pid: int) -> float | None:
    """Resident set size of ``pid`` in MiB, or None when it has exited."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def last_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (FileNotFoundError, json.JSONDecodeError, IndexError, KeyError):
        return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--run-dir", default="/tmp/difftrain-soak")
    parser.add_argument("--interval-s", type=float, default=2.0)
    parser.add_argument("--warmup-frac", type=float, default=0.2)
    parser.add_argument("--max-growth-mib", type=float, default=20.0)
    args = parser.parse_args()

    run_dir = Path(args.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "difftrain", "train", "--config", "configs/tiny.toml", "--run-dir", str(run_dir)]
    cmd += [x for o in OVERRIDES + [f"train.total_steps={args.steps}"] for x in ("--set", o)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    samples: list[tuple[float, int, float]] = []  # (seconds, step, RSS MiB)
    while proc.poll() is None:
        rss = rss_mib(proc.pid)
        if rss is not None:
            samples.append((time.monotonic() - start, last_step(run_dir / "metrics.jsonl"), rss))
        time.sleep(args.interval_s)
    if proc.returncode != 0:
        print(f"soak: training exited with {proc.returncode}")
        return 1
    warm = [s for s in samples if s[1] >= args.warmup_frac * args.steps]
    if len(warm) < 2:
        print("soak: too few samples after warm-up; lower --interval-s")
        return 1
    print(f"soak: {args.steps} steps in {time.monotonic() - start:.0f} s, {len(samples)} RSS samples")
    print(f"{'seconds':>8} {'step':>6} {'RSS MiB':>8}")
    every = max(1, len(samples) // 20)
    for t, step, rss in samples[::every] + [samples[-1]]:
        print(f"{t:8.0f} {step:6d} {rss:8.1f}")
    first, last = warm[0][2], warm[-1][2]
    peak = max(s[2] for s in warm)
    growth = last - first
    print(
        f"after warm-up (step >= {int(args.warmup_frac * args.steps)}): first {first:.1f} MiB, "
        f"last {last:.1f} MiB, peak {peak:.1f} MiB, growth {growth:+.1f} MiB"
    )
    ok = growth <= args.max_growth_mib and peak - first <= args.max_growth_mib
    print("soak: PASS" if ok else f"soak: FAIL (growth over {args.max_growth_mib} MiB)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
