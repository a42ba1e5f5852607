"""Exponential moving average of model weights, with warm-up and a swap-in context manager."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
from torch import nn

from difftrain.networks.quantize import shared_state


def averaged_copy(model: nn.Module) -> tuple[nn.Module, list[int]]:
    """A copy of ``model`` for an average, in eval mode and frozen, and the indices (in
    ``model.parameters()`` order) of the parameters that train. Frozen parameters (a LoRA run's
    base) are shared with ``model``, not copied: they never change, so neither memory nor the
    averaging is spent on them; nor is a quantized base's (``networks/quantize.py``)."""
    frozen = {id(p): p for p in model.parameters() if not p.requires_grad}
    frozen.update(shared_state(model))  # a quantized base's weights kept outside its parameters (int8)
    copied = copy.deepcopy(model, memo=dict(frozen)).eval().requires_grad_(False)
    return copied, [i for i, p in enumerate(model.parameters()) if p.requires_grad]


def trainable(params: list, indices: list[int]) -> list:
    """``params`` at ``indices`` (all of them when every parameter trains)."""
    return params if len(indices) == len(params) else [params[i] for i in indices]


class EMA:
    """Keeps ``ema = decay_t * ema + (1 - decay_t) * params`` after each optimizer step.

    With ``warmup`` the decay ramps up as ``decay_t = min(decay, (1 + t) / (10 + t))`` (the
    schedule of the TensorFlow EMA used by DDPM), so early averages are not dominated by the
    random initialisation. With ``warmup_power`` p > 0 it ramps as ``decay_t = min(decay,
    1 - (1 + t) ** -p)`` instead (the warm-up of diffusers' ``EMAModel``, after Karras et al.'s
    power-function EMA; p = 3/4 suits short runs, 2/3 long ones), which averages over about
    ``t ** p`` recent updates rather than the last ninth of the run. Buffers are copied, not
    averaged.

    With ``view`` (:func:`is_view`: decay 0, updated every step, weights read as they are) the
    average equals the trained weights after every update, so none is kept: ``self.model`` is
    ``model`` itself (no tensor of its own), updates only count, and everything that reads the
    EMA (validation, held-out loss, checkpoints' ``ema`` entry, export, sample) reads the weights.

    Args:
        model: the (unwrapped) model whose parameters are averaged.
        decay: the final decay in [0, 1]; 0 copies the weights, 1 freezes the average.
        warmup: ramp the decay up over the first updates.
        warmup_power: 0 for the DDPM ramp, p > 0 for ``1 - (1 + t) ** -p``.
        view: keep no copy: the average is ``model`` (only with decay 0, where they are equal).
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999, warmup: bool = True, warmup_power: float = 0.0,
                 view: bool = False):
        if warmup_power < 0:
            raise ValueError(f"ema.warmup_power must be >= 0, got {warmup_power}")
        if view and decay != 0:
            raise ValueError(f"an EMA that is a view of the weights needs ema.decay = 0, got {decay}")
        self.decay = decay
        self.warmup = warmup
        self.warmup_power = warmup_power
        self.num_updates = 0
        self.is_view = view
        self.model, self._trained = (model, []) if view else averaged_copy(model)
        self.rebind()

    def rebind(self) -> None:
        """Take the average's parameters and buffers anew, after something replaced them in
        ``self.model`` (FSDP's ``fully_shard`` turns them into shards); a view has none of its own."""
        own = not self.is_view
        self._ema_params = trainable(list(self.model.parameters()), self._trained) if own else []
        self._ema_buffers = list(self.model.buffers()) if own else []

    def copies(self) -> list[nn.Module]:
        """The average's own copy of the model, in a list (what FSDP lays out as shards); none for a view."""
        return [] if self.is_view else [self.model]

    def current_decay(self) -> float:
        """The decay that the next :meth:`update` uses."""
        if not self.warmup:
            return self.decay
        t = self.num_updates
        if self.warmup_power > 0:
            return min(self.decay, 1.0 - (1.0 + t) ** -self.warmup_power)
        return min(self.decay, (1 + t) / (10 + t))

    @torch.no_grad()
    def update(self, model: nn.Module, apply: torch.Tensor | None = None, read: Reader | None = None) -> None:
        """Move the average towards ``model``'s weights.

        Args:
            model: the trained model (same architecture, unwrapped).
            apply: optional 0-dim float tensor, 1 to update and 0 to leave the average as it is
                (a skipped optimizer step); keeps the update free of host synchronisation.
            read: optional map from a parameter to the weights averaged in its place (a
                schedule-free optimizer's x: ``optimizers.averaged_weights``).
        """
        weight = 1.0 - self.current_decay()
        if apply is not None:
            weight = apply.to(torch.float32) * weight
        self.lerp_(model, weight, read)
        self.num_updates += 1

    @torch.no_grad()
    def lerp_(self, model: nn.Module, weight: float | torch.Tensor, read: Reader | None = None) -> None:
        """``ema += weight * (params - ema)`` and copy the buffers; ``weight`` may be a 0-dim
        device tensor (a captured step fills it before each replay). Counts no update; a view
        has nothing to move (it is ``model``)."""
        if self.is_view:
            return
        params = trainable(list(model.parameters()), self._trained)  # under no_grad: no detach needed
        if params:
            foreach_lerp_(self._ema_params, params, weight, read)
        for ema_buf, buf in zip(self._ema_buffers, model.buffers()):
            ema_buf.copy_(buf)

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "num_updates": self.num_updates,
            "decay": self.decay,
            "warmup": self.warmup,
            "warmup_power": self.warmup_power,
        }

    def load_state_dict(self, state: dict) -> None:
        """The saved average and its count; a view takes the count only (its weights are the
        model's, which the checkpoint's ``model`` entry gives)."""
        if not self.is_view:
            self.model.load_state_dict(state["model"])
        self.num_updates = int(state["num_updates"])

    @contextlib.contextmanager
    def swapped_into(self, model: nn.Module) -> Iterator[nn.Module]:
        """Temporarily load the EMA weights (and buffers) into ``model``; restore on exit (a view
        into its own model: nothing to swap)."""
        if self.is_view and model is self.model:
            yield model
            return
        backup = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(self.model.state_dict())
        try:
            yield model
        finally:
            model.load_state_dict(backup)


Reader = Callable[[torch.Tensor], torch.Tensor]


def is_view(decay: float, update_every_steps: int, optimizer: str) -> bool:
    """Whether the EMA of these settings (``ema.decay``, ``ema.update_every_steps``, ``optim.name``)
    equals the trained weights at every step, so that it is kept as a view of them, not a copy:
    decay 0 (each update copies the weights), updated every step (else it lags between updates)
    and an optimizer whose parameters are what the average reads (schedule-free's EMA reads its
    average x, not the parameters: ``optimizers.averaged_weights``)."""
    return decay == 0 and update_every_steps == 1 and optimizer != "schedulefree"


def foreach_lerp_(averages: list[torch.Tensor], params: list[torch.Tensor], weight: float | torch.Tensor,
                  read: Reader | None = None) -> None:
    """``averages[i] += weight * (read(params[i]) - averages[i])`` in place, for every i.

    ``read`` (None: the parameters themselves) gives the weights to average for one parameter;
    it is called one tensor at a time, so at most one parameter-sized temporary is alive.

    With a float weight, or on the CPU, this is ``torch._foreach_lerp_`` (bit for bit what runs
    have always done). With a 0-dim weight tensor on an accelerator (the step's skip gate, the
    captured step's filled weight) it is a subtraction, a multiplication by the tensor and an
    addition: ``_foreach_lerp_`` reads a tensor weight back to the host as a number, which waits
    for the device every step (found on an H100 by
    ``tests/unit/test_step_sync.py::test_the_step_never_synchronises_with_the_gpu``) and cannot be
    recorded in a CUDA graph ("operation not permitted when stream is capturing"); the foreach
    multiplication by a 0-dim tensor does neither.
    """
    if read is not None:
        for average, p in zip(averages, params):
            foreach_lerp_([average], [read(p)], weight)
        return
    on_device = isinstance(weight, torch.Tensor) and weight.device.type != "cpu"
    if not on_device:
        torch._foreach_lerp_(averages, params, weight)
        return
    delta = torch._foreach_sub(params, averages)
    torch._foreach_mul_(delta, weight)
    torch._foreach_add_(averages, delta)
