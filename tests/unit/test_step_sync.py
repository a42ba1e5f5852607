"""The step never waits for the device: nothing in difftrain's step reads a tensor's values back
to the host, nor copies host values to the device with a blocking copy (on the CPU, by tensor methods
that would sync on CUDA, patched to raise; on CUDA, torch's sync debug mode), for difftrain's UNet and
for the base families (SDXL's time_ids and both SDXL's and SD's token ids)."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

from conftest import TINY_OVERRIDES
from difftrain.networks.conditioning import Conditioning
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


class BlockingCopy(AssertionError):
    """A tensor was made on or copied to a device in a way that waits for it inside the step."""


def _names_device(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to`` call names a device (``to(device, ...)``, ``to(device=...)``, ``to(other)``)."""
    first = args[0] if args else None
    return kwargs.get("device") is not None or isinstance(first, (str, torch.device, torch.Tensor))


@contextlib.contextmanager
def no_blocking_copies():
    """Make difftrain's own ``torch.tensor(..., device=...)`` and ``Tensor.to(device)`` without
    ``non_blocking=True`` raise :class:`BlockingCopy`: on CUDA each copies host values to the device and
    waits (from pageable memory the copy synchronises the stream). On the CPU every tensor is a host
    tensor, so a copy difftrain would make of a tensor already on the device is caught too (it makes none);
    torch's and the libraries' own calls, which move tensors that are already on the device, are not
    guarded. Enter it after a first step, which makes the per-device caches."""
    real_to, real_tensor = torch.Tensor.to, torch.tensor

    def ours() -> bool:
        return str(sys._getframe(2).f_globals.get("__name__", "")).startswith("difftrain")

    def raise_from(what: str):
        caller = sys._getframe(2)
        raise BlockingCopy(f"{caller.f_globals.get('__name__')}:{caller.f_lineno} {what} inside the step")

    def to(self, *args, **kwargs):
        if _names_device(args, kwargs) and not kwargs.get("non_blocking", False) and ours():
            raise_from("copied a tensor to a device with a blocking Tensor.to")
        return real_to(self, *args, **kwargs)

    def tensor(data, *args, **kwargs):
        if kwargs.get("device") is not None and ours():
            raise_from("made a tensor on a device with torch.tensor(..., device=)")
        return real_tensor(data, *args, **kwargs)

    try:
        torch.Tensor.to, torch.tensor = to, tensor
        yield
    finally:
        torch.Tensor.to, torch.tensor = real_to, real_tensor


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
        train_step(state, objective, batches, 1e-3, metrics)  # the first makes the per-device caches
        with no_blocking_copies():
            train_step(state, objective, batches, 1e-3, metrics)
    assert state.step == 2 and metrics.read(DistContext())["skipped"] == 0


@pytest.fixture(scope="module")
def family_bases(tmp_path_factory):
    """Tiny SDXL and SD bases (tests/family_bases.py, tests/text_components.py)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from tests.family_bases import write_tiny_sdxl_folder
    from tests.text_components import write_tiny_sd_folder

    root = tmp_path_factory.mktemp("bases")
    return {"sdxl": write_tiny_sdxl_folder(root / "sdxl"), "sd": write_tiny_sd_folder(root / "sd")}


def family_run(base, device: torch.device):
    """(state, objective, batches) of a base family's full fine-tune with caption dropout: its own prompt
    encoder (no text cache), latent moments and, as every dataset gives them, each image's geometry."""
    cfg = load_config(None, [f"model.init_from={base}", "data.resolution=16", "data.num_workers=0",
                             "train.batch_size=4", "model.class_dropout=0.5", "train.compile=off"])
    conditioning = Conditioning.from_config(cfg, 0, device)
    state = RunState.build(cfg, 0, device, conditioning=conditioning)
    channels, side = conditioning.network_shape()
    moments = torch.rand(4, 2 * channels, side, side, generator=torch.Generator().manual_seed(0))
    geometry = torch.tensor([[32, 16, 0, 0], [16, 40, 0, 12], [16, 16, 0, 0], [24, 16, 4, 0]])
    captions = ["a red square", "a blue disc", "a green triangle", "a small circle"]
    if device.type == "cuda":
        moments, geometry = moments.pin_memory(), geometry.pin_memory()  # as the loader pins them
    return state, build_objective(cfg.diffusion).to(device), iter([(moments, captions, geometry)] * 8)


@pytest.mark.parametrize("family", ["sdxl", "sd"])
def test_a_base_familys_step_reads_nothing_back_and_copies_without_waiting(family_bases, family):
    """A base family's step (its prompt encoder's token ids, SDXL's time_ids from the batch's geometry)
    under :func:`no_host_reads` and, after a first step, :func:`no_blocking_copies`: before the fix SDXL's
    time_ids were made with ``torch.tensor(..., device=)`` and the token ids copied with a blocking ``.to``."""
    device = torch.device("cpu")
    state, objective, batches = family_run(family_bases[family], device)
    metrics = StepMetrics(device)
    with no_host_reads():
        train_step(state, objective, batches, 1e-3, metrics)  # the first makes the per-device caches
        with no_blocking_copies():
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
        _three_steps_the_last_two_in_sync_error_mode(state, objective, iter([(x0, second)] * 8), device)


def _three_steps_the_last_two_in_sync_error_mode(state, objective, batches, device) -> None:
    """One warm-up CUDA step (per-device caches are made once), then two with torch's sync debug
    mode set to "error": any wait for the device raises."""
    metrics = StepMetrics(device)
    train_step(state, objective, batches, 1e-3, metrics)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            train_step(state, objective, batches, 1e-3, metrics)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert state.step == 3 and metrics.read(DistContext(device=device))["skipped"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sdxl", "sd"])
def test_a_base_familys_step_never_synchronises_with_the_gpu(family_bases, family):
    """torch's sync debug mode set to "error" around two CUDA steps of a base family (after one warm-up
    step): its token ids and SDXL's time_ids reach the device without a wait."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    state, objective, batches = family_run(family_bases[family], device)
    _three_steps_the_last_two_in_sync_error_mode(state, objective, batches, device)
