"""Block swap (issue 41 item 3, ``networks/block_swap.py``) on the CPU, on the tiny bases: a LoRA on a Flux and
an SDXL denoiser (tests/family_bases.py, loaded as training loads them) and on difftrain's UNet (build_model).

With the frozen weights of all blocks but one swapped, one forward and backward gives the outputs, the adapter's
gradients and the input's gradient of the network without the plan, bit for bit (torch.equal: the same ops on
the same values, the device copies being exact copies), with and without gradient checkpointing. How many blocks
are resident is read off the tensors themselves, not the plan's bookkeeping: a TorchDispatchMode sees every op,
forward and backward, and at each one counts the swapped blocks holding a live device copy (a weak reference to
each storage the block's tensors have pointed at, other than their host copies); it also finds any op (a copy
aside) that computed on a host copy, which on the CPU would give the right numbers and so hide a missed load.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from conftest import TINY_OVERRIDES
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from difftrain.config import load_config
from difftrain.families import family_named
from difftrain.models import build_model
from difftrain.networks.block_swap import BlockSwap, frozen_tensors, planned_bytes
from difftrain.networks.lora import apply_lora
from difftrain.runtime.fsdp import blocks
from tests.family_bases import write_tiny_flux_folder, write_tiny_sdxl_folder

B, L = 2, 5  # batch, text tokens
NETWORKS = ["unet", "sdxl", "flux"]
COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten.detach.default,
          torch.ops.aten.alias.default}  # ops that may read a host copy: making a device copy


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("block-swap")
    return {"sdxl": write_tiny_sdxl_folder(root / "sdxl"), "flux": write_tiny_flux_folder(root / "flux")}


def _network(which: str, folders, checkpointing: bool, device: str = "cpu", quantize: str = "off", kind: str = "lora"):
    """(a LoRA network (``lora.kind``) on the tiny base ``which`` (held quantized as ``quantize``:
    ``model.quantize_base``), random weights and adapter, and one input (x, t, cond))."""
    flag = f"model.gradient_checkpointing={str(checkpointing).lower()}"
    cfg = load_config(None, TINY_OVERRIDES + [flag])
    g = torch.Generator().manual_seed(0)
    if which == "unet":
        torch.manual_seed(0)
        base, record = build_model(cfg), {"kind": "unet"}
        x, t, cond = torch.randn(B, 3, 16, 16, generator=g), torch.tensor([10, 50]), None
    else:
        family = family_named(which)
        base = family.load_denoiser(folders[which])
        base.set_gradient_checkpointing(checkpointing)
        record = base.record()
        shapes = family.condition_shapes(base.config, max_sequence_length=L)
        cond = {k: torch.randn(B, *s, generator=g) for k, s in shapes.items()}
        if "time_ids" in cond:
            cond["time_ids"] = torch.tensor([[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]] * B)
        x = torch.randn(B, family.latent_channels(base.config), 8, 8, generator=g)
        t = torch.tensor([10.0, 500.0])
    for p in base.parameters():  # the zero-initialised last layers would let no gradient through
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(p.numel()))
    net = apply_lora(base, dataclasses.replace(cfg.lora, rank=4, kind=kind), base_record=record, base_source="tiny",
                     quantize=quantize)
    with torch.no_grad():  # lora_B starts at zero: lora_A's gradient would be too
        for p in net.state_dict(keep_vars=True).values():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    net.train()
    move = (lambda v: v.to(device)) if device != "cpu" else (lambda v: v)
    cond = None if cond is None else {k: move(v) for k, v in cond.items()}
    return net.to(device), (move(x).requires_grad_(True), move(t), cond)


def _step(net, batch):
    """(output, {adapter parameter: gradient}, input gradient) of one forward and backward."""
    x, t, cond = batch
    x.grad = None
    net.zero_grad(set_to_none=True)
    out = net(x, t, cond) if cond is not None else net(x, t)
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    return out.detach(), grads, x.grad.clone()


class Watch(TorchDispatchMode):
    """At every op: how many swapped blocks hold a live device copy (``most``: the largest count seen), and
    which ops other than copies read a host copy (``host_reads``)."""

    def __init__(self, plan: BlockSwap):
        super().__init__()
        self.tensors = [[t for _, _, t in frozen_tensors(b)] for b in plan.swapped]
        self.host = {t.untyped_storage().data_ptr() for ts in self.tensors for t in ts}  # installed, none loaded
        self.copies: list[dict[int, StorageWeakRef]] = [{} for _ in self.tensors]
        self.most, self.host_reads, self.ops, self.backward_ops = 0, [], 0, 0

    def alive(self) -> int:
        """Swapped blocks with a device copy alive now (first noting the copies their tensors point at)."""
        count = 0
        for tensors, copies in zip(self.tensors, self.copies):
            for t in tensors:
                s = t.untyped_storage()
                ptr = s.data_ptr()
                if ptr not in self.host and (ptr not in copies or copies[ptr].expired()):
                    copies[ptr] = StorageWeakRef(s)
            count += any(not w.expired() for w in copies.values())
        return count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.backward_ops += torch._C._current_graph_task_id() != -1
        self.most = max(self.most, self.alive())
        if func not in COPIES:
            for a in tree_leaves((args, kwargs)):
                if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.host:
                    self.host_reads.append(str(func))
        out = func(*args, **(kwargs or {}))
        self.most = max(self.most, self.alive())
        return out


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("which", NETWORKS)
def test_swapped_blocks_give_the_same_outputs_and_gradients_with_at_most_the_planned_blocks_resident(
        which, checkpointing, folders):
    net, batch = _network(which, folders, checkpointing)
    expected = _step(net, batch)
    units = blocks(net)
    assert len(units) >= 2
    n = len(units) - 1 if len(units) > 2 else len(units)  # the first block kept, every other swapped (Flux's 2: both)
    plan = BlockSwap(units, n, torch.device("cpu"))
    assert plan.bound == len(units) - n + 2
    with plan:
        watch = Watch(plan)
        with watch:
            x, t, cond = batch
            x.grad = None
            net.zero_grad(set_to_none=True)
            out = net(x, t, cond) if cond is not None else net(x, t)
            after_forward = watch.alive()
            out.square().mean().backward()
        after_backward = watch.alive()
        first = (out.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None},
                 x.grad.clone())
        assert plan.resident() == units[:len(units) - n]
        again = _step(net, batch)  # and again, the plan still in place
    assert watch.ops > 0 and watch.backward_ops > 0  # the watch saw backward's ops too
    assert watch.host_reads == []  # every op ran on a device copy
    assert 1 <= watch.most <= plan.bound - plan.first  # the running block and the prefetched one, no more
    assert after_forward == 0  # autograd kept no device copy for backward (the saved-tensor hooks)
    assert after_backward == 0  # and backward dropped the last one it loaded
    assert plan.loads > plan.n  # each swapped block loaded for forward and again for backward
    assert plan.prefetches > 0
    for o, grads, xg in (first, again):
        assert torch.equal(o, expected[0])
        assert grads.keys() == expected[1].keys() and any(".lora_A." in n for n in grads)
        for name in grads:
            assert torch.equal(grads[name], expected[1][name]), name
        assert torch.equal(xg, expected[2])


def test_every_block_swapped_and_no_grad_forward(folders):
    """All blocks swapped (the first one prefetched by nobody: loaded when it runs); under no_grad (sampling)
    each block's copy is dropped after its forward, and the output is the same."""
    net, (x, t, cond) = _network("flux", folders, False)
    with torch.no_grad():
        expected = net(x, t, cond)
    units = blocks(net)
    plan = BlockSwap(units, len(units), "cpu")
    assert plan.bound == 2 and plan.first == 0
    with plan, Watch(plan) as watch, torch.no_grad():
        out = net(x, t, cond)
        assert watch.alive() == 0 and plan.resident() == []
    assert watch.host_reads == [] and 1 <= watch.most <= 2
    assert torch.equal(out, expected)


@pytest.mark.parametrize("kind", ["dora", "loha", "lokr"])
def test_every_adapter_kind(kind, folders):
    """DoRA (which reads its base weight inside peft's layer, outside the base layer's call), LoHa and LoKr."""
    net, batch = _network("flux", folders, False, kind=kind)
    expected = _step(net, batch)
    units = blocks(net)
    plan = BlockSwap(units, len(units), "cpu")
    with plan, Watch(plan) as watch:
        got = _step(net, batch)
    assert watch.host_reads == [] and 1 <= watch.most <= 2
    assert torch.equal(got[0], expected[0]) and torch.equal(got[2], expected[2])
    assert got[1].keys() == expected[1].keys()
    for name in expected[1]:
        assert torch.equal(got[1][name], expected[1][name]), name


@pytest.mark.parametrize("which", ["unet", "flux"])
def test_a_bf16_run_frozen_base_held_in_bf16_under_autocast(which, folders):
    """A bf16 LoRA run as training makes it (the frozen base held in bf16, networks/frozen_dtype.py; the step under
    autocast): the same outputs and gradients, at most the planned blocks resident."""
    from difftrain.networks.frozen_dtype import hold_frozen

    net, batch = _network(which, folders, True)
    hold_frozen(net.base, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _step(net, batch)
    units = blocks(net)
    plan = BlockSwap(units, len(units), "cpu")
    with plan, Watch(plan) as watch, torch.autocast("cpu", dtype=torch.bfloat16):
        got = _step(net, batch)
    assert watch.host_reads == [] and 1 <= watch.most <= 2 and watch.backward_ops > 0
    assert torch.equal(got[0], expected[0]) and torch.equal(got[2], expected[2])
    assert got[1].keys() == expected[1].keys()
    for name in expected[1]:
        assert torch.equal(got[1][name], expected[1][name]), name


def test_an_average_sharing_the_frozen_base_follows_the_swap(folders):
    """The EMA's copy of a LoRA network (training/ema.py: frozen base shared, adapter and buffers copied), hooked
    through ``shared_with``, runs on the device copies too and gives its output without the plan; a copy that
    does not share the base is refused in one line."""
    import copy

    from difftrain.training.ema import averaged_copy

    net, (x, t, cond) = _network("unet", folders, True)
    average, _ = averaged_copy(net)
    with torch.no_grad():
        expected = average(x, t)
    units = blocks(net)
    plan = BlockSwap(units, len(units) - 1, "cpu", shared_with=[blocks(average)])
    with plan, Watch(plan) as watch:
        _step(net, batch=(x, t, cond))
        with torch.no_grad():
            got = average(x, t)
    assert watch.host_reads == [] and 1 <= watch.most <= 2
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="^model.swap_blocks: .* is not shared by a network given as sharing"):
        BlockSwap(units, 2, "cpu", shared_with=[blocks(copy.deepcopy(net))])


def test_planned_bytes_on_the_meta_device():
    """What estimate counts: the blocks' frozen bytes on the device (the kept blocks, two neighbouring swapped
    ones at most) and on the host, from shapes alone (a meta network)."""
    cfg = load_config(None, TINY_OVERRIDES)
    with torch.device("meta"):
        net = build_model(cfg)
    units = blocks(net.requires_grad_(False))
    sizes = [sum(t.numel() * t.element_size() for t in [*b.parameters(), *b.buffers()]) for b in units]
    assert planned_bytes(units, 0) == (sum(sizes), 0)
    n = len(units) - 2
    pairs = max(a + b for a, b in itertools.pairwise(sizes[2:]))
    assert planned_bytes(units, n) == (sizes[0] + sizes[1] + pairs, sum(sizes[2:]))
    assert planned_bytes(units, 1) == (sum(sizes), sizes[-1])


def test_removing_the_plan_restores_the_network_exactly(folders):
    net, batch = _network("sdxl", folders, True)
    tensors = lambda: dict([*net.named_parameters(), *net.named_buffers()])
    before = {n: (t, t.detach().clone(), t.device, t.untyped_storage().data_ptr()) for n, t in tensors().items()}
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in net.modules())
    units = blocks(net)
    plan = BlockSwap(units, 3, "cpu").install()
    moved = {id(t) for b in plan.swapped for _, _, t in frozen_tensors(b)}
    assert moved and all(t.untyped_storage().data_ptr() != before[n][3] for n, t in tensors().items() if id(t) in moved)
    _step(net, batch)
    plan.remove()
    after = tensors()
    assert after.keys() == before.keys()
    for name, (t, value, device, _) in before.items():
        assert after[name] is t, name  # the same Parameter / buffer object
        assert t.device == device and t.dtype == value.dtype and torch.equal(t, value), name  # never stepped
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in net.modules()) == hooks  # none left


def test_more_blocks_than_the_network_has_is_refused_in_one_line(folders):
    net, _ = _network("unet", folders, False)
    units = blocks(net)
    with pytest.raises(ValueError) as err:
        BlockSwap(units, len(units) + 1, "cpu")
    assert str(err.value) == (f"model.swap_blocks = {len(units) + 1} is outside 0..{len(units)}: "
                              f"this network has {len(units)} blocks to swap")
    with pytest.raises(ValueError, match="model.swap_blocks must be a whole number"):
        BlockSwap(units, -1, "cpu")
    assert BlockSwap(units, 0, "cpu").install().resident() == units  # 0: nothing swapped, a no-op


@pytest.mark.parametrize("kind, library", [("int8", "bitsandbytes"), ("fp8", "torchao")])
def test_a_quantized_base_is_refused_in_one_line(folders, kind, library):
    """bitsandbytes' and torchao's weights keep their scales beside (or inside) the data a swap would copy."""
    pytest.importorskip(library)
    net, _ = _network("flux", folders, False, quantize=kind)
    with pytest.raises(ValueError) as err:
        BlockSwap(blocks(net), 1, "cpu")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"model.swap_blocks does not combine with model.quantize_base = {kind}")


@pytest.mark.gpu
def test_side_stream_prefetch_on_cuda(folders):
    """On CUDA the next block is copied on a side stream while the one before it runs; the output is the one
    without the plan (the same kernels on the same values), the gradients too up to the order CUDA's attention
    backward adds in (it may use atomics: two runs without the plan can differ in the last bits), and at most the
    planned blocks are resident."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    net, batch = _network("flux", folders, False, device="cuda")
    expected = _step(net, batch)
    units = blocks(net)
    plan = BlockSwap(units, len(units), "cuda")
    with plan:
        held = [t for b in plan.swapped for _, _, t in frozen_tensors(b)]
        assert held and all(t.device.type == "cpu" and t.is_pinned() for t in held)  # between steps: on the host
        with Watch(plan) as watch:
            got = _step(net, batch)
        torch.cuda.synchronize()
    assert plan.prefetches > 0
    assert watch.host_reads == [] and 1 <= watch.most <= 2
    assert torch.equal(got[0], expected[0])
    assert got[1].keys() == expected[1].keys()
    for name in expected[1]:
        torch.testing.assert_close(got[1][name], expected[1][name], rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(got[2], expected[2], rtol=1e-5, atol=1e-6)


def test_digest_and_state_dict_read_the_right_values_under_the_plan(folders):
    """Between steps (and after one) a swapped tensor's ``.data`` is its host copy, so what reads the network
    outside the step (the base's digest, ``networks/lora.base_digest``; a state dict, what a checkpoint writes)
    finds the values it had before the plan; ``swap_base`` (the training loop's) is None for 0 blocks."""
    from difftrain.networks.block_swap import swap_base
    from difftrain.networks.lora import base_digest

    net, batch = _network("flux", folders, False)
    digest, values = base_digest(net.base), {k: v.clone() for k, v in net.base.state_dict().items()}
    assert swap_base(net, 0, "cpu") is None
    plan = swap_base(net, len(blocks(net)), "cpu")
    _step(net, batch)
    assert plan.resident() == [] and base_digest(net.base) == digest
    after = net.base.state_dict()
    assert all(torch.equal(after[k], v) for k, v in values.items())
    plan.remove()
