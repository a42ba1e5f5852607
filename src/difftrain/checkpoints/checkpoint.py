"""Crash-safe checkpoints: atomic writes, a latest-pointer, rotation, safe loading.

A checkpoint is one file, ``checkpoints/step_XXXXXXXX.pt``: a dict of tensors, numbers,
strings and lists, written with ``torch.save`` and read back with ``weights_only=True``, so
loading never unpickles code. ``checkpoints/latest`` names the newest complete file. Its keys
are :data:`SCHEMA` (the run state of ``training/state.py``); every reader goes through
:func:`load_checkpoint`, which upgrades older versions and checks each key once, naming the
file and the key when one is missing or wrong.

Writes go to a temporary file in the same directory, are flushed and fsync'd, then renamed
over the final name and the directory is fsync'd; the pointer is updated the same way. Old
checkpoints are deleted only after the new one and the pointer are durable.

``checkpoints/best`` (with ``evaluation.fid_every_steps``) names the checkpoint with the lowest
FID and holds that FID on its second line; it is written the same way, after ``latest``, and
rotation never removes the file it names. ``RUN/best`` (or ``RUN:best``) names that checkpoint
wherever a checkpoint is read.

An FSDP run writes a folder, ``checkpoints/step_XXXXXXXX.dcp/``, instead of a file
(``checkpoints/sharded.py``): listed, pointed at and rotated like a file by
``checkpoints/store.py`` (what both forms share, re-exported here), and loaded here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from difftrain.runtime.files import atomic_write
from difftrain.runtime.stored_digest import DIGEST_KINDS, FLOAT32
from difftrain.checkpoints import store as store
from difftrain.checkpoints.store import (  # noqa: F401 - re-exported: checkpoint.X is the public name
    BEST, FORMAT, LATEST, OLDER_FORMATS, PAUSE_ENV, CheckpointError, CheckpointWriteError, NonFiniteWeights,
    check_finite, checkpoint_name, find_checkpoint, first_non_finite, is_better, list_checkpoints, load_error,
    read_best, report_write_error,
)
from difftrain.checkpoints.sharded import load_consolidated, read_run_state


def _save_atomic(obj: dict, path: Path) -> None:
    try:
        with atomic_write(path, before_rename=store.pause_for_fault_injection) as f:
            torch.save(obj, f)
    except BaseException as e:
        cause = store.os_error_in(e)
        if cause is not None and cause is not e:
            # torch.save's zip writer replaces a failed write (ENOSPC) with a RuntimeError of
            # its own; report the OS error underneath instead.
            raise cause from e
        raise


def _write_file(state: dict, ckpt_dir: Path, step: int) -> Path:
    path = ckpt_dir / checkpoint_name(step)
    save_checkpoint_file(state, path)
    return path


def save_checkpoint(
    state: dict, ckpt_dir: Path, step: int, keep_last: int = 3, keep_every_steps: int = 0,
    best: float | None = None,
) -> Path:
    """Write ``state`` as the file checkpoint of ``step``, point ``latest`` at it, then rotate
    (``store.save_checkpoint``, which says how)."""
    return store.save_checkpoint(state, ckpt_dir, step, keep_last, keep_every_steps, best, write=_write_file)


def save_checkpoint_file(state: dict, path: Path) -> None:
    """Write ``state`` (checked finite, with the format added) to the file ``path``, atomically:
    no pointer, no rotation (``save_checkpoint`` adds those; ``posthoc-ema`` writes one file)."""
    try:
        check_finite(state)
    except NonFiniteWeights as e:
        raise NonFiniteWeights(f"refusing to write a checkpoint: {e}") from None
    _save_atomic({"format": FORMAT, **state}, Path(path))




def save_or_report(
    state: dict, ckpt_dir: Path, step: int, keep_last: int, keep_every_steps: int, on_write_error: str,
    best: float | None = None,
) -> Path | None:
    """:func:`save_checkpoint`, turning an OS error into a report naming the path and the error.

    ``on_write_error`` "stop" raises :class:`CheckpointWriteError`; "continue" prints the report
    to stderr and returns None, so training goes on and the next interval tries again. Either
    way the partial temporary file is gone and the previous checkpoint is untouched.
    """
    try:
        return save_checkpoint(state, ckpt_dir, step, keep_last, keep_every_steps, best)
    except OSError as e:
        return report_write_error(e, ckpt_dir, step, on_write_error)


# key -> (check, what it must be): the run state as training/state.py writes it.
def _is_tensor_dict(v) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in v.items())


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


SCHEMA = {
    "step": (_is_count, "an integer >= 0"),
    "data_position": (_is_count, "an integer >= 0 (images consumed by all ranks)"),
    "skipped_steps": (_is_count, "an integer >= 0"),
    "num_classes": (_is_count, "an integer >= 0"),
    "config": (lambda v: isinstance(v, dict) and all(isinstance(s, dict) for s in v.values()), "a table of config sections"),
    "model": (lambda v: _is_tensor_dict(v) and len(v) > 0, "a non-empty dict of tensors"),
    "ema": (lambda v: isinstance(v, dict) and _is_tensor_dict(v.get("model")) and _is_count(v.get("num_updates")),
            "a dict with 'model' (tensors) and 'num_updates'"),
    "optimizer": (lambda v: isinstance(v, dict) and isinstance(v.get("state"), dict)
                  and isinstance(v.get("param_groups"), list), "an optimizer state dict"),
    "scaler": (lambda v: isinstance(v, dict), "a dict (the loss scaler's state)"),
    "rng": (lambda v: isinstance(v, dict) and isinstance(v.get("torch"), torch.Tensor), "a dict with the 'torch' RNG state"),
    "posthoc_ema": (lambda v: isinstance(v, dict) and isinstance(v.get("stds"), list)
                    and all(isinstance(s, float) for s in v["stds"]) and isinstance(v.get("models"), list)
                    and len(v["models"]) == len(v["stds"]) and all(_is_tensor_dict(m) for m in v["models"]),
                    "a dict with 'stds' (floats) and as many 'models' (tensors)"),
    "network": (lambda v: isinstance(v, dict) and isinstance(v.get("kind"), str)
                and (v["kind"] == "unet" or isinstance(v.get("config"), dict)
                     or (v["kind"] == "lora" and isinstance(v.get("base"), dict) and isinstance(v.get("lora"), dict)
                         and isinstance(v.get("base_digest"), str)
                         and v.get("base_digest_kind", FLOAT32) in DIGEST_KINDS)),
                ("a dict with 'kind' ('unet', a diffusers UNet with its 'config', or 'lora' with its 'base'"
                 f" and a 'base_digest_kind' of {', '.join(DIGEST_KINDS)} if any)")),
    "frozen": (lambda v: isinstance(v, dict) and all(
                   isinstance(r, dict) and isinstance(r.get("source"), str) and isinstance(r.get("digest"), str)
                   for r in v.values()),
               "a dict naming each frozen part's 'source' and 'digest'"),
}


_SHARD_KEYS = ("model", "ema", "optimizer", "posthoc_ema")  # what a sharded checkpoint keeps in its shards


def _upgrade(state: dict) -> dict:
    """An older checkpoint in v4's keys. v1 -> v2: ``counters.skipped_steps`` -> ``skipped_steps``;
    the unread ``images_seen``, ``lr_schedule`` and ``world_size`` dropped. v2 -> v3: no post-hoc
    EMAs (``posthoc_ema`` empty). v3 -> v4: difftrain's UNet, no frozen parts."""
    if state.get("format") == "difftrain-checkpoint-v1":
        state = dict(state)
        counters = state.pop("counters", {})
        state["skipped_steps"] = counters.get("skipped_steps") if isinstance(counters, dict) else None
        state.setdefault("data_position", state.get("images_seen"))
        state.setdefault("num_classes", 0)
        for key in ("images_seen", "lr_schedule", "world_size"):
            state.pop(key, None)
        state["format"] = "difftrain-checkpoint-v2"
    if state.get("format") == "difftrain-checkpoint-v2":
        state = dict(state)
        state.setdefault("posthoc_ema", {"stds": [], "gammas": [], "models": []})
        state["format"] = "difftrain-checkpoint-v3"
    if state.get("format") == "difftrain-checkpoint-v3":
        state = dict(state)
        state.setdefault("network", {"kind": "unet"})
        state.setdefault("frozen", {})
        state["format"] = FORMAT
    return state


def check_schema(state: dict, path: str | Path, keys=None, kind: str = "checkpoint") -> None:
    """Raise :class:`CheckpointError` naming ``path`` and the first missing or wrong key, or
    the first model or EMA weight that is not finite. ``keys``: the keys of :data:`SCHEMA` to
    check (default all), for records that share a checkpoint's fields (an adapter's, a weights
    file's: ``kind`` names them in the message)."""
    for key in SCHEMA if keys is None else keys:
        ok, what = SCHEMA[key]
        if key not in state:
            raise CheckpointError(f"{kind} {path} has no key {key!r} ({what} expected)")
        if not ok(state[key]):
            raise CheckpointError(f"{kind} {path}: key {key!r} must be {what}, got {_shown(state[key])}")
    try:
        check_finite(state)
    except NonFiniteWeights as e:
        raise CheckpointError(f"{kind} {path}: {e}") from None


def _shown(value) -> str:
    """A short value as itself (``-5``), anything else as its type's name."""
    if isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 40):
        return repr(value)
    return type(value).__name__


def load_checkpoint(path: str | Path, tensors: bool = True) -> dict:
    """Load a checkpoint on the CPU with ``weights_only=True`` (never runs pickled code), upgrade
    an older version and check it against :data:`SCHEMA`. ``state["path"]`` is the file read.
    A sharded checkpoint's folder is read by ``sharded.load_consolidated`` (its DCP
    metadata through ``checkpoints/dcp_reader.py``); with ``tensors=False``, only its run state
    (``sharded.read_run_state``), every key but the tensors checked, and
    ``state["shards"]``, the folder, for an FSDP run to read its part of (a file is read whole
    either way). Every failure is one :class:`CheckpointError` line naming the file."""
    path = find_checkpoint(path)
    lazy = path.is_dir() and not tensors
    try:
        if lazy:
            state = read_run_state(path)
        elif path.is_dir():
            state = load_consolidated(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the file named, in one line
        raise CheckpointError(f"cannot load checkpoint {path}: {load_error(e)}") from e
    if not isinstance(state, dict) or state.get("format") not in (FORMAT, *OLDER_FORMATS):
        raise CheckpointError(f"{path} is not a difftrain checkpoint (format {FORMAT!r} expected)")
    state = _upgrade(state)
    check_schema(state, path, keys=[k for k in SCHEMA if k not in _SHARD_KEYS] if lazy else None)
    state["path"] = str(path)
    if lazy:
        state["shards"] = str(path)
    return state


def load_weights(module: torch.nn.Module, tensors: dict[str, torch.Tensor], path: str | Path, key: str,
                 fill=None) -> None:
    """``module.load_state_dict(tensors)``, with a missing, unexpected or wrongly shaped weight
    reported as a :class:`CheckpointError` naming the file and the key. ``fill(module, tensors)``
    loads instead when given (a sharded module keeps its part of each whole tensor: ``fsdp.fill_shards``)."""
    own = module.state_dict()
    missing = sorted(set(own) - set(tensors))
    extra = sorted(set(tensors) - set(own))
    if missing or extra:
        what = f"lacks {missing[0]!r}" if missing else f"has an unknown weight {extra[0]!r}"
        raise CheckpointError(f"checkpoint {path}: key {key!r} {what} for this model "
                              f"({len(missing)} missing, {len(extra)} unknown)")
    for name, t in tensors.items():
        if t.shape != own[name].shape:
            raise CheckpointError(f"checkpoint {path}: key {key}.{name} has shape {tuple(t.shape)}, "
                                  f"the model's is {tuple(own[name].shape)}")
    if fill is not None:
        fill(module, tensors)
    else:
        module.load_state_dict(tensors)


def state_dict_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes of a state dict, in key order."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        # reshape(-1): a channels_last weight with size-1 dims counts as contiguous but keeps
        # its strides, which view(uint8) refuses; flat, it is plain row-major bytes.
        t = state_dict[name].detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(state_dict[name].shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
