"""The step never waits for the device: nothing in difftrain's step reads a tensor's values back
to the host (on the CPU, by tensor methods that would sync on CUDA, patched to raise; on CUDA,
torch's sync debug mode)."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

from conftest import TINY_OVERRIDES
from difftrain.conditioning import Conditioning
from difftrain.config import load_config
from difftrain.diffusion.objective import build_objective
from difftrain.runtime.distributed import DistContext
from difftrain.training.state import RunState
from difftrain.training.step import StepMetrics, train_step

# Tensor methods that copy a tensor's values to the host: on CUDA each one waits for the device.
HOST_READS = ("tolist", "item", "cpu", "numpy", "__array__", "__bool__", "__float__", "__int__", "__index__",
              "__format__")


class HostRead(AssertionError):
    """A tensor's values were read back to the host inside the step."""


@contextlib.contextmanager
def no_host_reads():
    """Make every :data:`HOST_READS` method raise :class:`HostRead`, whoever calls it (difftrain,
    torch's optimizer and loss scaler, the tokenizer); restored on exit. On the CPU every tensor is
    a host tensor, so this is stricter than CUDA: a read of a tensor that lives on the host there
    would be caught too (the step makes none)."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def guard(name):
        def method(self, *args, **kwargs):
            caller = sys._getframe(1)
            raise HostRead(f"{caller.f_globals.get('__name__')}:{caller.f_lineno} read a tensor back to the host "
                           f"with Tensor.{name} inside the step")

        return method

    try:
        for name in saved:
            setattr(torch.Tensor, name, guard(name))
        yield
    finally:
        for name, real in saved.items():
            setattr(torch.Tensor, name, real)


def test_the_guard_catches_each_host_read_and_restores_the_methods():
    drop = torch.tensor([True, False])
    with no_host_reads():
        for read in (drop.tolist, drop[0].item, drop.cpu, drop.numpy, lambda: bool(drop[0]), lambda: float(drop[0]),
                     lambda: [0, 1][drop[0]], lambda: f"{drop[0]}", lambda: [c for c, d in zip("ab", drop) if d]):
            with pytest.raises(HostRead, match="read a tensor back to the host"):
                read()
    assert drop.tolist() == [True, False] and bool(drop[0])


TEXT = ["data.captions=true", "model.text_encoder=builtin:tiny-clip"]


@pytest.mark.parametrize("overrides", [TEXT, ["train.grad_accum_steps=2"]], ids=["text", "labels"])
def test_the_step_reads_nothing_back_from_the_device(overrides):
    """Text and class-conditional steps with condition dropout (half the rows), two steps each,
    under :func:`no_host_reads`: before the fix the caption dropout's ``drop.tolist()`` raised."""
    cfg = load_config(None, TINY_OVERRIDES + ["train.batch_size=4", "model.class_dropout=0.5"] + overrides)
    device = torch.device("cpu")
    text = "model.text_encoder=builtin:tiny-clip" in overrides
    conditioning = Conditioning.from_config(cfg, 0 if text else 3, device)
    state = RunState.build(cfg, 0 if text else 3, device, conditioning=conditioning)
    objective = build_objective(cfg.diffusion)
    x0 = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    second = ["a red square", "a blue disc", "a green triangle", "a small circle"] if text else torch.tensor([0, 1, 2, 0])
    batches, metrics = iter([(x0, second)] * 4), StepMetrics(device)
    with no_host_reads():
        for _ in range(2):
            train_step(state, objective, batches, 1e-3, metrics)
    assert state.step == 2 and metrics.read(DistContext())["skipped"] == 0


def test_caption_dropout_encodes_the_empty_caption_on_the_dropped_rows():
    """The dropped rows' embeddings are the empty caption's, the others their caption's, bit for
    bit as when the dropped captions are encoded as "" in the batch."""
    cfg = load_config(None, TINY_OVERRIDES + TEXT)
    c = Conditioning.from_config(cfg, 0)
    captions = ["a red square", "a blue disc", "a green triangle"]
    drop = torch.tensor([False, True, False])
    got = c.condition(captions, drop, torch.device("cpu"))
    assert torch.equal(got, c.text.encode(["a red square", "", "a green triangle"]))
    assert torch.equal(c.condition(captions, None, torch.device("cpu")), c.text.encode(captions))


@pytest.mark.gpu
def test_the_step_never_synchronises_with_the_gpu():
    """torch's sync debug mode set to "error" around CUDA steps (text and labels, accumulation,
    dropout) after one warm-up step (which makes the per-device caches): any wait for the
    device inside the step raises."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    for overrides in (TEXT, ["train.grad_accum_steps=2"]):
        cfg = load_config(None, TINY_OVERRIDES + ["train.batch_size=4", "model.class_dropout=0.5",
                                                  "train.compile=off"] + overrides)
        text = bool(cfg.model.text_encoder)
        conditioning = Conditioning.from_config(cfg, 0 if text else 3, device)
        state = RunState.build(cfg, 0 if text else 3, device, conditioning=conditioning)
        objective = build_objective(cfg.diffusion).to(device)
        x0 = (torch.rand(4, 3, 16, 16) * 2 - 1).pin_memory()
        second = ["a red square", "a blue disc", "a green triangle", "a small circle"] if text else \
            torch.tensor([0, 1, 2, 0]).pin_memory()
        batches, metrics = iter([(x0, second)] * 8), StepMetrics(device)
        train_step(state, objective, batches, 1e-3, metrics)  # warm-up: per-device caches are made once
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):
                train_step(state, objective, batches, 1e-3, metrics)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert state.step == 3 and metrics.read(DistContext(device=device))["skipped"] == 0
