"""LoRA fine-tuning speed beside diffusers' ``train_text_to_image_lora.py``: the same tiny random
Stable Diffusion folder, data, batch, steps, LR plan, rank and precision, both at the same time,
one core each; steps per second from each one's own log.

    python bench/peer_lora_speed.py --peer-python /path/to/venv/bin/python \\
        --peer-script /path/to/diffusers/examples/text_to_image/train_text_to_image_lora.py

Writes into ``--work``: ``sd/`` (the tiny random Stable Diffusion folder the tests use,
tests/text_components.py), ``data/`` (``--images`` built-in shapes at ``--resolution`` px with a
``metadata.jsonl`` of their captions), then runs diffusers' script pinned to one core and
``difftrain train`` to the other (``taskset``, one thread each), and prints both commands and
the steady-state steps per second (steps ``--skip`` to the last, from each log's own
timestamps: the peer's progress bar's elapsed time, difftrain's metrics.jsonl).

Matched: base, data (difftrain reads the same ``metadata.jsonl``), resolution, random flips,
batch, steps, AdamW (lr, betas, eps, weight decay 1e-2 as the peer's default), constant LR
without warm-up, gradient clipping at 1, rank and alpha = rank on to_q, to_k, to_v, to_out.0,
fp32, seed. Not matched, by design: difftrain encodes every image through the VAE once before the
first step (its latent cache) where the peer encodes each batch at every step; difftrain keeps an
EMA of the adapter (ema.decay = 0 here: a copy, a few thousand numbers). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_inputs(work: Path, images: int, resolution: int) -> tuple[Path, Path]:
    """(the tiny SD folder, the image folder with metadata.jsonl) under ``work``."""
    from PIL import Image

    from difftrain.data.builtin import describe_shape, draw_shape, shape_caption

    sys.path.insert(0, str(ROOT))
    from tests.text_components import write_tiny_sd_folder

    sd = work / "sd"
    if not (sd / "model_index.json").is_file():
        write_tiny_sd_folder(sd)
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(images):
        Image.fromarray(draw_shape(i, resolution)[0]).save(data / f"{i:05d}.png")
        lines.append(json.dumps({"file_name": f"{i:05d}.png", "text": shape_caption(describe_shape(i, resolution))}))
    (data / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return sd, data


def rate(times: dict[int, float], skip: int) -> tuple[float, int, int]:
    """(steps / s, first, last step) between the first logged step >= ``skip`` and the last."""
    first, last = min(s for s in times if s >= skip), max(times)
    return (last - first) / (times[last] - times[first]), first, last


def peer_times(log: str) -> dict[int, float]:
    """Step -> elapsed seconds (whole seconds), from the peer's ``Steps:`` progress bar (tqdm's
    ``n/N [mm:ss<`` updates; the first update of each step)."""
    times: dict[int, float] = {}
    for n, mm, ss in re.findall(r"Steps:[^|]*\|[^|]*\| *(\d+)/\d+ \[(\d+):(\d+)<", log):
        times.setdefault(int(n), 60 * int(mm) + int(ss))
    return times


def difftrain_times(run_dir: Path) -> dict[int, float]:
    """Step -> time, from difftrain's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["time"] for r in rows if "time" in r}


def run_pair(peer: list[str], ours: list[str], work: Path, run_dir: Path, peer_out: Path) -> bool:
    """Run both commands at the same time (one thread each, offline), logs in ``work/peer.log`` and
    ``work/difftrain.log``, after clearing their output folders; False (with one line) if either failed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    for cmd in (peer, ours):
        print("$ OMP_NUM_THREADS=1 " + " ".join(cmd))
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(peer_out, ignore_errors=True)
    with open(work / "peer.log", "w") as peer_log, open(work / "difftrain.log", "w") as our_log:
        procs = [subprocess.Popen(peer, env=env, stdout=peer_log, stderr=subprocess.STDOUT),
                 subprocess.Popen(ours, env=env, stdout=our_log, stderr=subprocess.STDOUT)]
        codes = [proc.wait() for proc in procs]
    if any(codes):
        print(f"exit codes: peer {codes[0]}, difftrain {codes[1]}; logs in {work}", file=sys.stderr)
    return not any(codes)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peer-python", required=True, help="a Python with diffusers, accelerate, peft, datasets")
    p.add_argument("--peer-script", required=True, help="diffusers' train_text_to_image_lora.py")
    p.add_argument("--work", default="/tmp/peer-lora-speed")
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--skip", type=int, default=20, help="steps left out of the rate (start-up, first steps)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--cores", default="0,1", help="the peer's core and difftrain's (swap them for a second run)")
    args = p.parse_args()
    work = Path(args.work)
    sd, data = write_inputs(work, args.images, args.resolution)
    peer_out, run_dir = work / "peer-out", work / "difftrain-run"
    peer_core, our_core = args.cores.split(",")
    peer = ["taskset", "-c", peer_core, args.peer_python, args.peer_script, "--pretrained_model_name_or_path", str(sd),
            "--train_data_dir", str(data), "--caption_column", "text", "--resolution", str(args.resolution),
            "--random_flip", "--train_batch_size", str(args.batch), "--max_train_steps", str(args.steps),
            "--learning_rate", str(args.lr), "--lr_scheduler", "constant", "--lr_warmup_steps", "0",
            "--rank", str(args.rank), "--output_dir", str(peer_out), "--seed", "0",
            "--dataloader_num_workers", "0", "--checkpointing_steps", "100000"]
    ours = ["taskset", "-c", our_core, sys.executable, "-m", "difftrain", "train", "--run-dir", str(run_dir)]
    for o in [f"data.path={data}", "data.captions=true", f"data.resolution={args.resolution}", "data.random_flip=true",
              "data.num_workers=0", f"model.init_from={sd}", f"model.text_encoder={sd}", f"model.vae={sd}",
              f"lora.rank={args.rank}", f"optim.lr={args.lr}", "optim.lr_schedule=constant", "optim.warmup_steps=0",
              "optim.weight_decay=0.01", "optim.grad_clip=1.0", "model.class_dropout=0", "ema.decay=0",
              f"train.batch_size={args.batch}", f"train.total_steps={args.steps}", "train.log_every_steps=10",
              "train.device=cpu", "train.precision=fp32", "train.seed=0", "train.progress_bar=false",
              "validation.every_steps=0", f"checkpoint.every_steps={args.steps}"]:
        ours += ["--set", o]
    if not run_pair(peer, ours, work, run_dir, peer_out):
        return 1
    peer_sps, p0, p1 = rate(peer_times((work / "peer.log").read_text()), args.skip)
    ours_sps, o0, o1 = rate(difftrain_times(run_dir), args.skip)
    print("\n| program | steps timed | steps / s |\n|---|---|---:|")
    print(f"| diffusers train_text_to_image_lora.py, core {peer_core} | {p0}-{p1} | {peer_sps:.2f} |")
    print(f"| difftrain train, lora.rank={args.rank}, core {our_core} | {o0}-{o1} | {ours_sps:.2f} |")
    print(f"difftrain / diffusers: {ours_sps / peer_sps:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
