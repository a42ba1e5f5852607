"""What a training forward keeps for its backward pass, counted on the meta device (no memory, no arithmetic).

    kept = saved_for_backward(lambda: net(x, t, cond), net, precision="bf16", checkpointed=net.model)
    kept.total            # bytes of activations at the step's peak (see SavedBytes)

The forward runs on meta tensors (shapes and dtypes only) under ``torch.autograd.graph.saved_tensors_hooks``,
which see every tensor autograd keeps; each storage is counted once, the parameters never (they are
counted as weights). Three stand-ins make a meta forward keep what a CUDA training step keeps:

- **autocast** (``train.precision`` bf16 / fp16): the meta device has no autocast, so a
  ``TorchFunctionMode`` casts each call's floating arguments as CUDA autocast does (the op lists of
  torch's "Automatic Mixed Precision" reference: matmuls, linear, convolutions and attention in the
  low dtype; norms, softmax, pow, exp, sums... in float32), caching the low-precision copy of a weight
  that trains once per forward as autocast's cache does. ``policy="cpu"`` uses the CPU's lists instead
  (only the low-precision one matters to diffusers' models), which is how a test checks the stand-in
  against real CPU autocast, to the byte;
- **fused attention**: on meta, ``scaled_dot_product_attention`` falls back to the math kernel, which
  keeps the (B, H, L, L) scores; the stand-in keeps what the flash / memory-efficient kernels keep
  (CUDA, and the CPU's flash kernel): q, k, v, the output and a (B, H, L) float32 log-sum-exp; with an
  attention mask (Sana's and Lumina 2's text masks) the memory-efficient kernel, which keeps the mask too;
- **gradient checkpointing**: diffusers' ``enable_gradient_checkpointing`` takes the function that
  checkpoints a block; the stand-in counts the block's inputs (the checkpoint holds them until
  backward) and what the block keeps when it is recomputed in backward, apart from the rest.

A quantized frozen base (``quantized``: ids of the weights held quantized) keeps no low-precision copy
of its weights: the quantized layers dequantize again in backward (bitsandbytes' and torchao's do).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

# CUDA autocast's op lists (torch docs, "Automatic Mixed Precision package", CUDA Op-Specific Behavior):
# ops that run in the low-precision dtype, and ops that autocast to float32. Names as torch functions
# and Tensor methods carry them (``F.linear`` -> "linear", ``a @ b`` -> "__matmul__").
CUDA_LOW = frozenset({
    "__matmul__", "__rmatmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "multi_dot",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "linear", "matmul",
    "mm", "mv", "prelu", "scaled_dot_product_attention"})
CUDA_FP32 = frozenset({
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits", "cosh",
    "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv",
    "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log", "log_softmax",
    "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss", "multilabel_margin_loss", "multi_margin_loss",
    "nll_loss", "norm", "normalize", "pdist", "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh",
    "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan",
    "triplet_margin_loss"})
# CPU autocast's low-precision list; its float32 list holds losses, FFTs and linear algebra that
# diffusers' denoisers do not call.
CPU_LOW = frozenset({
    "__matmul__", "__rmatmul__", "conv1d", "conv2d", "conv3d", "bmm", "mm", "baddbmm", "addmm", "addbmm", "linear",
    "matmul", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu", "scaled_dot_product_attention"})
POLICIES = {"cuda": (CUDA_LOW, CUDA_FP32), "cpu": (CPU_LOW, frozenset())}
LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _ref(t: Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


class _FusedAttention(torch.autograd.Function):
    """(B, H, L, D) q, k, v (and an attention mask or None) -> (B, H, L, Dv): keeps q, k, v, the output, a
    (B, H, L) float32 log-sum-exp and the mask, as the flash and memory-efficient kernels do; computes nothing
    (meta tensors)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        # laid out (B, L, H, Dv) and seen as (B, H, L, Dv), as those kernels return it: the caller's
        # transpose(1, 2).reshape(B, L, H * Dv) is then a view, as on the device
        out = q.new_empty(*q.shape[:-3], q.shape[-2], q.shape[-3], v.shape[-1]).transpose(-3, -2) if q.dim() >= 3 \
            else q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if isinstance(mask, Tensor) else []))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


class _StandIns(TorchFunctionMode):
    """Autocast (``dtype`` None: off) and fused attention on meta tensors; the low-precision copies of
    parameters it makes are recorded in ``casts`` (storage -> (copy, kind)), kind "trained" (cached
    once, as autocast caches a leaf that requires grad), "frozen" or "quantized"."""

    def __init__(self, dtype: torch.dtype | None, policy: str, params: dict[int, str]):
        super().__init__()
        self.dtype, self.params = dtype, params
        self.low, self.fp32 = POLICIES[policy]
        self.cache: dict[int, Tensor] = {}
        self.casts: dict[StorageWeakRef, tuple[Tensor, str]] = {}

    def _cast(self, value, dtype: torch.dtype):
        if isinstance(value, (tuple, list)):
            return type(value)(self._cast(v, dtype) for v in value)
        if not isinstance(value, Tensor) or not value.is_floating_point() or value.dtype in (dtype, torch.float64):
            return value
        kind = self.params.get(id(value))
        if kind == "trained" and id(value) in self.cache:
            return self.cache[id(value)]
        out = value.to(dtype)
        if kind is not None:
            self.casts[_ref(out)] = (out, kind)
            if kind == "trained":
                self.cache[id(value)] = out
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.dtype is not None and (name in self.low or name in self.fp32):
            dtype = self.dtype if name in self.low else torch.float32
            args = tuple(self._cast(a, dtype) for a in args)
            kwargs = {k: self._cast(v, dtype) for k, v in kwargs.items()}
        if name == "scaled_dot_product_attention":
            named = dict(zip(("query", "key", "value", "attn_mask"), args)) | kwargs
            if named["query"].is_meta:
                return _FusedAttention.apply(named["query"], named["key"], named["value"], named.get("attn_mask"))
        return func(*args, **kwargs)


class _Kept:
    """The storages a ``saved_tensors_hooks`` pack sees, each once, parameters left out."""

    def __init__(self, skip: set[StorageWeakRef]):
        self.skip, self.kept = skip, {}

    def pack(self, t: Tensor) -> Tensor:
        ref = _ref(t)
        if ref not in self.skip and ref not in self.kept:
            self.kept[ref] = t
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _bytes(kept: dict[StorageWeakRef, Tensor], leave_out=()) -> int:
    return sum(t.untyped_storage().nbytes() for ref, t in kept.items() if ref not in leave_out)


@dataclass
class SavedBytes:
    """Bytes a training forward keeps for its backward pass.

    saved: what autograd keeps outside checkpointed blocks (everything, without checkpointing);
    frozen_casts, trained_casts: of ``saved``, the low-precision copies of frozen weights (a LoRA run's
    base under autocast: 2 bytes a weight; none for a quantized base) and of trained ones;
    cast_cache: autocast's cached copies of trained weights not already in ``saved`` (alive until the
    forward ends); checkpoint_inputs: the checkpointed blocks' inputs; largest_block: what recomputing
    the largest block keeps in backward, of which ``largest_block_casts`` are weight copies.
    """

    saved: int
    frozen_casts: int
    cast_cache: int
    trained_casts: int = 0
    checkpoint_inputs: int = 0
    largest_block: int = 0
    largest_block_casts: int = 0
    blocks: int = 0  # checkpointed block calls seen

    @property
    def total(self) -> int:
        """The most held at once: at the end of the forward (the cached casts alive), or in backward
        while the largest checkpointed block is recomputed."""
        held = self.saved + self.checkpoint_inputs
        return held + max(self.cast_cache, self.largest_block)

    @property
    def sharded_total(self) -> int:
        """:attr:`total` under FSDP's mixed precision: the weights are gathered in the low dtype (no autocast
        copies; FSDP frees and gathers them again for backward, its transient), so no weight copy is kept."""
        return (self.saved - self.frozen_casts - self.trained_casts + self.checkpoint_inputs
                + self.largest_block - self.largest_block_casts)


@dataclass
class _Checkpoint:
    """diffusers' ``gradient_checkpointing_func``: runs the block under its own hooks (what its
    recompute keeps), and records its inputs, which a checkpoint holds."""

    skip: set[StorageWeakRef]
    inputs: dict[StorageWeakRef, Tensor] = field(default_factory=dict)
    blocks: list[dict[StorageWeakRef, Tensor]] = field(default_factory=list)

    def __call__(self, block: Callable, *args):
        for t in (a for a in args if isinstance(a, Tensor)):  # what torch's checkpoint saves (a tuple's stay referenced)
            ref = _ref(t)
            if ref not in self.skip:
                self.inputs.setdefault(ref, t)
        inner = _Kept(self.skip)
        with inner.hooks():
            out = block(*args)
        self.blocks.append(inner.kept)
        return out


def saved_for_backward(forward: Callable[[], Tensor], model: nn.Module, precision: str = "fp32",
                       checkpointed: nn.Module | None = None, quantized: frozenset[int] = frozenset(),
                       policy: str = "cuda") -> SavedBytes:
    """Run ``forward()`` (the model's training forward and loss, on meta tensors) and count what it keeps.

    model: whose parameters are weights, not activations (those with ``requires_grad`` train);
    precision: ``train.precision`` ("fp32": no autocast); checkpointed: a diffusers model whose blocks
    are checkpointed (``enable_gradient_checkpointing`` with the counting stand-in; None: off);
    quantized: ids of frozen weights held quantized; policy: "cuda" or "cpu" autocast lists.
    """
    params = {id(p): ("trained" if p.requires_grad else "quantized" if id(p) in quantized else "frozen")
              for p in model.parameters()}
    skip = {_ref(p) for p in model.parameters()}
    modes = _StandIns(LOW_DTYPES.get(precision), policy, params)
    outer = _Kept(skip)
    check = _Checkpoint(skip)
    if checkpointed is not None:
        checkpointed.enable_gradient_checkpointing(gradient_checkpointing_func=check)
    try:
        with modes, outer.hooks(), torch.enable_grad():
            forward()
    finally:
        if checkpointed is not None:
            checkpointed.disable_gradient_checkpointing()
    quantized_casts = {r for r, (_, kind) in modes.casts.items() if kind == "quantized"}
    frozen_casts = {r for r, (_, kind) in modes.casts.items() if kind == "frozen"}
    trained_casts = {r: c for r, (c, kind) in modes.casts.items() if kind == "trained"}
    casts = set(modes.casts)
    held = set(outer.kept) | set(check.inputs)
    blocks = [(_bytes(b, held | quantized_casts), _bytes({r: t for r, t in b.items() if r in casts}, held | quantized_casts))
              for b in check.blocks]
    largest = max(blocks, default=(0, 0))

    def outer_bytes(refs) -> int:
        return sum(t.untyped_storage().nbytes() for r, t in outer.kept.items() if r in refs)

    return SavedBytes(
        saved=_bytes(outer.kept, quantized_casts),
        frozen_casts=outer_bytes(frozen_casts),
        cast_cache=_bytes(trained_casts, held),
        trained_casts=outer_bytes(set(trained_casts)),
        checkpoint_inputs=_bytes(check.inputs, set(outer.kept) | quantized_casts),
        largest_block=largest[0],
        largest_block_casts=largest[1],
        blocks=len(check.blocks),
    )
