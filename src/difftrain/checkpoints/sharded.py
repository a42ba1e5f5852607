"""Sharded checkpoints of an FSDP run: a folder ``checkpoints/step_XXXXXXXX.dcp/`` that every rank
writes its shards into at once through ``torch.distributed.checkpoint`` (DCP); readable on any
world size, and in one process without a process group.

    step_XXXXXXXX.dcp/
        .metadata, __0_0.distcp, __1_0.distcp, ...   DCP: weights, EMA weights, AdamW's moments, post-hoc EMAs
        run_state.pt    the rest (step, data position, RNG, config, scaler, optimizer settings...)

The DCP part holds tensors only (AdamW's state keyed by parameter name, so that it reshards);
``run_state.pt`` is written by rank 0 with ``torch.save`` and read with ``weights_only=True``.
DCP's own ``.metadata`` is a pickle, as in every DCP checkpoint: it is read through
``checkpoints/dcp_reader.py`` (an allow-list unpickler, then checked against the shard files), so
loading a sharded checkpoint never runs code either.

Atomic like a single-file checkpoint (``checkpoints/checkpoint.py``): the ranks write into
``.step_XXXXXXXX.dcp.tmp/`` (DCP fsyncs each file); rank 0 then writes ``run_state.pt``,
fsyncs the folder, renames it to its final name, fsyncs ``checkpoints/``, and only then moves
``latest``. A kill at any moment leaves the previous checkpoint and pointer as they were; the
next save removes the unfinished folder.

Reading back, through torch's public ``torch.distributed.checkpoint.load`` and
``checkpoints/dcp_reader.py``'s ``SafeReader`` (never a plain unpickling of ``.metadata``; an entry DCP
would unpickle, a bytes one, is refused from the metadata, and ``dcp_reader.load``'s planner refuses
one again rather than read it):

* :func:`load_shards`: an FSDP run on any world size fills its own sharded state dicts (weights,
  EMA, post-hoc EMAs, optimizer state) in place, every rank reading only its part of each tensor
  (``RunState.load_shards``); :func:`read_run_state` is the rest, read first to check the resume.
* :func:`load_part`: the same for one part (``"ema"``), into a sharded model: an FSDP run whose
  ``model.init_from`` is a sharded checkpoint (``interop.defer_init_weights``); :func:`tensor_source`,
  the same part read one whole tensor at a time, for what needs whole tensors (a LoRA base, a quantized one).
* :func:`load_consolidated`: one process (no process group needed) reads the whole checkpoint as
  whole tensors, in the keys of a single-file checkpoint plus ``layout = "sharded"`` (the optimizer's
  state keyed by parameter name): ``export``, ``sample``, ``evaluate``, a resume in one process or
  under DDP read it through ``load_checkpoint`` like a file.

This module builds on ``checkpoints/store.py`` (what both checkpoint forms share) and
never imports ``checkpoints/checkpoint.py``.
"""

from __future__ import annotations

import os
import shutil
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from difftrain.runtime import distributed
from difftrain.runtime.distributed import DistContext
from difftrain.runtime.files import atomic_write, fsync_dir
from difftrain.runtime.tensor_source import TensorSource
from difftrain.checkpoints import store as store
from difftrain.checkpoints.store import RUN_STATE, CheckpointError, is_sharded_checkpoint, sharded_name  # noqa: F401
from difftrain.checkpoints import dcp_reader
from difftrain.checkpoints.dcp_reader import SafeReader

SUFFIX = store.SHARDED_SUFFIX
_TENSOR_KEYS = ("model", "optimizer", "ema", "posthoc_ema")  # what the DCP part holds


def shard_tensors(model, ema_model, posthoc_models, optimizer) -> dict:
    """The DCP part of a checkpoint, keyed as it is written and read: the live (sharded) tensors of
    the model, the EMA, each post-hoc EMA (keyed by its index, a string) and the optimizer's state
    keyed by parameter name (``get_optimizer_state_dict``; a fresh optimizer's is initialised)."""
    return {"model": model.state_dict(), "ema": ema_model.state_dict(),
            "optimizer": get_optimizer_state_dict(model, optimizer)["state"],
            "posthoc_ema": {str(k): m.state_dict() for k, m in enumerate(posthoc_models)}}


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
        return store.report_write_error(e, ckpt_dir, step, on_write_error, quiet=not dctx.is_main)
    rest = {k: v for k, v in snapshot.items() if k not in _TENSOR_KEYS}
    rest["ema"] = {k: v for k, v in snapshot["ema"].items() if k != "model"}
    rest["posthoc_ema"] = {k: v for k, v in snapshot["posthoc_ema"].items() if k != "models"}
    rest["optimizer_param_groups"] = optimizer["param_groups"]
    rest["world_size"] = dctx.world_size  # for the record: any world size reads it
    return distributed.run_on_main(
        lambda: store.save_or_report(rest, ckpt_dir, step, keep_last, keep_every_steps, on_write_error, best,
                                     write=partial(_finish, tmp=tmp)),
        dctx,
    )


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _check_finite(tensors: dict, dctx: DistContext) -> None:
    """Raise :class:`checkpoint_store.NonFiniteWeights` on every rank when a shard of any rank holds
    NaN or infinity (each rank checks its own shards)."""
    bad = _first_non_finite(tensors)
    if distributed.max_over_ranks(int(bad is not None), dctx):
        raise store.NonFiniteWeights(f"refusing to write a checkpoint: {bad or 'a weight shard of another rank is not finite'}")


def _first_non_finite(tensors: dict) -> str | None:
    """'model weight NAME is not finite' for this rank's first non-finite model or EMA shard (of those
    ``tensors`` holds); None if none."""
    local = {k: {n: _local(t) for n, t in tensors.get(k, {}).items()} for k in ("model", "ema")}
    try:
        store.check_finite({"model": local["model"], "ema": {"model": local["ema"]}})
    except store.NonFiniteWeights as e:
        return str(e)
    return None


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
            os_error = store.os_error_in(error)
            if os_error is not None:
                raise os_error from None
        raise RuntimeError(f"cannot write the sharded checkpoint {folder}: {e}") from None


def _finish(rest: dict, ckpt_dir: Path, step: int, tmp: Path) -> Path:
    """Rank 0: add ``run_state.pt`` to the folder of shards and rename it to its final name, durably."""
    with atomic_write(tmp / RUN_STATE) as f:
        torch.save({"format": store.FORMAT, "layout": "sharded", **rest}, f)
    fsync_dir(tmp)
    store.pause_for_fault_injection()
    path = ckpt_dir / sharded_name(step)
    aside = ckpt_dir / f".{path.name}.old.tmp"
    if path.exists():  # a checkpoint of this same step, from a run resumed from an older one
        os.replace(path, aside)
    os.replace(tmp, path)
    fsync_dir(ckpt_dir)
    if aside.exists():
        shutil.rmtree(aside)
    return path


def read_run_state(path: Path) -> dict:
    """The run state of the sharded checkpoint ``path`` (``run_state.pt``, ``weights_only``): every key
    of a single-file checkpoint but the tensors, which stay in the shards."""
    try:
        rest = torch.load(path / RUN_STATE, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named, in one line
        raise CheckpointError(f"cannot load checkpoint {path / RUN_STATE}: {store.load_error(e)}") from None
    if not isinstance(rest, dict) or not isinstance(rest.get("posthoc_ema"), dict) or not isinstance(rest.get("ema"), dict):
        raise CheckpointError(f"{path / RUN_STATE} is not a difftrain sharded checkpoint's run state")
    # What a resume reads of the averages besides their shards (the lazy schema leaves them to this reader).
    updates, stds = rest["ema"].get("num_updates"), rest["posthoc_ema"].get("stds")
    if isinstance(updates, bool) or not isinstance(updates, int) or updates < 0:
        raise CheckpointError(f"{path / RUN_STATE}: ema.num_updates must be a count, got {updates!r}")
    if not isinstance(stds, (list, tuple)) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                     for v in stds):
        raise CheckpointError(f"{path / RUN_STATE}: posthoc_ema.stds must be a list of numbers, got {stds!r}")
    return rest


def load_shards(path: Path, tensors: dict, dctx: DistContext) -> None:
    """Every rank: fill ``tensors`` (:func:`shard_tensors` of the run's sharded state) in place from
    the shards of ``path``, written on any world size; each rank reads only its part of each tensor
    (``torch.distributed.checkpoint.load`` through ``SafeReader``). A missing, unexpected or wrongly
    shaped tensor, an unreadable shard or a non-finite weight is one :class:`CheckpointError`."""
    _load(path, tensors, dctx)


def tensor_source(path: Path, key: str) -> TensorSource:
    """The tensors stored under ``key`` (``"ema"``: the EMA weights, what ``model.init_from`` takes of a
    checkpoint) in the sharded checkpoint ``path`` as a ``runtime.tensor_source.TensorSource``: names and
    shapes from its checked metadata (nothing else read yet), each read one whole tensor, alone, through
    ``torch.distributed.checkpoint.load`` in this process (``no_dist``), for what needs whole tensors in turn
    (a LoRA base's digest and its shards, a base quantized as it loads). :class:`CheckpointError` naming the
    file when the metadata is refused or a shard cannot be read."""
    reader = SafeReader(path)  # refuses a crafted or damaged .metadata before anything is read
    metadata = reader.read_metadata()
    paths = metadata.planner_data or {}
    specs: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        keys = tuple(str(p) for p in paths.get(fqn, (fqn,)))
        if isinstance(item, md.TensorStorageMetadata) and len(keys) == 2 and keys[0] == key:
            specs[keys[1]] = (item.size, item.properties.dtype)

    def read(_folder: Path, name: str) -> torch.Tensor:
        t = torch.empty(specs[name][0], dtype=specs[name][1])
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp_reader.load({key: {name: t}}, reader, no_dist=True)
        except CheckpointException as e:  # a BaseException: a shard file DCP could not read
            raise CheckpointError(f"cannot read the shards of sharded checkpoint {path}: {_first_failure(e)}") from None
        return t

    return TensorSource({name: (path, name) for name in specs}, {name: tuple(size) for name, (size, _) in specs.items()},
                        read)


def load_part(path: Path, key: str, tensors: dict, dctx: DistContext) -> None:
    """Every rank: fill ``tensors`` (the state dict of a sharded model, its DTensors) in place with the
    tensors stored under ``key`` of the sharded checkpoint ``path`` (``"ema"``: ``model.init_from`` of a
    sharded checkpoint), each rank reading only its part of each (``torch.distributed.checkpoint.load``
    through ``SafeReader``); the checkpoint's other tensors are not read. Failures as :func:`load_shards`."""
    _load(path, {key: tensors}, dctx)


def _load(path: Path, tensors: dict, dctx: DistContext) -> None:
    """``dcp_reader.load`` of ``tensors`` from ``path`` on every rank, failures one :class:`CheckpointError`."""
    try:
        dcp_reader.load(tensors, SafeReader(path))
    except CheckpointException as e:  # a BaseException: a shard file DCP could not read, a key it lacks
        raise CheckpointError(f"cannot read the shards of sharded checkpoint {path}: {_first_failure(e)}") from None
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"sharded checkpoint {path} does not fit this run: {store.load_error(e)}") from None
    bad = _first_non_finite(tensors)
    if distributed.max_over_ranks(int(bad is not None), dctx):
        raise CheckpointError(f"checkpoint {path}: {bad or 'a weight shard of another rank is not finite'}")


def load_consolidated(path: Path) -> dict:
    """A sharded checkpoint read whole in this process (no process group needed), in the keys of
    a single-file checkpoint: whole CPU tensors, ``optimizer`` keyed by parameter name, and
    ``layout = "sharded"``. Not yet checked against ``checkpoint.SCHEMA`` (the caller does).

    Through the public ``torch.distributed.checkpoint.load`` (``no_dist``): the state dict it fills
    is made from the checked metadata (each tensor's size and dtype, under its key path, which joins
    back to its own key); entries that are not tensors (DCP would unpickle them) are refused by the check."""
    rest = read_run_state(path)
    reader = SafeReader(path)  # refuses a crafted or damaged .metadata before DCP reads anything
    tensors = _empty_state_dict(reader.read_metadata(), path)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp_reader.load(tensors, reader, no_dist=True)
    except CheckpointException as e:  # a BaseException: a shard file DCP could not read
        raise CheckpointError(
            f"cannot read the shards of sharded checkpoint {path}: {_first_failure(e)}") from None
    if not isinstance(tensors.get("model"), dict):
        raise CheckpointError(f"sharded checkpoint {path} holds no model weights")
    state = {k: v for k, v in rest.items() if k != "optimizer_param_groups"}
    state["model"] = tensors["model"]
    state["ema"] = {**rest.get("ema", {}), "model": tensors.get("ema")}
    state["optimizer"] = {"state": tensors.get("optimizer", {}), "param_groups": rest.get("optimizer_param_groups")}
    posthoc, averages = rest["posthoc_ema"], tensors.get("posthoc_ema", {})  # averages keyed by index, a string
    state["posthoc_ema"] = {**posthoc, "models": [averages.get(str(k)) for k in range(len(posthoc.get("stds", [])))]}
    return state


def _empty_state_dict(metadata: md.Metadata, path: Path) -> dict:
    """The nested state dict a checkpoint's metadata describes, its tensors empty (on the CPU):
    DCP's flattened keys unflattened through its ``planner_data`` (the key path of each). Key paths
    that are empty, repeated or a prefix of another are a :class:`CheckpointError` naming ``path``."""
    out: dict = {}
    paths = metadata.planner_data or {}
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, md.TensorStorageMetadata):
            continue  # bytes: refused by read_metadata (DCP would unpickle them); difftrain writes none
        keys = tuple(str(p) for p in paths.get(fqn, (fqn,)))
        node = out
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                break
        if not keys or not isinstance(node, dict) or keys[-1] in node:
            raise CheckpointError(f"sharded checkpoint {path}: its metadata gives {fqn!r} the key path {list(keys)}, "
                                  "empty or clashing with another tensor's")
        node[keys[-1]] = torch.empty(item.size, dtype=item.properties.dtype)
    return out


def _first_failure(e: CheckpointException) -> str:
    """The first line of the first rank's error that DCP gathered into ``e``."""
    for failure in e.failures.values():
        error = failure[0] if isinstance(failure, tuple) else failure
        text = str(error).strip()
        return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
    return str(e).strip().splitlines()[0]
