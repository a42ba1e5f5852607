"""LoRA against full fine-tuning of the same UNet2DConditionModel: parameters trained, memory of a
training step (``difftrain estimate``'s measured breakdown) and seconds per optimizer step.

    python bench/lora_vs_full.py                        # a Stable-Diffusion-shaped UNet, scaled down, random
    python bench/lora_vs_full.py --ranks 4 16 --batch 4 --steps 5
    python bench/lora_vs_full.py --ranks 4 --kinds lora dora loha lokr   # the adapter kinds (lora.kind)
    python bench/lora_vs_full.py --sd /path/to/stable-diffusion-folder --resolution 64   # a real one

Without ``--sd`` the UNet has Stable Diffusion 1.x's blocks (three cross-attention levels and a
plain one, two residual blocks per level) at ``--width`` base channels, on 3-channel 32 px images
with ``builtin:tiny-clip`` captions (no VAE): everything is made here, nothing is downloaded.
Memory is ``difftrain estimate``'s breakdown (gradients, AdamW state, EMA and the activations
autograd saves, measured; "step total" adds the weights), each mode in a fresh subprocess. Step
times are taken in one process, one step of each mode per round after a warm-up round, the
fastest and the median over ``--steps`` rounds, so that a change in the machine's load falls on
every mode alike (on a shared machine the fastest step is the one least disturbed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_unet(folder: Path, width: int, resolution: int) -> Path:
    """A random Stable-Diffusion-shaped UNet2DConditionModel (pixel space, 64-wide text) in ``folder``."""
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=resolution, in_channels=3, out_channels=3, layers_per_block=2,
        block_out_channels=(width, 2 * width, 4 * width, 4 * width), attention_head_dim=8, cross_attention_dim=64,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    )
    unet.save_pretrained(folder)
    return folder


def overrides(args, init_from: str, mode: tuple[int, str]) -> list[str]:
    rank, kind = mode
    common = [f"model.init_from={init_from}", "data.captions=true", f"data.resolution={args.resolution}",
              f"train.batch_size={args.batch}", "train.device=cpu", "train.compile=off", "validation.every_steps=0",
              f"lora.rank={rank}", f"lora.kind={kind}", f"data.path={args.tmp}/no-data"]
    if args.sd:
        common += [f"model.text_encoder={args.sd}", f"model.vae={args.sd}"]
    else:
        common += ["model.text_encoder=builtin:tiny-clip"]
    return common


def measure_memory(args, init_from: str, mode: tuple[int, str]) -> dict:
    """One mode's ``difftrain estimate`` breakdown (run in a fresh subprocess)."""
    import torch

    from difftrain.config import load_config
    from difftrain.tools.estimate import estimate

    torch.set_num_threads(args.threads)
    est = estimate(load_config(None, overrides(args, init_from, mode)), batch_size=args.batch)
    return {"rank": mode[0], "kind": mode[1], "parameters": est["parameters"], "trained": est["trained_parameters"],
            "grads_mib": est["grads_mib"], "optimizer_mib": est["optimizer_mib"], "ema_mib": est["ema_mib"],
            "activations_mib": est["activations_mib"], "total_mib": est["total_mib"]}


def measure_steps(args, init_from: str, ranks: list[tuple[int, str]]) -> dict[tuple[int, str], tuple[float, float]]:
    """(Fastest, median) seconds per optimizer step of each mode, timed in interleaved rounds (one step of
    each mode per round, in alternating order, after a warm-up round) so that a change in the
    machine's load falls on every mode alike."""
    import torch

    from difftrain.config import load_config
    from difftrain.tools.common import build_setup, fetch_batch
    from difftrain.training.step import StepMetrics, train_step

    torch.set_num_threads(args.threads)
    setups = {r: build_setup(load_config(None, overrides(args, init_from, r)), need_data=False) for r in ranks}
    batches = {r: fetch_batch(s, args.batch, seed=0) for r, s in setups.items()}
    times: dict[tuple[int, str], list[float]] = {r: [] for r in ranks}
    for round_ in range(args.steps + 1):
        order = ranks if round_ % 2 else ranks[::-1]  # alternate the order: no mode always runs first
        for r in order:
            setup = setups[r]
            start = time.perf_counter()
            train_step(setup.state, setup.objective, iter([batches[r]]), 1e-4, StepMetrics(setup.device))
            if round_:  # round 0 warms up
                times[r].append(time.perf_counter() - start)
    return {r: (min(t), statistics.median(t)) for r, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 16], help="LoRA ranks to measure beside full")
    p.add_argument("--kinds", nargs="+", default=["lora"], choices=["lora", "dora", "loha", "lokr"],
                   help="adapter kinds (lora.kind) measured at each rank")
    p.add_argument("--width", type=int, default=64, help="base channels of the generated UNet (SD: 320)")
    p.add_argument("--resolution", type=int, default=32, help="image size in pixels (latent runs: / 8)")
    p.add_argument("--batch", type=int, default=4, help="images per step")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--sd", help="a local Stable Diffusion folder to measure instead of the generated UNet")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one mode, print JSON
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        init_from, rank, kind = args.one.rsplit(":", 2)
        print(json.dumps(measure_memory(args, init_from, (int(rank), kind))))
        return
    ranks = [(0, "lora"), *[(r, k) for r in args.ranks for k in args.kinds]]
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        init_from = args.sd or str(write_unet(Path(tmp) / "unet", args.width, args.resolution))
        rows = []
        for rank, kind in ranks:
            cmd = [sys.executable, __file__, "--one", f"{init_from}:{rank}:{kind}", "--tmp", tmp, *sys.argv[1:]]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ}).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
        seconds = measure_steps(args, init_from, ranks)
    full = rows[0]
    print(f"UNet2DConditionModel {'from ' + args.sd if args.sd else f'SD-shaped, width {args.width}'}, "
          f"{full['parameters'] / 1e6:.1f}M parameters; batch {args.batch} at {args.resolution} px, fp32, "
          f"{args.threads} CPU threads; s / step over {args.steps} interleaved rounds (the fastest is the "
          f"least disturbed by other load); "
          f"load average {load:.1f} at the start on {os.cpu_count()} cores")
    print()
    print("| mode | parameters trained | gradients MiB | AdamW state MiB | EMA MiB | activations MiB "
          "| step total MiB | s / step, fastest | s / step, median |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        names = {"lora": "LoRA", "dora": "DoRA", "loha": "LoHa", "lokr": "LoKr"}
        mode = "full fine-tuning" if r["rank"] == 0 else f"{names[r['kind']]} rank {r['rank']}"
        share = r["trained"] / r["parameters"]
        print(f"| {mode} | {r['trained']:,} ({share:.2%}) | {r['grads_mib']:.1f} | {r['optimizer_mib']:.1f} | "
              f"{r['ema_mib']:.1f} | {r['activations_mib']:.1f} | {r['total_mib']:.1f} | "
              f"{seconds[r['rank'], r['kind']][0]:.2f} | {seconds[r['rank'], r['kind']][1]:.2f} |")


if __name__ == "__main__":
    main()
