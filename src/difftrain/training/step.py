"""One optimizer step as a unit: ``train_step(state, objective, batches, lr, metrics)``.

The training loop, the benchmarks, ``lr-find`` and ``estimate`` call it; nothing copies it. A
step draws its random numbers from (seed, step, micro-batch), accumulates gradients over
``train.grad_accum_steps`` micro-batches, clips, takes the optimizer step (skipped on the device
when the loss or a gradient is not finite), updates the EMA and the post-hoc power EMAs and
adds its figures to :class:`StepMetrics`, all without waiting for the device.

On CUDA, :class:`CapturedStep` runs the same step as one CUDA graph (``train.cuda_graphs``):
the random numbers are drawn outside the graph, exactly as :func:`train_step` draws them, and
copied into static input buffers; the learning rate, the EMA weight and the post-hoc EMAs'
weights (which depend on the step) are device tensors that are filled before each replay.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator

import torch

from difftrain.data.latents import sample_latents
from difftrain.diffusion.objective import Objective, per_sample_loss
from difftrain.runtime import distributed
from difftrain.runtime.distributed import DistContext
from difftrain.runtime.seeding import derive_seed, step_generator
from difftrain.training.dreambooth import loss_weights
from difftrain.training.optimizers import averaged_weights
from difftrain.training.state import RunState

NUM_LOSS_BUCKETS = 10  # the loss is also reported per tenth of the noise levels


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch as the step uses it, all on the device: this rank's rows."""

    x0: torch.Tensor  # (B, C, H, W): images, or latents in a latent run
    condition: torch.Tensor | None  # labels (B,) / text embeddings (B, L, D), dropped rows null; None when unconditional
    levels: torch.Tensor  # (B,) noise levels (DDPM: timesteps)
    noise: torch.Tensor  # (B, C, H, W): the target's noise (offset noise included)
    input_noise: torch.Tensor | None = None  # (B, C, H, W): the network input's noise, with input perturbation
    weight: torch.Tensor | None = None  # (B,) per-sample loss weights (DreamBooth's prior); None: all 1
    mask: torch.Tensor | None = None  # (B, 1, H, W) loss mask in [0, 1] (data.masks); None: every pixel


def draw_micro_batch(
    state: RunState, objective: Objective, x0: torch.Tensor, second, micro: int, dctx: DistContext,
    geometry: torch.Tensor | None = None,
) -> MicroBatch:
    """Move a loaded micro-batch to the device and draw its noise levels, noise, condition dropout,
    (latent runs) the latents from their cached distribution, and then, only where their keys are
    on, the offset noise and the input perturbation (so that runs without them draw what they did).

    x0: (B, C, H, W) images in [-1, 1], or (B, 2c, h, w) latent means and stds (``data/latents.py``);
    second: labels (B,) long or captions (B strings), turned into the network's condition by
    ``state.conditioning``; geometry: (B, 4) long, each image's original size and crop (a bucketed
    dataset's third entry), which a base family's image condition takes (SDXL's time_ids), or None.

    The numbers are drawn for the GLOBAL micro-batch from a generator seeded by (seed, step, micro)
    and this rank keeps its rows, so any world size sees the same numbers (see runtime/distributed.py).
    """
    cfg, device, c = state.cfg, dctx.device, state.conditioning
    x0 = x0.to(device, non_blocking=True)
    mask = None
    if cfg.data.masks:  # the items' last channel: the loss mask, at the network's resolution (data/latents.py)
        x0, mask = x0[:, :-1], x0[:, -1:].float()
    references = None
    if (cfg.data.references or cfg.data.reference_column) and c.codec is not None:  # an edit family's pairs: the
        # items' reference moments after the target's (data/latents.py)
        k = 2 * c.codec.latent_channels
        x0, references = x0[:, :k], [x0[:, i: i + k] for i in range(k, x0.shape[1], k)]
    gen = step_generator(cfg.train.seed, 0, state.step * cfg.train.grad_accum_steps + micro, device, "diffusion")
    n = x0.shape[0] * dctx.world_size
    shape = (c.codec.latent_channels, *x0.shape[2:]) if c.codec is not None else tuple(x0.shape[1:])
    levels = distributed.rank_rows(objective.draw_levels(n, gen, device), dctx)
    noise = distributed.rank_rows(torch.randn((n, *shape), device=device, generator=gen), dctx)
    drop = None
    if c.kind != "none":  # label or caption dropout for classifier-free guidance
        drop = distributed.rank_rows(torch.rand((n,), device=device, generator=gen), dctx) < cfg.model.class_dropout
    condition = c.condition(second, drop, device, geometry, c.pixel_size(x0))  # the batch's (bucket's) pixels
    if references:  # an edit family's reference latents: the mode (the mean), as its pipeline encodes them
        condition = condition | c.reference_condition([c.codec.to_model(r[:, : k // 2]) for r in references],
                                                      second, drop, None, device)
    weight = loss_weights(cfg.dreambooth, second, device)  # before dropout emptied captions; None unless a prior
    if c.codec is not None:  # a latent drawn from the image's cached distribution
        eps = distributed.rank_rows(torch.randn((n, *shape), device=device, generator=gen), dctx)
        x0 = sample_latents(x0, eps, c.codec)
    dc, input_noise = cfg.diffusion, None
    if dc.noise_offset > 0:  # offset noise (Guttenberg 2023): one constant per (sample, channel)
        offset = distributed.rank_rows(torch.randn((n, shape[0], 1, 1), device=device, generator=gen), dctx)
        noise = noise + dc.noise_offset * offset
    if dc.input_perturbation > 0:  # input perturbation (Ning et al. 2023): x_t from more noise, target from `noise`
        extra = distributed.rank_rows(torch.randn((n, *shape), device=device, generator=gen), dctx)
        input_noise = noise + dc.input_perturbation * extra
    return MicroBatch(x0, condition, levels, noise, input_noise, weight, mask)


class StepMetrics:
    """Running sums of a log window, kept on the device; :meth:`read` is the one host sync."""

    def __init__(self, device: torch.device, num_buckets: int = NUM_LOSS_BUCKETS):
        zero = torch.zeros((), device=device)
        self.loss_sum, self.grad_norm_sum, self.skipped = zero.clone(), zero.clone(), zero.clone()
        self.streak, self.max_streak = zero.clone(), zero.clone()
        self.bucket_loss = torch.zeros(num_buckets, device=device)
        self.bucket_count = torch.zeros(num_buckets, device=device)
        self.num_buckets = num_buckets
        self.steps = 0
        self.last: MicroBatch | None = None  # the last micro-batch, for a divergence report
        self.last_loss: torch.Tensor | None = None
        self._ones: torch.Tensor | None = None  # (B,) ones counted per bucket, made once

    def add_micro(self, objective: Objective, batch: MicroBatch, per_sample: torch.Tensor) -> None:
        """Per-sample losses (B,) of one micro-batch, by noise-level bucket."""
        buckets = objective.bucket(batch.levels, self.num_buckets)
        if self._ones is None or self._ones.shape != per_sample.shape:
            self._ones = torch.ones_like(per_sample)
        self.bucket_loss.index_add_(0, buckets, per_sample.detach())
        self.bucket_count.index_add_(0, buckets, self._ones)

    def add_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, finite: torch.Tensor) -> None:
        """One optimizer step's loss and gradient norm (left out when the step was skipped)."""
        self.last_loss = loss  # the step's loss as computed, even when skipped
        skipped = 1 - finite.float()
        self.loss_sum += torch.where(finite, loss, 0.0)
        self.grad_norm_sum += torch.where(finite, grad_norm, 0.0)
        self.skipped += skipped
        self.streak.add_(1).mul_(skipped)  # steps skipped in a row, 0 after a good one
        torch.maximum(self.max_streak, self.streak, out=self.max_streak)

    def read(self, dctx: DistContext) -> dict:
        """The window's means (losses averaged over ranks), skipped steps and longest run of
        skipped steps; then start a new window."""
        distributed.all_reduce_sum_(self.loss_sum, self.bucket_loss, self.bucket_count)  # grad norms agree
        skipped = int(self.skipped.item())
        good = max(1, self.steps - skipped)
        counts = self.bucket_count.clamp(min=1)
        out = {
            "loss": self.loss_sum.item() / dctx.world_size / good,
            "grad_norm": self.grad_norm_sum.item() / good,
            "skipped": skipped,
            "max_streak": int(self.max_streak.item()),
            "steps": self.steps,
            "buckets": (self.bucket_loss / counts).tolist(),
        }
        for t in (self.loss_sum, self.grad_norm_sum, self.skipped, self.max_streak, self.bucket_loss, self.bucket_count):
            t.zero_()
        self.steps = 0
        return out


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def _accumulate(state: RunState, objective: Objective, batches: list[MicroBatch], metrics: StepMetrics) -> torch.Tensor:
    """Forward and backward of every micro-batch; returns the step's loss (0-dim, detached)."""
    net, accum = state.net, len(batches)
    step_loss = torch.zeros((), device=batches[0].x0.device)
    for micro, b in enumerate(batches):
        with distributed.sync_gradients(net, sync=micro == accum - 1):
            per_sample = per_sample_loss(objective, net, b.x0, b.condition, b.levels, b.noise, state.precision.autocast(),
                                         b.input_noise, uncertainty=state.cfg.diffusion.uncertainty_weighting,
                                         pixel_weight=b.mask)
            if b.weight is not None:
                per_sample = per_sample * b.weight
            loss = per_sample.mean() / accum
            state.precision.backward(loss)
        step_loss += loss.detach()
        metrics.add_micro(objective, b, per_sample)
    return step_loss


def _update(state: RunState, step_loss: torch.Tensor, metrics: StepMetrics,
            captured: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Clip, step (skipped on the device if not finite), update the EMAs, count.

    ``captured``: the (EMA weight, post-hoc weights (K,)) device tensors of a captured step.
    The post-hoc EMAs update every step, a skipped one too (the weights did not move, so the
    average takes in the same weights again): their profile needs one update per step.
    """
    grad_norm, finite = state.precision.step(state.optimizer, state.model.parameters(), state.cfg.optim.grad_clip, step_loss)
    read = averaged_weights(state.optimizer)  # the averages take in a schedule-free optimizer's x
    if captured is not None:  # the EMA weight is 0 between updates
        ema_weight, posthoc_weights = captured
        state.ema.lerp_(state.model, finite.float() * ema_weight, read)
        state.posthoc.lerp_(state.model, posthoc_weights, read)
    else:
        if (state.step + 1) % state.cfg.ema.update_every_steps == 0:
            state.ema.update(state.model, apply=finite.float(), read=read)
        state.posthoc.update(state.model, state.step + 1, read=read)
    metrics.add_step(step_loss, grad_norm, finite)


def train_step(
    state: RunState,
    objective: Objective,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    metrics: StepMetrics,
    dctx: DistContext | None = None,
) -> StepMetrics:
    """One optimizer step on ``train.grad_accum_steps`` micro-batches taken from ``batches``.

    batches: yields (x0 (B, C, H, W) in [-1, 1] or latent moments, labels (B,) long or captions),
        this rank's share.
    Advances ``state.step`` and ``state.position``; returns ``metrics`` with the step added.
    """
    dctx = dctx or DistContext(device=next(state.model.parameters()).device)
    cfg = state.cfg
    # Every random number of this step derives from (seed, rank, step).
    torch.manual_seed(derive_seed(cfg.train.seed, dctx.rank, state.step, "dropout"))
    _set_lr(state.optimizer, lr)
    micro = [_draw(state, objective, next(batches), m, dctx) for m in range(cfg.train.grad_accum_steps)]
    _update(state, _accumulate(state, objective, micro, metrics), metrics, None)
    _advance(state, metrics, micro, dctx)
    return metrics


def _draw(state: RunState, objective: Objective, batch: tuple, micro: int, dctx: DistContext) -> MicroBatch:
    """:func:`draw_micro_batch` of a loaded batch: (x0, second) or, bucketed, (x0, second, geometry)."""
    x0, second, *rest = batch
    return draw_micro_batch(state, objective, x0, second, micro, dctx, *rest)


def _advance(state: RunState, metrics: StepMetrics, micro: list[MicroBatch], dctx: DistContext) -> None:
    metrics.steps += 1
    metrics.last = micro[-1]
    state.step += 1
    state.position += micro[0].x0.shape[0] * len(micro) * dctx.world_size


class CapturedStep:
    """:func:`train_step` replayed as one CUDA graph: forward, backward, clipping, the fused AdamW
    step, the non-finite skip, the EMA update and the metric sums, with gradient accumulation.

    The first call warms up on a side stream (three eager steps, which also create AdamW's state
    and compile the network) and then captures; each later call draws the step's random numbers
    as ``train_step`` does, copies them and the batch into the static buffers, and replays.
    DDP is not captured: under torchrun the loop keeps the eager step (see ``runtime/device.py``).
    """

    WARMUP_STEPS = 3

    def __init__(self, state: RunState, objective: Objective):
        device = next(state.model.parameters()).device
        if device.type != "cuda":
            raise ValueError("train.cuda_graphs needs a CUDA device")
        self.objective = objective
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: list[MicroBatch] | None = None
        # Tensors the graph reads, filled before each replay.
        self.ema_weight = torch.zeros((), device=device)
        self.posthoc_weights = torch.zeros(len(state.posthoc.stds), device=device)
        for group in state.optimizer.param_groups:  # a tensor learning rate, read by the captured step
            group["lr"] = torch.tensor(float(group["lr"]), device=device)
            group["capturable"] = True

    def _copy_in(self, micro: list[MicroBatch]) -> None:
        if self.static is None:
            self.static = [MicroBatch(*(None if v is None else v.clone() for v in _fields(b))) for b in micro]
            return
        for dst, src in zip(self.static, micro):
            for d, s in zip(_fields(dst), _fields(src)):
                if d is not None:
                    d.copy_(s, non_blocking=True)

    def _body(self, state: RunState, metrics: StepMetrics) -> None:
        step_loss = _accumulate(state, self.objective, self.static, metrics)
        _update(state, step_loss, metrics, (self.ema_weight, self.posthoc_weights))

    def __call__(self, state: RunState, objective: Objective, batches, lr: float, metrics: StepMetrics,
                 dctx: DistContext | None = None) -> StepMetrics:
        dctx = dctx or DistContext(device=self.ema_weight.device)
        cfg = state.cfg
        dropout_seed = derive_seed(cfg.train.seed, dctx.rank, state.step, "dropout")
        torch.manual_seed(dropout_seed)
        _set_lr(state.optimizer, lr)
        micro = [_draw(state, objective, next(batches), m, dctx) for m in range(cfg.train.grad_accum_steps)]
        self._copy_in(micro)
        update = (state.step + 1) % cfg.ema.update_every_steps == 0
        self.ema_weight.fill_(1.0 - state.ema.current_decay() if update else 0.0)
        for k, w in enumerate(state.posthoc.weights(state.step + 1)):
            self.posthoc_weights[k].fill_(w)
        if self.graph is None:
            self._capture(state, metrics, dropout_seed)
        else:
            self.graph.replay()
        state.ema.num_updates += int(update)
        _advance(state, metrics, micro, dctx)
        return metrics

    def _capture(self, state: RunState, metrics: StepMetrics, dropout_seed: int) -> None:
        """Warm up on a side stream (eager steps on the state's own tensors, which are restored
        in place afterwards), capture the step, then replay it once as this call's step."""
        tensors = _state_tensors(state)
        saved = [t.detach().clone() for t in tensors]
        scratch = StepMetrics(self.ema_weight.device, metrics.num_buckets)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*capturable=True.*")  # the warm-up runs uncaptured
            for _ in range(self.WARMUP_STEPS):
                self._body(state, scratch)
        torch.cuda.current_stream().wait_stream(side)
        with torch.no_grad():
            for t, v in zip(tensors, saved):
                t.copy_(v)
            for t in _state_tensors(state)[len(tensors):]:  # AdamW's state, created by the warm-up
                t.zero_()
        state.optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # records the kernels; runs none of them
            self._body(state, metrics)
        torch.manual_seed(dropout_seed)  # the replay draws the dropout masks the eager step would
        self.graph.replay()


def _fields(b: MicroBatch) -> tuple:
    """The micro-batch's tensors themselves, in field order (``dataclasses.astuple`` deep-copies
    them, so copying into its result never reached the graph's static buffers)."""
    return tuple(getattr(b, f.name) for f in dataclasses.fields(b))


def _state_tensors(state: RunState) -> list[torch.Tensor]:
    """Every tensor a step changes: weights, EMAs, loss scale, then AdamW's state (if any yet)."""
    tensors = list(state.model.state_dict().values()) + list(state.ema.model.state_dict().values())
    tensors += state.posthoc.tensors()
    tensors += state.precision.tensors()
    tensors += [v for s in state.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [t for t in tensors if t is not None]
