"""``difftrain diagnose``: the pitfall checks of the training guides, the error per noise-level
bucket, and a denoising trajectory grid, for one checkpoint, through the run's objective.

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
from difftrain.diffusion.losses import diffusion_loss
from difftrain.diffusion.process import to_x0_and_eps
from difftrain.diffusion.samplers import sampling_timesteps
from difftrain.generation.sampling import make_grid, save_png, to_uint8
from difftrain.tools.common import Setup, build_setup, fetch_batch, network_condition
from difftrain.checkpoints.checkpoint import load_checkpoint, load_weights, state_dict_sha256
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


def _training_levels(setup: Setup, draws: int) -> torch.Tensor:
    """The noise levels of the first ``draws`` steps, drawn as training/step.py's draw_micro_batch does."""
    cfg = setup.cfg
    levels = []
    for step in range(draws):
        gen = step_generator(cfg.train.seed, 0, step * cfg.train.grad_accum_steps, setup.device, "diffusion")
        levels.append(setup.objective.draw_levels(cfg.train.batch_size, gen, setup.device))
    return torch.cat(levels)


def check_levels(setup: Setup, draws: int = 64, num_buckets: int = 10) -> Check:
    """Continuous training levels (EDM sigma, flow t), drawn as the loop draws them, are finite,
    inside the objective's range, and reach every bucket of the training distribution."""
    name = "noise levels cover the range"
    obj = setup.objective
    levels = _training_levels(setup, draws).double().cpu()
    hi = 1.0 if obj.family == "flow" else float("inf")
    if not bool(torch.isfinite(levels).all()) or not bool(((levels > 0) & (levels < hi)).all()):
        return Check(name, "fail", f"training levels span [{float(levels.min()):.4g}, {float(levels.max()):.4g}], "
                                   f"outside (0, {hi:g})")
    counts = torch.bincount(obj.bucket(levels, num_buckets), minlength=num_buckets)
    if int(counts.min()) == 0:
        return Check(name, "warn", f"{levels.numel()} training draws leave buckets empty: {counts.tolist()}")
    return Check(name, "ok", f"{levels.numel()} {obj.family} training draws (as the loop draws them) span "
                             f"[{float(levels.min()):.4g}, {float(levels.max()):.4g}], every bucket reached")


def check_timesteps(setup: Setup, draws: int = 64) -> Check:
    """Training timesteps (drawn as the loop draws them) are integers covering 0 .. T-1, and
    the validation sampler starts at t = T-1, so its pure-noise x_T matches what was trained
    (Lin et al. 2024); its last step returns the x0 prediction. Other objectives: :func:`check_levels`."""
    if setup.objective.family != "ddpm":
        return check_levels(setup, draws)
    cfg = setup.cfg
    T = cfg.diffusion.num_timesteps
    t = _training_levels(setup, draws)
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
    """The training loss and the denoising error mean((x0_hat - x0)^2) per noise-level bucket
    (equal probability under the training distribution), on one batch of training images, each
    image evaluated at stratified levels across the buckets (DDPM: also the noise-prediction
    error and each bucket's timestep range)."""
    cfg, obj = setup.cfg, setup.objective
    model = setup.model.eval()
    x0, second = fetch_batch(setup, num_images, seed=derive_seed(cfg.train.seed, "diagnose"), augment=False)
    n = x0.shape[0]
    g = torch.Generator().manual_seed(derive_seed(cfg.train.seed, "diagnose-noise"))
    levels = obj.stratified_levels(n * num_buckets, g)  # (k n,) ascending: slice i ~ bucket i
    noise = torch.randn((n * num_buckets, *x0.shape[1:]), generator=g).to(setup.device)
    buckets = obj.bucket(levels, num_buckets)
    levels = levels.to(setup.device)
    x0 = x0.repeat(num_buckets, 1, 1, 1)
    labels = network_condition(setup, second, num_buckets)
    b = obj.noised(x0, levels, noise)
    out = model(b.input, b.cond, labels).float()
    loss = diffusion_loss(out, b.target, b.weight).cpu()
    x0_err = (obj.x0_hat(b, out, levels).clamp(-1, 1) - x0).square().flatten(1).mean(1).cpu()
    if obj.family == "ddpm":
        eps_hat = to_x0_and_eps(obj.prediction, out, b.input, obj.alpha_bar[levels])[1]
        eps_err = (eps_hat - noise).square().flatten(1).mean(1).cpu()
        bounds = list(bucket_bounds(cfg.diffusion.num_timesteps, num_buckets))
    rows = []
    for i in range(num_buckets):
        mine = buckets == i
        if not bool(mine.any()):
            continue
        lv = levels.cpu()[mine]
        row = {"bucket": i, "level_min": float(lv.min()), "level_max": float(lv.max()),
               "loss": float(loss[mine].mean()), "x0_mse": float(x0_err[mine].mean())}
        if obj.family == "ddpm":
            row.update(t_first=bounds[i][0], t_last=bounds[i][1], eps_mse=float(eps_err[mine].mean()))
        rows.append(row)
    return rows


@torch.no_grad()
def trajectory_grid(setup: Setup, levels: list, num_images: int = 4) -> np.ndarray:
    """(H', W', C) uint8 grid: for each image a row of the network's input at ``levels`` (DDPM:
    x_t at timesteps; EDM: c_in (x0 + sigma n); flow: x_t), then a row of the predicted x_0 at
    the same levels (one-step denoising from the checkpoint)."""
    cfg, obj = setup.cfg, setup.objective
    model = setup.model.eval()
    x0, second = fetch_batch(setup, num_images, seed=derive_seed(cfg.train.seed, "diagnose"), augment=False)
    labels = network_condition(setup, second)
    g = torch.Generator().manual_seed(derive_seed(cfg.train.seed, "trajectory"))
    noise = torch.randn(x0.shape, generator=g).to(setup.device)  # the same noise at every level
    dtype = torch.long if obj.family == "ddpm" else torch.float32
    rows = []
    for k in range(num_images):
        xs, preds = [], []
        for lv in levels:
            level = torch.full((1,), lv, device=setup.device, dtype=dtype)
            b = obj.noised(x0[k : k + 1], level, noise[k : k + 1])
            lab = None if labels is None else labels[k : k + 1]
            x0_hat = obj.x0_hat(b, model(b.input, b.cond, lab).float(), level)
            xs.append(b.input.clamp(-1, 1))
            preds.append(x0_hat.clamp(-1, 1))
        rows += [torch.cat([x0[k : k + 1]] + xs), torch.cat([x0[k : k + 1]] + preds)]
    images = to_uint8(torch.cat(rows).float().cpu())
    return make_grid(images, ncols=len(levels) + 1)


# Where the trajectory of a continuous objective is shown: these quantiles of its training levels.
TRAJECTORY_QUANTILES = (0.001, 0.1, 0.25, 0.5, 0.75, 0.999)


def diagnose(checkpoint: str | Path, out_dir: str | Path, timesteps: list[int] | None = None,
             num_images: int = 32, device: str | None = None) -> dict:
    """Run every check on ``checkpoint`` (EMA weights); write ``diagnose.json``,
    ``trajectory.png`` to ``out_dir``; return the JSON record."""
    state = load_checkpoint(checkpoint)  # checked against the schema: every key below exists
    cfg = config_from_dict(state["config"], source=state["path"])
    if device:
        cfg.train.device = device
    if cfg.model.vae:
        raise ValueError(f"diagnose looks at images in pixel space; {state['path']} is a latent model (model.vae)")
    setup = build_setup(cfg, network=state["network"])
    setup.state.conditioning.check_references(state["frozen"], f"checkpoint {state['path']}")
    load_weights(setup.model, state["ema"]["model"], state["path"], "ema.model")
    if setup.objective.family == "ddpm":
        T = cfg.diffusion.num_timesteps
        levels = timesteps or [0, T // 10, T // 4, T // 2, 3 * T // 4, T - 1]
        bad = [t for t in levels if not 0 <= t < T]
        if bad:
            raise ValueError(f"--timesteps must lie in [0, {T}), got {bad}")
    elif timesteps:
        raise ValueError(f"--timesteps applies to ddpm models; this one is {setup.objective.family} "
                         f"(its trajectory is shown at quantiles {list(TRAJECTORY_QUANTILES)} of its training levels)")
    else:
        levels = [round(float(v), 6) for v in setup.objective.quantile(torch.tensor(TRAJECTORY_QUANTILES))]
    checks = [check_data_range(setup), check_timesteps(setup), check_ema(state), check_optimizer_state(state)]
    errors = error_per_timestep(setup, num_images)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_png(trajectory_grid(setup, levels), out_dir / "trajectory.png")
    record = {"checkpoint": state["path"], "step": state["step"], "objective": setup.objective.family,
              "checks": [dataclasses.asdict(c) for c in checks], "error_per_timestep": errors,
              "trajectory": {"png": str(out_dir / "trajectory.png"), "timesteps": levels,
                             "rows": "per image: the network input at each level (first column x_0), then predicted x_0"}}
    (out_dir / "diagnose.json").write_text(json.dumps(record, indent=1))
    return record


def format_diagnosis(record: dict) -> str:
    lines = [f"checkpoint {record['checkpoint']} (step {record['step']})", "", "checks:"]
    for c in record["checks"]:
        lines.append(f"  [{c['status']:4s}] {c['name']:30s} {c['detail']}")
    errors = record["error_per_timestep"]
    if errors and "eps_mse" in errors[0]:
        lines += ["", "error per timestep bucket:", "  bucket  t range      eps MSE    x0 MSE      loss"]
        for r in errors:
            lines.append(f"  {r['bucket']:6d}  {r['t_first']:4d}-{r['t_last']:<6d} {r['eps_mse']:9.4f} "
                         f"{r['x0_mse']:9.4f} {r['loss']:9.4f}")
    else:
        lines += ["", f"error per noise-level bucket ({record.get('objective')}):",
                  "  bucket  levels drawn            x0 MSE      loss"]
        for r in errors:
            lines.append(f"  {r['bucket']:6d}  {r['level_min']:9.4g}-{r['level_max']:<11.4g} {r['x0_mse']:9.4f} {r['loss']:9.4f}")
    lines += ["", f"trajectory grid: {record['trajectory']['png']} (levels {record['trajectory']['timesteps']})"]
    return "\n".join(lines)
