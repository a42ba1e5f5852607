"""Each optim.name's state bytes per parameter (exact, after one step) and step time.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/optimizers.py [--steps 20]

The tiny UNet (0.77M parameters) and the same at 128 base channels (12M), 16x16 images, batch 8,
fp32 on the CPU; the step is forward, backward and optimizer.step (no EMA, no clipping).
"""

from __future__ import annotations

import argparse
import time

import torch

from difftrain.config import load_config
from difftrain.models import build_unet
from difftrain.training.optimizers import OPTIMIZERS, build_optimizer, measured_state_bytes, state_bytes

LR = {"prodigy": 1.0, "adafactor": 1e-2}


def run(name: str, base_channels: int, steps: int) -> tuple[int, float, float, float]:
    """(parameters, measured bytes per parameter, counted bytes per parameter, ms per step)."""
    extra = ["optim.lr_schedule=constant"] if name == "schedulefree" else []
    cfg = load_config(None, [f"optim.name={name}", f"optim.lr={LR.get(name, 1e-3)}", *extra])
    torch.manual_seed(0)
    model = build_unet("tiny", resolution=16, in_channels=3, attention_resolutions=(8,), base_channels=base_channels)
    opt = build_optimizer(cfg.optim, model, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 1000, (8,), generator=g)
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        (model(x, t) - x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        if i == 0:
            n = sum(p.numel() for p in model.parameters())
            measured, counted = measured_state_bytes(opt), state_bytes(name, [p.shape for p in model.parameters()])
    times = sorted(times[2:])
    return n, measured / n, counted / n, 1000 * times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print("| optim.name | parameters | state B/param measured | counted (estimate) | ms/step (median) |")
    print("|---|---|---|---|---|")
    for base in (32, 128):
        for name in OPTIMIZERS:
            n, measured, counted, ms = run(name, base, args.steps)
            print(f"| {name} | {n / 1e6:.2f}M | {measured:.3f} | {counted:.3f} | {ms:.1f} |")


if __name__ == "__main__":
    main()
