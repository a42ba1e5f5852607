"""Block swap (``model.swap_blocks = N``): the frozen weights of N of a network's blocks held in host memory,
each block's copied onto the compute device just before it runs and dropped after, as musubi-tuner's
``blocks_to_swap``, OneTrainer's layer offload and ai-toolkit's low-VRAM mode do.

    plan = BlockSwap(fsdp.blocks(model), n=16, device=torch.device("cuda"))
    plan.install()        # the last 16 blocks' frozen tensors now live on the host (pinned on CUDA)
    loss = model(x, t, cond).square().mean(); loss.backward()   # the step, unchanged
    plan.resident()       # the blocks whose device copy is alive now (the 16 swapped ones: none, between steps)
    plan.bound            # blocks never swapped + the one running + the one prefetched: len(blocks) - 16 + 2
    planned_bytes(blocks, 16)  # (the blocks' frozen bytes on the device at most, on the host): for estimate
    plan.remove()         # every tensor back on its device, the same objects, the same values
    with BlockSwap(blocks, 16, device):  # the same, as a context manager
        ...
    BlockSwap(blocks, 16, device, shared_with=[fsdp.blocks(ema.model)])  # the EMA's copy (sharing the base) too
    swap_base(model, 16, device, [ema.model])  # a training run's (RunState.parallelize): the above, installed

What lives where. ``blocks`` is the list ``runtime/fsdp.blocks(model)`` returns, in forward order (a family
denoiser's ``fsdp_units()``: Flux's double and single transformer blocks, an SDXL UNet's ResNet, transformer
and resampling modules; difftrain's UNet's ResBlocks, attention blocks, resamplers and middle block). The last
N of them are swapped (:attr:`BlockSwap.swapped`); of each, only its frozen tensors move: the parameters with
``requires_grad=False`` and the buffers (a ``(out, in)`` Linear weight, a ``(out, in, k, k)`` convolution,
norms' ``(C,)`` scales and biases), each as the same ``nn.Parameter`` / buffer object whose ``.data`` is
pointed, in turn, at

- its host copy (made at :meth:`BlockSwap.install`, same shape and dtype, pinned where ``device`` is CUDA): what
  the tensor holds while its block is not running, so that a reader outside the step (a digest, an export, a
  state dict) finds its values;
- a device copy (``host.to(device)``, a separate tensor even when ``device`` is the CPU): made when the block
  is about to run (synchronously), or prefetched while the block before it runs (on a side CUDA stream, the
  compute stream waiting for it by an event; synchronously elsewhere), dropped when the block's forward ends.

The trainable parameters inside a block (a LoRA adapter's ``lora_A`` / ``lora_B``, DoRA's magnitude) never
move, nor does anything outside the swapped blocks (embeddings, first and last layers, the N - len(blocks)
blocks kept). So the device holds at most :attr:`BlockSwap.bound` blocks' frozen weights at once.

Backward. Autograd keeps the tensors an op needs for backward (``F.linear`` saves its weight, a convolution
its kernel); kept as they are, every swapped block's device copy would live until backward. While a swapped
block runs, a ``torch.autograd.graph.saved_tensors_hooks`` pair packs each saved tensor that is one of the
block's device copies, or a view of one, as a small handle (block, tensor, size, stride, offset) and unpacks
it by bringing the block back (the block before it prefetched: backward runs the blocks in reverse) and
rebuilding the view; any other saved tensor goes to the hooks in force around it (gradient checkpointing's,
or none). A callback queued on the autograd engine drops what is still resident when backward ends. With
gradient checkpointing (diffusers' ``enable_gradient_checkpointing``, difftrain's ``model.gradient_checkpointing``:
``torch.utils.checkpoint`` non-reentrant) nothing of the weights is saved and the recompute's forward brings
the block back: every submodule of a swapped block checks, before its forward, that its block is resident
(difftrain's UNet recomputes ``ResBlock._forward`` without the block's own hooks).

What it does not compose with, refused by :func:`refusal` in one line: a quantized base
(``model.quantize_base``: bitsandbytes' ``Params4bit`` / ``Int8Params`` keep their scales beside the weight, in
the parameter's ``quant_state`` or the layer's ``state``, and torchao's fp8 weight is a tensor subclass holding
its scales inside: a ``.data`` copy moves the bytes, not the scales, so a swapped quantized block would compute
on the wrong numbers or on the wrong device), FSDP (its parameters are ``DTensor`` shards that FSDP itself
gathers for each block: ``train.fsdp_offload`` is its own host offload), and a frozen tensor shared between a
swapped block and one that is not. Autocast: a float32 frozen weight is cast to bf16/fp16 at each use and the
cast (a new tensor, not the block's) is what the matmul saves; hold the frozen base in the compute dtype
(``networks/frozen_dtype.py``, what a bf16 LoRA run does) so that the weight is used, and saved, as it is.
Install the plan once the network is on its device and remove it before moving it (``.to()`` would move the
host copies).

The side stream's speed is unmeasured (issue 41 item 7): on the CPU, and on a device where a copy cannot
overlap compute, a prefetch is a plain synchronous copy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Self

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from difftrain.networks.quantize import layer_kind
from difftrain.runtime import fsdp

OPTION = "model.swap_blocks"  # the config option a refusal names


@dataclass
class _Slot:
    """One frozen tensor of a swapped block: the ``nn.Parameter`` or buffer object itself, its host copy and
    the device it was on at :meth:`BlockSwap.install` (where :meth:`BlockSwap.remove` puts it back)."""

    tensor: Tensor
    host: Tensor
    home: torch.device


@dataclass(frozen=True)
class _Saved:
    """What autograd keeps of a saved device copy (or view of one): which block and tensor, and the view."""

    block: int
    index: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class _Theirs:
    """A saved tensor packed by the hooks in force around a swapped block (gradient checkpointing's)."""

    packed: object
    unpack: object


def frozen_tensors(block: nn.Module) -> list[tuple[str, nn.Module, Tensor]]:
    """``(name, owner, tensor)`` of every frozen parameter and buffer of ``block``, each once (the first name
    it has), empty ones left out."""
    out, seen = [], set()
    for module_name, module in block.named_modules():
        own = [(n, p) for n, p in module._parameters.items() if p is not None and not p.requires_grad]
        own += [(n, b) for n, b in module._buffers.items() if b is not None]
        for name, t in own:
            if id(t) not in seen and t.numel() > 0:
                seen.add(id(t))
                out.append((f"{module_name}.{name}".lstrip("."), module, t))
    return out


def refusal(blocks: list[nn.Module], n: int) -> str | None:
    """None where the last ``n`` of ``blocks`` can be swapped, else one line saying why not: ``n`` outside
    0..len(blocks), a quantized layer or an FSDP shard among their frozen tensors, or a frozen tensor they
    share with a block that is kept."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        return f"{OPTION} must be a whole number of blocks from 0 to {len(blocks)}, got {n!r}"
    if n > len(blocks):
        return f"{OPTION} = {n} is outside 0..{len(blocks)}: this network has {len(blocks)} blocks to swap"
    swapped, kept = blocks[len(blocks) - n:], blocks[:len(blocks) - n]
    kept_ids = {id(t) for b in kept for _, _, t in frozen_tensors(b)}
    for block in swapped:
        for name, module, t in frozen_tensors(block):
            kind = layer_kind(module)
            if kind is not None or type(t) not in (Tensor, nn.Parameter):
                what = f"model.quantize_base = {kind}" if kind else f"a {type(t).__name__} weight"
                if type(t).__name__ == "DTensor":
                    what = 'train.parallel = "fsdp" (its weights are DTensor shards; train.fsdp_offload offloads them)'
                elif kind is None and "Float8" in type(t).__name__:
                    what = "model.quantize_base = fp8"
                return (f"{OPTION} does not combine with {what}: {type(block).__name__}'s {name} is held "
                        f"{type(t).__name__}, whose scales a copy of its data would not carry; set one or the other")
            if id(t) in kept_ids:
                return f"{OPTION}: {name} of a swapped {type(block).__name__} is shared with a block that is kept"
    return None


def planned_bytes(blocks: list[nn.Module], n: int) -> tuple[int, int]:
    """(device bytes, host bytes) of the frozen tensors of ``blocks`` with the last ``n`` swapped, as held now
    (numel * element_size: a meta-device network counts as well, for ``estimate``): on the device, the kept
    blocks' and, at the worst moment, two neighbouring swapped blocks' (the one running and the one prefetched:
    forward and backward both take them in order); on the host (pinned on CUDA), every swapped block's. A
    network without swap (n = 0) has all its blocks' frozen bytes on the device and none on the host."""
    sizes = [sum(t.numel() * t.element_size() for _, _, t in frozen_tensors(b)) for b in blocks]
    first = len(blocks) - n
    swapped = sizes[first:]
    running = max((a + b for a, b in itertools.pairwise(swapped)), default=sum(swapped))
    return sum(sizes[:first]) + running, sum(swapped)


def _unshared(blocks: list[nn.Module], n: int, other: list[nn.Module]) -> str | None:
    """None where every frozen parameter of the last ``n`` of ``blocks`` is also ``other``'s block of the same
    index's (the same object), else one line naming the first that is not."""
    if len(other) != len(blocks):
        return f"{OPTION}: a network sharing the swapped blocks has {len(other)} blocks, not {len(blocks)}"
    for i in range(len(blocks) - n, len(blocks)):
        theirs = {id(t) for t in other[i].parameters()}
        for name, _, t in frozen_tensors(blocks[i]):
            if isinstance(t, nn.Parameter) and id(t) not in theirs:
                return (f"{OPTION}: {name} of block {i} is not shared by a network given as sharing the swapped "
                        f"blocks (it holds a copy): that network cannot follow the swap")
    return None


def swap_base(model: nn.Module, n: int, device: torch.device | str, averages: list[nn.Module] = ()) -> BlockSwap | None:
    """A training run's plan (``model.swap_blocks = n``, what ``RunState.parallelize`` installs): the last ``n``
    of ``runtime/fsdp.blocks(model)`` (a LoRA network's: its base's) swapped, the averages that share its frozen
    base (the EMA's and post-hoc EMA's copies, ``training/ema.averaged_copy``) following it; installed. None for
    n = 0. A count above the base's blocks is one ValueError naming the option, the count and the base's blocks."""
    if not n:
        return None
    units = fsdp.blocks(model)
    if n > len(units):
        inner = model.fsdp_inner() if callable(getattr(model, "fsdp_inner", None)) else model
        raise ValueError(f"{OPTION} = {n} is more than the {len(units)} blocks of the base "
                         f"({type(inner).__name__}): set it to at most {len(units)}")
    return BlockSwap(units, n, device, shared_with=[fsdp.blocks(a) for a in averages]).install()


class BlockSwap:
    """Keep the frozen tensors of the last ``n`` of ``blocks`` on the host, each block's on ``device`` only
    while it runs (forward, backward, a checkpointed recompute), the next one prefetched. See the module's
    docstring for what lives where. One ValueError (:func:`refusal`'s line) where it cannot apply.

    shared_with: the blocks of other networks that hold these blocks' frozen parameters themselves (the same
    objects), in the same order (an average's copy of a LoRA network: ``training/ema.py`` shares the frozen
    base, copies the adapter and buffers): hooked as these are, so that they too find each block on the device
    when they run (what they hold of their own stays where it is)."""

    def __init__(self, blocks: list[nn.Module], n: int, device: torch.device | str,
                 shared_with: list[list[nn.Module]] = ()) -> None:
        self.blocks = list(blocks)
        problem = refusal(self.blocks, n) or next(filter(None, (_unshared(self.blocks, n, other) for other in shared_with)), None)
        if problem:
            raise ValueError(problem)
        self.twins = [list(other) for other in shared_with]
        self.n, self.device = n, torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # as the copies report it: cuda:0, not cuda
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.first = len(self.blocks) - n  # blocks[first:] are swapped
        self._slots: dict[int, list[_Slot]] = {}  # block index -> its frozen tensors (while installed)
        self._copies: dict[int, list[Tensor]] = {}  # block index -> its device copies (resident blocks)
        self._ready: dict[int, torch.cuda.Event] = {}  # a prefetched block -> the event its copy recorded
        self._by_storage: dict[int, tuple[int, int, torch.dtype]] = {}  # device copy's data_ptr -> (block, index, dtype)
        self._handles: list[RemovableHandle] = []
        self._callback_task = None  # the backward whose end-callback is queued
        self._pushed: list[int] = []  # the blocks running now whose saved-tensor hooks are pushed (a stack)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.loads = 0  # device copies made, a block at a time (counts re-fetches for backward)
        self.prefetches = 0  # of which, made ahead of the block's turn

    # -- what the plan promises ---------------------------------------------------------------------

    @property
    def swapped(self) -> list[nn.Module]:
        """The blocks whose frozen tensors live on the host: the last ``n``."""
        return self.blocks[self.first:]

    @property
    def bound(self) -> int:
        """The most blocks whose frozen weights are on the device at once: those never swapped, the one
        running and the one prefetched."""
        return self.first + min(self.n, 2)

    def resident(self) -> list[nn.Module]:
        """The blocks whose device copy is alive now: every kept block, and the swapped ones loaded."""
        return self.blocks[:self.first] + [self.blocks[i] for i in sorted(self._copies)]

    # -- install, remove ----------------------------------------------------------------------------

    def install(self) -> BlockSwap:
        """Move the swapped blocks' frozen tensors to host copies and hook every block. Returns the plan."""
        if self._handles or self._slots:
            raise RuntimeError("this BlockSwap is installed already")
        pin = self.device.type == "cuda"
        for i in range(self.first, len(self.blocks)):
            slots = []
            for _, _, t in frozen_tensors(self.blocks[i]):
                host = t.detach().to("cpu", copy=True)
                slots.append(_Slot(t, host.pin_memory() if pin else host, t.device))
                t.data = slots[-1].host
            self._slots[i] = slots
        for i, block in [(i, b) for blocks in (self.blocks, *self.twins) for i, b in enumerate(blocks)]:
            if i >= self.first:
                self._handles.append(block.register_forward_pre_hook(self._pre_hook(i)))
                self._handles.append(block.register_forward_hook(self._post_hook(i), always_call=True))
                check = self._check_hook(i)
                self._handles += [m.register_forward_pre_hook(check) for m in block.modules() if m is not block]
            elif i + 1 == self.first:
                self._handles.append(block.register_forward_pre_hook(self._prefetch_hook(i + 1)))
        return self

    def remove(self) -> None:
        """Undo :meth:`install`: hooks off, every swapped tensor back on the device it was on (the same
        ``Parameter`` / buffer objects, the same values). Call it with no backward pending."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.release()
        for slots in self._slots.values():
            for s in slots:
                s.tensor.data = s.host.to(s.home, copy=s.home.type != "cpu")
        self._slots.clear()

    def release(self) -> None:
        """Drop every swapped block's device copy (each tensor back on its host copy)."""
        for i in list(self._copies):
            self._evict(i)

    def __enter__(self) -> Self:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()

    # -- moving blocks ------------------------------------------------------------------------------

    def _load(self, i: int, ahead: bool) -> None:
        """Make block ``i``'s device copies and point its tensors at them; ``ahead`` on CUDA: on the side
        stream, the compute stream to wait for :attr:`_ready`'s event before using them."""
        slots = self._slots[i]
        if self._stream is not None and ahead:
            compute = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self._stream):
                copies = [s.host.to(self.device, non_blocking=True) for s in slots]
                event = torch.cuda.Event()
                event.record(self._stream)
            for c in copies:  # made on the side stream, used on the compute stream: not reused before it is done
                c.record_stream(compute)
            self._ready[i] = event
        else:
            copies = [s.host.to(self.device, copy=True) for s in slots]
        for k, (s, c) in enumerate(zip(slots, copies)):
            s.tensor.data = c
            self._by_storage[c.untyped_storage().data_ptr()] = (i, k, c.dtype)
        self._copies[i] = copies
        self.loads += 1
        self.prefetches += int(ahead)

    def _evict(self, i: int) -> None:
        """Drop block ``i``'s device copies: its tensors point at their host copies again."""
        for s, c in zip(self._slots[i], self._copies.pop(i)):
            self._by_storage.pop(c.untyped_storage().data_ptr(), None)
            s.tensor.data = s.host
        self._ready.pop(i, None)

    def _prefetch(self, i: int) -> None:
        if self.first <= i < len(self.blocks) and i not in self._copies:
            self._load(i, ahead=True)

    def _ensure(self, i: int) -> None:
        """Block ``i`` resident and ready on the compute stream, every other swapped block dropped but the
        next in this pass's order (forward: i + 1; backward: i - 1), which is prefetched."""
        backward = torch._C._current_graph_task_id() != -1
        if i not in self._copies:
            self._load(i, ahead=False)
        event = self._ready.pop(i, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        nxt = i - 1 if backward else i + 1
        for j in [j for j in self._copies if j not in (i, nxt)]:
            self._evict(j)
        self._prefetch(nxt)
        if backward and self._callback_task != torch._C._current_graph_task_id():
            self._callback_task = torch._C._current_graph_task_id()
            # the engine's end-of-backward callback (what FSDP's post-backward uses; no public name)
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._callback_task = None
        self.release()

    # -- hooks --------------------------------------------------------------------------------------

    def _pre_hook(self, i: int):
        def hook(module, args):
            self._ensure(i)
            # The hooks in force around the block (gradient checkpointing's), to which what is not a weight goes.
            # torch has no public getter for them; _top_saved_tensors_default_hooks is what AOTAutograd reads.
            theirs = torch._C._autograd._top_saved_tensors_default_hooks(True)
            torch._C._autograd._push_saved_tensors_default_hooks(self._packer(theirs), self._unpack)
            self._pushed.append(i)
        return hook

    def _post_hook(self, i: int):
        def hook(module, args, output):
            if self._pushed and self._pushed[-1] == i:  # (always called: also when the forward raised)
                self._pushed.pop()
                torch._C._autograd._pop_saved_tensors_default_hooks()
            # In backward (a checkpointed recompute) the block's own nodes come next: kept till another block loads.
            if torch._C._current_graph_task_id() == -1 and i in self._copies:
                self._evict(i)
        return hook

    def _check_hook(self, i: int):
        def hook(module, args):
            if i not in self._copies or i in self._ready:
                self._ensure(i)
        return hook

    def _prefetch_hook(self, i: int):
        def hook(module, args):
            if torch._C._current_graph_task_id() == -1:
                self._prefetch(i)
        return hook

    def _packer(self, theirs):
        def pack(t: Tensor):
            try:
                found = self._by_storage.get(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass): not ours
                found = None
            if found is not None and found[2] == t.dtype and t.device == self.device:
                return _Saved(found[0], found[1], tuple(t.size()), tuple(t.stride()), t.storage_offset())
            return t if theirs is None else _Theirs(theirs[0](t), theirs[1])
        return pack

    def _unpack(self, saved) -> Tensor:
        if isinstance(saved, _Theirs):
            return saved.unpack(saved.packed)
        if not isinstance(saved, _Saved):
            return saved
        self._ensure(saved.block)
        return self._copies[saved.block][saved.index].as_strided(saved.size, saved.stride, saved.offset)
