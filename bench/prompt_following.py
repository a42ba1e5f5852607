"""Does a text-conditioned model draw what its prompt says? Shape and colour accuracy of its samples.

Trains (with --train) the built-in text demo, configs/text-shapes.toml, through the real CLI, then
samples every caption the built-in shapes data uses, --per-prompt images each, and judges each
image's shape and colour by image analysis (difftrain.evaluation.prompt_following). Printed beside
the model's rows:

- the judge on the training images themselves, with their own captions (how far it can be trusted);
- the same model given the empty prompt (no text: unconditional samples), judged against the same
  prompts: what the data's own mix of shapes and colours gives without reading the prompt;
- uniform chance (1/3 shapes, 1/8 colours).

    python bench/prompt_following.py --train --run-dir runs/text-shapes      # train, then measure
    python bench/prompt_following.py --run-dir runs/text-shapes              # measure a finished run

A benchmark, not a test: its figures go to docs/text_to_image.md with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from difftrain.data.builtin import ShapesDataset
from difftrain.evaluation.prompt_following import prompt_following
from difftrain.generation.inference import generate_images, load_model
from difftrain.generation.sampling import to_uint8

ROOT = Path(__file__).resolve().parents[1]


def data_prompts(resolution: int, scan: int) -> tuple[list[str], np.ndarray, list[str]]:
    """(the distinct captions among the first ``scan`` training images, sorted; those images (N, H, W, 3)
    uint8 and their captions, for the judge's own accuracy)."""
    data = ShapesDataset(resolution=resolution, captions=True)
    items = [data[i] for i in range(scan)]
    images = to_uint8(torch.stack([x for x, _ in items]))
    captions = [c for _, c in items]
    return sorted(set(captions)), images, captions


def measure(run_dir: Path, per_prompt: int, guidance: list[float], steps: int, sampler: str, seed: int) -> list[dict]:
    loaded = load_model(run_dir, device="cpu")
    res = loaded.cfg.data.resolution
    prompts, real, real_captions = data_prompts(res, 2000)
    asked = [p for p in prompts for _ in range(per_prompt)]
    rows = [{"what": "judge on training images, their own captions", **prompt_following(real, real_captions)}]
    start = time.perf_counter()
    empty = generate_images(loaded, len(asked), prompt=[""] * len(asked), steps=steps, sampler=sampler, seed=seed)
    rows.append({"what": "model, empty prompt (no text), judged against the prompts",
                 **prompt_following(to_uint8(empty), asked)})
    for g in guidance:
        images = generate_images(loaded, len(asked), prompt=asked, guidance_scale=g, steps=steps, sampler=sampler,
                                 seed=seed)
        rows.append({"what": f"model, prompted, guidance {g:g}", **prompt_following(to_uint8(images), asked)})
    print(f"sampled {len(asked) * (1 + len(guidance))} images in {time.perf_counter() - start:.0f} s "
          f"({len(prompts)} prompts x {per_prompt}, {sampler} {steps} steps)", file=sys.stderr)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default="runs/text-shapes", help="the run to measure (trained here with --train)")
    p.add_argument("--train", action="store_true", help="first train configs/text-shapes.toml into --run-dir")
    p.add_argument("--config", default=str(ROOT / "configs" / "text-shapes.toml"))
    p.add_argument("--per-prompt", type=int, default=8, help="samples per prompt")
    p.add_argument("--guidance", default="1,3,5", help="guidance scales, comma-separated")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--sampler", default="ddim")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    run_dir = Path(args.run_dir)
    train_s = None
    if args.train:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "difftrain", "train", "--config", args.config, "--run-dir", str(run_dir),
                        "--set", "train.progress_bar=false"], check=True)
        train_s = time.perf_counter() - start
    rows = measure(run_dir, args.per_prompt, [float(g) for g in args.guidance.split(",")], args.steps, args.sampler,
                   args.seed)
    print(f"\n{run_dir} on {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads" + (f"; training took {train_s:.0f} s" if train_s else ""))
    print("| what | n | shape | colour | both |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['what']} | {r['n']} | {r['shape_accuracy']:.1%} | {r['colour_accuracy']:.1%} | {r['both_accuracy']:.1%} |")
    c = rows[0]
    print(f"| uniform chance | | {c['shape_chance']:.1%} | {c['colour_chance']:.1%} | {c['both_chance']:.1%} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"train_s": train_s, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
