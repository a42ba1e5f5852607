"""The single-process layer of training/distributed.py, and how ranks split a global batch."""

from __future__ import annotations

import torch
from torch import nn

from difftrain.data.sampler import InfiniteSampler
from difftrain.runtime import distributed


def test_single_process_is_a_no_op(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ctx = distributed.setup(torch.device("cpu"))
    assert (ctx.rank, ctx.world_size, ctx.enabled, ctx.is_main) == (0, 1, False, True)
    model = nn.Linear(2, 2)
    assert distributed.wrap(model, ctx) is model
    x = torch.arange(6)
    assert distributed.rank_rows(x, ctx) is x
    assert distributed.gather_cat(x, ctx) is x
    assert distributed.shard(5, ctx) == slice(0, 5)


def test_rank_rows_match_the_sampler_shards():
    # Row i of rank r's batch is stream position r + i * W; rank_rows must pick the same rows
    # of a tensor drawn for the global batch, or noise would not follow its image.
    world, batch, start = 3, 4, 12
    global_keys = [k for k, _ in zip(InfiniteSampler(50, seed=1, start=start), range(world * batch))]
    drawn = torch.arange(world * batch)  # stands for noise drawn for the global batch
    for rank in range(world):
        ctx = distributed.DistContext(rank=rank, world_size=world)
        keys = [k for k, _ in zip(InfiniteSampler(50, seed=1, start=start, rank=rank, world_size=world), range(batch))]
        rows = distributed.rank_rows(drawn, ctx).tolist()
        assert keys == [global_keys[j] for j in rows]


def test_shards_cover_every_item_once():
    for n in (0, 1, 5, 64):
        for world in (1, 2, 3, 8):
            parts = [distributed.shard(n, distributed.DistContext(rank=r, world_size=world)) for r in range(world)]
            assert [i for p in parts for i in range(n)[p]] == list(range(n))


def test_a_group_fault_is_told_apart_from_an_error_of_this_rank():
    # Only errors of a collective that another rank caused end the run as a group fault.
    two = distributed.DistContext(rank=1, world_size=2)
    gone = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.7]:40344. This is ...")
    assert "process ended (its connection from 10.0.0.7 closed)" in distributed.describe_group_fault(gone, two)
    assert distributed.describe_group_fault(RuntimeError("CUDA out of memory"), two) is None
    assert distributed.describe_group_fault(ValueError("Connection closed by peer"), two) is None
    assert distributed.describe_group_fault(gone, distributed.DistContext()) is None  # one process: no group


def test_torchrun_restarts_with_a_shared_rendezvous_store_are_warned_of(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in distributed.launch_warnings()[0]
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what that setting gives the workers
    assert distributed.launch_warnings() == []
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert distributed.launch_warnings() == []


def test_rank_0_names_every_rank_that_misses_the_barrier_after_a_timeout(monkeypatch):
    def missed(group=None, timeout=None, wait_all_ranks=False):
        raise RuntimeError("[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 30000 ms")

    monkeypatch.setattr(distributed.dist, "monitored_barrier", missed)
    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 600000ms for recv operation")
    said = distributed.describe_group_fault(timeout, distributed.DistContext(rank=0, world_size=4, timeout_s=600))
    assert said == ("a collective waited train.collective_timeout_s=600 s: "
                    "ranks 1, 3 did not answer (hung: stopped, or stuck in I/O)")
    # Rank 2 sees the same timeout, but its barrier goes through rank 0: it cannot tell which.
    said = distributed.describe_group_fault(timeout, distributed.DistContext(rank=2, world_size=4, timeout_s=600))
    assert said.endswith("rank 0 did not answer, or another rank did (then rank 0's line names it)")
