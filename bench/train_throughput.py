"""Training images/s, peak memory and model FLOPs utilisation: difftrain against diffusers.

    python bench/train_throughput.py --presets tiny ddpm-cifar10 --batch 128 --steps 5 --rounds 3
    python bench/train_throughput.py --presets ddpm-cifar10 --precision fp32 bf16   # both, each matched

Both implementations train the same architecture (diffusers' UNet2DModel built from
``diffusers_config``) on the same device, batch, precision and thread count, in this one
process, in interleaved rounds (difftrain, diffusers, diffusers, difftrain, ...); images/s is the
median over rounds. FLOPs per image (forward + backward) are counted with
``torch.utils.flop_counter``; MFU divides achieved FLOP/s by this device's measured matmul peak
in the training precision. Peak memory: CUDA's max allocated; on a CPU, the growth of peak RSS
in a fresh subprocess that builds the step and runs two steps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _steps import IMPLS, bench_config, fmt_float, median, sync  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def matmul_peak(device: torch.device, precision: str) -> float:
    """Measured FLOP/s of a large square matmul in ``precision`` (best of a few)."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=DTYPES[precision])
    b = torch.randn(n, n, device=device, dtype=DTYPES[precision])
    best = 0.0
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        reps = 10 if device.type == "cuda" else 2
        for _ in range(reps):
            a @ b
        sync(device)
        best = max(best, reps * 2 * n**3 / (time.perf_counter() - t0))
    return best


def preset_precision(preset: str) -> str:
    """The training precision that ``configs/<preset>.toml`` sets (fp32 without such a file)."""
    from difftrain.config import load_config

    path = Path(__file__).resolve().parents[1] / "configs" / f"{preset}.toml"
    return load_config(path, []).train.precision if path.exists() else "fp32"


def flops_per_image(cfg, device: torch.device) -> float:
    """Forward + backward FLOPs of difftrain's model per image (counted, batch 2)."""
    from difftrain.models import build_model

    model = build_model(cfg).to(device)
    r = cfg.data.resolution
    x = torch.randn(2, 3, r, r, device=device)
    t = torch.randint(0, 1000, (2,), device=device)
    with FlopCounterMode(display=False) as counter:
        model(x, t, None).square().mean().backward()
    return counter.get_total_flops() / 2


def peak_memory_subprocess(impl: str, args, preset: str, precision: str, batch: int) -> float:
    """MB of peak-RSS growth of building ``impl``'s step and running two steps (CPU)."""
    cmd = [sys.executable, __file__, "--_memory", impl, "--presets", preset, "--batch", str(batch),
           "--precision", precision, "--compile", args.compile, "--channels-last", args.channels_last,
           "--device", args.device]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def _status_kb(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1])


def _memory_child(args) -> None:
    device = torch.device(args.device)
    cfg = bench_config(args.presets[0], args.batch[0], args.precision[0], args.compile, args.channels_last)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to the RSS now
    before = _status_kb("VmRSS")
    step, _ = IMPLS[args._memory](cfg, device)
    step(), step()
    print((_status_kb("VmHWM") - before) / 1024)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "ddpm-cifar10"])
    p.add_argument("--batch", type=int, nargs="+", default=[128], help="batch sizes to sweep (e.g. 128 256 512)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (and compilation)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--precision", nargs="+", default=["bf16" if torch.cuda.is_available() else "fp32"],
                   choices=sorted(DTYPES), help="each one measured for both implementations")
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="difftrain's train.compile")
    p.add_argument("--channels-last", default="auto", choices=["auto", "on", "off"], help="difftrain's train.channels_last")
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                   help="difftrain's train.cuda_graphs (the step captured as a CUDA graph)")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS), help="implementations to measure")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--_memory", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._memory:
        return _memory_child(args)

    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {name}; torch {torch.__version__}; batch {args.batch}; "
          f"{args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up; "
          f"difftrain compile={args.compile} channels_last={args.channels_last} cuda_graphs={args.cuda_graphs}")
    peaks = {precision: matmul_peak(device, precision) for precision in args.precision}
    for precision, peak in peaks.items():
        print(f"measured {precision} matmul peak: {peak / 1e12:.2f} TFLOP/s")
    rows = []
    cases = [(preset, precision, batch) for preset in args.presets for precision in args.precision for batch in args.batch]
    for preset, precision, batch in cases:
        peak = peaks[precision]
        cfg = bench_config(preset, batch, precision, args.compile, args.channels_last, args.cuda_graphs)
        fpi = flops_per_image(cfg, device)
        steps = {impl: IMPLS[impl](cfg, device)[0] for impl in args.impls}
        for impl, step in steps.items():
            for _ in range(args.warmup):
                step()
            sync(device)
        rates = {impl: [] for impl in steps}
        memory = {}
        order = list(steps)
        for r in range(args.rounds):
            for impl in order if r % 2 == 0 else order[::-1]:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                sync(device)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    steps[impl]()
                sync(device)
                rates[impl].append(args.steps * batch / (time.perf_counter() - t0))
                if device.type == "cuda":
                    memory[impl] = torch.cuda.max_memory_allocated(device) / 2**20
        if device.type != "cuda":
            memory = {impl: peak_memory_subprocess(impl, args, preset, precision, batch) for impl in steps}
        for impl in steps:
            ips = median(rates[impl])
            rows.append(dict(preset=preset, precision=precision, batch=batch, impl=impl, images_per_s=ips, rounds=rates[impl], peak_mb=memory[impl],
                             gflop_per_image=fpi / 1e9, mfu=ips * fpi / peak))
        del steps

    print()
    print("| preset | precision | batch | implementation | images/s (median) | speed-up | peak memory MB "
          "| GFLOP/image (fwd+bwd) | MFU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        base = next((r for r in rows if r["preset"] == row["preset"] and r["precision"] == row["precision"]
                     and r["batch"] == row["batch"] and r["impl"] == "diffusers"), None)
        speedup = f"{row['images_per_s'] / base['images_per_s']:.2f}x" if base else "n/a"
        print(f"| {row['preset']} | {row['precision']} | {row['batch']} | {row['impl']} | {fmt_float(row['images_per_s'])} | "
              f"{speedup} | {fmt_float(row['peak_mb'])} | "
              f"{row['gflop_per_image']:.2f} | {100 * row['mfu']:.1f}% |")
    # What each user gets without flags: difftrain trains in its config file's precision (bf16
    # in the GPU presets), diffusers' train_unconditional in fp32 (--mixed_precision "no").
    for preset in args.presets:
        default = preset_precision(preset)
        ours = next((r for r in rows if r["preset"] == preset and r["impl"] == "difftrain" and r["precision"] == default), None)
        theirs = next((r for r in rows if r["preset"] == preset and r["impl"] == "diffusers" and r["precision"] == "fp32"), None)
        if default != "fp32" and ours and theirs:
            print(f"\n{preset}, each at its default precision: difftrain {default} (configs/{preset}.toml) against "
                  f"diffusers fp32: {ours['images_per_s'] / theirs['images_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=name, args=vars(args), rows=rows), indent=1))


if __name__ == "__main__":
    main()
