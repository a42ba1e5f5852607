"""Sharded checkpoints of an FSDP run: a folder ``checkpoints/step_XXXXXXXX.dcp/`` that every rank
writes its shards into at once through ``torch.distributed.checkpoint`` (DCP); readable on any
world size, and in one process without a process group.

    step_XXXXXXXX.dcp/
        .metadata, __0_0.distcp, __1_0.distcp, ...   DCP: weights, EMA weights, AdamW's moments, post-hoc EMAs
        run_state.pt    the rest (step, data position, RNG, config, scaler, optimizer settings...)

The DCP part holds tensors only (AdamW's state keyed by parameter name, so that it reshards);
``run_state.pt`` is written by rank 0 with ``torch.save`` and read with ``weights_only=True``.
DCP's own ``.metadata`` is a pickle, as in every DCP checkpoint: it is read through
``training/dcp_reader.py`` (an allow-list unpickler, then checked against the shard files), so
loading a sharded checkpoint never runs code either.

Atomic like a single-file checkpoint (``training/checkpoint.py``): the ranks write into
``.step_XXXXXXXX.dcp.tmp/`` (DCP fsyncs each file); rank 0 then writes ``run_state.pt``,
fsyncs the folder, renames it to its final name, fsyncs ``checkpoints/``, and only then moves
``latest``. A kill at any moment leaves the previous checkpoint and pointer as they were; the
next save removes the unfinished folder.

:func:`load_consolidated` reads a whole checkpoint as whole tensors, in the keys of a single-file
checkpoint plus ``layout = "sharded"`` (the optimizer's state is keyed by parameter name):
training resumes from it on any world size (``RunState.load_state_dict``, then
``RunState.parallelize`` shards it), and ``export``, ``sample`` and ``evaluate`` read it through
``load_checkpoint`` like a file.
"""

from __future__ import annotations

import os
import shutil
from functools import partial
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.tensor import DTensor

from difftrain.runtime import distributed
from difftrain.runtime.distributed import DistContext
from difftrain.runtime.files import atomic_write, fsync_dir
from difftrain.training import checkpoint as ckpt
from difftrain.training.dcp_reader import SafeReader

SUFFIX = ".dcp"
RUN_STATE = "run_state.pt"


def sharded_name(step: int) -> str:
    return f"step_{step:08d}{SUFFIX}"


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a finished sharded checkpoint folder."""
    return path.name.endswith(SUFFIX) and (path / RUN_STATE).is_file()


def save_or_report(state, snapshot: dict, ckpt_dir: Path, step: int, keep_last: int, keep_every_steps: int,
                   on_write_error: str, dctx: DistContext, best: float | None = None) -> Path | None:
    """Every rank: write the sharded checkpoint of ``step`` (``snapshot`` = ``state.state_dict()``
    of the sharded ``state``), then rank 0 points ``latest`` at it and rotates, as
    :func:`checkpoint.save_or_report` does; every rank returns its outcome (the path; None when
    ``on_write_error="continue"`` let a failure pass) or raises the same error."""
    optimizer = get_optimizer_state_dict(state.model, state.optimizer)
    tensors = {"model": snapshot["model"], "ema": snapshot["ema"]["model"], "optimizer": optimizer["state"],
               "posthoc_ema": {str(k): m for k, m in enumerate(snapshot["posthoc_ema"]["models"])}}
    _check_finite(tensors, dctx)
    tmp = ckpt_dir / f".{sharded_name(step)}.tmp"
    try:
        distributed.run_on_main(partial(_fresh_folder, tmp), dctx)
        _save_shards(tensors, tmp)
    except OSError as e:
        return ckpt.report_write_error(e, ckpt_dir, step, on_write_error, quiet=not dctx.is_main)
    rest = {k: v for k, v in snapshot.items() if k not in ("model", "optimizer", "ema", "posthoc_ema")}
    rest["ema"] = {k: v for k, v in snapshot["ema"].items() if k != "model"}
    rest["posthoc_ema"] = {k: v for k, v in snapshot["posthoc_ema"].items() if k != "models"}
    rest["optimizer_param_groups"] = optimizer["param_groups"]
    rest["world_size"] = dctx.world_size  # for the record: any world size reads it
    return distributed.run_on_main(
        lambda: ckpt.save_or_report(rest, ckpt_dir, step, keep_last, keep_every_steps, on_write_error, best,
                                    write=partial(_finish, tmp=tmp)),
        dctx,
    )


def _check_finite(tensors: dict, dctx: DistContext) -> None:
    """Raise :class:`checkpoint.NonFiniteWeights` on every rank when a shard of any rank holds NaN
    or infinity (each rank checks its own shards)."""
    local = {k: {n: t.to_local() if isinstance(t, DTensor) else t for n, t in tensors[k].items()} for k in ("model", "ema")}
    try:
        ckpt.check_finite({"model": local["model"], "ema": {"model": local["ema"]}})
        bad = None
    except ckpt.NonFiniteWeights as e:
        bad = str(e)
    if distributed.max_over_ranks(int(bad is not None), dctx):
        raise ckpt.NonFiniteWeights(f"refusing to write a checkpoint: {bad or 'a weight shard of another rank is not finite'}")


def _fresh_folder(tmp: Path) -> None:
    """An empty temporary folder (one left by a killed save is removed first)."""
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)


def _save_shards(tensors: dict, folder: Path) -> None:
    """``dcp.save`` of every rank's shards into ``folder`` (a collective). DCP gathers the ranks'
    failures into one exception on every rank; an OS error among them is raised as itself."""
    try:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder, sync_files=True))
    except CheckpointException as e:
        for failure in e.failures.values():
            error = failure[0] if isinstance(failure, tuple) else failure
            os_error = ckpt._os_error_in(error)
            if os_error is not None:
                raise os_error from None
        raise RuntimeError(f"cannot write the sharded checkpoint {folder}: {e}") from None


def _finish(rest: dict, ckpt_dir: Path, step: int, tmp: Path) -> Path:
    """Rank 0: add ``run_state.pt`` to the folder of shards and rename it to its final name, durably."""
    with atomic_write(tmp / RUN_STATE) as f:
        torch.save({"format": ckpt.FORMAT, "layout": "sharded", **rest}, f)
    fsync_dir(tmp)
    ckpt._pause_for_fault_injection()
    path = ckpt_dir / sharded_name(step)
    aside = ckpt_dir / f".{path.name}.old.tmp"
    if path.exists():  # a checkpoint of this same step, from a run resumed from an older one
        os.replace(path, aside)
    os.replace(tmp, path)
    fsync_dir(ckpt_dir)
    if aside.exists():
        shutil.rmtree(aside)
    return path


def load_consolidated(path: Path) -> dict:
    """A sharded checkpoint read whole in this process (no process group needed), in the keys of
    a single-file checkpoint: whole CPU tensors, ``optimizer`` keyed by parameter name, and
    ``layout = "sharded"``. Not yet checked against ``checkpoint.SCHEMA`` (the caller does)."""
    try:
        rest = torch.load(path / RUN_STATE, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named, in one line
        raise ckpt.CheckpointError(f"cannot load checkpoint {path / RUN_STATE}: {ckpt.load_error(e)}") from None
    if not isinstance(rest, dict) or not isinstance(rest.get("posthoc_ema"), dict):
        raise ckpt.CheckpointError(f"{path / RUN_STATE} is not a difftrain sharded checkpoint's run state")
    tensors: dict = {}  # filled with the checkpoint's own keys, as torch's format_utils.dcp_to_torch_save does
    reader = SafeReader(path)  # refuses a crafted or damaged .metadata before DCP reads anything
    try:
        _load_state_dict(tensors, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except CheckpointException as e:  # a BaseException: a shard file DCP could not read
        raise ckpt.CheckpointError(
            f"cannot read the shards of sharded checkpoint {path}: {_first_failure(e)}") from None
    if not isinstance(tensors.get("model"), dict):
        raise ckpt.CheckpointError(f"sharded checkpoint {path} holds no model weights")
    state = {k: v for k, v in rest.items() if k != "optimizer_param_groups"}
    state["model"] = tensors["model"]
    state["ema"] = {**rest.get("ema", {}), "model": tensors.get("ema")}
    state["optimizer"] = {"state": tensors.get("optimizer", {}), "param_groups": rest.get("optimizer_param_groups")}
    posthoc, averages = rest["posthoc_ema"], tensors.get("posthoc_ema", {})  # averages keyed by index, a string
    state["posthoc_ema"] = {**posthoc, "models": [averages.get(str(k)) for k in range(len(posthoc.get("stds", [])))]}
    return state


def _first_failure(e: CheckpointException) -> str:
    """The first line of the first rank's error that DCP gathered into ``e``."""
    for failure in e.failures.values():
        error = failure[0] if isinstance(failure, tuple) else failure
        text = str(error).strip()
        return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
    return str(e).strip().splitlines()[0]
