"""The device and its speed switches: TF32, channels_last, torch.compile, CUDA graphs; each a
no-op where it does not apply.

The other speed choices live where they act: bf16 autocast in ``precision.py``, the fused AdamW
in ``training/state.py``, the ``_foreach_lerp_`` EMA in ``ema.py``, scaled-dot-product attention and
gradient checkpointing (``model.gradient_checkpointing``) in the UNet.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from difftrain.runtime.files import cache_dir
from difftrain.runtime.fsdp import is_sharded


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device is {name!r} but CUDA is not available on this machine")
    return device


# Where ``auto`` turns each switch on (docs/benchmarks.md has the measurements): channels_last
# pays in oneDNN's CPU convolutions, but on an H100 (bf16, ddpm-cifar10, batch 128) the plain
# layout was faster, eager (1,714 against 1,530 images/s) and compiled + captured (4,584 against
# 4,297), so ``auto`` keeps it to the CPU. Compiling the UNet took minutes on a 2-core CPU and then
# ran slower than eager there; on the H100 it ran 1.22x eager: ``auto`` compiles on CUDA only.
# CUDA graphs: the captured step runs right and faster on an H100 for pixel DDPM-family runs in
# fp32 and bf16 (1.45x eager), but fp16 (its loss scaler reads a flag on the host), text and
# latent runs and the EDM and flow objectives have not been captured on a GPU, so ``auto`` leaves
# it off everywhere and ``on`` is the user's choice (CUDA only).
AUTO_ON = {"channels_last": ("cpu",), "compile": ("cuda",), "cuda_graphs": ()}


def to_device_async(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A tensor made on the host inside a step (token ids, loss weights) copied to ``device``
    without waiting for the device: pinned first on CUDA, where a copy from pageable memory can
    wait for the stream."""
    if torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def resolve_toggle(value: str, device: torch.device, switch: str) -> bool:
    """``on`` / ``off``, or ``auto``: on for the device types in ``AUTO_ON[switch]``."""
    if value == "auto":
        return device.type in AUTO_ON[switch]
    if value == "on" and device.type != "cuda" and switch == "cuda_graphs":
        raise ValueError(f"train.cuda_graphs is 'on' but the device is {device.type}: CUDA graphs need CUDA")
    return value == "on"


def configure_backends(device: torch.device, tf32: bool, cudnn_attention: bool = True) -> None:
    """Let float32 matmuls and convolutions use TF32 tensor cores (Ampere and newer GPUs); with
    ``cudnn_attention`` False, ``scaled_dot_product_attention`` never picks cuDNN's kernel (``train.cudnn_attention``:
    on an H200 with torch 2.11+cu130 that kernel failed on a Flux-shaped transformer's attention, docs/benchmarks.md)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest conv kernels
        torch.backends.cuda.enable_cudnn_sdp(cudnn_attention)


def prepare_model(model: nn.Module, device: torch.device, channels_last: str, tf32: bool,
                  cudnn_attention: bool = True) -> nn.Module:
    """Set the backend flags and the weights' memory format; returns ``model`` itself.

    With channels_last the convolution weights are stored (N, H, W, C)-major, and convolutions
    then run on the (B, C, H, W) inputs in channels_last layout too (the tensor cores' layout).
    """
    configure_backends(device, tf32, cudnn_attention)
    if resolve_toggle(channels_last, device, "channels_last"):
        model.to(memory_format=torch.channels_last)
    return model


def compile_model(net: nn.Module, device: torch.device, mode: str) -> nn.Module:
    """``torch.compile(net)`` when ``mode`` resolves to on, else ``net``.

    Compile the DDP-wrapped module (if any) so that DDP's bucketed all-reduce overlaps the
    compiled backward; save and average the unwrapped model, never this one. A model sharded by
    FSDP (``runtime/fsdp.py``) runs eager: ``auto`` leaves it uncompiled (the config refuses ``on``).
    """
    if not resolve_toggle(mode, device, "compile") or is_sharded(net):
        return net
    # Inductor's compiled kernels are kept in difftrain's cache folder, so a second run (or a
    # resume) of the same model loads them instead of compiling again.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir("inductor")))
    return torch.compile(net)


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation that failed: Python's MemoryError, PyTorch's device
    OutOfMemoryError, or the plain RuntimeError of PyTorch's CPU allocator."""
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
