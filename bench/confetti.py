"""The confetti share of a checkpoint's samples, per sampler, steps and variant: one table.

A sample counts as confetti when its mean |4-neighbour Laplacian| is above the 99th percentile of
real images (``difftrain.evaluation.confetti``). Every case samples the same initial noise (seed
0) from the EMA weights (``:ema=0`` for the raw ones). A case is NAME=SAMPLER:STEPS[:k=v,...]
with, for DDPM-family models, ``spacing=trailing|leading|linspace`` (the timestep grid) and
``clip=0|1`` (x0 clamped to [-1, 1] at each step); other k=v go to the sampler (``eta=1``).

    python bench/confetti.py --checkpoint runs/c16 --ref /tmp/cifar16/test --num 1000 \\
        --case ddim50=ddim:50 --case ddpm250=ddpm:250 --case dpm2m50=dpmpp_2m:50 --save /tmp/confetti

``--save DIR`` writes DIR/NAME.npz (uint8 samples, for ``difftrain fid``) and DIR/NAME.png (a grid
of the first 64, confetti framed in red), so the numbers can be looked at.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from difftrain.diffusion.objective import DDPMObjective
from difftrain.diffusion.samplers import SAMPLERS, karras_timesteps, sampling_timesteps
from difftrain.evaluation.confetti import confetti_threshold, laplacian_energy
from difftrain.generation.inference import load_model
from difftrain.runtime.seeding import derive_seed
from difftrain.generation.sampling import initial_noise, make_grid, to_uint8


def parse_case(text: str) -> tuple[str, str, int, dict]:
    name, _, spec = text.partition("=")
    sampler, steps, *opts = spec.split(":")
    options = {}
    for opt in ",".join(opts).split(",") if opts else []:
        key, _, value = opt.partition("=")
        options[key] = value if key == "spacing" else float(value)
    return name, sampler, int(steps), options


def load_reference(folder: Path, num: int) -> np.ndarray:
    """(N, H, W, 3) uint8 of the first ``num`` images under ``folder`` (sorted paths)."""
    paths = sorted(p for p in folder.rglob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg"))[:num]
    if not paths:
        raise SystemExit(f"{folder}: no images")
    return np.stack([np.asarray(Image.open(p).convert("RGB")) for p in paths])


@torch.no_grad()
def sample_case(loaded, noise: torch.Tensor, sampler: str, steps: int, options: dict, batch: int) -> torch.Tensor:
    """(N, C, H, W) in [-1, 1]: the checkpoint's samples from ``noise`` for one case."""
    model, objective = loaded.model, loaded.objective
    device = next(model.parameters()).device
    spacing = options.pop("spacing", None)
    clip = bool(options.pop("clip", 1.0))
    out = []
    for i, start in enumerate(range(0, noise.shape[0], batch)):
        x_T = noise[start : start + batch].to(device)
        gen = torch.Generator(device=device).manual_seed(derive_seed(0, "sampler", i))

        def network(x, t):
            return model(x, t, None).float()

        if isinstance(objective, DDPMObjective) and spacing is not None:
            if sampler == "heun":
                timesteps = karras_timesteps(objective.alpha_bar, steps, objective.sigma_min, objective.sigma_max,
                                             objective.rho)
            else:
                timesteps = sampling_timesteps(objective.num_timesteps, steps, spacing)
            alpha_bar = objective.alpha_bar.to(device)
            x0 = SAMPLERS[sampler](objective.denoiser(network, alpha_bar, clip), x_T, timesteps.to(device),
                                   alpha_bar, gen, **options)
        else:
            x0 = objective.sample(network, x_T, sampler, steps, gen, clip=clip, **options)
        out.append(x0.cpu())
    return torch.cat(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", action="append", required=True, metavar="[LABEL=]PATH")
    p.add_argument("--ref", required=True, help="folder of real images at the model's resolution")
    p.add_argument("--ref-num", type=int, default=2000)
    p.add_argument("--num", type=int, default=200)
    p.add_argument("--case", action="append", required=True, metavar="NAME=SAMPLER:STEPS[:k=v,...]")
    p.add_argument("--batch-size", type=int, default=500)
    p.add_argument("--device", default="auto")
    p.add_argument("--save", help="folder for NAME.npz and NAME.png of each case")
    args = p.parse_args(argv)

    reference = load_reference(Path(args.ref), args.ref_num)
    threshold = confetti_threshold(reference)
    print(f"reference: {len(reference)} images of {args.ref}; 99th percentile of the Laplacian energy {threshold:.4f}")
    save = Path(args.save) if args.save else None
    if save:
        save.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in args.checkpoint:
        label, _, path = spec.rpartition("=")
        for case in args.case:
            name, sampler, steps, options = parse_case(case)
            use_ema = bool(options.pop("ema", 1.0))
            loaded = load_model(path, use_ema=use_ema, device=args.device)
            noise = initial_noise(args.num, tuple(loaded.cfg_shape) if hasattr(loaded, "cfg_shape") else
                                  (loaded.cfg.data.channels, loaded.cfg.data.resolution, loaded.cfg.data.resolution), 0)
            t0 = time.perf_counter()
            images = sample_case(loaded, noise, sampler, steps, dict(options), args.batch_size)
            seconds = time.perf_counter() - t0
            energy = laplacian_energy(images)
            share = float((energy > threshold).mean())
            rows.append((label or Path(path).name, loaded.step, name, f"{sampler}:{steps}", options, use_ema,
                         share, float(np.median(energy)), seconds))
            print(f"  {rows[-1][0]} step {loaded.step} {name}: confetti {100 * share:.1f}% ({seconds:.1f} s)", flush=True)
            if save:
                tag = f"{label}-{name}" if label else name
                pixels = to_uint8(images)
                np.savez_compressed(save / f"{tag}.npz", images=pixels, energy=energy)
                grid = pixels[:64].copy()
                for k in np.flatnonzero(energy[:64] > threshold):  # frame confetti in red
                    grid[k, 0, :], grid[k, -1, :], grid[k, :, 0], grid[k, :, -1] = (255, 0, 0), (255, 0, 0), (255, 0, 0), (255, 0, 0)
                Image.fromarray(make_grid(grid, 8)).resize((8 * 18 * 3 + 6, 8 * 18 * 3 + 6), Image.NEAREST).save(
                    save / f"{tag}.png")
    print()
    print("| checkpoint | step | case | sampler:steps | options | EMA | confetti % | median energy | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, step, name, ss, options, ema, share, med, seconds in rows:
        opts = ",".join(f"{k}={v}" for k, v in options.items()) or "-"
        print(f"| {label} | {step} | {name} | {ss} | {opts} | {'yes' if ema else 'no'} | {100 * share:.1f} | "
              f"{med:.4f} | {seconds:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
