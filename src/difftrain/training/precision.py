"""Mixed precision as no-ops where it does not apply: one code path for fp32, bf16 and fp16."""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast to the precision's dtype, or a null context for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A loss scaler that is enabled for fp16 only (bf16 has fp32's exponent range)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
