"""Speed switches: TF32, channels_last, torch.compile; each a no-op where it does not apply.

The other speed choices live where they act: bf16 autocast in ``precision.py``, the fused AdamW
in ``builders.py``, the ``_foreach_lerp_`` EMA in ``ema.py``, scaled-dot-product attention and
gradient checkpointing (``model.gradient_checkpointing``) in the UNet.
"""

from __future__ import annotations

import torch
from torch import nn


# Where ``auto`` turns each switch on (docs/benchmarks.md has the measurements): channels_last
# pays on CUDA tensor cores and in oneDNN's CPU convolutions; compiling the UNet took minutes on
# a 2-core CPU and then ran slower than eager there, so ``auto`` compiles on CUDA only.
AUTO_ON = {"channels_last": ("cuda", "cpu"), "compile": ("cuda",)}


def resolve_toggle(value: str, device: torch.device, switch: str) -> bool:
    """``on`` / ``off``, or ``auto``: on for the device types in ``AUTO_ON[switch]``."""
    if value == "auto":
        return device.type in AUTO_ON[switch]
    return value == "on"


def configure_backends(device: torch.device, tf32: bool) -> None:
    """Let float32 matmuls and convolutions use TF32 tensor cores (Ampere and newer GPUs)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest conv kernels


def prepare_model(model: nn.Module, device: torch.device, channels_last: str, tf32: bool) -> nn.Module:
    """Set the backend flags and the weights' memory format; returns ``model`` itself.

    With channels_last the convolution weights are stored (N, H, W, C)-major, and convolutions
    then run on the (B, C, H, W) inputs in channels_last layout too (the tensor cores' layout).
    """
    configure_backends(device, tf32)
    if resolve_toggle(channels_last, device, "channels_last"):
        model.to(memory_format=torch.channels_last)
    return model


def compile_model(net: nn.Module, device: torch.device, mode: str) -> nn.Module:
    """``torch.compile(net)`` when ``mode`` resolves to on, else ``net``.

    Compile the DDP-wrapped module (if any) so that DDP's bucketed all-reduce overlaps the
    compiled backward; save and average the unwrapped model, never this one.
    """
    if not resolve_toggle(mode, device, "compile"):
        return net
    return torch.compile(net)
