"""Files: one atomic write, one fingerprint of a set of files, one cache folder, one safetensors header read.

Every file difftrain writes for later (checkpoints, the latest pointer, config.toml, caches,
statistics) goes through :func:`atomic_write`: a temporary file beside the target, flushed and
fsync'd, renamed over it, then the folder fsync'd; a crash leaves the old file or the new one,
never half of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

CACHE_ENV_VAR = "DIFFTRAIN_CACHE"  # the cache folder; else $XDG_CACHE_HOME/difftrain or ~/.cache/difftrain


def fsync_dir(path: Path) -> None:
    """Make a rename or a deletion inside the folder ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: Path) -> None:
    """Remove a partial temporary file; a folder we can't write to may refuse that too."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, before_rename=None) -> Iterator[BinaryIO]:
    """``with atomic_write(path) as f: f.write(...)``: ``path`` gets all of it or none of it.

    ``before_rename`` (a callable) runs after the data is durable and before the rename: a test
    hook for aiming a kill inside the write. The temporary file is removed on any error.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except OSError as e:
        unlink_quietly(tmp)
        if e.filename is None:  # a failed write or fsync names no file: name the one being written
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    except BaseException:
        unlink_quietly(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old or the new file."""
    with atomic_write(path) as f:
        f.write(data)


def files_fingerprint(root: Path, paths: list[Path], salt: str = "") -> str:
    """SHA-256 (hex) over ``salt`` and (relative path, size, mtime in ns) of every file, in order:
    the key under which anything computed from these files is cached."""
    digest = hashlib.sha256(salt.encode())
    for path in paths:
        st = path.stat()
        rel = path.relative_to(root).as_posix().encode("utf-8", "surrogateescape")
        digest.update(rel + f"\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def cache_dir(kind: str, override: str | os.PathLike | None = None) -> Path:
    """The folder for one kind of cache ("decode", "fid", "inductor"): ``override`` itself when
    given, else ``$DIFFTRAIN_CACHE/kind``, ``$XDG_CACHE_HOME/difftrain/kind`` or
    ``~/.cache/difftrain/kind``."""
    if override:
        return Path(override).expanduser()
    root = os.environ.get(CACHE_ENV_VAR)
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "difftrain"
    return Path(root).expanduser() / kind


def cache_dir_error(e: OSError, override: str, kind: str) -> OSError:
    """``e`` with ``data.cache_dir`` named when it happened in the cache folder of ``kind`` that
    the option chose (or, when unset, the default one), else ``e`` itself."""
    folder = cache_dir(kind, override).absolute()
    where = Path(e.filename or "").absolute() if e.filename else None
    if where is None or not (where == folder or folder in where.parents or where in folder.parents):
        return e
    option = f"data.cache_dir={override}" if override else f"the default cache folder {folder} (data.cache_dir)"
    return OSError(e.errno, f"cannot write the {kind} cache in {option}: {e.strerror or e}", e.filename)


def safetensors_header(path: str | os.PathLike) -> tuple[int, dict]:
    """(where the data starts, the header) of the safetensors file ``path``, read with two plain reads (the
    8-byte length, then the JSON header): no mapping of the file, so a check of many files' headers touches one
    page of each. One ValueError saying why when the header is not a safetensors header or the file is shorter
    than its tensors' offsets say; its values are not read."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"its header claims {n} bytes, more than the file holds")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] or not isinstance(info.get("shape"), list)
                or not isinstance(info.get("dtype"), str)):
            raise ValueError(f"tensor {name!r}: not a safetensors entry (dtype, shape, data_offsets)")
        end = max(end, offsets[1])
    if 8 + n + end > size:
        raise ValueError(f"the file ends before its tensors' data ({size} bytes, {8 + n + end} needed)")
    return 8 + n, header

