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

import hashlib
import os
import re
from pathlib import Path

import torch

FORMAT = "difftrain-checkpoint-v1"
LATEST = "latest"
_NAME = re.compile(r"^step_(\d{8,})\.pt$")


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
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _save_atomic(obj: dict, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


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
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / checkpoint_name(step)
    _save_atomic({"format": FORMAT, **state}, path)
    atomic_write_bytes(ckpt_dir / LATEST, (path.name + "\n").encode())
    existing = list_checkpoints(ckpt_dir)
    newest = {p for _, p in existing[-keep_last:]}
    for s, p in existing:
        keep = p in newest or (keep_every_steps > 0 and s % keep_every_steps == 0)
        if not keep:
            p.unlink(missing_ok=True)
    return path


def find_checkpoint(path: str | Path) -> Path:
    """Resolve a checkpoint file, a ``checkpoints/`` folder or a run directory to one file.

    A folder resolves through its ``latest`` pointer, or to its newest checkpoint when the
    pointer is missing or names a file that is gone.
    """
    path = Path(path)
    if path.is_file():
        return path
    ckpt_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}: not a file or a directory")
    pointer = ckpt_dir / LATEST
    if pointer.is_file():
        named = ckpt_dir / pointer.read_text().strip()
        if named.is_file():
            return named
    found = list_checkpoints(ckpt_dir)
    if not found:
        raise FileNotFoundError(f"no checkpoint in {ckpt_dir}")
    return found[-1][1]


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
