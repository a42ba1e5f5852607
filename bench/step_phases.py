"""Where a training step of a preset spends its time, phase by phase (CPU wall clock).

    OMP_NUM_THREADS=1 python bench/step_phases.py --config configs/tiny.toml --steps 300
    OMP_NUM_THREADS=2 python bench/step_phases.py --config configs/tiny.toml --steps 300 --set train.batch_size=64

Builds the data, run state, objective and loader as the training loop does (``prepare_training_data``,
``RunState.build``, ``build_objective``, ``build_loader``; no checkpoints, no validation) and runs
``--steps`` steps whose phases are the pieces ``training/step.py`` calls, in its order, each timed
with ``time.perf_counter`` (on the CPU every op finishes before it returns, so no sync is needed):
the loader's next batch, the noise draw, the forward pass with the loss (the uncertainty head
included), the backward pass, the per-bucket loss sums, gradient clipping, the AdamW step, the
EMA update, the post-hoc EMAs and the step's metric sums. The first ``--warmup`` steps are left
out. Then it times ``--steps`` calls of the real ``train_step`` on the same loader (the figure to
trust for the total), the log step's metric read, and one checkpoint save.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch

from difftrain.config import load_config
from difftrain.data import build_loader
from difftrain.data.prepare import prepare_training_data
from difftrain.diffusion.objective import build_objective, per_sample_loss
from difftrain.runtime.distributed import DistContext
from difftrain.runtime.seeding import derive_seed
from difftrain.checkpoints import checkpoint as ckpt
from difftrain.training.lr_schedule import lr_at
from difftrain.training.state import RunState, effective_batch, peak_lr
from difftrain.training.step import StepMetrics, draw_micro_batch, train_step

PHASES = ("data", "draw noise", "forward + loss", "backward", "bucket sums", "clip grad norm", "optimizer step",
          "zero grad", "EMA", "post-hoc EMA", "step metrics")


class Clock:
    def __init__(self):
        self.total: dict[str, float] = {p: 0.0 for p in PHASES}
        self.on = False

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        if self.on:
            self.total[name] += time.perf_counter() - start


def phased_step(state, objective, batches, lr, metrics, dctx, clock: Clock) -> None:
    """``train_step`` of one micro-batch (no accumulation), cut into timed phases."""
    cfg = state.cfg
    torch.manual_seed(derive_seed(cfg.train.seed, dctx.rank, state.step, "dropout"))
    for group in state.optimizer.param_groups:
        group["lr"] = lr
    with clock("data"):
        x0, second = next(batches)[:2]
    with clock("draw noise"):
        b = draw_micro_batch(state, objective, x0, second, 0, dctx)
    with clock("forward + loss"):
        per_sample = per_sample_loss(objective, state.net, b.x0, b.condition, b.levels, b.noise, None, b.input_noise,
                                     uncertainty=cfg.diffusion.uncertainty_weighting)
        loss = per_sample.mean()
    with clock("backward"):
        state.precision.backward(loss)
    with clock("bucket sums"):
        metrics.add_micro(objective, b, per_sample)
    p = state.precision
    with clock("clip grad norm"):
        p.scaler.unscale_(state.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(state.model.parameters(), cfg.optim.grad_clip or float("inf"))
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
    with clock("optimizer step"):
        p.scaler.step(state.optimizer)
        p.scaler.update(1.0)
    with clock("zero grad"):
        state.optimizer.zero_grad(set_to_none=True)
    with clock("EMA"):
        state.ema.update(state.model, apply=finite.float())
    with clock("post-hoc EMA"):
        state.posthoc.update(state.model, state.step + 1)
    with clock("step metrics"):
        metrics.add_step(loss.detach(), grad_norm, finite)
    metrics.steps += 1
    state.step += 1
    state.position += b.x0.shape[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--set", action="append", default=[], help="config overrides, key=value")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    cfg = load_config(args.config, ["validation.every_steps=0", "data.num_workers=0", *args.set])
    device = torch.device("cpu")
    dctx = DistContext(device=device)
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_training_data(cfg, Path(tmp))
        tc = cfg.train

        def fresh():
            state = RunState.build(cfg, data.num_classes, device)
            state.net = state.model
            state.model.train()
            loader = build_loader(data.train, batch_size=tc.batch_size, seed=tc.seed, start=0,
                                  num_workers=cfg.data.num_workers, device=device)
            return state, iter(loader), StepMetrics(device)

        objective = build_objective(cfg.diffusion).to(device)
        lr_peak = peak_lr(cfg.optim, effective_batch(cfg.train, 1))

        def lr_of(step):
            o = cfg.optim
            return lr_at(step, peak_lr=lr_peak, warmup_steps=o.warmup_steps, total_steps=tc.total_steps,
                         schedule=o.lr_schedule, min_lr_ratio=o.min_lr_ratio, ref_steps=o.lr_ref_steps)

        # 1. The phases.
        state, batches, metrics = fresh()
        clock = Clock()
        for i in range(args.warmup + args.steps):
            clock.on = i >= args.warmup
            phased_step(state, objective, batches, lr_of(state.step), metrics, dctx, clock)
        phased = sum(clock.total.values())

        # 2. The real step, and the log step's read.
        state, batches, metrics = fresh()
        times, reads = [], []
        for i in range(args.warmup + args.steps):
            start = time.perf_counter()
            train_step(state, objective, batches, lr_of(state.step), metrics, dctx)
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
            if (i + 1) % tc.log_every_steps == 0:
                start = time.perf_counter()
                metrics.read(dctx)
                reads.append(time.perf_counter() - start)
        # 3. One checkpoint save.
        start = time.perf_counter()
        ckpt.save_or_report(state.state_dict(), Path(tmp) / "checkpoints", state.step, 2, 0, "raise")
        save_s = time.perf_counter() - start

    threads = torch.get_num_threads()
    params = sum(p.numel() for p in state.model.parameters())
    print(f"{args.config} {' '.join(args.set)}: batch {tc.batch_size}, {params / 1e6:.3f}M parameters, "
          f"{threads} torch thread(s), {args.steps} steps after {args.warmup}")
    print("| phase | ms / step | share |")
    print("|---|---|---|")
    for name, total in clock.total.items():
        print(f"| {name} | {1e3 * total / args.steps:.2f} | {100 * total / phased:.1f}% |")
    print(f"| **sum of the phases** | **{1e3 * phased / args.steps:.2f}** | 100% |")
    mean = statistics.fmean(times)
    print(f"train_step: mean {1e3 * mean:.2f} ms, median {1e3 * statistics.median(times):.2f} ms "
          f"-> {tc.batch_size / mean:.0f} images/s; {tc.total_steps} steps: {tc.total_steps * mean:.0f} s")
    if reads:
        print(f"metrics.read (every {tc.log_every_steps} steps): {1e3 * statistics.fmean(reads):.2f} ms")
    print(f"one checkpoint save: {1e3 * save_s:.1f} ms")


if __name__ == "__main__":
    main()
