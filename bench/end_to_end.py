"""The real CLI on an image folder against diffusers' real training script: time to first step
and steady-state images/s, each trainer in its own process, one after the other.

    python bench/end_to_end.py --data /tmp/cifar10/train --steps 600 --batch 128     # a GPU machine
    python bench/end_to_end.py --data builtin:shapes --config configs/tiny.toml --steps 60 --batch 32 \\
        --resolution 16 --peer none                                                  # the CPU

difftrain: ``difftrain train`` as a user runs it; its time to first step and images/s come from
its own ``metrics.jsonl`` (``time_to_first_step_s``; the median ``images_per_s`` of the log
windows after the first, which leave out validation and checkpoint time). diffusers:
``accelerate launch ../shared/peers/train_unconditional.py`` (it needs torchvision, so it runs
on the GPU machines only; elsewhere it is reported as skipped); its progress bar's timestamps
give the time to its first step and the median steps/s after the first tenth of the steps.
Both trainers are timed from process start.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers"


def run_difftrain(args, out: Path) -> dict:
    """Train with the CLI; read its metrics.jsonl."""
    run_dir = out / "difftrain"
    sets = [f"data.path={args.data}", f"data.resolution={args.resolution}", f"train.total_steps={args.steps}",
            f"train.batch_size={args.batch}", "train.log_every_steps=20", "train.progress_bar=false",
            f"checkpoint.every_steps={args.steps}", f"validation.every_steps={args.steps}",
            f"optim.warmup_steps={min(500, args.steps // 2)}", *args.set]
    cmd = [sys.executable, "-m", "difftrain", "train", "--run-dir", str(run_dir)]
    cmd += ["--config", args.config] if args.config else []
    cmd += [x for s in sets for x in ("--set", s)]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["images_per_s"] for r in rows if "images_per_s" in r][1:]  # the first window holds compilation
    first = next(r["time_to_first_step_s"] for r in rows if "time_to_first_step_s" in r)
    return {"trainer": "difftrain", "steps": args.steps, "wall_s": wall, "time_to_first_step_s": first,
            "images_per_s": statistics.median(rates) if rates else float("nan")}


_BAR = re.compile(r"(\d+)/(\d+) \[")


def run_diffusers(args, out: Path) -> dict:
    """diffusers' train_unconditional.py through accelerate, timed from its progress bar."""
    if importlib.util.find_spec("torchvision") is None or importlib.util.find_spec("accelerate") is None:
        return {"trainer": "diffusers", "skipped": "needs torchvision and accelerate (the GPU machines have them)"}
    epochs = max(1, -(-args.steps * args.batch // args.num_images))
    cmd = ["accelerate", "launch", "--num_processes", "1", "--mixed_precision", args.peer_precision,
           str(PEERS / "train_unconditional.py"), "--train_data_dir", args.data, "--resolution", str(args.resolution),
           "--output_dir", str(out / "diffusers"), "--model_config_name_or_path", str(PEERS / "ddpm-cifar10-unet"),
           "--train_batch_size", str(args.batch), "--num_epochs", str(epochs), "--learning_rate", "2e-4",
           "--lr_warmup_steps", str(min(500, args.steps // 2)), "--mixed_precision", args.peer_precision,
           "--dataloader_num_workers", "8", "--use_ema", "--save_model_epochs", "1000", "--save_images_epochs", "1000",
           "--checkpointing_steps", "1000000", "--cache_dir", str(out / "hf")]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=PEERS)
    seen: list[tuple[float, int]] = []  # (seconds since start, global step) at each progress update
    buffer, offset, last = "", 0, 0
    while True:
        chunk = proc.stderr.read(256)
        if not chunk:
            break
        buffer += chunk
        *updates, buffer = re.split(r"[\r\n]", buffer)
        for text in updates:
            m = _BAR.search(text)
            if not m:
                continue
            step = int(m.group(1))
            if step < last:  # a new epoch's bar starts from 0
                offset += last
            last = step
            if step > 0:
                seen.append((time.perf_counter() - start, offset + step))
        if seen and seen[-1][1] >= args.steps:
            proc.terminate()
    proc.wait()
    wall = time.perf_counter() - start
    if len(seen) < 3:
        return {"trainer": "diffusers", "skipped": f"its progress bar showed {len(seen)} steps (exit {proc.returncode})"}
    steady = seen[len(seen) // 10 :]
    rates = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(steady, steady[1:]) if b[0] > a[0] and b[1] > a[1]]
    return {"trainer": "diffusers", "steps": seen[-1][1], "wall_s": wall, "time_to_first_step_s": seen[0][0],
            "images_per_s": statistics.median(rates) * args.batch if rates else float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="image folder (class subfolders allowed) or builtin:NAME")
    p.add_argument("--config", default="configs/ddpm-cifar10.toml", help="difftrain preset ('' for the defaults)")
    p.add_argument("--set", action="append", default=[], help="extra difftrain overrides")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--num-images", type=int, default=50_000, help="images in --data (for the peer's epochs)")
    p.add_argument("--peer", default="diffusers", choices=["diffusers", "none"])
    p.add_argument("--peer-precision", default="bf16", choices=["no", "bf16", "fp16"])
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(run_difftrain(args, Path(tmp)))
        if args.peer == "diffusers":
            rows.append(run_diffusers(args, Path(tmp)))
    print("\n| trainer | steps | time to first step (s) | steady images/s | wall (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['trainer']} | skipped: {r['skipped']} | | | |")
        else:
            print(f"| {r['trainer']} | {r['steps']} | {r['time_to_first_step_s']:.1f} | {r['images_per_s']:,.0f} | "
                  f"{r['wall_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
