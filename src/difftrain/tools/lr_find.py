"""The learning-rate range test (Smith 2017, "Cyclical Learning Rates", sec. 3.3).

Train from the run's initial weights while the learning rate grows exponentially from
``start_lr`` to ``end_lr``, one optimizer step per rate; stop early once the smoothed loss has
diverged (``diverge_factor`` times its minimum, or not finite). The loss falls, flattens, then
explodes; a good peak learning rate lies well below the explosion. The suggestion is the rate
at the minimum of the smoothed loss divided by 10 (the rule of thumb of Smith and of fast.ai),
capped by the rate where the smoothed loss fell fastest.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path


from difftrain.config import Config
from difftrain.report.png_plot import png_line_plot
from difftrain.tools.common import build_setup, fetch_batch
from difftrain.runtime.progress import CountProgress
from difftrain.training.step import StepMetrics, train_step
from difftrain.runtime.seeding import derive_seed


def lr_schedule(start_lr: float, end_lr: float, num_steps: int) -> list[float]:
    """``num_steps`` rates spaced evenly in log from ``start_lr`` to ``end_lr``."""
    if not 0 < start_lr < end_lr:
        raise ValueError(f"--start-lr must be > 0 and below --end-lr, got {start_lr} and {end_lr}")
    if num_steps < 2:
        raise ValueError(f"--num-steps must be >= 2, got {num_steps}")
    ratio = end_lr / start_lr
    return [start_lr * ratio ** (i / (num_steps - 1)) for i in range(num_steps)]


def smooth(losses: list[float], beta: float) -> list[float]:
    """Exponential moving average with bias correction (so early values are not pulled to 0)."""
    out, avg = [], 0.0
    for i, loss in enumerate(losses):
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta ** (i + 1)))
    return out


def suggest_lr(lrs: list[float], smoothed: list[float], skip_start: int = 3) -> dict[str, float]:
    """``min_div10`` (the rate at the smoothed minimum / 10), ``steepest`` (most negative slope
    of the smoothed loss against log lr) and ``suggested`` (the smaller of the two)."""
    finite = [i for i, v in enumerate(smoothed) if math.isfinite(v)]
    if len(finite) < skip_start + 3:
        raise ValueError("the sweep stopped before enough finite losses; lower --start-lr")
    i_min = min(finite[skip_start:], key=lambda i: smoothed[i])
    slopes = [
        ((smoothed[i + 1] - smoothed[i - 1]) / (math.log(lrs[i + 1]) - math.log(lrs[i - 1])), i)
        for i in finite[skip_start:-1]
        if i + 1 in finite and i - 1 in finite and i <= i_min
    ]
    steepest = lrs[min(slopes)[1]] if slopes else lrs[i_min] / 10
    min_div10 = lrs[i_min] / 10
    return {"min_div10": min_div10, "steepest": steepest, "suggested": min(min_div10, steepest),
            "min_loss_lr": lrs[i_min]}


def lr_find(
    cfg: Config,
    out_dir: str | Path,
    start_lr: float = 1e-6,
    end_lr: float = 1.0,
    num_steps: int = 100,
    diverge_factor: float = 4.0,
    beta: float = 0.9,
    progress: bool = False,
) -> dict:
    """Run the sweep on ``cfg``'s model and data; write ``lr_find.png``, ``.csv`` and ``.json``
    to ``out_dir``; return the JSON record (rates, losses, suggestion, stop reason)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    setup = build_setup(cfg)
    tc = cfg.train
    lrs = lr_schedule(start_lr, end_lr, num_steps)
    metrics = StepMetrics(setup.device)
    shown = CountProgress("lr-find", num_steps, unit="steps", enabled=progress)
    losses: list[float] = []
    stop = "reached --end-lr"
    best = math.inf
    for i, lr in enumerate(lrs):
        batches = (fetch_batch(setup, tc.batch_size, derive_seed(tc.seed, "lr-find-data", i, m))
                   for m in range(tc.grad_accum_steps))
        train_step(setup.state, setup.objective, batches, lr, metrics)  # the training loop's step
        losses.append(metrics.last_loss.item())
        shown.advance(1)
        s = smooth(losses, beta)[-1]
        if not math.isfinite(s):
            stop = f"loss not finite at lr {lr:.3g}"
            break
        best = min(best, s)
        if i >= 5 and s > diverge_factor * best:
            stop = f"smoothed loss passed {diverge_factor} x its minimum at lr {lr:.3g}"
            break
    lrs = lrs[: len(losses)]
    smoothed = smooth(losses, beta)
    suggestion = suggest_lr(lrs, smoothed)
    record = {"lr": lrs, "loss": losses, "smoothed_loss": smoothed, "stop": stop, **suggestion,
              "batch_size": tc.batch_size, "grad_accum_steps": tc.grad_accum_steps,
              "set": f"optim.lr={suggestion['suggested']:.3g}"}
    (out_dir / "lr_find.json").write_text(json.dumps(record, indent=1))
    with open(out_dir / "lr_find.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["lr", "loss", "smoothed_loss"])
        w.writerows(zip(lrs, losses, smoothed))
    shown = [v if math.isfinite(v) and v < diverge_factor * 2 * best else math.nan for v in losses]
    shown_s = [v if math.isfinite(v) and v < diverge_factor * 2 * best else math.nan for v in smoothed]
    png_line_plot(
        out_dir / "lr_find.png", lrs, {"loss": shown, "smoothed": shown_s},
        title=f"LR range test: {cfg.model.preset} on {cfg.data.path}, batch {tc.batch_size * tc.grad_accum_steps}",
        x_label="learning rate (log scale)", y_label="loss", log_x=True,
        marker_x=suggestion["suggested"], marker_label=f"suggested {suggestion['suggested']:.2g}",
    )
    return record
