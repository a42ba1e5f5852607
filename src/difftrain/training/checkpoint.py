"""Crash-safe checkpoints: atomic writes, a latest-pointer, rotation, safe loading.

A checkpoint is one file, ``checkpoints/step_XXXXXXXX.pt``: a dict of tensors, numbers,
strings and lists (model, EMA, optimizer, scaler, LR schedule, step, data position, RNG states
and the config), written with ``torch.save`` and read back with ``weights_only=True``, so
loading never unpickles code. ``checkpoints/latest`` names the newest complete file.

Writes go to a temporary file in the same directory, are flushed and fsync'd, then renamed
over the final name and the directory is fsync'd; the pointer is updated the same way. Old
checkpoints are deleted only after the new one and the pointer are durable.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import sys
import time
from pathlib import Path

import torch

FORMAT = "difftrain-checkpoint-v1"
LATEST = "latest"
_NAME = re.compile(r"^step_(\d{8,})\.pt$")
# Test hook for fault injection: seconds to pause between writing a checkpoint's temporary file
# and renaming it, so that a kill can be aimed inside the write. Unset in normal use.
PAUSE_ENV = "DIFFTRAIN_TEST_SAVE_PAUSE_S"


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, permission denied, read-only folder).

    The previous checkpoint and the ``latest`` pointer are left as they were.
    """


class NonFiniteWeights(ValueError):
    """Refused to write a checkpoint whose model or EMA weights hold NaN or infinity."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.pt"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old or the new file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    _fsync_dir(path.parent)


def _unlink_quietly(path: Path) -> None:
    """Remove a partial temporary file; a folder we can't write to may refuse that too."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _save_atomic(obj: dict, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        pause = float(os.environ.get(PAUSE_ENV, "0") or 0)
        if pause > 0:
            time.sleep(pause)
        os.replace(tmp, path)
    except BaseException as e:
        _unlink_quietly(tmp)
        cause = _os_error_in(e)
        if cause is not None and cause is not e:
            # torch.save's zip writer replaces a failed write (ENOSPC) with a RuntimeError of
            # its own; report the OS error underneath instead.
            raise cause from e
        raise
    _fsync_dir(path.parent)


def _os_error_in(e: BaseException | None) -> OSError | None:
    """The first OSError in ``e``'s chain of causes and contexts, if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoint files in ``ckpt_dir`` as (step, path), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = []
    for p in ckpt_dir.iterdir():
        m = _NAME.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def save_checkpoint(
    state: dict, ckpt_dir: Path, step: int, keep_last: int = 3, keep_every_steps: int = 0
) -> Path:
    """Write ``state`` as the checkpoint of ``step``, point ``latest`` at it, then rotate.

    Rotation keeps the newest ``keep_last`` files plus every file whose step is a multiple of
    ``keep_every_steps`` (when > 0), for later evaluation.
    """
    check_finite(state)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / checkpoint_name(step)
    _save_atomic({"format": FORMAT, **state}, path)
    atomic_write_bytes(ckpt_dir / LATEST, (path.name + "\n").encode())
    for stale in ckpt_dir.glob(".step_*.pt.tmp"):  # left by a process killed mid-write
        _unlink_quietly(stale)
    existing = list_checkpoints(ckpt_dir)
    newest = {p for _, p in existing[-keep_last:]}
    for s, p in existing:
        keep = p in newest or (keep_every_steps > 0 and s % keep_every_steps == 0)
        if not keep:
            p.unlink(missing_ok=True)
    return path


def check_finite(state: dict) -> None:
    """Raise :class:`NonFiniteWeights` naming the first model or EMA tensor with NaN or inf."""
    groups = {"model": state.get("model", {}), "ema": state.get("ema", {}).get("model", {})}
    for group, tensors in groups.items():
        for name, t in tensors.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise NonFiniteWeights(f"refusing to write a checkpoint: {group} weight {name} is not finite")


def save_or_report(
    state: dict, ckpt_dir: Path, step: int, keep_last: int, keep_every_steps: int, on_write_error: str
) -> Path | None:
    """:func:`save_checkpoint`, turning an OS error into a report naming the path and the error.

    ``on_write_error`` "stop" raises :class:`CheckpointWriteError`; "continue" prints the report
    to stderr and returns None, so training goes on and the next interval tries again. Either
    way the partial temporary file is gone and the previous checkpoint is untouched.
    """
    try:
        return save_checkpoint(state, ckpt_dir, step, keep_last, keep_every_steps)
    except OSError as e:
        where = e.filename or ckpt_dir / checkpoint_name(step)
        reason = errno.errorcode.get(e.errno, "") if e.errno else ""
        message = (
            f"cannot write the checkpoint of step {step} to {where}: {reason + ' ' if reason else ''}"
            f"{e.strerror or e}; the previous checkpoint "
            f"({_latest_name(ckpt_dir)}) is intact (checkpoint.on_write_error={on_write_error!r})"
        )
        if on_write_error == "stop":
            raise CheckpointWriteError(message) from e
        print(f"difftrain: warning: {message}; training goes on", file=sys.stderr, flush=True)
        return None


def _latest_name(ckpt_dir: Path) -> str:
    try:
        return find_checkpoint(ckpt_dir).name
    except (FileNotFoundError, OSError):
        return "none yet"


def find_checkpoint(path: str | Path) -> Path:
    """Resolve a checkpoint file, a ``checkpoints/`` folder or a run directory to one file.

    A folder resolves through its ``latest`` pointer, or to its newest checkpoint when the
    pointer is missing or names a file that is gone. The pointer is followed only when it
    holds the name of one of this folder's own checkpoints (``step_NNNNNNNN.pt``): a path, a
    ``..``, another run's checkpoint, bytes that are not UTF-8 or an over-long name are
    ignored with a warning, and the newest checkpoint of the folder is used instead.
    """
    path = Path(path)
    if path.is_file():
        return path
    ckpt_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}: not a file or a directory")
    found = list_checkpoints(ckpt_dir)
    named = _read_latest(ckpt_dir / LATEST)
    if named is not None:
        if named.name in {p.name for _, p in found}:
            return ckpt_dir / named.name
        if found:
            print(f"difftrain: warning: {ckpt_dir / LATEST} names {named.text}, which is not a checkpoint of "
                  f"this folder; using the newest one, {found[-1][1].name}", file=sys.stderr)
    if not found:
        raise FileNotFoundError(f"no checkpoint in {ckpt_dir}")
    return found[-1][1]


class _Pointer:
    """What a ``latest`` file holds: ``name`` when it is a plain checkpoint name, and its text."""

    def __init__(self, name: str, text: str):
        self.name, self.text = name, text


def _read_latest(pointer: Path) -> _Pointer | None:
    """The ``latest`` pointer's content; None when there is none. Never raises."""
    try:
        if not pointer.is_file():
            return None
        raw = pointer.read_bytes()[:1024]
    except OSError:
        return None
    text = raw.decode("utf-8", "backslashreplace").strip()
    shown = repr(text if len(text) <= 80 else text[:77] + "...")
    name = text if _NAME.match(text) and len(text) <= 255 else ""  # no "/", "..", or absolute path
    return _Pointer(name, shown)


def load_checkpoint(path: str | Path) -> dict:
    """Load a checkpoint on the CPU with ``weights_only=True`` (never runs pickled code)."""
    path = find_checkpoint(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise ValueError(f"cannot load checkpoint {path}: {e}") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a difftrain checkpoint (format {FORMAT!r} expected)")
    state["path"] = str(path)
    return state


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
