"""The ``difftrain`` command: parse arguments, build the config, call the API. No logic here."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from difftrain.config import ConfigError, config_to_toml, load_config


def _train(args: argparse.Namespace) -> int:
    from difftrain.training.loop import train

    cfg = load_config(args.config, args.set)
    if args.dry_run:
        print(config_to_toml(cfg), end="")
        return 0
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / (Path(args.config).stem if args.config else "default")
    result = train(cfg, run_dir, resume=args.resume, stop_at_step=args.stop_at_step)
    if result.stopped_by:
        from difftrain.training.signals import EXIT_STOPPED

        print(f"difftrain: {result.stopped_by} stopped the run at step {result.step}; checkpoint {result.checkpoint}")
        return EXIT_STOPPED
    print(f"difftrain: trained to step {result.step} ({result.images_seen:,} images); checkpoint {result.checkpoint}")
    return 0


def _data_check(args: argparse.Namespace) -> int:
    from difftrain.data.check import check_folder

    report = check_folder(args.path, args.resolution)
    print(json.dumps(report.__dict__, indent=2) if args.json else report.summary())
    return 1 if report.bad else 0


def _sample(args: argparse.Namespace) -> int:
    from difftrain.inference import load_model, sample_to_folder

    loaded = load_model(args.checkpoint, use_ema=not args.no_ema, device=args.device)
    options = {"eta": args.eta} if args.sampler == "ddim" else {}
    grid = sample_to_folder(
        loaded,
        args.out,
        num=args.num,
        sampler=args.sampler,
        steps=args.steps,
        seed=args.seed,
        batch_size=args.batch_size,
        class_label=args.class_label,
        guidance_scale=args.guidance_scale,
        **options,
    )
    weights = "EMA" if loaded.ema else "raw"
    print(
        f"difftrain: {args.num} images from {loaded.path} (step {loaded.step}, {weights} weights, "
        f"{args.sampler} {args.steps} steps, seed {args.seed}) in {args.out}; grid {grid}"
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from difftrain.checkpoint_info import describe_checkpoint

    info = describe_checkpoint(args.checkpoint)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key in ("path", "step", "images_seen", "parameters", "model_sha256", "ema_sha256"):
        print(f"{key:12s} {info[key]:,}" if isinstance(info[key], int) else f"{key:12s} {info[key]}")
    print("config:")
    print(info["config_toml"], end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="difftrain", description="Train image diffusion models (DDPM family).")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train, or resume the run in --run-dir")
    p.add_argument("--config", help="a TOML preset, e.g. configs/tiny.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    p.add_argument("--run-dir", help="run directory (default runs/<config name>); resumes if it has checkpoints")
    p.add_argument("--resume", help="resume from this checkpoint file or run directory")
    p.add_argument("--stop-at-step", type=int, help="save and exit at this step (the schedule still spans total_steps)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    p.set_defaults(func=_train)

    p = sub.add_parser("data", help="dataset tools")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    p = data_sub.add_parser("check", help="decode every image; report counts, sizes, modes and bad files (exit 1 if any)")
    p.add_argument("path", help="a folder of images")
    p.add_argument("--resolution", type=int, default=32, help="images with a shorter side are reported too small")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_data_check)

    p = sub.add_parser("sample", help="write samples of a trained model as PNGs and a grid")
    p.add_argument("--checkpoint", required=True, help="checkpoint file or run directory")
    p.add_argument("--num", type=int, default=64, help="number of images")
    p.add_argument("--sampler", default="ddim", choices=_sampler_choices())
    p.add_argument("--steps", type=int, default=50, help="sampling steps")
    p.add_argument("--eta", type=float, default=0.0, help="DDIM eta (0 = deterministic)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--no-ema", action="store_true", help="use the raw weights instead of the EMA")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--class-label", type=int, help="class to sample (class-conditional models)")
    p.add_argument("--guidance-scale", type=float, default=1.0, help="classifier-free guidance scale")
    p.add_argument("--device", default="auto")
    p.set_defaults(func=_sample)

    p = sub.add_parser("inspect", help="step, config, parameter count and weight digests of a checkpoint")
    p.add_argument("checkpoint", help="checkpoint file or run directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_inspect)
    return parser


def _sampler_choices() -> list[str]:
    from difftrain.diffusion.samplers import SAMPLERS

    return list(SAMPLERS)


def main(argv: list[str] | None = None) -> int:
    from difftrain.training.checkpoint import CheckpointWriteError
    from difftrain.training.loop import TrainingDiverged

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError, CheckpointWriteError, TrainingDiverged) as e:
        print(f"difftrain {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
