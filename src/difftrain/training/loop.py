"""The training loop: one function that reads top to bottom in phases."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from difftrain.checkpoints import checkpoint as ckpt
from difftrain.checkpoints import sharded as sharded
from difftrain.config import Config, ModelConfig, config_to_dict
from difftrain.data import build_loader
from difftrain.data.cached_conditions import cached_conditions
from difftrain.data.latents import with_latents
from difftrain.data.prepare import prepare_training_data
from difftrain.data.text_cache import with_caption_options, with_text_cache
from difftrain.diffusion.objective import build_objective
from difftrain.evaluation.during_training import TrainingFID
from difftrain.evaluation.sample_check import SampleCheck, plan_groups
from difftrain.generation.sampling import naming_samples
from difftrain.models import network_of_preset
from difftrain.networks.conditioning import Conditioning, image_side_multiple
from difftrain.networks.frozen_dtype import frozen_dtype
from difftrain.networks.init_from import init_source_changes
from difftrain.networks.lora_import import check_adapted_output
from difftrain.networks.quantize import logical_numel
from difftrain.runtime import distributed
from difftrain.runtime.device import compile_model, resolve_device, resolve_toggle
from difftrain.training.diagnostics import divergence_report
from difftrain.training.dreambooth import with_class_images
from difftrain.training.heldout import build_heldout
from difftrain.training.lr_schedule import lr_at
from difftrain.training.power_ema import save_snapshots
from difftrain.training.progress import Progress, memory_stats
from difftrain.training.records import record_start
from difftrain.training.signals import StopRequest, leave_process_group, signal_name
from difftrain.training.state import RunState, effective_batch, load_resume, peak_lr, resume_source
from difftrain.training.step import CapturedStep, StepMetrics, train_step
from difftrain.training.trackers import Trackers, build_trackers
from difftrain.training.validation import ValidationScores, save_grids, validation_grids, validation_plan
from difftrain.training.warnings import RunWarnings, WatchedTrackers


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row; the last good checkpoint is left untouched."""


class NothingTrained(TrainingDiverged):
    """A run that reached its end with every optimizer step skipped (non-finite): its weights are
    those it started from. Exit 2, as a divergence."""


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
    clock = _Clock()  # start-up, the log window, and the seconds paused in it for evaluation and saving
    run_dir, tc = Path(run_dir), cfg.train
    dctx = distributed.setup(resolve_device(tc.device), tc.collective_timeout_s)  # a no-op without torchrun
    device, is_main = dctx.device, dctx.is_main

    # Data: scanned for bad images, cached, the held-out share split off; the frozen text encoder
    # and VAE (text and latent runs), whose latents of the images are cached once.
    data = prepare_training_data(cfg, run_dir, image_side_multiple(cfg.model), dctx.world_size)  # buckets: the VAE's multiple
    check = SampleCheck(cfg, data.train, device)  # memorization and diversity; a no-op unless validation.memorization
    conditioning = Conditioning.from_config(cfg, data.num_classes, device, text_cache=True)  # text.cache: encoders load only to fill it
    conditioning.check_reference_data(cfg.data, cfg.model.init_from)  # an edit family trains on pairs
    data = with_class_images(data, cfg, conditioning, run_dir, dctx)  # DreamBooth's prior; made once
    source, resumed_from = resume_source(run_dir, resume), None
    saved = load_resume(source, cfg, dctx)  # an FSDP run's sharded checkpoint: its run state; the shards later
    if saved is not None:  # before encoding the images with a VAE the checkpoint was not trained with
        conditioning.check_references(saved["frozen"], f"checkpoint {saved['path']}")
    data = with_latents(data, conditioning.codec, cfg.data, cfg.validation.heldout_batch_size, dctx)
    data = with_caption_options(data, cfg)  # text.*: a trigger word, tags shuffled and dropped per sample
    with_text_cache(data, conditioning, cfg, dctx)  # every caption's text-encoder outputs computed once (text.cache)
    # a LoRA run's text encoders and VAE in bf16/fp16, once the latents were cached in float32
    conditioning.hold_frozen(frozen_dtype(cfg, saved["network"] if saved else None, "conditioning"))

    # Run state: fresh weights, or where a checkpoint left off.
    objective = build_objective(cfg.diffusion).to(device)
    state = RunState.build(cfg, data.num_classes, device, init_weights=source is None, conditioning=conditioning,
                           network=saved["network"] if saved else None, dctx=dctx)  # FSDP: sharded, never whole
    if saved is not None:
        resumed_from = _resume(state, saved, dctx)
        del saved
    elif cfg.model.init_lora_from:  # finite weights can still overflow: refused before any step (every rank)
        check_adapted_output(state.model, objective, conditioning, device,
                             f"model.init_lora_from {cfg.model.init_lora_from}", state.precision.autocast())
    # `state.net` runs forward and backward (DDP-wrapped or FSDP-sharded, compiled); `state.model` is saved and averaged.
    state.net = compile_model(state.parallelize(dctx), device, "off" if state.swap else tc.compile)  # block swap: eager
    step_fn = _step_function(state, objective, dctx, bucketed=getattr(data.train, "bucket_shapes", None) is not None)

    # Run folder, loader, trackers and the evaluations.
    _open_run_dir(run_dir, cfg, state, data, dctx, fresh=resumed_from is None)
    loader = build_loader(cached_conditions(data.train, conditioning),  # text.cache: conditions read in the workers
                          batch_size=tc.batch_size, seed=tc.seed, start=state.position, device=device,
                          num_workers=cfg.data.num_workers, prefetch_factor=cfg.data.prefetch_factor, rank=dctx.rank,
                          world_size=dctx.world_size, worker_init_fn=leave_process_group)  # SIGTERM: the main process's
    trackers = WatchedTrackers(build_trackers(run_dir, cfg.tracking, config_to_dict(cfg)),  # rank 0's, watched (warnings.py)
                               RunWarnings.resumed(cfg.validation, run_dir / "metrics.jsonl", state.step)) if is_main else Trackers([])
    heldout = build_heldout(data.heldout, cfg.validation, cfg.data, objective, device, dctx, conditioning)  # each rank holds its shard
    progress = Progress(tc.total_steps, start_step=state.step, enabled=tc.progress_bar and is_main)
    plan = validation_plan(cfg.validation, cfg.diffusion, tc.batch_size, conditioning, data.train) if cfg.validation.every_steps else None
    scores = ValidationScores(cfg.evaluation, device)  # CLIP score, Inception Score: no-ops unless configured
    # A no-op unless evaluation.fid_every_steps > 0; a text run's samples take captions of data.train.
    fid = TrainingFID(cfg, objective, device, dctx, conditioning, data.train, check)
    metrics = StepMetrics(device)  # running sums on the device, read at log steps only
    lr_peak = peak_lr(cfg.optim, images_per_step := effective_batch(tc, dctx.world_size))  # images per optimizer step
    end = tc.total_steps if stop_at_step is None else min(stop_at_step, tc.total_steps)
    start_step = last_saved = state.step
    stopped_by, posthoc_every = None, cfg.ema.posthoc_every_steps or cfg.checkpoint.every_steps
    state.model.train()
    # SIGTERM / SIGINT: save at the end of the step, then return. Installed before the loader's
    # workers fork, so that they inherit it and survive a Ctrl-C sent to the whole group.
    stop = StopRequest().install()
    batches = clock.timed(iter(loader))  # the first log window starts: its seconds waiting for batches counted
    try:
        while state.step < end:
            # One optimizer step: accumulate, clip, step, EMA (training/step.py).
            lr = lr_at(state.step, peak_lr=lr_peak, warmup_steps=cfg.optim.warmup_steps, total_steps=tc.total_steps,
                       schedule=cfg.optim.lr_schedule, min_lr_ratio=cfg.optim.min_lr_ratio, ref_steps=cfg.optim.lr_ref_steps)
            step_fn(state, objective, batches, lr, metrics, dctx)
            clock.first_step(is_main)
            step = state.step

            # Log.
            if step % tc.log_every_steps == 0 or step == end:
                window, logged = _log_window(clock, metrics, lr, state, images_per_step, dctx)  # every rank's sums
                trackers.log(step, logged)
                progress.update(step, logged)
                if window["max_streak"] >= tc.max_nonfinite_in_row:
                    raise TrainingDiverged(_diverged_message(state, objective, metrics, window["max_streak"], run_dir))
                clock.new_window()

            # Agree on stopping: a signal to any rank stops all of them after this same step. A
            # stopping run saves at once (a preemption gives it seconds), skipping evaluation.
            stopped_by = signal_name(distributed.max_over_ranks(stop.signum, dctx))

            # Validate: grids from fixed noise and the held-out loss, each rank its share.
            if (v := cfg.validation.every_steps) and (step % v == 0 or step == tc.total_steps) and not stopped_by:
                # schedule-free: its average; NaN or inf samples stop the run with one line
                with clock.paused("validation_s"), state.reading_weights(), _naming(cfg.model, step, run_dir):
                    model, ema_model = state.evaluation_models()  # themselves; under FSDP the sharded model, in lockstep
                    grids, images = validation_grids(model, ema_model, cfg.validation, plan, conditioning, objective, dctx)
                    heldout_metrics = heldout.evaluate(model, ema_model)
                    del model, ema_model
                    if is_main:
                        save_grids(grids, run_dir, step, trackers)
                        trackers.log(step, {**heldout_metrics, **(scores(images, plan) if scores.enabled else {}),
                                            **check(step, images, plan_groups(plan), run_dir, trackers)})

            # Measure FID of the EMA weights; a new lowest FID is saved now and becomes checkpoints/best.
            best_fid = None
            if not stopped_by and fid.due(step):
                with clock.paused("fid_s"), state.reading_weights(), _naming(cfg.model, step, run_dir, "the FID samples"):
                    fid_metrics = fid(step, state.evaluation_models()[1])
                    trackers.log(step, fid_metrics)
                    best_fid = fid.new_best(fid_metrics, run_dir / "checkpoints")

            # Snapshot the post-hoc EMAs before the checkpoint of the same step (which so implies every snapshot up
            # to it on disk); only at their interval and the last step, so a stop and resume leaves the same files.
            if state.posthoc.stds and (step % posthoc_every == 0 or step == tc.total_steps):
                with clock.paused("checkpoint_s"):  # rank 0 writes (gathered whole under FSDP)
                    save_snapshots(state.posthoc, run_dir, step, config_to_dict(cfg), data.num_classes, dctx)

            # Save: rank 0 writes (under FSDP every rank its shards), every rank gets its outcome
            # (the path, None when on_write_error="continue" let a failure pass, or the error to raise).
            if step % cfg.checkpoint.every_steps == 0 or step == end or stopped_by or best_fid is not None:
                with clock.paused("checkpoint_s"), state.reading_weights():  # live tensors: written inside
                    saved_to = _save(state, metrics, run_dir / "checkpoints", step, best_fid, dctx)
                last_saved = step if saved_to else last_saved
            if stopped_by:
                break
    except RuntimeError as e:  # another rank died or hung: one line naming it and the newest checkpoint
        fault = distributed.describe_group_fault(e, dctx)
        if fault is None:
            raise
        raise distributed.GroupFault(_group_fault_message(fault, dctx, run_dir, state.step)) from e
    finally:
        # The loader's workers are shut down while the handler is still installed, so that a
        # second signal during their shutdown exits at once with its one line, as during the save.
        del batches, loader
        state.close()  # model.swap_blocks: the frozen base back on its device
        progress.close()
        trackers.close()
        distributed.teardown(dctx)
        # Last: under torchrun a rank that exits stops the others with SIGTERM, which must not
        # kill one that is still closing its files.
        stop.restore()
    final = _final_checkpoint(run_dir, state.step, start_step, last_saved, resumed_from)
    if not stopped_by and 0 < state.step <= state.skipped_steps:  # counted over the run, every start of it
        raise NothingTrained(_nothing_trained_message(cfg.model, state.step, final))
    return TrainResult(step=state.step, images_seen=state.position, checkpoint=final,
                       skipped_steps=state.skipped_steps, stopped_by=stopped_by)


def _resume(state: RunState, saved: dict, dctx: distributed.DistContext) -> Path:
    """Load the checkpoint ``saved`` into ``state`` (each reason it cannot resume exactly printed first); its path."""
    for line in state.check_resumable(saved, dctx.world_size):
        print(f"difftrain: {line}")
    state.load_state_dict(saved)
    if dctx.is_main:
        print(f"difftrain: resumed from {saved['path']} at step {state.step} ({state.position:,} images seen)")
    return Path(saved["path"])


def _open_run_dir(run_dir: Path, cfg: Config, state: RunState, data, dctx: distributed.DistContext, fresh: bool) -> None:
    """The run folder (every rank); rank 0 records the start (config.toml once, history.jsonl always) and
    prints the start line and the warnings of the settings."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if dctx.is_main:
        (run_dir / "samples").mkdir(exist_ok=True)
        record_start(run_dir, cfg, dctx.device, dctx.world_size, state.step)
        print(f"difftrain: {_start_line(cfg, state, data, dctx)}")
        for warning in _warnings(cfg, fresh=fresh):
            print(f"difftrain: warning: {warning}", file=sys.stderr)


def _log_window(clock: _Clock, metrics: StepMetrics, lr: float, state: RunState, images_per_step: int,
                dctx: distributed.DistContext) -> tuple[dict, dict]:
    """(this log window's sums, read on every rank; the metrics logged for it); its skipped steps are added to
    the run's."""
    elapsed = clock.window_s()
    window = metrics.read(dctx)
    state.skipped_steps += window["skipped"]
    return window, {
        "loss": window["loss"], "grad_norm": window["grad_norm"], "lr": lr,
        "ema_decay": state.ema.current_decay(),
        "images_per_s": window["steps"] * images_per_step / elapsed,
        "data_wait_frac": clock.take_wait() / elapsed,
        "skipped_steps": state.skipped_steps, "images_seen": state.position,
        "time_to_first_step_s": clock.first_step_s,
        **clock.paused_s,  # validation_s, fid_s, checkpoint_s: so their cost is visible
        **{f"loss_bucket/{i}": v for i, v in enumerate(window["buckets"])},
        **memory_stats(dctx.device),
    }


def _save(state: RunState, metrics: StepMetrics, ckpt_dir: Path, step: int, best_fid: float | None,
          dctx: distributed.DistContext) -> Path | None:
    """Rank 0 writes the checkpoint file (every rank gets its outcome), or, under FSDP, every rank
    writes its shards of one checkpoint folder (checkpoints/sharded.py)."""
    snapshot = state.state_dict()
    snapshot["skipped_steps"] += int(metrics.skipped.item())  # this window's, not yet logged
    c = state.cfg.checkpoint
    if state.template is not None:
        return sharded.save_or_report(state, snapshot, ckpt_dir, step, c.keep_last, c.keep_every_steps,
                                      c.on_write_error, dctx, best=best_fid)
    return distributed.run_on_main(
        lambda: ckpt.save_or_report(snapshot, ckpt_dir, step, c.keep_last, c.keep_every_steps, c.on_write_error,
                                    best=best_fid),
        dctx,
    )


def _final_checkpoint(run_dir: Path, step: int, start_step: int, last_saved: int, resumed_from: Path | None) -> Path | None:
    """The run's result: the checkpoint of its last step, or the one resumed from when nothing was left to
    train; CheckpointWriteError when the last step's save failed too (on_write_error="continue" went on)."""
    if resumed_from is not None and step == start_step:
        return resumed_from
    if last_saved != step:
        raise ckpt.CheckpointWriteError(_unsaved_message(run_dir, step, start_step, resumed_from))
    return ckpt.find_checkpoint(run_dir)


def _step_function(state: RunState, objective, dctx: distributed.DistContext, bucketed: bool = False):
    """``train_step``, or the same step captured as a CUDA graph (``train.cuda_graphs``; not
    under DDP, whose all-reduce hooks are not captured, nor with aspect-ratio buckets, whose batches
    change shape: auto keeps the eager step there)."""
    use_graphs = resolve_toggle(state.cfg.train.cuda_graphs, dctx.device, "cuda_graphs") and not bucketed
    if use_graphs and dctx.enabled:
        if state.cfg.train.cuda_graphs == "on":
            raise ValueError("train.cuda_graphs='on' is not supported under torchrun (DDP); use 'auto' or 'off'")
        use_graphs = False
    return CapturedStep(state, objective) if use_graphs else train_step


class _Clock:
    """The run's time: seconds to its first step, and in each log window the seconds waiting for batches and
    those paused for evaluation and saving (``with clock.paused("fid_s"):``), which images/s leaves out (it
    counts training only) and the log shows."""

    def __init__(self):
        self.started = time.perf_counter()
        self.first_step_s: float | None = None
        self.window_start, self.wait, self.paused_s = self.started, 0.0, {}

    def timed(self, it: Iterator) -> _TimedBatches:
        """``it``, its waits counted; the first log window starts now."""
        self.new_window()
        return _TimedBatches(it, self)

    def first_step(self, is_main: bool) -> None:
        """Note the start-up's seconds after the first step (rank 0 prints them)."""
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - self.started
            if is_main:
                print(f"difftrain: first step after {self.first_step_s:.1f} s (start-up: data, model, compile)")

    def window_s(self) -> float:
        """Seconds of training in this log window: its time, less that paused."""
        return time.perf_counter() - self.window_start - sum(self.paused_s.values())

    def take_wait(self) -> float:
        wait, self.wait = self.wait, 0.0
        return wait

    def new_window(self) -> None:
        self.window_start, self.paused_s = time.perf_counter(), {}

    def paused(self, name: str) -> _Paused:
        return _Paused(self.paused_s, name)


class _TimedBatches:
    """The loader's iterator, adding the seconds spent waiting for batches to its clock's."""

    def __init__(self, it: Iterator, clock: _Clock):
        self.it, self.clock = it, clock

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self.it)
        finally:
            self.clock.wait += time.perf_counter() - start


class _Paused:
    """``with _Paused(paused, "name"):`` adds the block's seconds to ``paused[name]``."""

    def __init__(self, paused: dict, name: str):
        self.paused, self.name = paused, name

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.paused[self.name] = self.paused.get(self.name, 0.0) + time.perf_counter() - self.start


def _start_line(cfg: Config, state: RunState, data, dctx: distributed.DistContext) -> str:
    """Device, parameters, images, effective batch, steps and precision of this start."""
    tc, w = cfg.train, dctx.world_size
    params = sum(logical_numel(p) for p in state.model.parameters())  # nf4 packs two weights a byte
    trained = sum(p.numel() for p in state.model.parameters() if p.requires_grad)
    base = getattr(state.model, "base", state.model)  # under a LoRA adapter (networks/lora.py), its base
    family = getattr(base, "family", None)  # a base family's denoiser (difftrain.families)
    kind = (f"{family} {type(base.model).__name__}" if family
            else f"{cfg.model.preset} {network_of_preset(cfg.model.preset).cls.__name__}")
    network = f"{kind} {params / 1e6:.2f}M parameters"
    if trained < params:  # LoRA: the adapter trains, the base is frozen
        quantized = f", base Linear layers in {cfg.model.quantize_base}" if cfg.model.quantize_base != "off" else ""
        network += f" ({trained / 1e6:.3f}M trained: LoRA rank {cfg.lora.rank}{quantized})"
    held = f" (+{len(data.heldout):,} held out)" if data.heldout is not None else ""
    per_step = effective_batch(tc, w)
    where = f"{w} x {dctx.device.type}" if w > 1 else str(dctx.device)
    if w > 1 and tc.parallel == "fsdp":
        where += " (FSDP: weights, gradients, optimizer state and EMA sharded)"
    return (f"{where}, {network}, {len(data.train):,} images{held}, "
            f"batch {tc.batch_size} x {tc.grad_accum_steps} accumulation x {w} processes = {per_step} per step, "
            f"steps {state.step:,} -> {tc.total_steps:,} ({tc.total_steps * per_step:,} images), {tc.precision}, "
            f"{cfg.diffusion.objective} objective{_condition_text(cfg.model, state)}")


def _condition_text(m: ModelConfig, state: RunState) -> str:
    """", text-conditioned (...), latent CxHxW (...)": the frozen parts of ``model`` section ``m`` that run."""
    c, parts = state.conditioning, []
    if c.text is not None:
        parts.append(f"text-conditioned ({m.text_encoder}, {c.text.dim}-d)")
    if c.codec is not None:
        channels, resolution = c.network_shape()
        parts.append(f"latent {channels}x{resolution}x{resolution} ({m.vae})")
    return "".join(f", {p}" for p in parts)


def _warnings(cfg: Config, fresh: bool) -> list[str]:
    """Settings that are valid but probably not what was meant; in a new run, a model.init_from
    trained with another prediction (or schedule, ...) than this run's, which it switches."""
    o, tc = cfg.optim, cfg.train
    out = (init_source_changes(cfg.model, cfg.diffusion) if fresh else []) + distributed.launch_warnings()
    if cfg.diffusion.zero_terminal_snr and cfg.diffusion.loss_weighting == "min_snr":
        out.append("diffusion.loss_weighting='min_snr' weighs the last timestep (SNR 0) by min(SNR, gamma) = 0: "
                   "diffusion.zero_terminal_snr then never trains the step that sampling starts from")
    if o.warmup_steps >= tc.total_steps:
        out.append(f"optim.warmup_steps={o.warmup_steps:,} is not shorter than train.total_steps={tc.total_steps:,}: "
                   "the learning rate never reaches optim.lr")
    return out


def _unsaved_message(run_dir: Path, step: int, start_step: int, resumed_from: Path | None) -> str:
    """The run ended at ``step`` without its checkpoint: name the newest one on disk and the
    steps lost since."""
    saved = ckpt.list_checkpoints(run_dir / "checkpoints")
    if saved:
        newest_step, newest = saved[-1]
    else:  # none in this run folder: the checkpoint resumed from, if any
        newest, newest_step = resumed_from, start_step if resumed_from else 0
    where = f"the newest checkpoint on disk is {newest} (step {newest_step})" if newest else "no checkpoint is on disk"
    return (f"the checkpoint of the last step, {step}, could not be written either "
            f"(checkpoint.on_write_error='continue'): {where}, {step - newest_step} steps unsaved; "
            "free space or fix the folder, then run the same command again")


def fault_before_training(e: BaseException, run_dir: str | Path) -> distributed.GroupFault | None:
    """``e`` as a :class:`GroupFault` when a rank died or hung during a start-up under torchrun
    (joining the group, the DDP set-up: before the loop's own handler); else None."""
    world_size, fault = int(os.environ.get("WORLD_SIZE", "1")), distributed.fault_text(e)
    if world_size <= 1 or fault is None or isinstance(e, distributed.GroupFault):
        return None
    ctx = distributed.DistContext(rank=int(os.environ.get("RANK", "0")), world_size=world_size)
    return distributed.GroupFault(_group_fault_message(fault, ctx, Path(run_dir), None))


def _group_fault_message(fault: str, dctx: distributed.DistContext, run_dir: Path, step: int | None) -> str:
    """Rank r's line for a rank that died or hung: what is known, the newest checkpoint, what next."""
    saved = ckpt.list_checkpoints(run_dir / "checkpoints")
    newest = f"the newest checkpoint is {saved[-1][1]} (step {saved[-1][0]})" if saved else "no checkpoint is on disk"
    when = "during start-up" if step is None else f"after step {step}"
    then = "resumes from it" if saved else "starts over"
    return (f"rank {dctx.rank} of {dctx.world_size}, {when}: {fault}; {newest}; exit "
            f"{distributed.EXIT_GROUP_FAULT}: torchrun --max-restarts restarts the group, which {then}")


def _naming(m: ModelConfig, step: int, run_dir: Path, what: str = ""):
    """Samples of the run that come out NaN or infinite (validation, FID) stop it with one line naming the
    step, what was sampled and where the weights started; its newest checkpoint is left as it is."""
    return naming_samples(f"step {step}" + (f": {what}" if what else ""),
                          then=f"the newest checkpoint in {run_dir / 'checkpoints'} is untouched; lower optim.lr, or "
                               f"check the weights the run started from{_started_from(m)}")


def _started_from(m: ModelConfig) -> str:
    """" (model.init_lora_from FILE, model.init_from FOLDER)": the run's starting weights (``model`` section
    ``m``), where set."""
    started = [f"{key} {value}" for key, value in (("model.init_lora_from", m.init_lora_from),
                                                   ("model.init_from", m.init_from)) if value]
    return f" ({', '.join(started)})" if started else ""


def _nothing_trained_message(m: ModelConfig, steps: int, final: Path | None) -> str:
    """The line of a run whose every optimizer step was skipped (fewer than train.max_nonfinite_in_row in a
    row in each start, so no start stopped)."""
    held = f"; {final} holds them" if final else ""
    return (f"no step of this run was applied: all {steps} were skipped for a non-finite loss or gradient, so its "
            f"weights are those it started from{_started_from(m)}{held}. Lower optim.lr, use bf16 instead of fp16, "
            "or check the data and the starting weights")


def _diverged_message(state: RunState, objective, metrics: StepMetrics, streak: int, run_dir: Path) -> str:
    tc = state.cfg.train
    return (
        f"{streak} non-finite steps in a row by step {state.step} "
        f"(train.max_nonfinite_in_row={tc.max_nonfinite_in_row}); the last good "
        f"checkpoint in {run_dir / 'checkpoints'} is untouched. Lower optim.lr, "
        f"use bf16 instead of fp16, or check the data.\n"
        + divergence_report(state.model, objective, metrics.last)
    )
