"""Fully sharded data parallel (``train.parallel = "fsdp"``): PyTorch's FSDP2 ``fully_shard``
applied once to a plain model, per UNet block and then to the root, after torchtitan's
``apply_fsdp``. The model and the training step know nothing of it.

Each rank keeps 1/W of every parameter, gradient and AdamW moment (a ``DTensor`` sharded on
dim 0); a block's parameters are all-gathered just before its forward and backward and freed
after, and gradients are reduce-scattered (averaged, as DDP averages them), so W ranks at batch
B take the same steps as DDP, and as one process at batch W x B, to float rounding. With
``train.precision = "bf16"`` the gathered parameters are bf16 for compute while the shards (the
master weights) and the gradient reduction stay fp32.

A LoRA run (``networks/lora.py``) is sharded the same way: the frozen base and the adapter
share each unit (FSDP2 gathers both, and reduce-scatters the adapter's gradients alone), the
optimizer holds the adapter's shards. Averages of the weights (the EMA, post-hoc EMAs) are not
FSDP units but plain copies holding shards laid out as the model's (:func:`shard_like`): each
rank averages its own shard, and a frozen base is the model's own shards, shared.

Start-up holds no whole copy of the model (``RunState.build`` with a ``DistContext``): the network
is built on the meta device (``runtime/meta_init.py``), its template, EMA and post-hoc EMAs are
copies of that (no storage), :func:`shard_model` shards it, :func:`materialize` gives each rank
storage for its shards alone, and the weights are filled shard by shard: :func:`fill_shard` from
one whole tensor at a time (a fresh run's replayed initialisation), :func:`fill_shard_from` from the
rows of each tensor this rank keeps, read alone (a ``model.init_from`` -- a base family's denoiser, a
LoRA's base, difftrain's UNet -- from its safetensors files, a safetensors slice, or a torch zip file
mapped: ``runtime/tensor_source.py``: each rank reads 1/N of the base), or
``torch.distributed.checkpoint.load`` of a sharded checkpoint, each rank reading its part.
:func:`copy_shards` then makes the averages' shards copies of the model's.

Evaluation during training (validation grids, held-out loss, FID) runs on the sharded model itself,
in lockstep: every forward is a collective (each unit's weights all-gathered), so every rank runs the
same number of forwards over its share of the images, the last share padded
(``distributed.padded_shard``; :func:`in_lockstep` says when). An average's weights (the EMA) run
through the same sharded model: :class:`AverageView` swaps its shards into the model's for each call
and back, so no rank holds a whole copy of either. :func:`unsharded_copy` (whole copies gathered onto
every rank) remains for what needs the whole weights in one process.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from difftrain.runtime.distributed import DistContext

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # train.precision -> dtype of the gathered weights


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """bf16 weights for compute under ``train.precision = "bf16"`` (else the fp32 weights as
    they are); fp32 gradient reduction and fp32 shards (master weights) always.

    The inputs of a block are not cast (autocast does that): a cast copies the list of skip
    connections that the UNet's levels append to.
    """
    param_dtype = None if PARAM_DTYPES[precision] == torch.float32 else PARAM_DTYPES[precision]
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The units sharded on their own, in forward order. difftrain's UNet: each ResBlock,
    attention block and down- or upsampling of its levels, and the middle block (not a level as a
    whole: a level appends to or pops from the list of skip connections it is passed, and FSDP's
    hooks pass a module copies of its arguments). A base family's denoiser: its
    ``fsdp_units()`` (the family's ``fsdp_units``; a diffusers UNet: the ResNet, transformer and
    resampling modules of its blocks). A network wrapped around another (a LoRA network,
    ``networks/lora.py``) names the one whose blocks are its units by ``fsdp_inner()``.
    What is left (embeddings, the first and last convolutions) belongs to the root's unit."""
    if callable(getattr(model, "fsdp_inner", None)):  # a wrapper: its inner network's blocks (a LoRA's base)
        model = model.fsdp_inner()
    if callable(getattr(model, "fsdp_units", None)):  # a base family's denoiser names its own (difftrain.families)
        return list(model.fsdp_units())
    unet = model
    if not isinstance(getattr(unet, "down", None), nn.ModuleList):
        return []
    found: list[nn.Module] = []
    for levels in (unet.down, [unet.mid], unet.up):
        for level in levels:
            parts = [level] if level is unet.mid else [
                m for pair in zip(level.res, level.attn) for m in pair
            ] + [getattr(level, "downsample", None) or getattr(level, "upsample", None)]
            found += [m for m in parts if m is not None and next(m.parameters(), None) is not None]
    return found


def offload_policy(offload: bool, device: torch.device) -> OffloadPolicy:
    """``train.fsdp_offload``: FSDP2's ``CPUOffloadPolicy`` (shards, gradients and so the optimizer
    state in CPU memory; each unit's weights copied to the device for its forward and backward),
    pinned where the device is CUDA; else no offload."""
    return CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()


def shard_model(model: nn.Module, ctx: DistContext, precision: str, offload: bool = False) -> nn.Module:
    """Shard ``model`` in place across the ``ctx.world_size`` ranks (``fully_shard`` per block of
    :func:`blocks`, then the root) and return it. Its parameters become ``DTensor`` shards of
    dim 0 (in CPU memory with ``offload``: :func:`offload_policy`); its buffers stay whole on every
    rank. Every rank must call this with the same model."""
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    policy, where = mixed_precision(precision), offload_policy(offload, ctx.device)
    for block in blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy, offload_policy=where)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=where)
    return model


@torch.no_grad()
def shard_like(average: nn.Module, model: nn.Module) -> None:
    """Lay ``average`` (an EMA's copy of ``model``, not sharded) out as the sharded ``model``, in
    place: each parameter that trains becomes a ``DTensor`` of this rank's shard, as ``model``'s
    (on the same device: the CPU under ``train.fsdp_offload``); each frozen one (a LoRA run's base)
    is replaced by ``model``'s own shard, shared (it never changes). Buffers stay whole. Not a
    collective: each rank keeps its own slice."""
    sharded = dict(model.named_parameters())
    for name, p in list(average.named_parameters()):
        s = sharded[name]
        if s.requires_grad:
            copy = s.detach().clone()
            _fill(copy, name, p.detach())
            s = nn.Parameter(copy, requires_grad=False)
        owner, _, leaf = name.rpartition(".")
        setattr(average.get_submodule(owner), leaf, s)


def shard_device(offload: bool, device: torch.device) -> torch.device:
    """Where the shards (and so the optimizer state) live: the CPU under ``train.fsdp_offload``."""
    return torch.device("cpu") if offload else device


def materialize(model: nn.Module, device: torch.device) -> None:
    """Storage on ``device`` for the shards of ``model`` (sharded by :func:`shard_model` while its
    parameters were on the meta device), values unset; its buffers (built real) keep their values."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in buffers.items():
            model.get_buffer(name).copy_(b)


@torch.no_grad()
def fill_shard(model: nn.Module, name: str, whole: torch.Tensor) -> None:
    """Copy this rank's part of ``whole`` (the parameter ``name``'s full value, on any device) into
    the sharded ``model``'s parameter: dim-0 chunks as ``fully_shard`` lays them out
    (``torch.chunk``), so no collective and no other rank's part is read. A buffer (whole on every
    rank) is copied as it is."""
    try:
        target = model.get_parameter(name)
    except AttributeError:
        target = model.get_buffer(name)
    _fill(target, name, whole)


def shard_rows(p: torch.Tensor) -> tuple[int, int] | None:
    """(start, stop): the rows (dim 0) of the whole tensor this rank's shard of ``p`` holds, as
    ``fully_shard`` lays them out (``torch.chunk``: chunks of ceil(rows / ranks), the last ranks' empty when
    there are fewer chunks than ranks); None for a tensor not sharded by rows here (a buffer, a scalar)."""
    if not isinstance(p, DTensor) or p.dim() == 0 or tuple(p.placements) != (Shard(0),):
        return None
    rows, ranks = p.shape[0], p.device_mesh.size()
    chunk = -(-rows // ranks)
    start = min(p.device_mesh.get_local_rank() * chunk, rows)
    return start, min(start + chunk, rows)


@torch.no_grad()
def fill_shard_from(model: nn.Module, name: str, read) -> None:
    """:func:`fill_shard` from ``read``, a reader of the parameter ``name`` (``tensor_source.DeferredWeights.bind``):
    ``read((start, stop))`` gives this rank's rows alone (:func:`shard_rows`), so each rank reads only its
    part of the base's files; ``read()`` the whole tensor where it is not sharded by rows."""
    try:
        target = model.get_parameter(name)
    except AttributeError:
        target = model.get_buffer(name)
    rows = shard_rows(target)
    if rows is None:
        _fill(target, name, read())
        return
    local, part = target.to_local(), read(rows)
    if part.shape != local.shape:
        raise RuntimeError(f"{name}: shard {tuple(local.shape)} is not rows {rows} of the whole {tuple(target.shape)}")
    local.copy_(part)


@torch.no_grad()
def fill_shards(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Each entry of ``module.state_dict()`` (sharded parameters, whole buffers) from the whole
    tensor of the same name in ``tensors``: this rank's part of each (:func:`fill_shard`)."""
    for name, target in module.state_dict().items():
        _fill(target, name, tensors[name])


def _fill(p: torch.Tensor, name: str, whole: torch.Tensor) -> None:
    if not isinstance(p, DTensor):
        p.copy_(whole)
        return
    local = p.to_local()
    mesh = p.device_mesh
    chunks = torch.chunk(whole, mesh.size(), dim=0)
    rank = mesh.get_local_rank()
    part = chunks[rank] if rank < len(chunks) else whole[:0]
    if part.shape != local.shape:
        raise RuntimeError(f"{name}: shard {tuple(local.shape)} is not rows of the whole {tuple(whole.shape)}")
    local.copy_(part)


@torch.no_grad()
def copy_shards(average: nn.Module, model: nn.Module) -> None:
    """Lay ``average`` (a copy of ``model`` made on the meta device: an EMA, a post-hoc EMA) out as the
    sharded ``model`` with the model's values, in place: each parameter that trains becomes a copy of
    ``model``'s shard; each frozen one is ``model``'s own shard, shared. Buffers move to the model's
    device. Not a collective."""
    sharded = dict(model.named_parameters())
    for name, _ in list(average.named_parameters()):
        s = sharded[name]
        if s.requires_grad:
            s = nn.Parameter(s.detach().clone(), requires_grad=False)
        owner, _, leaf = name.rpartition(".")
        setattr(average.get_submodule(owner), leaf, s)
    device = next(iter(sharded.values())).device
    average.to(device)


def is_sharded(model: nn.Module) -> bool:
    """Whether :func:`shard_model` sharded ``model``."""
    return isinstance(model, FSDPModule)


def meta_template(model: nn.Module) -> nn.Module:
    """A copy of the (not yet sharded) ``model`` on the meta device: its structure without
    storage, from which :func:`unsharded_copy` builds plain copies. Of a model whose parameters are
    already on the meta device, a plain copy (no storage copied); else each tensor is moved to the
    meta device as it is copied (never a second whole copy)."""
    memo = {id(p): nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
            for p in model.parameters() if not p.is_meta}
    memo.update({id(b): b.to("meta") for b in model.buffers() if not b.is_meta})
    return copy.deepcopy(model, memo=memo)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or the whole tensor of a ``DTensor`` (a collective: every rank calls it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def unsharded_copy(model: nn.Module, template: nn.Module, device: torch.device) -> nn.Module:
    """A plain (unsharded) copy of the sharded ``model`` (or of an average laid out by
    :func:`shard_like`) on ``device``, in eval mode and frozen: its weights all-gathered onto every
    rank (a collective: every rank calls it), its buffers copied. ``template``: the model's
    :func:`meta_template`. All the weights, a LoRA network's frozen base too (``nn.Module``'s own
    state dict: a LoraNetwork's holds the adapter alone)."""
    whole = {k: full_tensor(v) for k, v in nn.Module.state_dict(model).items()}  # the same order on every rank
    plain = copy.deepcopy(template).to_empty(device=device)
    nn.Module.load_state_dict(plain, whole)
    for name, buf in model.named_buffers():  # non-persistent buffers too, which the state dict leaves out
        plain.get_buffer(name).copy_(buf)
    return plain.eval().requires_grad_(False)


def in_lockstep(model: nn.Module) -> bool:
    """Whether every rank must run each forward of ``model`` together: a sharded model (its forward
    all-gathers each unit's weights) or an :class:`AverageView` of one."""
    return isinstance(model, (FSDPModule, AverageView))


class AverageView(nn.Module):
    """``view(*args)``: the sharded ``model``'s forward with the weights of ``average`` (the EMA or a
    post-hoc EMA, laid out by :func:`copy_shards` / :func:`shard_like`): each call swaps the average's
    shards into the model's trainable parameters, runs the model, and swaps them back, in place (one
    tensor of scratch at a time; frozen weights are shared already). A collective, as the model's
    forward is. The root's unit keeps its weights gathered after a forward (FSDP2 does not reshard the
    root after forward, for the backward that usually follows): it is resharded before and after each
    swap, so that neither the average nor the model runs on the other's gathered weights."""

    def __init__(self, model: nn.Module, average: nn.Module) -> None:
        super().__init__()
        self.targets = (model, average)  # a tuple: neither is registered as a submodule of the view
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @torch.no_grad()
    def _swap(self) -> None:
        model, average = self.targets
        model.reshard()  # the root's parameters registered as their shards again
        if self._pairs is None:
            own = dict(average.named_parameters())
            self._pairs = [(p, own[name]) for name, p in model.named_parameters() if own[name] is not p]
        for p, a in self._pairs:
            mine, theirs = p.to_local(), a.to_local()
            scratch = mine.clone()
            mine.copy_(theirs)
            theirs.copy_(scratch)
        model.reshard()

    def parameters(self, recurse: bool = True):  # the average's shards (their device and dtype: the model's)
        return self.targets[1].parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.targets[1].named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True):
        return self.targets[0].buffers(recurse)

    def train(self, mode: bool = True) -> AverageView:
        self.targets[0].train(mode)
        return super().train(mode)

    def forward(self, *args, **kwargs):
        self._swap()
        try:
            return self.targets[0](*args, **kwargs)
        finally:
            self._swap()

    def __getattr__(self, name):  # the model's attributes (num_classes, context_dim, ...)
        if name in ("targets", "_pairs"):
            raise AttributeError(name)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.targets[0], name)
