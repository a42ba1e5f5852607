"""The speed switches change how a step runs, not what it computes."""

from __future__ import annotations

import pytest
import torch

from difftrain.config import load_config
from difftrain.checkpoints import checkpoint as ckpt
from difftrain.training.loop import train
from difftrain.runtime.device import resolve_toggle


def _final_weights(run_dir) -> dict[str, torch.Tensor]:
    return ckpt.load_checkpoint(run_dir)["model"]


def _trains_the_same(tmp_path, overrides, switches, atol):
    off = ["train.channels_last=off", "train.compile=off"]
    plain = load_config(None, overrides + ["train.total_steps=3", "validation.every_steps=0", *off])
    fast = load_config(None, overrides + ["train.total_steps=3", "validation.every_steps=0", *off, *switches])
    train(plain, tmp_path / "plain")
    train(fast, tmp_path / "fast")
    a, b = _final_weights(tmp_path / "plain"), _final_weights(tmp_path / "fast")
    assert a.keys() == b.keys()  # saved unwrapped: no _orig_mod. prefixes
    for k in a:
        torch.testing.assert_close(a[k].contiguous(), b[k].contiguous(), rtol=1e-4, atol=atol, msg=k)


def test_channels_last_trains_the_same(tmp_path, tiny_overrides):
    # Without dropout: nn.Dropout draws its mask in memory order, so with channels_last on a CPU
    # the same seed drops other units (the weights then differ by about 3e-3 here).
    _trains_the_same(tmp_path, tiny_overrides + ["model.dropout=0"], ["train.channels_last=on"], atol=1e-5)


def test_auto_turns_channels_last_on_for_the_cpu_only_and_compile_for_cuda_only():
    # On an H100 the plain layout measured faster (docs/benchmarks.md), so auto keeps channels_last to the CPU.
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_toggle("auto", cpu, "channels_last") and not resolve_toggle("auto", cuda, "channels_last")
    assert not resolve_toggle("auto", cpu, "compile") and resolve_toggle("auto", cuda, "compile")
    assert not resolve_toggle("off", cuda, "compile") and resolve_toggle("on", cpu, "compile")


@pytest.mark.slow  # compiling takes a minute or more on a CPU
def test_compile_trains_the_same(tmp_path, tiny_overrides):
    _trains_the_same(tmp_path, tiny_overrides, ["train.compile=on"], atol=1e-5)


def test_weight_digest_ignores_the_memory_format():
    # 1x1 convolution weights in channels_last count as contiguous but keep odd strides.
    for shape in [(8, 4, 1, 1), (8, 4, 3, 3)]:
        w = torch.randn(shape)
        cl = w.to(memory_format=torch.channels_last)
        assert ckpt.state_dict_sha256({"w": w}) == ckpt.state_dict_sha256({"w": cl})
