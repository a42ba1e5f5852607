"""LoRA over a quantized frozen base (``model.quantize_base``): memory, step time and how far samples move.

    python bench/quantized_base.py                     # off, int8, nf4, fp8 on a wide random Flux base
    python bench/quantized_base.py --kinds off int8 --steps 20 --heads 8 --double 2 --single 4

The base is bench/family_bases_sized.py's proportioned Flux folder with its transformer made wider
(``--heads`` heads of 64, ``--double`` + ``--single`` blocks): a Flux transformer is Linear layers almost
throughout, as the real one (12B) is, so what quantizing them saves shows. Each kind trains in its own
process (configs/flux-lora.toml, rank 16, batch 1, 32 px, fp32, no validation), which reports:

- the denoiser's weight bytes as held (quantized storage and scales counted, each storage once);
- the process's peak RSS and its RSS at the end of training (the base is read in float32 and then
  quantized, so the peak holds the float32 base once whatever the kind; on CUDA the device only ever
  holds the quantized weights, which move there after quantizing);
- the mean step time after the first log window;
- samples (8 Euler steps, 2 images, fixed noise) of the run as difftrain samples it (its quantized
  base) and of ``export --merge`` (the adapter folded into the float32 base: what diffusers samples
  with the exported LoRA on the unquantized base; tests/integration/test_quantized_base.py checks that
  equality through diffusers' pipeline).

The table compares each kind's samples with its own merged export (how far the quantized base moves
difftrain's samples from the adapter's on the real base) and each kind's merged export with the
float32 run's (how far training over a quantized base moves the adapter's result). A benchmark, not a
test; results go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))

SAMPLE = {"sampler": "euler", "steps": 8, "seed": 3, "prompt": "a red square on a dark background"}


def write_wide_flux(path: Path, heads: int, double: int, single: int) -> Path:
    """The proportioned Flux folder with a transformer of ``heads`` heads of 64 and ``double`` + ``single`` blocks."""
    from diffusers import FluxTransformer2DModel
    from family_bases_sized import write_base

    from tests import family_bases as fb

    if (path / "model_index.json").is_file():
        return path
    write_base("flux", "proportioned", path)
    config = json.loads((path / "transformer" / "config.json").read_text())
    transformer = fb.seeded(0, lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=config["in_channels"], num_layers=double, num_single_layers=single,
        attention_head_dim=64, num_attention_heads=heads, joint_attention_dim=config["joint_attention_dim"],
        pooled_projection_dim=config["pooled_projection_dim"], guidance_embeds=True, axes_dims_rope=(16, 24, 24)))
    transformer.save_pretrained(path / "transformer")
    return path


def weight_bytes(net) -> int:
    """Bytes of every tensor ``net`` holds, quantized storage and scales included, each storage once."""
    import torch

    seen: dict[int, int] = {}

    def add(t):
        if isinstance(t, torch.Tensor) and type(t).__name__ != "Float8Tensor":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for t in list(net.parameters()) + list(net.buffers()):
        if type(t).__name__ == "Float8Tensor":
            add(t.qdata)
            add(t.scale)
            continue
        add(t)
        state = getattr(t, "quant_state", None)
        if state is not None:
            add(state.absmax)
            if state.state2 is not None:
                add(state.state2.absmax)
    for m in net.modules():
        state = getattr(m, "state", None)
        if state is not None and hasattr(state, "CB"):
            add(state.CB)
            add(state.SCB)
    return sum(seen.values())


def rss_now_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(args) -> None:
    """Train one kind, print one JSON line of its figures; samples to ``args.out``."""
    import torch

    from difftrain import api
    from difftrain.config import load_config
    from difftrain.generation.inference import generate_images, load_model
    from difftrain.training.loop import train

    torch.set_num_threads(1)
    run = Path(args.out) / args.child
    cfg = load_config(str(ROOT / "configs" / "flux-lora.toml"), [
        f"model.init_from={args.base}", f"data.path={args.data}", "data.resolution=32", "data.buckets=off",
        "data.random_flip=false", "data.num_workers=0", "train.batch_size=1", "train.grad_accum_steps=1",
        "train.precision=fp32", f"train.total_steps={args.steps}", "train.log_every_steps=5", "train.progress_bar=false",
        f"optim.lr={args.lr}", "optim.lr_schedule=constant", "validation.every_steps=0", "checkpoint.every_steps=1000",
        "tracking.tensorboard=false", f"model.quantize_base={args.child}", "train.device=cpu"])
    train(cfg, run)
    peak, end = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, rss_now_mib()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [r["images_per_s"] for r in rows[1:] if "images_per_s" in r]  # after the first window (start-up)
    loaded = load_model(run, device="cpu")
    ours = generate_images(loaded, 2, **SAMPLE)
    merged = api.export(run, Path(args.out) / f"{args.child}-merged.safetensors", format="safetensors", merge=True)
    on_float32 = generate_images(load_model(merged, device="cpu"), 2, **SAMPLE)
    loaded.model.set_scale(0.0)
    base = generate_images(loaded, 2, **SAMPLE)  # the base alone, as held (the adapter's effect: ours - base)
    torch.save({"ours": ours, "merged": on_float32, "base": base}, Path(args.out) / f"{args.child}-samples.pt")
    print(json.dumps({"kind": args.child, "weights_mib": weight_bytes(loaded.model.base) / 2**20, "peak_rss_mib": peak,
                      "end_rss_mib": end, "step_s": len(rates) / sum(1 / r for r in rates) if rates else None}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=["off", "int8", "nf4", "fp8"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--double", type=int, default=2)
    parser.add_argument("--single", type=int, default=4)
    parser.add_argument("--work", default="", help="folder for the base, data and runs (default: a temporary one)")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--base", default="", help=argparse.SUPPRESS)
    parser.add_argument("--data", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    import torch
    from family_peer_speed import write_data

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        base = write_wide_flux(work / "flux-wide", args.heads, args.double, args.single)
        data = write_data(work / "data", 16, 32)
        from family_bases_sized import parameter_counts

        counts = parameter_counts(base)
        print(f"base: Flux transformer {counts['denoiser'] / 1e6:.1f}M parameters ({args.heads} heads of 64, "
              f"{args.double} double + {args.single} single blocks), text encoders {counts['text encoders'] / 1e6:.1f}M; "
              f"{args.steps} steps at lr {args.lr:g}, batch 1, 32 px, rank 16, fp32, 1 thread")
        results = {}
        for kind in args.kinds:
            cmd = [sys.executable, __file__, "--child", kind, "--base", str(base), "--data", str(data), "--out",
                   str(work), "--steps", str(args.steps), "--lr", str(args.lr)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**_env(), "OMP_NUM_THREADS": "1"})
            results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
        samples = {k: torch.load(work / f"{k}-samples.pt") for k in args.kinds}
        print("| model.quantize_base | denoiser weights (MiB) | peak RSS (MiB) | RSS after training (MiB) | s / step "
              "| adapter's effect on its samples (max / mean abs) | own samples vs adapter on float32 base "
              "(max / mean abs) | merged vs float32 run's (max / mean abs) |")
        print("|---|---|---|---|---|---|---|---|")
        for kind in args.kinds:
            r, s = results[kind], samples[kind]
            own, effect = (s["ours"] - s["merged"]).abs(), (s["ours"] - s["base"]).abs()
            vs = (s["merged"] - samples["off"]["merged"]).abs() if "off" in samples else None
            print(f"| {kind} | {r['weights_mib']:.1f} | {r['peak_rss_mib']:.0f} | {r['end_rss_mib']:.0f} | "
                  f"{r['step_s']:.3f} | {effect.max():.4f} / {effect.mean():.4f} | {own.max():.4f} / {own.mean():.4f} | "
                  + (f"{vs.max():.4f} / {vs.mean():.4f} |" if vs is not None else "- |"))


def _env() -> dict:
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}


if __name__ == "__main__":
    main()
