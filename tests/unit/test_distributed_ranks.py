"""training/distributed.py on two real gloo processes: control messages."""

from __future__ import annotations

import torch

from multiproc import run_ranks

from difftrain.training import checkpoint as ckpt
from difftrain.training import distributed

# ---- Control messages --------------------------------------------------------------------------


def _control(ctx: distributed.DistContext, tmp_path) -> dict:
    out = {"max": distributed.max_over_ranks(15 if ctx.rank == 1 else 0, ctx)}  # a signal on rank 1 only
    out["shared"] = distributed.run_on_main(lambda: f"computed by rank {ctx.rank}", ctx)
    blocked = tmp_path / "a-file"  # a checkpoint folder under a file: the write fails on rank 0
    blocked.write_text("")
    save = lambda policy: ckpt.save_or_report({"step": 4}, blocked / "checkpoints", 4, 1, 0, policy)  # noqa: E731
    try:
        distributed.run_on_main(lambda: save("stop"), ctx)
    except ckpt.CheckpointWriteError as e:
        out["stop"] = str(e)
    out["continue"] = distributed.run_on_main(lambda: save("continue"), ctx)
    out["gathered"] = distributed.gather_cat(torch.arange(ctx.rank + 1) + 10 * ctx.rank, ctx)
    return out


def test_control_messages_reach_every_rank(tmp_path):
    rank0, rank1 = run_ranks(_control, 2, tmp_path)
    assert rank0["max"] == rank1["max"] == 15  # rank 0 learns of rank 1's signal
    assert rank0["shared"] == rank1["shared"] == "computed by rank 0"
    # Rank 0's failed write is every rank's error, so none of them waits for it at a barrier.
    assert rank0["stop"] == rank1["stop"] and "cannot write the checkpoint of step 4" in rank1["stop"]
    assert rank0["continue"] is None and rank1["continue"] is None
    assert rank0["gathered"].tolist() == [0, 10, 11] and rank1["gathered"] is None
