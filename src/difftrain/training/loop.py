"""The training loop: one function that reads top to bottom in phases."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch

from difftrain.config import Config, allowed_changes, config_to_dict, config_to_toml, incompatible_keys
from difftrain.data import build_dataset, build_loader
from difftrain.data.cache import with_decode_cache
from difftrain.data.check import prepare_dataset
from difftrain.diffusion.losses import diffusion_loss, loss_weight
from difftrain.diffusion.process import prediction_target, q_sample
from difftrain.diffusion.schedules import alpha_bar_schedule
from difftrain.evaluation.during_training import TrainingFID
from difftrain.sampling import grid_class_labels, initial_noise
from difftrain.training import checkpoint as ckpt
from difftrain.training import distributed
from difftrain.training.builders import build_model, build_optimizer, effective_batch, peak_lr, resolve_device
from difftrain.training.diagnostics import divergence_report
from difftrain.training.ema import EMA
from difftrain.training.heldout import build_heldout, split_heldout
from difftrain.training.lr_schedule import lr_at
from difftrain.training.precision import autocast, grad_scaler
from difftrain.training.progress import Progress, memory_stats
from difftrain.training.seeding import derive_seed, rng_state, set_rng_state, step_generator
from difftrain.training.signals import StopRequest, signal_name
from difftrain.training.speed import compile_model, prepare_model
from difftrain.training.trackers import Trackers, build_trackers
from difftrain.training.validation import save_grids, validation_grids

NUM_LOSS_BUCKETS = 10  # loss is also reported per tenth of [0, T)


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row; the last good checkpoint is left untouched."""


@dataclasses.dataclass
class TrainResult:
    step: int
    images_seen: int
    checkpoint: Path | None
    skipped_steps: int
    stopped_by: str | None = None  # the signal that stopped the run early, if one did


def train(
    cfg: Config, run_dir: str | Path, resume: str | Path | None = None, stop_at_step: int | None = None
) -> TrainResult:
    """Train ``cfg`` in ``run_dir``; resume from ``resume`` or from the run's newest checkpoint.

    ``stop_at_step`` ends this process early, with a checkpoint, at that step (the schedule
    still runs to ``train.total_steps``): for job queues with time limits, and for tests.

    Running the same call again in the same run directory continues where it stopped, with the
    same data order, random numbers, LR schedule and EMA, so the result is the same as one
    uninterrupted run (bit for bit on the CPU in fp32).
    """
    run_dir = Path(run_dir)
    tc = cfg.train
    dctx = distributed.setup(resolve_device(tc.device))  # a no-op without torchrun
    device, rank, world_size = dctx.device, dctx.rank, dctx.world_size

    # Data.
    d = cfg.data
    dataset = build_dataset(d.path, d.resolution, d.channels, d.random_flip, d.color_jitter, d.class_conditional)
    dataset = prepare_dataset(dataset, d.on_bad_image, run_dir, d.min_image_size)  # scan (cached); skip or fail
    dataset = with_decode_cache(dataset, d.cache, d.cache_dir)  # data.cache: decoded once, memory-mapped
    dataset, heldout_set = split_heldout(
        dataset, cfg, lambda p: build_dataset(p, d.resolution, d.channels, False, 0.0, d.class_conditional)
    )
    num_classes = getattr(dataset, "num_classes", 0) if d.class_conditional else 0
    if len(dataset) < tc.batch_size:
        raise ValueError(f"data.path {d.path} holds {len(dataset)} images, fewer than train.batch_size={tc.batch_size}")

    # Model, EMA, optimizer, schedule.
    torch.manual_seed(derive_seed(tc.seed, "init"))  # the same initial weights on every rank
    model = prepare_model(build_model(cfg, num_classes).to(device), device, tc.channels_last, tc.tf32)
    # `net` runs forward and backward (DDP-wrapped, compiled); `model` is saved and averaged.
    net = compile_model(distributed.wrap(model, dctx), device, tc.compile)
    ema = EMA(model, decay=cfg.ema.decay, warmup=cfg.ema.warmup, warmup_power=cfg.ema.warmup_power)
    optimizer = build_optimizer(cfg, model, device)
    scaler = grad_scaler(tc.precision, device)
    alpha_bar = alpha_bar_schedule(cfg.diffusion.schedule, cfg.diffusion.num_timesteps).to(device)
    T = cfg.diffusion.num_timesteps
    lr_peak = peak_lr(cfg, world_size)
    images_per_step = effective_batch(cfg, world_size)

    # Resume.
    step = 0
    position = 0  # images consumed by all ranks together: the global data position
    skipped_total = 0
    run_dir.mkdir(parents=True, exist_ok=True)
    source = resume if resume is not None else _existing_checkpoint(run_dir)
    if source is not None:
        state = ckpt.load_checkpoint(source)
        bad = incompatible_keys(state["config"], config_to_dict(cfg))
        if bad:
            lines = "\n".join(f"  {k}: checkpoint {old!r}, now {new!r}" for k, (old, new) in bad.items())
            raise ValueError(f"cannot resume from {state['path']}: the config changes the model or data:\n{lines}")
        for k, (old, new) in allowed_changes(state["config"], config_to_dict(cfg)).items():
            print(f"difftrain: resuming with a changed {k}: checkpoint {old!r}, now {new!r}")
        model.load_state_dict(state["model"])
        ema.load_state_dict(state["ema"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"])
        step = int(state["step"])
        position = int(state.get("data_position", step * images_per_step))
        if position % world_size:
            raise ValueError(
                f"cannot resume {state['path']} on {world_size} processes: its data position "
                f"{position} (images seen) is not a multiple of the world size"
            )
        skipped_total = int(state["counters"]["skipped_steps"])
        if dctx.is_main:
            print(f"difftrain: resumed from {state['path']} at step {step} ({position:,} images seen)")
        del state
    if dctx.is_main:
        (run_dir / "samples").mkdir(exist_ok=True)
        ckpt.atomic_write_bytes(run_dir / "config.toml", config_to_toml(cfg).encode())
    loader = build_loader(
        dataset,
        batch_size=tc.batch_size,
        seed=tc.seed,
        start=position,
        num_workers=d.num_workers,
        device=device,
        rank=rank,
        world_size=world_size,
        prefetch_factor=d.prefetch_factor,
    )
    trackers = build_trackers(run_dir, cfg.tracking, config_to_dict(cfg)) if dctx.is_main else Trackers([])
    heldout = build_heldout(heldout_set, cfg, alpha_bar, device, dctx)  # each rank holds its shard
    progress = Progress(tc.total_steps, start_step=step, enabled=tc.progress_bar and dctx.is_main)
    val_noise = initial_noise(cfg.validation.num_images, (d.channels, d.resolution, d.resolution), cfg.validation.seed)
    val_labels = grid_class_labels(cfg.validation.num_images, num_classes)
    fid = TrainingFID(cfg, alpha_bar, device, dctx)  # a no-op unless evaluation.fid_every_steps > 0

    # Running sums live on the device and are read only at log steps (no per-step sync).
    zero = torch.zeros((), device=device)
    loss_sum, grad_norm_sum, skipped_window = zero.clone(), zero.clone(), zero.clone()
    streak, max_streak = zero.clone(), zero.clone()
    bucket_loss = torch.zeros(NUM_LOSS_BUCKETS, device=device)
    bucket_count = torch.zeros(NUM_LOSS_BUCKETS, device=device)
    window_steps, data_wait, window_start = 0, 0.0, time.perf_counter()
    last_saved = step
    stopped_by = None  # the signal that stops every rank, once any of them has received one
    model.train()
    # SIGTERM / SIGINT: save at the end of the step, then return. Installed before the loader's
    # workers fork, so that they inherit it and survive a Ctrl-C sent to the whole group.
    stop = StopRequest().install()
    data_iter = iter(loader)

    end = tc.total_steps if stop_at_step is None else min(stop_at_step, tc.total_steps)
    try:
        while step < end:
            # Every random number of this step derives from (seed, rank, step).
            torch.manual_seed(derive_seed(tc.seed, rank, step, "dropout"))
            lr = lr_at(
                step,
                peak_lr=lr_peak,
                warmup_steps=cfg.optim.warmup_steps,
                total_steps=tc.total_steps,
                schedule=cfg.optim.lr_schedule,
                min_lr_ratio=cfg.optim.min_lr_ratio,
            )
            for group in optimizer.param_groups:
                group["lr"] = lr

            # Accumulate gradients.
            step_loss = zero.clone()
            for micro in range(tc.grad_accum_steps):
                fetch_start = time.perf_counter()
                x0, labels = next(data_iter)
                data_wait += time.perf_counter() - fetch_start
                x0 = x0.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True) if num_classes else None
                # Drawn for the global micro-batch, this rank keeps its rows: the same numbers
                # whatever the world size (see training/distributed.py).
                gen = step_generator(tc.seed, 0, step * tc.grad_accum_steps + micro, device, "diffusion")
                n = x0.shape[0] * world_size
                t = distributed.rank_rows(torch.randint(0, T, (n,), device=device, generator=gen), dctx)
                noise = distributed.rank_rows(torch.randn((n, *x0.shape[1:]), device=device, generator=gen), dctx)
                if labels is not None:  # label dropout for classifier-free guidance
                    drop = distributed.rank_rows(torch.rand((n,), device=device, generator=gen), dctx)
                    drop = drop < cfg.model.class_dropout
                    labels = torch.where(drop, torch.full_like(labels, num_classes), labels)
                ab_t = alpha_bar[t]
                x_t = q_sample(x0, t, noise, alpha_bar)
                target = prediction_target(cfg.diffusion.prediction, x0, noise, ab_t)
                weight = loss_weight(cfg.diffusion.loss_weighting, ab_t, cfg.diffusion.prediction, cfg.diffusion.min_snr_gamma)
                with distributed.sync_gradients(net, sync=micro == tc.grad_accum_steps - 1):
                    with autocast(tc.precision, device):
                        out = net(x_t, t, labels)
                    per_sample = diffusion_loss(out, target, weight)  # (B,) float32
                    loss = per_sample.mean() / tc.grad_accum_steps
                    scaler.scale(loss).backward()
                step_loss += loss.detach()
                buckets = (t * NUM_LOSS_BUCKETS) // T
                bucket_loss.index_add_(0, buckets, per_sample.detach())
                bucket_count.index_add_(0, buckets, torch.ones_like(per_sample))

            # Clip gradients; a non-finite loss or gradient skips the step on the device.
            scaler.unscale_(optimizer)
            max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            finite = torch.isfinite(step_loss) & torch.isfinite(grad_norm)

            # Optimizer step.
            if scaler.is_enabled():
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.found_inf = (~finite).float()
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            # Update EMA.
            if (step + 1) % cfg.ema.update_every_steps == 0:
                ema.update(model, apply=finite.float())
            step += 1
            position += images_per_step

            # Account.
            ok = finite.float()
            loss_sum += torch.where(finite, step_loss, zero)
            grad_norm_sum += torch.where(finite, grad_norm, zero)
            skipped_window += 1 - ok
            streak = (streak + 1) * (1 - ok)
            max_streak = torch.maximum(max_streak, streak)
            window_steps += 1

            # Log.
            if step % tc.log_every_steps == 0 or step == end:
                elapsed = time.perf_counter() - window_start
                distributed.all_reduce_sum_(loss_sum, bucket_loss, bucket_count)  # grad norms agree
                loss_sum /= world_size
                skipped = int(skipped_window.item())
                skipped_total += skipped
                good = max(1, window_steps - skipped)
                counts = bucket_count.clamp(min=1)
                metrics = {
                    "loss": loss_sum.item() / good,
                    "grad_norm": grad_norm_sum.item() / good,
                    "lr": lr,
                    "ema_decay": ema.current_decay(),
                    "images_per_s": window_steps * images_per_step / elapsed,
                    "data_wait_frac": data_wait / elapsed,
                    "skipped_steps": skipped_total,
                    "images_seen": position,
                    **{f"loss_bucket/{i}": v for i, v in enumerate((bucket_loss / counts).tolist())},
                    **memory_stats(device),
                }
                trackers.log(step, metrics)
                progress.update(step, metrics)
                if max_streak.item() >= tc.max_nonfinite_in_row:
                    raise TrainingDiverged(
                        f"{int(max_streak.item())} non-finite steps in a row by step {step} "
                        f"(train.max_nonfinite_in_row={tc.max_nonfinite_in_row}); the last good "
                        f"checkpoint in {run_dir / 'checkpoints'} is untouched. Lower optim.lr, "
                        f"use bf16 instead of fp16, or check the data.\n"
                        + divergence_report(model, x0, t, x_t, target, weight, labels, diffusion_loss)
                    )
                loss_sum.zero_(), grad_norm_sum.zero_(), skipped_window.zero_(), max_streak.zero_()
                bucket_loss.zero_(), bucket_count.zero_()
                window_steps, data_wait, window_start = 0, 0.0, time.perf_counter()

            # Agree on stopping: a signal to any rank stops all of them after this same step. A
            # stopping run saves at once (a preemption gives it seconds), skipping evaluation.
            stopped_by = signal_name(distributed.max_over_ranks(stop.signum, dctx))

            # Validate.
            v = cfg.validation
            if v.every_steps and (step % v.every_steps == 0 or step == tc.total_steps) and not stopped_by:
                pause_start = time.perf_counter()
                # Each rank samples its share of the grids and evaluates its share of the held-out
                # set; rank 0 gathers them: the same grids and numbers on any number of processes.
                grids = validation_grids(model, ema.model, cfg, val_noise, val_labels, num_classes, alpha_bar, dctx)
                heldout_metrics = heldout.evaluate(model, ema.model)
                if dctx.is_main:
                    save_grids(grids, run_dir, step, trackers)
                    trackers.log(step, heldout_metrics)
                window_start += time.perf_counter() - pause_start  # images/s counts training only

            # Measure FID.
            pause_start = time.perf_counter()
            if not stopped_by and (fid_metrics := fid(step, ema.model)):
                trackers.log(step, fid_metrics)
                window_start += time.perf_counter() - pause_start

            # Save.
            if step % cfg.checkpoint.every_steps == 0 or step == end or stopped_by:
                pause_start = time.perf_counter()
                state = {
                    "step": step,
                    "images_seen": position,
                    "data_position": position,  # global: resumes on any world size dividing it
                    "world_size": world_size,
                    "model": model.state_dict(),
                    "ema": ema.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(),
                    "lr_schedule": {"peak_lr": lr_peak, "last_lr": lr, "warmup_steps": cfg.optim.warmup_steps},
                    "rng": rng_state(),
                    "counters": {"skipped_steps": skipped_total + int(skipped_window.item())},
                    "config": config_to_dict(cfg),
                    "num_classes": num_classes,
                }
                c = cfg.checkpoint
                # Rank 0 writes; every rank waits for it and then gets its outcome (the path, None
                # when on_write_error="continue" let a failure pass, or its error to raise).
                saved = distributed.run_on_main(
                    lambda: ckpt.save_or_report(
                        state, run_dir / "checkpoints", step, c.keep_last, c.keep_every_steps, c.on_write_error
                    ),
                    dctx,
                )
                if saved:
                    last_saved = step
                window_start += time.perf_counter() - pause_start
                if stopped_by:
                    break
    finally:
        progress.close()
        trackers.close()
        distributed.teardown(dctx)
        # Last: under torchrun a rank that exits stops the others with SIGTERM, which must not
        # kill one that is still closing its files.
        stop.restore()
    final = ckpt.find_checkpoint(run_dir) if last_saved == step else None
    return TrainResult(
        step=step, images_seen=position, checkpoint=final, skipped_steps=skipped_total,
        stopped_by=stopped_by,
    )


def _existing_checkpoint(run_dir: Path) -> Path | None:
    try:
        return ckpt.find_checkpoint(run_dir / "checkpoints")
    except FileNotFoundError:
        return None
