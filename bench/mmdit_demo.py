"""A transformer base that learns and can be taught: an SD3-style MMDiT (diffusers'
SD3Transformer2DModel, small) trained from scratch by difftrain with flow matching on the built-in
text shapes, then taught the ring concept by LoRA and by DreamBooth, judged as bench/fine_tune_demo.py
judges the UNet (new-concept rate before / after, forgetting of the old prompts).

    python bench/mmdit_demo.py --work runs/mmdit-demo            # everything: 42 min on a busy 2-core CPU
    python bench/mmdit_demo.py --work runs/mmdit-demo --toy      # every piece at a toy size (the test's)
    python bench/mmdit_demo.py --work runs/mmdit-demo --reuse-base --lora-lr 1e-3   # the fine-tunes again, same base

1. A StableDiffusion3Pipeline folder (``WORK/random-base``), offline: an AutoencoderKL of factor 2
   trained here for ``--vae-steps`` steps on the shapes images to reconstruct them (a short plain
   PyTorch loop: L1 + MSE + a small KL term; its scaling and shift factors then set from its latents'
   std and mean, as SD3's were), judged by reconstructing held-out images; CLIP-L, CLIP-G and T5
   encoders with random weights (frozen, as tests/family_bases.py makes them; "ring" is in no
   vocabulary: spelled out from letters); a randomly initialised SD3Transformer2DModel with
   patch 1 (16 px -> 8 x 8 latents of 8 channels -> 64 image tokens: with SD3's patch 2, 16
   tokens of 4 x 4 px, the base drew blobs); a FlowMatchEulerDiscreteScheduler with shift 1
   (SD3's shift 3 is for 1024 px; the SD3 paper trains small images unshifted).
2. The base: ``difftrain train --set model.init_from=WORK/random-base`` on ``builtin:shapes`` with
   captions, ``--base-steps`` steps: full fine-tuning of random weights, that is training from
   scratch, with the family's flow matching (logit-normal t, the scheduler's shift); then ``difftrain
   export`` writes it as a base folder (``WORK/base``) that StableDiffusion3Pipeline loads.
3. The new concept: ``--images`` red rings (bench/concept_demo.py), taught to that folder by LoRA
   (the family's targets: the joint attention's projections) and by DreamBooth + LoRA (prior
   preservation with class images of "a red disc on a dark background" made by the base), and by
   full fine-tuning (``--full``), each through ``difftrain train`` (``--steps`` of ``--batch``).
4. Every model, the base included, judged by concept_demo.measure (the judge of fine_tune_demo.py):
   Euler, ``--sampling-steps`` steps, guidance ``--guidance``, the same noise for every model.

A benchmark, not a test: its table goes to docs/fine_tuning.md with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from concept_demo import CLASS_PROMPT, NEW_PROMPT, OLD_PROMPTS, measure, print_table, train, write_rings  # noqa: E402

from difftrain.data.builtin import describe_shape, draw_ring, draw_shape, shape_caption  # noqa: E402
from difftrain.evaluation.prompt_following import judge_image, prompt_following  # noqa: E402
from difftrain.generation.inference import generate_images, load_model  # noqa: E402
from difftrain.generation.sampling import make_grid, save_png, to_uint8  # noqa: E402
from tests import family_bases as fb  # noqa: E402  (tiny random text encoders and tokenizers, built offline)

RESOLUTION = 16  # pixels a side, as configs/text-shapes.toml
T5_TOKENS = 16  # model.max_sequence_length: the longest caption ("ring" spelled out) is 12 T5 tokens
HELD_OUT = 100_000  # shape indices from here on are not used to train the VAE
VAE_RINGS = 1_000_000  # the VAE's rings are draw_ring(VAE_RINGS + i): all hues, not the taught ones (0, 1, ...)

# Sizes: the demo's and a toy one (the test's). Text encoder widths: CLIP-L + CLIP-G <= T5's.
SIZES = {
    "demo": dict(vae_channels=(32, 32), latent_channels=8, patch=1, layers=4, heads=2, head_dim=32, clip_l=16,
                 clip_g=16, t5=32),
    "toy": dict(vae_channels=(8, 8), latent_channels=4, patch=1, layers=1, heads=2, head_dim=8, clip_l=8, clip_g=8,
                t5=16),
}


def shape_images(indices: list[int], resolution: int = RESOLUTION) -> torch.Tensor:
    """(B, 3, H, W) float32 in [-1, 1]: the built-in shapes ``indices``."""
    a = np.stack([draw_shape(i, resolution)[0] for i in indices])
    return torch.from_numpy(a).permute(0, 3, 1, 2).float() / 127.5 - 1


def vae_images(indices: list[int], resolution: int = RESOLUTION) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1]: the VAE's training images, the built-in shapes and, for every fourth
    index, a ring of any colour on either background (VAE_RINGS onwards: none of the taught red rings).
    SD3's VAE was trained on images of every kind; one trained on the three shapes alone cannot draw a
    ring's hole (red rings survived its round trip 8% of the time in a trial), so no denoiser could."""
    images = shape_images(indices, resolution)
    for k, i in enumerate(indices):
        if i % 4 == 3:
            ring = draw_ring(VAE_RINGS + i, resolution)
            images[k] = torch.from_numpy(ring).permute(2, 0, 1).float() / 127.5 - 1
    return images


def train_vae(size: dict, steps: int, batch: int, lr: float, kl_weight: float, seed: int):
    """An AutoencoderKL of factor 2 trained to reconstruct ``vae_images`` (L1 + MSE + ``kl_weight`` x the
    KL per latent element), AdamW with warm-up and cosine decay; its scaling_factor and shift_factor
    then set to 1 / std and the mean of its latents (the posterior means of 512 images)."""
    from diffusers import AutoencoderKL

    vae = fb.seeded(seed, lambda: AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=size["latent_channels"], layers_per_block=1,
        norm_num_groups=8 if min(size["vae_channels"]) >= 8 else 4, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=size["vae_channels"], sample_size=RESOLUTION))
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + np.cos(np.pi * step / steps))
        x = vae_images(torch.randint(0, HELD_OUT, (batch,), generator=gen).tolist())
        posterior = vae.encode(x).latent_dist
        rec = vae.decode(posterior.sample(generator=gen)).sample
        loss = (rec - x).abs().mean() + (rec - x).pow(2).mean() + kl_weight * posterior.kl().mean() / posterior.mean[0].numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"vae step {step}: loss {loss.item():.4f}", file=sys.stderr, flush=True)
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        z = vae.encode(shape_images(list(range(HELD_OUT, HELD_OUT + 512)))).latent_dist.mean
    vae.register_to_config(scaling_factor=float(1 / z.std()), shift_factor=float(z.mean()))
    return vae


@torch.no_grad()
def judge_reconstructions(vae, n: int = 480) -> dict:
    """The judge on ``n`` held-out shapes and 64 red rings after the VAE's round trip (posterior mean):
    how much of the base's ceiling the VAE leaves (the judge scores the images themselves 97.9%)."""
    idx = list(range(HELD_OUT, HELD_OUT + n))
    rec = vae.decode(vae.encode(shape_images(idx)).latent_dist.mean).sample
    scores = prompt_following(to_uint8(rec), [shape_caption(describe_shape(i, RESOLUTION)) for i in idx])
    rings = np.stack([draw_ring(i, RESOLUTION, hue_deg=(-10, 10), dark=True) for i in range(64)])
    rings = torch.from_numpy(rings).permute(0, 3, 1, 2).float() / 127.5 - 1
    seen = [judge_image(a) for a in to_uint8(vae.decode(vae.encode(rings).latent_dist.mean).sample)]
    return {"shape": scores["shape_accuracy"], "colour": scores["colour_accuracy"], "both": scores["both_accuracy"],
            "red_ring": float(np.mean([s == ("ring", "red") for s in seen]))}


def write_random_base(path: Path, vae, size: dict, seed: int) -> Path:
    """A StableDiffusion3Pipeline folder in ``path``: ``vae``, random frozen CLIP-L / CLIP-G / T5 (the
    tests' tokenizers), a random SD3Transformer2DModel of ``size`` and FlowMatchEulerDiscreteScheduler(shift=1)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    path.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab = fb.clip_tokenizer(path / "tokenizer")
    t5_tokenizer = fb.tiny_t5_tokenizer()
    latent = RESOLUTION // 2
    width = size["heads"] * size["head_dim"]
    transformer = fb.seeded(seed, lambda: SD3Transformer2DModel(
        sample_size=latent, patch_size=size["patch"], in_channels=size["latent_channels"], num_layers=size["layers"],
        attention_head_dim=size["head_dim"], num_attention_heads=size["heads"], joint_attention_dim=size["t5"],
        caption_projection_dim=width, pooled_projection_dim=size["clip_l"] + size["clip_g"],
        out_channels=size["latent_channels"], pos_embed_max_size=latent // size["patch"]))
    StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0),
        vae=vae, text_encoder=fb.tiny_clip(vocab, size["clip_l"], seed + 1, projection=True), tokenizer=tokenizer,
        text_encoder_2=fb.tiny_clip(vocab, size["clip_g"], seed + 2, projection=True), tokenizer_2=tokenizer,
        text_encoder_3=fb.tiny_t5_encoder(len(t5_tokenizer), size["t5"], seed + 3), tokenizer_3=t5_tokenizer,
    ).save_pretrained(path)
    fb.restore_clip_tokenizers(path, "tokenizer", "tokenizer_2")
    return path


def base_overrides(args, random_base: Path) -> list[str]:
    """``difftrain train`` settings of the from-scratch base (the family decides the objective, t
    sampling and shift from the folder)."""
    return [f"model.init_from={random_base}", "data.path=builtin:shapes", "data.captions=true",
            f"data.resolution={RESOLUTION}", "data.buckets=off", "data.random_flip=false", "data.num_workers=0",
            f"model.max_sequence_length={T5_TOKENS}", "model.class_dropout=0.1", f"optim.lr={args.base_lr}",
            f"optim.warmup_steps={min(200, args.base_steps // 5)}", "optim.lr_schedule=cosine", "optim.min_lr_ratio=0.1",
            f"train.total_steps={args.base_steps}", f"train.batch_size={args.base_batch}",
            f"train.log_every_steps={max(1, args.base_steps // 20)}", "train.progress_bar=false",
            f"ema.decay={args.base_ema}", f"checkpoint.every_steps={args.base_steps}", "validation.every_steps=0"]


def modes(args, base: Path, images: Path) -> dict[str, list[str]]:
    """Each fine-tune's ``--set`` overrides (the base folder decides the family's parts and flow settings)."""
    common = [f"model.init_from={base}", f"data.path={images}", f"data.resolution={RESOLUTION}", "data.num_workers=0",
              f"model.max_sequence_length={T5_TOKENS}", f"train.total_steps={args.steps}",
              f"train.batch_size={args.batch}", "optim.warmup_steps=0", "optim.lr_schedule=constant",
              f"ema.decay={args.ema_decay}", "validation.every_steps=0", f"checkpoint.every_steps={args.steps}",
              "train.progress_bar=false"]
    lora = [f"lora.rank={args.rank}", f"lora.alpha={args.rank}", f"optim.lr={args.lora_lr}"]
    full = [f"optim.lr={args.full_lr}"]
    prior = [f"dreambooth.instance_prompt={NEW_PROMPT}", f"dreambooth.class_prompt={CLASS_PROMPT}",
             f"dreambooth.num_class_images={args.class_images}", f"dreambooth.class_guidance_scale={args.guidance}",
             f"dreambooth.class_steps={args.sampling_steps}"]
    runs = {f"LoRA rank {args.rank}": common + lora, f"DreamBooth + LoRA rank {args.rank}": common + lora + prior}
    if args.full:
        runs |= {"full fine-tuning": common + full, "DreamBooth + full": common + full + prior}
    return runs


def trained_parameters(run_dir: Path) -> int:
    """Parameters a run trained: the tensors of its checkpoint's model (the adapter alone for LoRA)."""
    from difftrain.checkpoints import checkpoint as ckpt

    return sum(t.numel() for t in ckpt.load_checkpoint(run_dir)["model"].values())


def sample_grid(runs: dict[str, Path], path: Path, *, sampler: str, steps: int, guidance: float, seed: int,
                zoom: int = 3) -> Path:
    """A PNG of one row per run: 8 samples of NEW_PROMPT, then one of each of 8 old prompts (every
    sixth: each shape, colour and background), from the noise ``measure`` uses, ``zoom`` x nearest."""
    rows = []
    for run in runs.values():
        loaded = load_model(run, device="cpu")
        options = {"sampler": sampler, "steps": steps, "guidance_scale": guidance, "seed": seed}
        rows.append(to_uint8(generate_images(loaded, 8, prompt=NEW_PROMPT, **options)))
        rows.append(to_uint8(generate_images(loaded, 8, prompt=OLD_PROMPTS[::6], **options)))
    grid = make_grid(np.concatenate(rows), ncols=16)
    save_png(grid.repeat(zoom, axis=0).repeat(zoom, axis=1), Path(path))
    return Path(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="runs/mmdit-demo", help="folder for the bases, the images and the fine-tunes")
    p.add_argument("--toy", action="store_true", help="every piece at a toy size and a few steps (the test's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vae-steps", type=int, default=800, help="steps of the VAE's reconstruction training")
    p.add_argument("--vae-batch", type=int, default=32)
    p.add_argument("--vae-lr", type=float, default=3e-3)
    p.add_argument("--vae-kl", type=float, default=1e-5, help="weight of the KL term per latent element")
    p.add_argument("--base-steps", type=int, default=1500, help="steps of the from-scratch base")
    p.add_argument("--reuse-base", action="store_true",
                   help="keep WORK/base-run and WORK/base from an earlier run (its VAE judged again) and redo the fine-tunes")
    p.add_argument("--base-batch", type=int, default=64)
    p.add_argument("--base-lr", type=float, default=1e-3)
    p.add_argument("--base-ema", type=float, default=0.999)
    p.add_argument("--images", type=int, default=32, help="ring images to teach")
    p.add_argument("--steps", type=int, default=300, help="steps of each fine-tune")
    p.add_argument("--batch", type=int, default=16, help="images per step of each fine-tune")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (the joint attention's projections)")
    p.add_argument("--lora-lr", type=float, default=3e-3)
    p.add_argument("--full", action="store_true", help="also full fine-tuning, with and without DreamBooth")
    p.add_argument("--full-lr", type=float, default=2e-4)
    p.add_argument("--ema-decay", type=float, default=0.99, help="EMA of the fine-tunes (sampled)")
    p.add_argument("--class-images", type=int, default=64, help="DreamBooth class images, made by the base")
    p.add_argument("--guidance", type=float, default=5.0, help="guidance scale of every sample")
    p.add_argument("--sampling-steps", type=int, default=28, help="Euler steps (StableDiffusion3Pipeline's default)")
    p.add_argument("--new-images", type=int, default=64, help="samples of the new prompt per model")
    p.add_argument("--per-prompt", type=int, default=4, help="samples of each of the 48 old prompts per model")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--grid", help="also write a PNG of samples here: per model, 8 of the new prompt and 8 old prompts")
    args = p.parse_args(argv)
    if args.toy:
        args.vae_steps, args.vae_batch, args.base_steps, args.base_batch, args.steps, args.batch = 2, 4, 4, 4, 2, 2
        args.images, args.class_images, args.sampling_steps, args.new_images, args.per_prompt = 2, 2, 2, 2, 1
    size = SIZES["toy" if args.toy else "demo"]
    work = Path(args.work)
    load = os.getloadavg()[0]
    start = time.perf_counter()

    # 1. The random base folder, with a VAE trained to reconstruct the shapes.
    random_base, run, base = work / "random-base", work / "base-run", work / "base"
    if args.reuse_base:
        from diffusers import AutoencoderKL

        vae_s, base_s = 0.0, 0.0
        vae_check = judge_reconstructions(AutoencoderKL.from_pretrained(str(base / "vae")), n=48 if args.toy else 480)
    else:
        shutil.rmtree(random_base, ignore_errors=True)
        vae_start = time.perf_counter()
        vae = train_vae(size, args.vae_steps, args.vae_batch, args.vae_lr, args.vae_kl, args.seed)
        vae_s = time.perf_counter() - vae_start
        vae_check = judge_reconstructions(vae, n=48 if args.toy else 480)
        write_random_base(random_base, vae, size, args.seed)
    print(json.dumps({"vae_s": vae_s, **vae_check}), file=sys.stderr)

    # 2. The base, trained from scratch, exported as a pipeline folder.
    if not args.reuse_base:
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
        base_s = train(None, run, base_overrides(args, random_base.resolve()))
        subprocess.run([sys.executable, "-m", "difftrain", "export", str(run), str(base)], check=True)
    images = write_rings(work / "rings", args.images, RESOLUTION)

    # 3 and 4. The fine-tunes, then every model judged.
    sample = {"sampler": "euler", "steps": args.sampling_steps, "guidance": args.guidance,
              "new_images": args.new_images, "per_prompt": args.per_prompt, "seed": args.seed}
    runs = {"base (before)": run}
    rows = [{"mode": "base (before)", "train_s": base_s, "trained": trained_parameters(run), **measure(run, **sample)}]
    print(json.dumps(rows[-1]), file=sys.stderr)
    for name, overrides in modes(args, base.resolve(), images.resolve()).items():
        run_dir = work / name.lower().replace(" + ", "-").replace(" ", "-")
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time (a kept one would resume, done)
        train_s = train(None, run_dir, overrides)
        runs[name] = run_dir
        rows.append({"mode": name, "train_s": train_s, "trained": trained_parameters(run_dir),
                     **measure(run_dir, **sample)})
        print(json.dumps(rows[-1]), file=sys.stderr)

    if args.grid:
        sample_grid(runs, Path(args.grid), sampler="euler", steps=args.sampling_steps, guidance=args.guidance,
                    seed=args.seed)
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"load average {load:.1f} at the start; {time.perf_counter() - start:.0f} s in all")
    print(f"VAE (factor 2, {size['latent_channels']} latent channels) trained {args.vae_steps} steps of "
          f"{args.vae_batch} in {vae_s:.0f} s; the judge on its reconstructions of held-out shapes: shape "
          f"{vae_check['shape']:.1%}, colour {vae_check['colour']:.1%}, both {vae_check['both']:.1%}; red rings "
          f"{vae_check['red_ring']:.0%}")
    print(f"base: SD3Transformer2DModel {size['layers']} layers x {size['heads'] * size['head_dim']} wide, patch "
          f"{size['patch']}, "
          f"{rows[0]['trained']:,} parameters, from random weights, {args.base_steps} steps of {args.base_batch} "
          f"(LR {args.base_lr:g}) in {base_s:.0f} s; fine-tunes {args.steps} steps of {args.batch} on {args.images} "
          f"ring images; samples Euler {args.sampling_steps} steps, guidance {args.guidance:g}, seed {args.seed}")
    print_table(rows, args.new_images, args.per_prompt)
    if args.json:
        Path(args.json).write_text(json.dumps({"vae": {"seconds": vae_s, **vae_check}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
