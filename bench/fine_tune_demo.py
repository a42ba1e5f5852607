"""Teach the text-shapes model a shape it has never seen, a ring, by LoRA, DreamBooth and full
fine-tuning: how often the new prompt gives a ring before and after, and how well the old prompts
still work (forgetting), with memory and time.

    python bench/fine_tune_demo.py                          # trains the base first (configs/text-shapes.toml)
    python bench/fine_tune_demo.py --base runs/text-shapes  # a base trained earlier

1. The base: configs/text-shapes.toml trained from scratch (``--base-steps``; the config's 1,200
   by default), through the real CLI, unless ``--base`` names a finished run. It has seen discs,
   squares and triangles, never a ring.
2. The new concept: ``--images`` red rings on dark backgrounds, drawn like the built-in shapes
   (``draw_ring``), in a folder with a ``metadata.jsonl`` captioning each "a red ring on a dark
   background". The word "ring" is not in builtin:tiny-clip's vocabulary: it is spelled out
   from letters, and the text encoder stays frozen.
3. Four fine-tunes of the base, each through ``difftrain train``, ``--steps`` steps of
   ``--batch``: LoRA, full fine-tuning, and each with DreamBooth's prior preservation (the
   instance prompt the same caption; class images of "a red disc on a dark background" made by
   the base).
4. Every model, the base included, sampled from the same noise (DDIM, guidance ``--guidance``):
   the new prompt ``--new-images`` times, judged for a ring (and red); the 48 old captions
   (3 shapes x 8 colours x 2 backgrounds) ``--per-prompt`` times each, judged for shape and
   colour (difftrain.evaluation.prompt_following, which knows the ring). Memory is
   ``difftrain estimate``'s per-step total at ``--batch``; time is each training command's wall
   clock (start-up and the class images included).

A benchmark, not a test: its table goes to docs/fine_tuning.md with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from pathlib import Path

import torch
from concept_demo import (
    CLASS_PROMPT,
    NEW_PROMPT,
    measure,
    print_table,
    train,
    write_rings,
)

from difftrain.config import load_config
from difftrain.tools.estimate import estimate

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "text-shapes.toml"


def modes(args, base: Path, images: Path) -> dict[str, list[str]]:
    """Each fine-tune's ``--set`` overrides of configs/text-shapes.toml."""
    common = [f"model.init_from={base}", f"data.path={images}", "data.captions=true", f"train.total_steps={args.steps}",
              f"train.batch_size={args.batch}", "optim.warmup_steps=0", "optim.lr_schedule=constant",
              f"ema.decay={args.ema_decay}", "validation.every_steps=0", f"checkpoint.every_steps={args.steps}",
              "train.progress_bar=false"]
    lora = [f"lora.rank={args.rank}", "lora.include_conv=true", f"optim.lr={args.lora_lr}"]
    full = [f"optim.lr={args.full_lr}"]
    prior = [f"dreambooth.instance_prompt={NEW_PROMPT}", f"dreambooth.class_prompt={CLASS_PROMPT}",
             f"dreambooth.num_class_images={args.class_images}", f"dreambooth.class_guidance_scale={args.guidance}"]
    return {
        f"LoRA rank {args.rank}": common + lora,
        f"DreamBooth + LoRA rank {args.rank}": common + lora + prior,
        "full fine-tuning": common + full,
        "DreamBooth + full": common + full + prior,
    }


def memory_mib(overrides: list[str], batch: int) -> tuple[float, int]:
    """(``difftrain estimate``'s step total in MiB, parameters trained) of a fine-tune's config."""
    est = estimate(load_config(CONFIG, [o for o in overrides if not o.startswith("dreambooth.")]), batch_size=batch)
    return est["total_mib"], est["trained_parameters"]


def judge(run_dir: Path, args) -> dict:
    """concept_demo.measure of a run with this demo's sampling (DDIM)."""
    return measure(run_dir, sampler="ddim", steps=args.sampling_steps, guidance=args.guidance,
                   new_images=args.new_images, per_prompt=args.per_prompt, seed=args.seed)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="runs/fine-tune-demo", help="folder for the base, the images and the fine-tunes")
    p.add_argument("--base", help="a finished text-shapes run to start from (default: train one in WORK/base)")
    p.add_argument("--base-steps", type=int, default=1200, help="steps of the base when trained here")
    p.add_argument("--images", type=int, default=32, help="ring images to teach")
    p.add_argument("--steps", type=int, default=300, help="steps of each fine-tune")
    p.add_argument("--batch", type=int, default=16, help="images per step of each fine-tune")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (attention projections and convolutions)")
    p.add_argument("--lora-lr", type=float, default=3e-3)
    p.add_argument("--full-lr", type=float, default=2e-4)
    p.add_argument("--ema-decay", type=float, default=0.99, help="EMA of the fine-tunes (sampled)")
    p.add_argument("--class-images", type=int, default=64, help="DreamBooth class images, made by the base")
    p.add_argument("--guidance", type=float, default=5.0, help="guidance scale of every sample")
    p.add_argument("--sampling-steps", type=int, default=50)
    p.add_argument("--new-images", type=int, default=64, help="samples of the new prompt per model")
    p.add_argument("--per-prompt", type=int, default=4, help="samples of each of the 48 old prompts per model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", help="run only the modes whose names contain one of these words")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    work = Path(args.work)
    load = os.getloadavg()[0]
    resolution = load_config(CONFIG).data.resolution

    # The base.
    base, base_s = Path(args.base) if args.base else work / "base", None
    if not args.base:
        base_s = train(CONFIG, base, [f"train.total_steps={args.base_steps}", "train.progress_bar=false"])
    images = write_rings(work / "rings", args.images, resolution)

    # The fine-tunes, then every model judged.
    rows = [{"mode": "base (before)", "train_s": base_s, **judge(base, args)}]
    print(json.dumps(rows[-1]), file=sys.stderr)
    for name, overrides in modes(args, base.resolve(), images.resolve()).items():
        if args.only and not any(w.lower() in name.lower() for w in args.only):
            continue
        run_dir = work / name.lower().replace(" + ", "-").replace(" ", "-")
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time (a kept one would resume, done)
        train_s = train(CONFIG, run_dir, overrides)
        mib, trained = memory_mib(overrides, args.batch)
        rows.append({"mode": name, "train_s": train_s, "step_mib": mib, "trained": trained, **judge(run_dir, args)})
        print(json.dumps(rows[-1]), file=sys.stderr)

    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"load average {load:.1f} at the start; base {base}"
          + (f" trained in {base_s:.0f} s" if base_s else "")
          + f"; fine-tunes {args.steps} steps of {args.batch} on {args.images} ring images; samples DDIM "
          f"{args.sampling_steps} steps, guidance {args.guidance:g}, seed {args.seed}")
    print_table(rows, args.new_images, args.per_prompt)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
