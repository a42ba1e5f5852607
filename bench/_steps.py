"""The two training steps that the benchmarks compare, on the same architecture and batch.

difftrain's step is the training loop's own ``train_step`` (fused AdamW, foreach EMA,
device-side skip of non-finite steps, no host synchronisation; captured as a CUDA graph where
``cuda_graphs`` is on); diffusers' step follows
``examples/unconditional_image_generation/train_unconditional.py`` (DDPMScheduler.add_noise,
MSE on epsilon, AdamW, gradient clipping, EMAModel). Both train on a fixed in-memory batch, so
the data pipeline is measured apart (bench/loader.py).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from difftrain.config import load_config
from difftrain.diffusion.objective import build_objective
from difftrain.models.diffusers_export import diffusers_config
from difftrain.runtime.device import compile_model, resolve_toggle
from difftrain.runtime.distributed import DistContext
from difftrain.training.state import RunState, build_model
from difftrain.training.step import CapturedStep, StepMetrics, train_step


def bench_config(preset: str, batch: int, precision: str, compile_: str, channels_last: str, cuda_graphs: str = "off"):
    return load_config(
        None,
        [
            f"train.cuda_graphs={cuda_graphs}",
            f"model.preset={preset}",
            f"train.batch_size={batch}",
            f"train.precision={precision}",
            f"train.compile={compile_}",
            f"train.channels_last={channels_last}",
            "diffusion.schedule=linear",
        ],
    )


def difftrain_step(cfg, device: torch.device):
    """Return (step(), model) for difftrain's training step (training/step.py, as the loop runs it)
    on a fixed batch."""
    state = RunState.build(cfg, 0, device)
    state.net = compile_model(state.model, device, cfg.train.compile)
    objective = build_objective(cfg.diffusion).to(device)
    step_fn = CapturedStep(state, objective) if resolve_toggle(cfg.train.cuda_graphs, device, "cuda_graphs") else train_step
    metrics = StepMetrics(device)
    B, r = cfg.train.batch_size, cfg.data.resolution
    batch = (torch.rand(B, 3, r, r, device=device) * 2 - 1, torch.zeros(B, dtype=torch.long))
    batches = itertools.repeat(batch)
    dctx = DistContext(device=device)

    def step():
        step_fn(state, objective, batches, cfg.optim.lr, metrics, dctx)

    return step, state.model


def diffusers_step(cfg, device: torch.device):
    """Return (step(), model) for a train_unconditional-style step with diffusers' UNet2DModel."""
    from diffusers import DDPMScheduler, UNet2DModel
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel

    model = UNet2DModel(**diffusers_config(build_model(cfg))).to(device)
    scheduler = DDPMScheduler(num_train_timesteps=cfg.diffusion.num_timesteps, beta_schedule="linear")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.95, 0.999), weight_decay=1e-6, eps=1e-8)
    lr_sched = get_scheduler("cosine", optimizer=opt, num_warmup_steps=500, num_training_steps=100_000)
    ema = EMAModel(model.parameters(), decay=0.9999, use_ema_warmup=True, inv_gamma=1.0, power=0.75,
                   model_cls=UNet2DModel, model_config=model.config)
    ema.to(device)
    B, r = cfg.train.batch_size, cfg.data.resolution
    x0 = torch.rand(B, 3, r, r, device=device) * 2 - 1
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.train.precision]

    def step():
        noise = torch.randn(x0.shape, device=device)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (B,), device=device).long()
        noisy = scheduler.add_noise(x0, noise, timesteps)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            out = model(noisy, timesteps).sample
        loss = F.mse_loss(out.float(), noise.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lr_sched.step()
        opt.zero_grad()
        ema.step(model.parameters())

    return step, model


IMPLS = {"difftrain": difftrain_step, "diffusers": diffusers_step}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def fmt_float(x: float) -> str:
    if x is None or math.isnan(x):
        return "n/a"
    return f"{x:,.1f}" if abs(x) >= 100 else f"{x:.3g}"
