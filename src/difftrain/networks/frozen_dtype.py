"""Frozen parts held in the compute dtype: in a LoRA (or DreamBooth-LoRA) run with ``train.precision``
bf16 or fp16, the frozen base denoiser, the text encoders and the VAE are held in that dtype, the adapter
(peft's ``lora_A`` / ``lora_B`` ..., every parameter that trains), its optimizer state and EMA in float32,
as diffusers' LoRA scripts do (``cast_training_params``).

    dtype = frozen_dtype(cfg, network)        # None: hold everything as loaded (float32)
    hold_frozen(model, dtype)                 # every frozen float parameter cast in place, trainables kept

Why: autocast casts a float32 weight to the compute dtype at each use, and a matmul keeps that cast for
backward (a bf16 copy of every frozen weight alive through the step: 15.9 GiB of a Flux LoRA's
activations); a weight held in bf16 is used as it is. And the frozen weights themselves take half the bytes.

What is left alone: a full fine-tune (float32 master weights), fp32 runs, a quantized base's denoiser
(``model.quantize_base``: its layers are the quantizer's), and under ``train.parallel = "fsdp"`` the denoiser
(FSDP's ``MixedPrecisionPolicy`` already gathers it in the compute dtype; its frozen float32 shards are 1/N
of the base). The cast leaves the digests alone: a base family's denoiser's digest is of its files' stored bytes
(``runtime/stored_digest.py``), a base family's text encoders' of theirs too (``models.text.files_digest``), the
VAE's and difftrain's own text encoder's of their float32 weights as loaded, before this cast;
sampling, export and ``inference`` load the parts anew in float32: only the training run's own copies are cast.
"""

from __future__ import annotations

import torch
from torch import nn

from difftrain.networks.lora import is_lora_record
from difftrain.runtime.precision import DTYPES


def frozen_dtype(cfg, network: dict | None = None, part: str = "denoiser") -> torch.dtype | None:
    """The dtype a LoRA run of ``cfg`` holds its frozen ``part`` in ("denoiser" or "conditioning": the text
    encoders and VAE), or None (kept float32): ``train.precision``'s dtype in a LoRA run (``lora.rank``, or a
    checkpoint's LoRA ``network`` record) in bf16 or fp16; None for fp32 and a full fine-tune, and for the
    denoiser of a quantized base (``model.quantize_base``) or under FSDP (module docstring)."""
    lora = bool(cfg.lora.rank) if network is None else is_lora_record(network)
    if cfg.train.precision == "fp32" or not lora:
        return None
    if part == "denoiser" and (cfg.model.quantize_base != "off" or cfg.train.parallel == "fsdp"):
        return None
    return DTYPES[cfg.train.precision]


def hold_frozen(module: nn.Module | None, dtype: torch.dtype | None) -> int:
    """Cast every frozen (``requires_grad`` False) floating-point parameter of ``module`` to ``dtype`` in
    place (the same ``Parameter`` objects: an EMA or optimizer holding them sees the cast); trainable
    parameters, buffers and non-float (quantized) tensors unchanged. Returns the bytes freed. A no-op for
    None (either argument)."""
    if module is None or dtype is None:
        return 0
    freed = 0
    for p in module.parameters():
        if p.requires_grad or not p.is_floating_point() or p.dtype == dtype or type(p) is not nn.Parameter:
            continue  # a quantized layer's weight (a Params4bit, a torchao tensor) is the quantizer's
        before = p.numel() * p.element_size()
        p.data = p.data.to(dtype)
        freed += before - p.numel() * p.element_size()
    return freed


def held_bytes(module: nn.Module, trainable: bool = False) -> int:
    """Bytes of ``module``'s frozen (or, with ``trainable``, trainable) parameters as held: sum of
    numel * element_size."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad == trainable)


def gathered_in_compute_dtype(model: nn.Module, precision: str) -> None:
    """A sharded LoRA network (FSDP, ``train.precision`` bf16/fp16: its MixedPrecisionPolicy gathers every
    weight in that dtype) marked so that its forward outside the step's autocast (validation, held-out loss)
    runs under autocast to it (``LoraNetwork.held_dtype``), as a base held in bf16 does; its shards are
    unchanged (float32)."""
    if precision != "fp32" and hasattr(model, "held_dtype"):
        model.held_dtype = DTYPES[precision]
