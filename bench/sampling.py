"""Sampling images/s with DDIM (50 steps): difftrain's ``generate`` against diffusers' DDIMPipeline.

    python bench/sampling.py --preset ddpm-cifar10 --num 64 --steps 50 --rounds 3

The same weights in both (``to_diffusers_state_dict``), the same batch, device and thread
count, float32 as ``difftrain sample`` uses; interleaved rounds in one process, the median
reported. Both return images on the CPU (difftrain a float tensor, diffusers a NumPy array).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from difftrain.diffusion.objective import DDPMObjective
from difftrain.models.diffusers_export import diffusers_config, to_diffusers_state_dict
from difftrain.generation.sampling import generate, initial_noise
from difftrain.models import build_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _steps import bench_config, median, sync  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="ddpm-cifar10")
    p.add_argument("--num", type=int, default=64, help="images per round (one batch)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    from diffusers import DDIMPipeline, DDIMScheduler, UNet2DModel

    device = torch.device(args.device)
    cfg = bench_config(args.preset, args.num, "fp32", "off", "off")
    model = build_model(cfg).to(device).eval()
    hf = UNet2DModel(**diffusers_config(model))
    hf.load_state_dict(to_diffusers_state_dict(model))
    pipe = DDIMPipeline(unet=hf.to(device).eval(), scheduler=DDIMScheduler(num_train_timesteps=1000))
    pipe.set_progress_bar_config(disable=True)
    objective = DDPMObjective("linear", 1000, "epsilon", "uniform").to(device)
    noise = initial_noise(args.num, (3, cfg.data.resolution, cfg.data.resolution), 0)

    def ours():
        generate(model, objective=objective, noise=noise, steps=args.steps, batch_size=args.num)

    def theirs():
        pipe(batch_size=args.num, num_inference_steps=args.steps, output_type="np",
             generator=torch.Generator(device=device).manual_seed(0))

    impls = {"difftrain": ours, "diffusers DDIMPipeline": theirs}
    rates = {k: [] for k in impls}
    for r in range(args.rounds):
        for name in list(impls) if r % 2 == 0 else list(impls)[::-1]:
            sync(device)
            t0 = time.perf_counter()
            impls[name]()
            sync(device)
            rates[name].append(args.num / (time.perf_counter() - t0))
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {dev}; {args.preset}; DDIM {args.steps} steps; batch {args.num}; fp32; {args.rounds} rounds\n")
    print("| implementation | images/s (median) | rounds |")
    print("|---|---|---|")
    for name, xs in rates.items():
        print(f"| {name} | {median(xs):.2f} | {', '.join(f'{x:.2f}' for x in xs)} |")


if __name__ == "__main__":
    main()
