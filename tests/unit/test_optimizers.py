"""The optimizer registry: its names, exact state bytes, the schedule-free switch, bad input."""

from __future__ import annotations

import sys
import typing

import pytest
import torch

from difftrain.config import OPTIMIZER_PACKAGES, ConfigError, OptimizerName, check_environment, load_config
from difftrain.models import build_unet
from difftrain.runtime.optional import MissingDependency
from difftrain.tools.parallel_memory import optimizer_state
from difftrain.training.optimizers import (
    OPTIMIZERS, build_optimizer, measured_state_bytes, reading_weights, state_bytes,
)

CPU = torch.device("cpu")


def _cfg(tiny_overrides, name: str, *more: str):
    extra = ["optim.lr_schedule=constant"] if name == "schedulefree" else []
    return load_config(None, tiny_overrides + [f"optim.name={name}", *extra, *more])


def _stepped(cfg, steps: int = 1):
    """The tiny UNet after ``steps`` steps of ``optim.name`` on random 16x16 images."""
    torch.manual_seed(0)
    model = build_unet("tiny", resolution=16, in_channels=3, attention_resolutions=(8,))
    opt = build_optimizer(cfg.optim, model, CPU)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(2, 3, 16, 16, generator=g)
        (model(x, torch.tensor([3, 7])) - x).square().mean().backward()  # the output layer starts at 0
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def test_the_registry_is_the_configs_choices():
    assert list(OPTIMIZERS) == list(typing.get_args(OptimizerName))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_bytes_are_counted_to_the_byte(tiny_overrides, name):
    torch.manual_seed(0)
    zero = [not p.any() for p in build_unet("tiny", resolution=16, in_channels=3, attention_resolutions=(8,)).parameters()]
    model, opt = _stepped(_cfg(tiny_overrides, name))
    shapes = [p.shape for p in model.parameters()]
    # Prodigy keeps a 0-d p0 for a weight that was all zero at its first step (zero-initialised
    # output layers), 4 bytes where the count (a fine-tuned base's case) has 4 per element.
    spared = sum(4 * (p.numel() - 1) for p, z in zip(model.parameters(), zero) if z) if name == "prodigy" else 0
    assert measured_state_bytes(opt) == state_bytes(name, shapes) - spared
    # what estimate --unet-config counts on the meta device
    meta = [torch.empty(s, device="meta") for s in shapes]
    assert sum(t.numel() * t.element_size() for t in optimizer_state(meta, name, "ddp")) == state_bytes(name, shapes)


def test_adamw_is_todays_fused_adamw_bit_for_bit(tiny_overrides):
    model, _ = _stepped(_cfg(tiny_overrides, "adamw"), steps=3)
    torch.manual_seed(0)
    ref = build_unet("tiny", resolution=16, in_channels=3, attention_resolutions=(8,))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(2, 3, 16, 16, generator=g)
        (ref(x, torch.tensor([3, 7])) - x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_schedulefree_weights_read_are_its_average_and_training_goes_on_unperturbed(tiny_overrides):
    model, opt = _stepped(_cfg(tiny_overrides, "schedulefree"), steps=2)
    y = [p.detach().clone() for p in model.parameters()]
    with reading_weights(opt):
        x = [p.detach().clone() for p in model.parameters()]
        assert opt.param_groups[0]["train_mode"] is False
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), y))  # y back exactly
    assert opt.param_groups[0]["train_mode"] is True and all("y" not in s for s in opt.state.values())
    opt.eval()  # schedulefree's own x
    assert all(torch.allclose(a, b) for a, b in zip(model.parameters(), x))
    assert not all(torch.equal(a, b) for a, b in zip(x, y))


def test_reading_weights_is_a_no_op_for_the_others(tiny_overrides):
    model, opt = _stepped(_cfg(tiny_overrides, "prodigy", "optim.lr=1.0"))
    before = [p.detach().clone() for p in model.parameters()]
    with reading_weights(opt):
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


@pytest.mark.parametrize("name, package", [("adamw8bit", "bitsandbytes"), ("prodigy", "prodigyopt"),
                                           ("schedulefree", "schedulefree")])
def test_a_missing_package_names_the_extra(tiny_overrides, monkeypatch, name, package):
    monkeypatch.setitem(sys.modules, package, None)  # import fails as if not installed
    with pytest.raises(MissingDependency, match=rf"optim.name='{name}' needs the {package} package.*difftrain\[optim\]"):
        _stepped(_cfg(tiny_overrides, name))


@pytest.mark.parametrize("overrides, message", [
    (["optim.name=prodigy", "train.parallel=fsdp"], r"optim.name='prodigy' is not verified under train.parallel='fsdp'"),
    (["optim.name=adafactor", "train.cuda_graphs=on"], r"optim.name='adafactor' is not captured in a CUDA graph"),
    (["optim.name=schedulefree"], r"optim.name='schedulefree'.*optim.lr_schedule = 'constant'"),
    (["optim.name=lion"], r"optim.name"),
    (["optim.prodigy_d_coef=0"], r"optim.prodigy_d_coef must be > 0"),
])
def test_options_that_do_not_combine_are_refused(tiny_overrides, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, tiny_overrides + overrides)


@pytest.mark.parametrize("name", sorted(OPTIMIZER_PACKAGES))
def test_a_missing_package_is_found_before_the_run_starts(tiny_overrides, monkeypatch, name):
    import importlib.util

    package = OPTIMIZER_PACKAGES[name]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == package else find_spec(n, *a))
    with pytest.raises(ConfigError, match=rf"optim.name='{name}' needs the {package} package.*difftrain\[optim\]"):
        check_environment(_cfg(tiny_overrides, name))


def test_an_optimizer_the_device_cannot_run_is_one_line(tiny_overrides):
    # bitsandbytes has no 8-bit optimizer kernels for MPS: refused before anything is built there
    model = build_unet("tiny", resolution=16, in_channels=3, attention_resolutions=(8,))
    with pytest.raises(ValueError, match=r"^optim.name='adamw8bit' runs on cpu, cuda, xpu, not on mps: use "
                                         r"optim.name='adamw' \(or another\) there, or train.device one of those$"):
        build_optimizer(_cfg(tiny_overrides, "adamw8bit").optim, model, torch.device("mps"))
    assert all(OPTIMIZERS[n].devices is None for n in OPTIMIZERS if n != "adamw8bit")  # torch ops: any device


def test_the_config_knows_each_optimizers_package():
    assert {n for n, spec in OPTIMIZERS.items() if spec.extra} == set(OPTIMIZER_PACKAGES)


def test_the_cli_says_one_line_and_exits_2_for_a_missing_package(tiny_overrides, monkeypatch, tmp_path, capsys):
    import importlib.util

    from difftrain.cli import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "prodigyopt" else find_spec(n, *a))
    sets = [x for o in tiny_overrides + ["optim.name=prodigy"] for x in ("--set", o)]
    assert main(["train", "--run-dir", str(tmp_path / "run"), *sets]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'difftrain[optim]'" in err[0]


@pytest.mark.parametrize("name", ["adamw8bit", "adafactor"])
def test_estimate_prints_the_configured_optimizers_state(tiny_overrides, name):
    from difftrain.tools.estimate import MiB, estimate, format_estimate

    from difftrain.tools.common import build_setup

    cfg = _cfg(tiny_overrides, name)
    r = estimate(cfg, batch_size=2)
    model = build_setup(cfg, need_data=False).model  # the run's network, as estimate builds it
    assert round(r["optimizer_mib"] * MiB) == state_bytes(name, [p.shape for p in model.parameters()])
    assert {"adamw8bit": "8-bit AdamW", "adafactor": "Adafactor"}[name] in format_estimate(r)
