"""What the concept-teaching demos share (bench/fine_tune_demo.py on the text-shapes UNet,
bench/mmdit_demo.py on an SD3-style MMDiT): the ring images and their caption, the old prompts,
``difftrain train`` through the real CLI, the judge of a run (new-concept rate and forgetting of the
old prompts) and the result table.

    write_rings(folder, n, resolution)        n red rings + metadata.jsonl captioning each NEW_PROMPT
    train(config, run_dir, overrides)         `difftrain train`; its wall-clock seconds
    measure(run_dir, sampler=..., ...)        {"ring", "red_ring", "old_shape", "old_colour", "old_both", ...}
    print_table(rows, new_images, per_prompt) the markdown table of the docs
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from difftrain.data.builtin import (
    BACKGROUNDS,
    COLOUR_NAMES,
    SHAPE_CLASSES,
    ShapeDescription,
    draw_ring,
    shape_caption,
)
from difftrain.evaluation.prompt_following import judge_image, prompt_following
from difftrain.generation.inference import generate_images, load_model
from difftrain.generation.sampling import to_uint8

NEW_PROMPT = "a red ring on a dark background"  # the concept taught
CLASS_PROMPT = "a red disc on a dark background"  # DreamBooth's class: what the base draws nearest to it
OLD_PROMPTS = [shape_caption(ShapeDescription(s, c, b)) for s in SHAPE_CLASSES for c in COLOUR_NAMES for b in BACKGROUNDS]


def write_rings(folder: Path, n: int, resolution: int) -> Path:
    """``n`` red rings on dark backgrounds as PNGs in ``folder``, with a metadata.jsonl captioning each."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        Image.fromarray(draw_ring(i, resolution, hue_deg=(-10, 10), dark=True)).save(folder / f"{i:05d}.png")
        lines.append(json.dumps({"file_name": f"{i:05d}.png", "text": NEW_PROMPT}))
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def train(config: Path | None, run_dir: Path, overrides: list[str]) -> float:
    """Run ``difftrain train`` (on ``config``, or the defaults) with ``--set`` overrides; its wall-clock seconds."""
    cmd = [sys.executable, "-m", "difftrain", "train", "--run-dir", str(run_dir)]
    if config is not None:
        cmd += ["--config", str(config)]
    for o in overrides:
        cmd += ["--set", o]
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - start


def measure(run_dir: Path, *, sampler: str, steps: int, guidance: float, new_images: int, per_prompt: int,
            seed: int = 0) -> dict:
    """Prompt following of a run's EMA model, every model from the same noise: ``new_images`` samples of
    NEW_PROMPT judged for a ring (and a red one), and ``per_prompt`` of each OLD_PROMPTS judged for shape
    and colour (difftrain.evaluation.prompt_following)."""
    loaded = load_model(run_dir, device="cpu")
    sample = {"guidance_scale": guidance, "steps": steps, "sampler": sampler, "seed": seed}
    new = to_uint8(generate_images(loaded, new_images, prompt=NEW_PROMPT, **sample))
    seen = [judge_image(image) for image in new]
    asked = [p for p in OLD_PROMPTS for _ in range(per_prompt)]
    old = prompt_following(to_uint8(generate_images(loaded, len(asked), prompt=asked, **sample)), asked)
    return {"ring": float(np.mean([s == "ring" for s, _ in seen])),
            "red_ring": float(np.mean([(s, c) == ("ring", "red") for s, c in seen])),
            "old_shape": old["shape_accuracy"], "old_colour": old["colour_accuracy"], "old_both": old["both_accuracy"],
            "n_new": new_images, "n_old": old["n"]}


def print_table(rows: list[dict], new_images: int, per_prompt: int) -> None:
    """The rows as the markdown table of docs/fine_tuning.md (empty cells where a row has no value)."""
    print(f"| model | trained parameters | step memory MiB | training s | '{NEW_PROMPT}': ring | red ring "
          "| old prompts: shape | colour | both |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        trained = f"{r['trained']:,}" if r.get("trained") else ""
        mib = f"{r['step_mib']:.0f}" if r.get("step_mib") else ""
        secs = f"{r['train_s']:.0f}" if r.get("train_s") else ""
        print(f"| {r['mode']} | {trained} | {mib} | {secs} | {r['ring']:.0%} | {r['red_ring']:.0%} | "
              f"{r['old_shape']:.1%} | {r['old_colour']:.1%} | {r['old_both']:.1%} |")
    print(f"(new prompt: {new_images} samples per model; old prompts: {len(OLD_PROMPTS)} x {per_prompt})")
