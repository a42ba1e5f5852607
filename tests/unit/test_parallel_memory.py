"""Per-rank memory under DDP and FSDP (tools/parallel_memory.py): the FSDP accounting against
fully_shard's real local shards, the meta-device count of an SDXL-sized UNet, the CLI flags."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from difftrain.cli import main
from difftrain.models import build_unet
from difftrain.tools.parallel_memory import fsdp_blocks, fsdp_units, rank_memory, shard_numel

SDXL_CONFIG = Path(__file__).parents[2] / "bench" / "sdxl_unet_config.json"
SDXL_PARAMETERS = 2_567_463_684  # stabilityai/stable-diffusion-xl-base-1.0's UNet


def _local_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors by their local shards)."""
    storages = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


TINY_CONDITION_UNET = dict(  # a UNet2DConditionModel of 16x16, 3 channels, 8-wide text embeddings
    sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=8, attention_head_dim=4, norm_num_groups=8,
)


def _unet():
    return build_unet("tiny", resolution=16, in_channels=3)


def _condition_unet():
    from difftrain.families.sd import ConditionUNet

    pytest.importorskip("diffusers")
    return ConditionUNet.from_config(TINY_CONDITION_UNET)


def _one_step(model: torch.nn.Module) -> torch.optim.Optimizer:
    """One AdamW step on a batch of 2 random 16x16 images; the optimizer, its state made."""
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(2, 3, 16, 16, generator=g)
    cond = torch.randn(2, 5, 8, generator=g) if getattr(model, "context_dim", 0) else None
    model(x, torch.tensor([3, 7]), cond).square().mean().backward()
    opt.step()
    return opt


@pytest.fixture
def fake_group():
    """Rank 0 of a 3-rank process group whose collectives do nothing (torch's fake backend): the
    shapes of rank 0's shards, in one process."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=3)
    yield 3
    dist.destroy_process_group()


@pytest.mark.parametrize("build", [_condition_unet, _unet])
def test_fsdp_accounting_matches_fully_shards_local_shards(fake_group, build):
    from torch.distributed.fsdp import fully_shard

    world_size = fake_group
    torch.manual_seed(0)
    model = build()
    plain = copy.deepcopy(model)
    plain_opt = _one_step(plain)
    ema = [p.detach().clone() for p in plain.parameters()]
    expected = rank_memory(plain, [v for s in plain_opt.state.values() for v in s.values()], ema, "fsdp", world_size)

    # The shards do not depend on how parameters are grouped into units.
    for _, block in fsdp_blocks(model):
        fully_shard(block)
    fully_shard(model)
    opt = _one_step(model)
    params = list(model.parameters())
    assert _local_storage_bytes(params) == expected.params
    assert _local_storage_bytes(p.grad for p in params) == expected.grads
    # AdamW's moments are DTensors sharded as the weights; its step counts are plain 0-d tensors.
    assert _local_storage_bytes(v for s in opt.state.values() for v in s.values()) == expected.optimizer
    # A sharded EMA is a copy of the local shards.
    assert _local_storage_bytes([p.to_local().clone() for p in params]) == expected.ema


def test_fsdp_units_are_the_unets_blocks_and_the_root():
    model = _unet()
    names = [name for name, _ in fsdp_blocks(model)]
    assert names[0] == "down.0.res.0" and "mid" in names and names[-1].startswith("up.")
    assert not any(n.count(".") == 1 for n in names)  # never a whole level: it edits the list of skips
    units = dict(fsdp_units(model, 3))
    root = [p for n, p in model.named_parameters() if not n.startswith(("down.", "mid.", "up."))]
    assert units["root"] == sum(shard_numel(p, 3) * 3 for p in root)  # conv_in, embeddings, output norm and conv
    assert sum(units.values()) >= sum(p.numel() for p in model.parameters())
    names = [name for name, _ in fsdp_blocks(_condition_unet())]
    assert names[:2] == ["model.down_blocks.0.resnets.0", "model.down_blocks.0.attentions.0"]
    assert "model.mid_block.attentions.0" in names and any(".downsamplers." in n for n in names)


def test_ddp_holds_everything_on_every_rank_and_fsdp_a_padded_share():
    model = build_unet("tiny", resolution=16, in_channels=3)
    whole = rank_memory(model, [], [], "ddp", 1)
    n_bytes = 4 * sum(p.numel() for p in model.parameters())
    assert whole.params == whole.grads == n_bytes and whole.transient == 0
    assert rank_memory(model, [], [], "ddp", 8).transient == n_bytes  # the gradient buckets
    one = rank_memory(model, [], [], "fsdp", 1)
    assert one.params == n_bytes
    eight = rank_memory(model, [], [], "fsdp", 8)
    rows = sum(4 * p.numel() // p.shape[0] for p in model.parameters())
    assert n_bytes / 8 <= eight.params <= n_bytes / 8 + rows  # at most one padding row per tensor
    largest = max(fsdp_units(model, 8), key=lambda u: u[1])
    assert eight.transient == 2 * 2 * largest[1] * 4 and eight.largest_unit == largest[0]
    with pytest.raises(ValueError, match="world-size"):
        rank_memory(model, [], [], "fsdp", 0)


def test_sdxl_sized_unet_counted_on_meta_through_the_cli(capsys):
    pytest.importorskip("diffusers")
    assert main(["estimate", "--unet-config", str(SDXL_CONFIG), "--parallel", "fsdp", "--world-size", "8",
                 "--set", "train.precision=bf16", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["parameters"] == SDXL_PARAMETERS and "not measured" in r["device"]
    # fp32 weights, gradients and AdamW's two moments: ~41 GB on one rank, an eighth on each of 8.
    whole = r["params_mib"] + r["grads_mib"] + r["optimizer_mib"]
    assert whole * 2**20 == pytest.approx(16 * SDXL_PARAMETERS, rel=1e-4)
    p = r["per_rank"]
    assert (p["parallel"], p["world_size"]) == ("fsdp", 8)
    assert p["params_mib"] + p["grads_mib"] + p["optimizer_mib"] == pytest.approx(whole / 8, rel=1e-3)
    assert p["largest_unit"].endswith(".attentions.0") and 0 < p["transient_mib"] < 3 * 1024  # ten blocks, 351M


def test_estimate_parallel_flags(tiny_overrides, capsys):
    sets = [a for o in tiny_overrides for a in ("--set", o)]
    assert main(["estimate", *sets, "--batch-size", "2", "--parallel", "fsdp", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "FSDP, 2 ranks" in out and "total per rank" in out and "all-gathered" in out
    assert main(["estimate", *sets, "--batch-size", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["per_rank"]["parallel"], r["per_rank"]["world_size"]) == ("ddp", 1)
    with pytest.raises(SystemExit):
        main(["estimate", "--parallel", "zero"])
    assert main(["estimate", *sets, "--world-size", "0"]) != 0
    assert "--world-size must be >= 1" in capsys.readouterr().err
