"""Mixed precision as one object: one code path for fp32, bf16 and fp16.

:class:`Precision` gives the forward pass its autocast, the backward pass its loss scale (fp16
only) and the optimizer one step that is skipped on the device, without a host
synchronisation, when the loss or a gradient is not finite. The skip goes through PyTorch's own
``GradScaler`` for every precision: with fp16 it scales the loss dynamically; otherwise its scale
stays at exactly 1 (multiplying by 1 changes no bit) and it serves only to tell the optimizer to
skip. Fused optimizers skip on the device; others make the scaler read the flag on the host.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast to the precision's dtype, or a null context for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


class Precision:
    """Autocast, loss scaling and the guarded optimizer step of ``precision`` on ``device``.

    Args:
        precision: "fp32", "bf16" or "fp16".
        device: where the model trains.
    """

    def __init__(self, precision: str, device: torch.device):
        if precision not in DTYPES:
            raise ValueError(f"train.precision must be one of {', '.join(DTYPES)}, got {precision!r}")
        self.name = precision
        self.device = device
        self.dynamic = precision == "fp16"  # bf16 has fp32's exponent range: no scaling needed
        self.scaler = torch.amp.GradScaler(device.type, init_scale=2.0**16 if self.dynamic else 1.0)
        self.scaler.scale(torch.zeros((), device=device))  # creates the scale tensors now, on the device

    def tensors(self) -> list[torch.Tensor]:
        """The scaler's device tensors (its scale and growth counter), which a step changes."""
        return [self.scaler._scale, self.scaler._growth_tracker]

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.name, self.device)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (0-dim), scaled for fp16."""
        self.scaler.scale(loss).backward()

    def step(
        self, optimizer: torch.optim.Optimizer, parameters: Iterable[torch.Tensor], max_norm: float,
        loss: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscale, clip to ``max_norm`` (0 = no clipping), step and zero the gradients.

        The step is skipped on the device when a gradient is not finite. Returns the gradient
        norm before clipping and whether the step counts (``loss`` and the norm finite), both
        0-dim device tensors: nothing here waits for the device.
        """
        self.scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm if max_norm > 0 else math.inf)
        if isinstance(grad_norm, DTensor):  # sharded gradients (FSDP): the global norm, the same on every rank
            grad_norm = grad_norm.full_tensor()
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        self.scaler.step(optimizer)
        self.scaler.update(None if self.dynamic else 1.0)
        optimizer.zero_grad(set_to_none=True)
        return grad_norm, finite

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """The scaler's state; an empty one (saved by a disabled scaler before the scale was
        kept for every precision) leaves the fixed scale as it is."""
        if state:
            self.scaler.load_state_dict(state)
