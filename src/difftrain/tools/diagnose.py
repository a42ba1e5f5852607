"""``difftrain diagnose``: the pitfall checks of the training guides, the noise-prediction error
per timestep, and a denoising trajectory grid, for one checkpoint.

Each check reports ``ok``, ``warn`` or ``fail`` with a sentence saying what it saw and, when it
is not ok, what to do.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from difftrain.config import config_from_dict
from difftrain.diffusion.process import q_sample, to_x0_and_eps
from difftrain.diffusion.samplers import sampling_timesteps
from difftrain.sampling import make_grid, save_png, to_uint8
from difftrain.tools.common import Setup, build_setup, fetch_batch
from difftrain.training.checkpoint import load_checkpoint, load_weights, state_dict_sha256
from difftrain.training.heldout import bucket_bounds
from difftrain.runtime.seeding import derive_seed, step_generator


@dataclasses.dataclass
class Check:
    name: str
    status: str  # "ok", "warn" or "fail"
    detail: str


def check_data_range(setup: Setup, num: int = 64) -> Check:
    """Training images must span [-1, 1]: outside it, or only [0, 1], is a scaling bug."""
    x0, _ = fetch_batch(setup, min(num, len(setup.dataset)), seed=derive_seed(setup.cfg.train.seed, "diagnose"))
    lo, hi = float(x0.min()), float(x0.max())
    if lo < -1 - 1e-6 or hi > 1 + 1e-6:
        return Check("data in [-1, 1]", "fail", f"batch spans [{lo:.3f}, {hi:.3f}], outside [-1, 1]")
    if lo >= -0.05:
        return Check("data in [-1, 1]", "fail", f"batch spans [{lo:.3f}, {hi:.3f}]: looks like [0, 1]; scale x * 2 - 1")
    if hi - lo < 0.5:
        return Check("data in [-1, 1]", "warn", f"batch spans only [{lo:.3f}, {hi:.3f}]; check the normalisation")
    return Check("data in [-1, 1]", "ok", f"batch of {x0.shape[0]} spans [{lo:.3f}, {hi:.3f}]")


def check_timesteps(setup: Setup, draws: int = 64) -> Check:
    """Training timesteps (drawn as the loop draws them) are integers covering 0 .. T-1, and
    the validation sampler starts at t = T-1, so its pure-noise x_T matches what was trained
    (Lin et al. 2024); its last step returns the x0 prediction."""
    cfg = setup.cfg
    T = cfg.diffusion.num_timesteps
    ts = []
    for step in range(draws):  # the generator and draw of training/step.py's draw_micro_batch
        gen = step_generator(cfg.train.seed, 0, step * cfg.train.grad_accum_steps, setup.device, "diffusion")
        ts.append(setup.objective.draw_levels(cfg.train.batch_size, gen, setup.device))
    t = torch.cat(ts)
    sched = sampling_timesteps(T, cfg.validation.steps)
    problems = []
    if t.dtype not in (torch.int64, torch.int32):
        problems.append(f"training timesteps have dtype {t.dtype}, not integer")
    if int(t.min()) < 0 or int(t.max()) >= T:
        problems.append(f"training timesteps span [{int(t.min())}, {int(t.max())}], outside [0, {T})")
    if int(t.min()) > T // 100 + 1:
        problems.append(f"smallest of {t.numel()} training timesteps is {int(t.min())}: t near 0 is not trained")
    if int(sched.max()) != T - 1:
        problems.append(f"validation sampler starts at t={int(sched.max())}, not T-1={T - 1}")
    if problems:
        return Check("timesteps integer, cover 0", "fail", "; ".join(problems))
    return Check("timesteps integer, cover 0", "ok",
                 f"{t.numel()} training draws (as the loop draws them), lowest {int(t.min())}, highest {int(t.max())}, "
                 f"uniform over [0, {T}); sampler starts at t={T - 1}")


def check_ema(state: dict) -> Check:
    """The checkpoint holds EMA weights that have been updated and differ from the raw ones
    (samples and validation grids use them)."""
    ema = state.get("ema")
    if not ema or "model" not in ema:
        return Check("EMA used for sampling", "fail", "the checkpoint has no EMA weights")
    updates = int(ema.get("num_updates", 0))
    same = state_dict_sha256(ema["model"]) == state_dict_sha256(state["model"])
    if updates == 0:
        return Check("EMA used for sampling", "fail", "EMA was never updated; samples would show the initial weights")
    if same and float(ema.get("decay", 0)) > 0:
        return Check("EMA used for sampling", "warn", "EMA weights equal the raw weights; is ema.decay in effect?")
    return Check("EMA used for sampling", "ok",
                 f"{updates} EMA updates, decay {ema.get('decay')}; sample and validation use the EMA weights by default")


def check_optimizer_state(state: dict) -> Check:
    """Resuming needs AdamW's moments for every parameter, or the first steps after it jump."""
    opt = state.get("optimizer") or {}
    per_param = opt.get("state", {})
    num_params = len(state["model"])  # an upper bound: buffers are in the state dict too
    with_moments = sum(1 for s in per_param.values() if "exp_avg" in s and "exp_avg_sq" in s)
    if not per_param:
        return Check("optimizer state in checkpoint", "fail", "no optimizer state: a resume would restart AdamW's moments")
    groups = opt.get("param_groups", [])
    expected = sum(len(g.get("params", [])) for g in groups) or num_params
    if with_moments < expected:
        return Check("optimizer state in checkpoint", "warn", f"moments for {with_moments} of {expected} parameters")
    return Check("optimizer state in checkpoint", "ok", f"AdamW moments for all {with_moments} parameter tensors")


@torch.no_grad()
def error_per_timestep(setup: Setup, num_images: int = 32, num_buckets: int = 10) -> list[dict]:
    """The noise-prediction error mean((eps_hat - eps)^2) per timestep bucket, on one batch of
    training images, each image evaluated at one timestep drawn inside every bucket."""
    cfg = setup.cfg
    T = cfg.diffusion.num_timesteps
    model = setup.model.eval()
    x0, labels = fetch_batch(setup, num_images, seed=derive_seed(cfg.train.seed, "diagnose"), augment=False)
    g = torch.Generator().manual_seed(derive_seed(cfg.train.seed, "diagnose-noise"))
    rows = []
    for i, (first, last) in enumerate(bucket_bounds(T, num_buckets)):
        t = torch.randint(first, last + 1, (x0.shape[0],), generator=g).to(setup.device)
        noise = torch.randn(x0.shape, generator=g).to(setup.device)
        x_t = q_sample(x0, t, noise, setup.objective.alpha_bar)
        x0_hat, eps_hat = to_x0_and_eps(cfg.diffusion.prediction, model(x_t, t, labels), x_t, setup.objective.alpha_bar[t])
        rows.append({
            "bucket": i, "t_first": first, "t_last": last,
            "eps_mse": float((eps_hat - noise).square().mean()),
            "x0_mse": float((x0_hat.clamp(-1, 1) - x0).square().mean()),
        })
    return rows


@torch.no_grad()
def trajectory_grid(setup: Setup, timesteps: list[int], num_images: int = 4) -> np.ndarray:
    """(H', W', C) uint8 grid: for each image a row of x_t at ``timesteps``, then a row of the
    predicted x_0 at the same t (one-step denoising from the checkpoint)."""
    cfg = setup.cfg
    model = setup.model.eval()
    x0, labels = fetch_batch(setup, num_images, seed=derive_seed(cfg.train.seed, "diagnose"), augment=False)
    g = torch.Generator().manual_seed(derive_seed(cfg.train.seed, "trajectory"))
    noise = torch.randn(x0.shape, generator=g).to(setup.device)  # the same noise at every t
    rows = []
    for k in range(num_images):
        xs, preds = [], []
        for tv in timesteps:
            t = torch.full((1,), tv, device=setup.device, dtype=torch.long)
            x_t = q_sample(x0[k : k + 1], t, noise[k : k + 1], setup.objective.alpha_bar)
            lab = None if labels is None else labels[k : k + 1]
            x0_hat, _ = to_x0_and_eps(cfg.diffusion.prediction, model(x_t, t, lab), x_t, setup.objective.alpha_bar[t])
            xs.append(x_t.clamp(-1, 1))
            preds.append(x0_hat.clamp(-1, 1))
        rows += [torch.cat([x0[k : k + 1]] + xs), torch.cat([x0[k : k + 1]] + preds)]
    images = to_uint8(torch.cat(rows).float().cpu())
    return make_grid(images, ncols=len(timesteps) + 1)


def diagnose(checkpoint: str | Path, out_dir: str | Path, timesteps: list[int] | None = None,
             num_images: int = 32, device: str | None = None) -> dict:
    """Run every check on ``checkpoint`` (EMA weights); write ``diagnose.json``,
    ``trajectory.png`` to ``out_dir``; return the JSON record."""
    state = load_checkpoint(checkpoint)  # checked against the schema: every key below exists
    cfg = config_from_dict(state["config"], source=state["path"])
    if device:
        cfg.train.device = device
    setup = build_setup(cfg)
    load_weights(setup.model, state["ema"]["model"], state["path"], "ema.model")
    T = cfg.diffusion.num_timesteps
    timesteps = timesteps or [0, T // 10, T // 4, T // 2, 3 * T // 4, T - 1]
    bad = [t for t in timesteps if not 0 <= t < T]
    if bad:
        raise ValueError(f"--timesteps must lie in [0, {T}), got {bad}")
    checks = [check_data_range(setup), check_timesteps(setup), check_ema(state), check_optimizer_state(state)]
    errors = error_per_timestep(setup, num_images)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_png(trajectory_grid(setup, timesteps), out_dir / "trajectory.png")
    record = {"checkpoint": state["path"], "step": state["step"],
              "checks": [dataclasses.asdict(c) for c in checks], "error_per_timestep": errors,
              "trajectory": {"png": str(out_dir / "trajectory.png"), "timesteps": timesteps,
                             "rows": "per image: x_t at each t (first column x_0), then predicted x_0"}}
    (out_dir / "diagnose.json").write_text(json.dumps(record, indent=1))
    return record


def format_diagnosis(record: dict) -> str:
    lines = [f"checkpoint {record['checkpoint']} (step {record['step']})", "", "checks:"]
    for c in record["checks"]:
        lines.append(f"  [{c['status']:4s}] {c['name']:30s} {c['detail']}")
    lines += ["", "noise-prediction error per timestep bucket:", "  bucket  t range      eps MSE    x0 MSE"]
    for r in record["error_per_timestep"]:
        lines.append(f"  {r['bucket']:6d}  {r['t_first']:4d}-{r['t_last']:<6d} {r['eps_mse']:9.4f} {r['x0_mse']:9.4f}")
    lines += ["", f"trajectory grid: {record['trajectory']['png']} (t = {record['trajectory']['timesteps']})"]
    return "\n".join(lines)
