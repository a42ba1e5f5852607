"""A run made to over-fit beside a healthy one, with the memorization, diversity, FID and held-out
signals and the warnings they raise (docs/monitoring.md, "Warnings").

    python bench/monitoring_demo.py --cifar16 /tmp/cifar16 --out /tmp/monitoring-demo

Both runs use configs/cifar10-16px-cpu.toml with the same schedule: ``overfit`` trains on
``--num-images`` (16; at least --batch) CIFAR-10 images without flips, ``healthy`` on the whole training set with
flips. Both hold out the same 200 test images (held-out loss) and measure FID against the same
200 other test images, so their numbers compare. ``--cifar16``: a folder with train/<class>/*.png and test/<class>/*.png
(bench/make_cifar16.py). Nothing made here goes into the repository.
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

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("memorization/near_copy_share", "memorization/median_ratio", "diversity/ratio", "fid", "heldout/loss")


def _folder(src: list[Path], dest: Path) -> Path:
    """``dest`` holding copies of ``src`` (class folders kept)."""
    if dest.exists():
        shutil.rmtree(dest)
    for p in src:
        (dest / p.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(p, dest / p.parent.name / p.name)
    return dest


def _sets(args, data: Path, heldout: Path, fid_ref: Path, flip: bool) -> list[str]:
    every = args.every
    return [f"data.path={data}", f"data.heldout_path={heldout}", f"data.random_flip={str(flip).lower()}",
            f"train.total_steps={args.steps}", f"train.batch_size={args.batch}", "train.log_every_steps=50",
            "train.device=cpu", "train.progress_bar=false", f"optim.lr={args.lr}", "optim.lr_schedule=constant",
            # the recipe this demo was measured with (the preset has since moved to EDM)
            "diffusion.objective=ddpm", "diffusion.schedule=linear", "diffusion.prediction=epsilon",
            "optim.warmup_steps=30", "ema.decay=0.995", f"checkpoint.every_steps={args.steps}",
            f"validation.every_steps={every}", "validation.num_images=32", "validation.sampler=ddim",
            "validation.steps=25", "validation.heldout_max_images=200", "validation.memorization=pixels",
            f"evaluation.fid_every_steps={every}", f"evaluation.fid_ref={fid_ref}", "evaluation.fid_num_samples=32",
            "evaluation.fid_batch_size=32", "evaluation.fid_steps=25", "tracking.tensorboard=false"]


def _train(name: str, sets: list[str], out: Path, resume: bool = False) -> tuple[float, list[str]]:
    run = out / name
    if run.exists() and not resume:
        shutil.rmtree(run)
    cmd = [sys.executable, "-m", "difftrain", "train", "--config", str(ROOT / "configs" / "cifar10-16px-cpu.toml"),
           "--run-dir", str(run), *[x for s in sets for x in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    with open(out / f"{name}.log", "a") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return seconds, [line for line in proc.stderr.splitlines() if "warning: step" in line]


def _warnings(out: Path, name: str) -> list[str]:
    """Every warning the run logged, from its metrics.jsonl (all its starts)."""
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return [r["warning"] for r in rows if "warning" in r]


def _table(out: Path, name: str) -> None:
    rows: dict[int, dict] = {}
    for line in (out / name / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows.setdefault(r["step"], {}).update({k: r[k] for k in KEYS if k in r})
    print(f"\n{name}\n| step | near-copy share | median ratio | diversity (Vendi / data's) | FID (32 vs 200) | held-out loss |")
    print("|---:|---:|---:|---:|---:|---:|")
    for step, r in sorted(rows.items()):
        if "fid" in r or "heldout/loss" in r:
            cells = [f"{r[k]:.0%}" if k.endswith("share") and k in r else f"{r[k]:.3g}" if k in r else ""
                     for k in KEYS]
            print(f"| {step} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cifar16", default="/tmp/cifar16")
    p.add_argument("--out", default="/tmp/monitoring-demo")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--num-images", type=int, default=16, help="training images of the over-fitting run")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--only", choices=["overfit", "healthy"])
    p.add_argument("--resume", action="store_true", help="continue the runs in --out to --steps instead of restarting")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(args.cifar16)
    train = sorted((src / "train").glob("*/*.png"))
    test = sorted((src / "test").glob("*/*.png"))
    n = args.num_images
    few = _folder([train[i] for i in range(0, len(train), len(train) // n)][:n], out / "data" / f"train{n}")
    heldout = _folder(test[::len(test) // 200][:200], out / "data" / "heldout200")
    fid_ref = _folder(test[1::len(test) // 200][:200], out / "data" / "fidref200")
    runs = {"overfit": _sets(args, few, heldout, fid_ref, flip=False),
            "healthy": _sets(args, src / "train", heldout, fid_ref, flip=True)}
    for name, sets in runs.items():
        if args.only and name != args.only:
            continue
        seconds, _ = _train(name, sets, out, args.resume)
        print(f"\n{name}: {seconds:.0f} s")
        for line in _warnings(out, name):
            print(f"  warning: {line}")
        _table(out, name)


if __name__ == "__main__":
    main()
