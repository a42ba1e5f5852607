"""What a checkpoint file and a sharded checkpoint folder share, below both: the format, the
errors, the names, the ``latest`` and ``best`` pointers, rotation, the report of a failed write and
the finiteness check.

``checkpoints/checkpoint.py`` (one file, ``step_XXXXXXXX.pt``) and ``checkpoints/sharded.py``
(an FSDP run's folder, ``step_XXXXXXXX.dcp/``) both build on this module; neither imports the other's
private helpers, and this module imports neither.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from difftrain.runtime.files import atomic_write_bytes, unlink_quietly

FORMAT = "difftrain-checkpoint-v4"  # v3: + posthoc_ema; v4: + network, frozen
OLDER_FORMATS = ("difftrain-checkpoint-v1", "difftrain-checkpoint-v2", "difftrain-checkpoint-v3")
LATEST = "latest"
BEST = "best"  # pointer to the checkpoint with the best (lowest) FID: "step_N.pt\nFID\n"
_NAME = re.compile(r"^step_(\d{8,})\.(?:pt|dcp)$")  # a file, or a sharded checkpoint's folder
# Test hook for fault injection: seconds to pause between writing a checkpoint's temporary file
# and renaming it, so that a kill can be aimed inside the write. Unset in normal use.
PAUSE_ENV = "DIFFTRAIN_TEST_SAVE_PAUSE_S"
SHARDED_SUFFIX = ".dcp"  # a sharded checkpoint's folder: step_XXXXXXXX.dcp/
RUN_STATE = "run_state.pt"  # its non-tensor part, written last by rank 0


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, permission denied, read-only folder).

    The previous checkpoint and the ``latest`` pointer are left as they were.
    """


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, not difftrain's, or holds a wrong or missing key."""


class NonFiniteWeights(ValueError):
    """Refused to write a checkpoint whose model or EMA weights hold NaN or infinity."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.pt"



def sharded_name(step: int) -> str:
    return f"step_{step:08d}{SHARDED_SUFFIX}"


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a finished sharded checkpoint folder."""
    return path.name.endswith(SHARDED_SUFFIX) and (path / RUN_STATE).is_file()


def pause_for_fault_injection() -> None:
    """Sleep ``DIFFTRAIN_TEST_SAVE_PAUSE_S`` seconds (a test hook; unset in normal use)."""
    pause = float(os.environ.get(PAUSE_ENV, "0") or 0)
    if pause > 0:
        time.sleep(pause)



def os_error_in(e: BaseException | None) -> OSError | None:
    """The first OSError in ``e``'s chain of causes and contexts, if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (files and sharded folders) in ``ckpt_dir`` as (step, path), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = []
    for p in ckpt_dir.iterdir():
        m = _NAME.match(p.name)
        if m and (p.is_file() or is_sharded_checkpoint(p)):
            found.append((int(m.group(1)), p))
    return sorted(found)



def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint file or a sharded checkpoint's folder."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)



def save_checkpoint(
    state: dict, ckpt_dir: Path, step: int, keep_last: int = 3, keep_every_steps: int = 0,
    best: float | None = None, *, write,
) -> Path:
    """Write ``state`` as the checkpoint of ``step``, point ``latest`` at it, then rotate.

    ``write(state, ckpt_dir, step)`` writes the checkpoint atomically and returns its path: one
    file by default; a sharded checkpoint's last step (``checkpoints/sharded.py``).

    ``best``: this checkpoint's FID, when it beats the ``best`` pointer's (see :func:`is_better`):
    ``best`` then names it, written after ``latest``. Rotation keeps the newest ``keep_last``
    files, every file whose step is a multiple of ``keep_every_steps`` (when > 0), for later
    evaluation, and the file ``best`` names.
    """
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = write(state, ckpt_dir, step)
    atomic_write_bytes(ckpt_dir / LATEST, (path.name + "\n").encode())
    if best is not None and is_better(ckpt_dir, best):
        atomic_write_bytes(ckpt_dir / BEST, f"{path.name}\n{best!r}\n".encode())
    for stale in ckpt_dir.glob(".step_*.pt.tmp"):  # left by a process killed mid-write
        unlink_quietly(stale)
    for stale in ckpt_dir.glob(".step_*.dcp*.tmp"):  # a sharded save's, killed mid-write
        shutil.rmtree(stale, ignore_errors=True)
    existing = list_checkpoints(ckpt_dir)
    newest = {p for _, p in existing[-keep_last:]}
    kept_best = read_best(ckpt_dir)
    for s, p in existing:
        keep = p in newest or (keep_every_steps > 0 and s % keep_every_steps == 0)
        if not keep and not (kept_best is not None and p.name == kept_best[0]):
            remove_checkpoint(p)
    return path


def read_best(ckpt_dir: Path) -> tuple[str, float] | None:
    """(file name, FID) of the ``best`` pointer of ``ckpt_dir``; None when there is none, it is not
    readable, or it names no checkpoint of this folder. Never raises."""
    try:
        lines = (Path(ckpt_dir) / BEST).read_bytes()[:1024].decode("utf-8").split()
        name, score = lines[0], float(lines[1])
    except (OSError, UnicodeDecodeError, IndexError, ValueError):
        return None
    if not _NAME.match(name) or not (Path(ckpt_dir) / name).exists():
        return None
    return name, score


def is_better(ckpt_dir: Path, score: float) -> bool:
    """Whether FID ``score`` is finite and lower than the ``best`` pointer's (or there is none)."""
    if not score == score or score in (float("inf"), float("-inf")):  # NaN or infinite
        return False
    current = read_best(ckpt_dir)
    return current is None or score < current[1]




def check_finite(state: dict) -> None:
    """Raise :class:`NonFiniteWeights` naming the first model or EMA tensor with NaN or inf."""
    groups = {"model": state.get("model", {}), "ema": state.get("ema", {}).get("model", {})}
    posthoc = state.get("posthoc_ema", {})
    for std, tensors in zip(posthoc.get("stds", []), posthoc.get("models", [])):
        groups[f"posthoc_ema[{std}]"] = tensors
    for group, tensors in groups.items():
        name = first_non_finite(tensors)
        if name is not None:
            raise NonFiniteWeights(f"{group} weight {name} is not finite")


def first_non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor of ``tensors`` holding NaN or infinity; None if none."""
    for name, t in tensors.items():
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            return name
    return None




def save_or_report(
    state: dict, ckpt_dir: Path, step: int, keep_last: int, keep_every_steps: int, on_write_error: str,
    best: float | None = None, *, write,
) -> Path | None:
    """:func:`save_checkpoint`, turning an OS error into a report naming the path and the error.

    ``on_write_error`` "stop" raises :class:`CheckpointWriteError`; "continue" prints the report
    to stderr and returns None, so training goes on and the next interval tries again. Either
    way the partial temporary file is gone and the previous checkpoint is untouched.
    """
    try:
        return save_checkpoint(state, ckpt_dir, step, keep_last, keep_every_steps, best, write=write)
    except OSError as e:
        return report_write_error(e, ckpt_dir, step, on_write_error)


def report_write_error(e: OSError, ckpt_dir: Path, step: int, on_write_error: str, quiet: bool = False) -> None:
    """The outcome of a failed write: raise :class:`CheckpointWriteError` ("stop"), or print the
    report (unless ``quiet``: another rank prints it) and return None ("continue")."""
    where = e.filename or ckpt_dir / checkpoint_name(step)
    reason = errno.errorcode.get(e.errno, "") if e.errno else ""
    message = (
        f"cannot write the checkpoint of step {step} to {where}: {reason + ' ' if reason else ''}"
        f"{e.strerror or e}; the previous checkpoint "
        f"({_latest_name(ckpt_dir)}) is intact (checkpoint.on_write_error={on_write_error!r})"
    )
    if on_write_error == "stop":
        raise CheckpointWriteError(message) from e
    if not quiet:
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

    ``RUN/best`` or ``RUN:best`` (RUN a run directory or its ``checkpoints/`` folder) is the
    checkpoint the ``best`` pointer names, the one with the lowest FID.
    """
    path = Path(path)
    best = _best_reference(path)
    if best is not None:
        return best
    if path.is_file() or is_sharded_checkpoint(path):
        return path
    if _NAME.match(path.name) and path.is_dir():  # step_N.dcp/ without the run state its save writes last
        raise FileNotFoundError(f"{path} is not a finished sharded checkpoint: it has no run_state.pt")
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


def _best_reference(path: Path) -> Path | None:
    """The checkpoint ``RUN/best`` or ``RUN:best`` names; None when ``path`` is neither form.
    Raises FileNotFoundError when the run has no best checkpoint."""
    text = str(path)
    if text.endswith(":best") and not path.exists():
        run = Path(text[: -len(":best")])
    elif path.name == BEST and not path.is_dir():  # RUN/best, or the pointer file RUN/checkpoints/best
        run = path.parent
    else:
        return None
    ckpt_dir = run / "checkpoints" if (run / "checkpoints").is_dir() else run
    found = read_best(ckpt_dir)
    if found is None:
        raise FileNotFoundError(f"no best checkpoint in {ckpt_dir}: the run has no {BEST} pointer to one of its "
                                "checkpoints (it is written when evaluation.fid_every_steps measures a new lowest FID)")
    return ckpt_dir / found[0]


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


# key -> (check, what it must be): the run state as training/state.py writes it.


def load_error(e: BaseException) -> str:
    """One line saying why ``torch.load(..., weights_only=True)`` (or a reader under it) failed:
    torch's refusal of a pickle that names code is several lines of advice to load it anyway."""
    if isinstance(e, pickle.UnpicklingError) and "weights only" in str(e).lower():
        return "it holds pickled objects other than tensors and plain data (refused: loading never runs code)"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__

