"""Per-step cost of the MeanFlow recipe against the CPU default, interleaved in one process, one thread.

    PYTHONPATH=src python bench/meanflow_step_cost.py --rounds 6 --steps 15

Both recipes build on ``configs/cifar10-16px-cpu.toml`` (the tiny UNet, 16 px, batch 32, each in the memory
layout it trains in: channels_last for the default, contiguous for MeanFlow, whose JVP through GroupNorm
fails on channels_last): the default (EDM with EDM2's uncertainty weighting) and MeanFlow (one JVP per step). Each
round times ``--steps`` optimizer steps (loss, backward, clip, AdamW step) of one, then of the other, on
random images; the ratio of the medians is what a recipe's step budget is divided by for equal wall clock
(docs/quality.md: the budget is in steps).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from difftrain.config import load_config
from difftrain.diffusion.objective import build_objective, per_sample_loss
from difftrain.models import build_model

CPU_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "cifar10-16px-cpu.toml"
RECIPES = {
    "default": [],
    "meanflow": ["diffusion.objective=meanflow", "diffusion.uncertainty_weighting=false"],
}


def make(overrides: list[str]):
    """(step function, batch size) of a recipe: one optimizer step on fresh random data per call."""
    cfg = load_config(CPU_CONFIG, overrides)
    torch.manual_seed(0)
    layout = torch.channels_last if cfg.train.channels_last == "auto" else torch.contiguous_format  # CPU: auto = on
    model = build_model(cfg).to(memory_format=layout)
    objective = build_objective(cfg.diffusion)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas)
    uw, n, res = cfg.diffusion.uncertainty_weighting, cfg.train.batch_size, cfg.data.resolution
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        x0 = (torch.rand(n, 3, res, res, generator=gen) * 2 - 1).contiguous(memory_format=layout)
        noise = torch.randn(x0.shape, generator=gen).contiguous(memory_format=layout)
        levels = objective.draw_levels(n, gen, torch.device("cpu"))
        loss = per_sample_loss(objective, model, x0, None, levels, noise, uncertainty=uw).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(1)
    steps = {name: make(o) for name, o in RECIPES.items()}
    for fn in steps.values():  # warm-up
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, fn in steps.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                fn()
            times[name].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(times["default"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name}: median {med * 1000:.1f} ms/step over {args.rounds} rounds of {args.steps} "
              f"(min {min(ts) * 1000:.1f}, max {max(ts) * 1000:.1f}); x{med / base:.3f} the default")


if __name__ == "__main__":
    main()
