"""FSDP with no whole copy on 2 gloo CPU processes: a one-process checkpoint (a file) resumes
sharded on 2 ranks, train.fsdp_offload trains as without it, and a rank's peak memory during
start-up, steps, validation, a sharded checkpoint and a resume stays under the whole training state.
(The equality of a sharded start with an ordinary build, and a 2-rank -> 2-rank and 2 -> 1 resume:
tests/integration/test_fsdp.py; the replayed initialisation: tests/unit/test_meta_init.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import TINY_OVERRIDES
from multiproc import assert_close_dicts, reset_peak, run_ranks, status_bytes, train_on_rank

from difftrain.config import ConfigError, load_config
from difftrain.checkpoints import checkpoint as ckpt
from difftrain.training.loop import train

RUN = TINY_OVERRIDES + ["train.total_steps=4", "train.device=cpu", "train.batch_size=2", "train.channels_last=off",
                        "validation.every_steps=0", "tracking.tensorboard=false", "ema.posthoc_std=[0.1]",
                        "train.parallel=fsdp"]


@pytest.mark.slow  # about 60 s on a busy 2-core machine: two one-process runs and a 2-rank one
def test_a_one_process_checkpoint_resumes_sharded_on_two_ranks(tmp_path):
    """2 steps in one process (a checkpoint file), 2 more sharded on 2 ranks (each keeps its part
    of each whole tensor, the optimizer's moments too): the one-process run to float rounding."""
    one = load_config(None, [*RUN, "train.batch_size=4"])  # the same global batch
    train(one, tmp_path / "straight")
    train(one, tmp_path / "resumed", stop_at_step=2)
    assert ckpt.find_checkpoint(tmp_path / "resumed").name == "step_00000002.pt"
    run_ranks(train_on_rank, 2, str(tmp_path / "resumed"), RUN, None)
    straight, resumed = ckpt.load_checkpoint(tmp_path / "straight"), ckpt.load_checkpoint(tmp_path / "resumed")
    assert resumed["path"].endswith("step_00000004.dcp") and resumed["step"] == 4
    assert_close_dicts(straight["model"], resumed["model"])
    assert_close_dicts(straight["ema"]["model"], resumed["ema"]["model"])
    assert_close_dicts(straight["posthoc_ema"]["models"][0], resumed["posthoc_ema"]["models"][0])


def _offload_steps(ctx) -> dict:
    """Two optimizer steps of a state built sharded, with and without train.fsdp_offload."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from difftrain.runtime import fsdp
    from difftrain.training.state import RunState

    out = {}
    for offload in (True, False):
        cfg = load_config(None, [*RUN, f"train.fsdp_offload={str(offload).lower()}"])
        state = RunState.build(cfg, 0, ctx.device, dctx=ctx)
        net = state.parallelize(ctx)
        x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(ctx.rank))
        for _ in range(2):
            net(x, torch.full((4,), 10)).square().mean().backward()
            state.precision.step(state.optimizer, net.parameters(), 1.0, torch.tensor(1.0))
            state.optimizer.zero_grad(set_to_none=True)
            state.ema.update(state.model)
        whole, ema = state.gathered_models()
        out[offload] = {"policy": isinstance(fsdp.offload_policy(offload, ctx.device), CPUOffloadPolicy),
                        "model": whole.state_dict(), "ema": ema.state_dict()}
    return out


def test_fsdp_offload_trains_as_without_it_and_needs_fsdp():
    rank0 = run_ranks(_offload_steps, 2)[0]
    with_offload, without = rank0[True], rank0[False]
    assert with_offload["policy"] and not without["policy"]
    assert_close_dicts(with_offload["model"], without["model"], rtol=0, atol=0)
    assert_close_dicts(with_offload["ema"], without["ema"], rtol=0, atol=0)
    with pytest.raises(ConfigError, match=r"^train\.fsdp_offload=true needs train\.parallel='fsdp'"):
        load_config(None, TINY_OVERRIDES + ["train.fsdp_offload=true"])


def _start_and_resume(ctx, run_dir: str, overrides: list[str]) -> dict:
    """A rank's peak RSS above its start while it builds the sharded state (and takes one step),
    then, that state gone, while it builds it again from the sharded checkpoint it wrote."""
    import ctypes
    import gc

    from difftrain.checkpoints import sharded as sharded
    from difftrain.training.state import RunState, load_resume

    cfg = load_config(None, overrides)
    start = reset_peak()
    state = RunState.build(cfg, 0, ctx.device, dctx=ctx)
    net = state.parallelize(ctx)
    built = status_bytes("VmHWM") - start
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(ctx.rank))
    net(x, torch.full((2,), 10)).square().mean().backward()
    state.precision.step(state.optimizer, net.parameters(), 1.0, torch.tensor(1.0))
    state.optimizer.zero_grad(set_to_none=True)
    state.step, state.position = 1, 4
    c = cfg.checkpoint
    sharded.save_or_report(state, state.state_dict(), Path(run_dir) / "checkpoints", 1, c.keep_last,
                           c.keep_every_steps, "stop", ctx)
    del state, net
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # give the freed memory back, so that the resume's peak counts anew
    start = reset_peak()
    saved = load_resume(Path(run_dir), cfg, ctx)
    state = RunState.build(cfg, 0, ctx.device, init_weights=False, network=saved["network"], dctx=ctx)
    state.load_state_dict(saved)
    return {"built": built, "resumed": status_bytes("VmHWM") - start, "step": state.step,
            "lazy": "shards" in saved and "model" not in saved}


def test_a_ranks_start_up_and_resume_hold_no_whole_copy(tmp_path):
    """difftrain's tiny UNet at 192 channels (27.6M parameters; its whole fp32 training state --
    weights, gradients, AdamW's moments, EMA, one post-hoc EMA -- 24 bytes per parameter, 633 MiB) on
    2 ranks. Building the sharded state holds each rank's shards of the weights, EMA and post-hoc EMA
    (6 bytes per parameter) and one whole tensor at a time; a resume, its part of each tensor of the
    sharded checkpoint and AdamW's moments (10 bytes per parameter, plus DCP's read buffers). The
    start-up stays under half the whole state and the resume under the whole state (measured on a
    2-core CPU: 204 and 324 MiB per rank; the whole-then-shard start-up and consolidated resume
    this replaced: 514 and 1161 MiB)."""
    from difftrain.networks.conditioning import Conditioning
    from difftrain.tools.parallel_memory import counted_memory
    from difftrain.networks.build import build_network

    overrides = [*RUN, "model.base_channels=192"]
    cfg = load_config(None, overrides)
    with torch.device("meta"):
        model = build_network(cfg, Conditioning(0, channels=3, resolution=16))
    whole = counted_memory(model, cfg, "ddp", 1)
    whole_state = whole.total - whole.transient
    for r in run_ranks(_start_and_resume, 2, str(tmp_path), overrides):
        assert r["step"] == 1 and r["lazy"]  # resumed from the shards, not a consolidated copy
        assert r["built"] < whole_state / 2, (r, whole_state)
        assert r["resumed"] < whole_state, (r, whole_state)
