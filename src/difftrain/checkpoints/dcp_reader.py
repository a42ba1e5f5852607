"""The one reader of sharded (DCP) checkpoints: DCP's ``.metadata`` read without running code.

torch's ``FileSystemReader.read_metadata`` loads a DCP folder's ``.metadata`` with plain
``pickle.load``, which runs whatever a crafted file names. :class:`SafeReader` is a
``torch.distributed.checkpoint.FileSystemReader`` that overrides only ``read_metadata`` (the
public ``StorageReader`` API: it returns the checkpoint's ``Metadata``; reading the shards stays
torch's). It reads the file with :class:`_AllowListUnpickler` (the standard library's documented
way to restrict globals: ``pickle.Unpickler.find_class``), which resolves only the classes DCP's
metadata is made of (``torch/distributed/checkpoint/metadata.py``, ``filesystem._StorageInfo``),
torch's dtypes, ``torch.Size`` and layouts, paths and a few plain builtins. Any other name refuses
the file, as do a missing, truncated or malformed file and one that lies about the shards:

* every tensor's chunks lie inside the tensor and cover it exactly (so a claimed size cannot make
  the loader allocate memory the shards do not back);
* every chunk is stored in a ``*.distcp`` file of the folder itself (no path, no ``..``), inside
  that file's size, and holds at least the chunk's bytes;
* no entry is DCP *bytes* (``BytesStorageMetadata``: a pickle that DCP's default planner reads with
  ``torch.load(weights_only=False)``; difftrain writes tensors only);
* every key path (``planner_data``: how a flattened key unflattens into the state dict) joins back,
  with dots, to its own key (a path that joins to another key would ask DCP for that key's entry).

And every ``torch.distributed.checkpoint.load`` in difftrain goes through :func:`load`, whose planner
(:class:`NoBytesPlanner`) refuses a bytes entry instead of unpickling it, should one ever reach it.

Errors are :class:`~difftrain.checkpoints.store.CheckpointError`, one line naming the file.
Every path that reads a sharded checkpoint goes through :func:`read_metadata`: an FSDP run's resume
(``sharded.load_shards``: each rank its own part, into its sharded state) and
``sharded.load_consolidated`` (whole, in one process), which ``checkpoint.load_checkpoint``
calls for a folder: ``sample``, ``export``, ``eval``, ``inspect``, ``posthoc-ema``, ``diagnose``, a
resume in one process or under DDP, and ``model.init_from``.
"""

from __future__ import annotations

import io
import math
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from difftrain.checkpoints.store import CheckpointError

METADATA = ".metadata"
_SHARD_NAME = re.compile(r"^[A-Za-z0-9_]+\.distcp$")  # what DCP's FileSystemWriter names its files: __0_0.distcp

# (module, name) the unpickler resolves; everything else refuses the file.
_ALLOWED = {
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch.strided pickles: a lookup by name
    *((m, n) for m in ("pathlib", "pathlib._local")
      for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
    ("collections", "OrderedDict"),
    *(("builtins", n) for n in ("set", "frozenset", "complex", "bytearray")),
}


class _AllowListUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`_ALLOWED` names and torch's dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(vars(torch).get(name), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata never holds "
                                     "(a crafted file? loading never runs code)")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id, which DCP metadata never holds")


def read_metadata(folder: Path) -> md.Metadata:
    """The checked ``Metadata`` of the DCP checkpoint ``folder``; :class:`CheckpointError` naming
    ``folder/.metadata`` when it is missing, crafted, damaged or lies about the shards."""
    path = Path(folder) / METADATA
    try:
        with open(path, "rb") as f:
            metadata = _AllowListUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"sharded checkpoint {path} is missing (DCP's index of the shards)") from None
    except OSError as e:
        raise CheckpointError(f"cannot read sharded checkpoint {path}: {e.strerror or e}") from None
    except Exception as e:  # noqa: BLE001 - an unpickling error of any kind: one line naming the file
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"sharded checkpoint {path} refused: {text}") from None
    problem = _problem(metadata, Path(folder))
    if problem:
        raise CheckpointError(f"sharded checkpoint {path} refused: {problem}")
    return metadata


def _problem(m: Any, folder: Path) -> str | None:
    """What is wrong with unpickled metadata ``m`` of ``folder``, or None."""
    if not isinstance(m, md.Metadata):
        return f"it holds a {type(m).__name__}, not DCP's Metadata"
    if not isinstance(m.state_dict_metadata, dict) or not isinstance(m.storage_data, dict):
        return "its state_dict_metadata or storage_data is not a dict"
    if m.planner_data is not None and not (isinstance(m.planner_data, dict) and all(
            isinstance(k, str) and isinstance(v, (tuple, list)) and all(isinstance(p, (str, int)) for p in v)
            for k, v in m.planner_data.items())):
        return "its planner_data is not a table of key paths"
    for fqn, path in (m.planner_data or {}).items():  # DCP's flatten_state_dict joins a key's path with dots
        if ".".join(map(str, path)) != fqn:
            return (f"it gives {fqn!r} the key path {list(path)}, which joins to another key "
                    "(a crafted file? a key path is its key's own)")
    if m.storage_meta is not None and not isinstance(m.storage_meta, md.StorageMeta):
        return "its storage_meta is not DCP's StorageMeta"
    sizes: dict[str, int] = {}
    for index, info in m.storage_data.items():
        if not (isinstance(index, md.MetadataIndex) and isinstance(info, filesystem._StorageInfo)):
            return "its storage_data holds something other than DCP's storage entries"
        if info.transform_descriptors:  # DCP's experimental stream extensions (compression): difftrain writes none
            return (f"it stores {index.fqn!r} through stream transforms {info.transform_descriptors!r}, "
                    "which difftrain never writes")
        name = info.relative_path
        if not (isinstance(name, str) and _SHARD_NAME.match(name)):
            return f"it stores {index.fqn!r} in {name!r}, not a .distcp file of this folder"
        if name not in sizes:
            try:
                sizes[name] = (folder / name).stat().st_size
            except OSError:
                return f"the shard file {name} it names is missing"
        if not (_is_count(info.offset) and _is_count(info.length) and info.offset + info.length <= sizes[name]):
            return (f"it places {index.fqn!r} at byte {info.offset!r}, length {info.length!r}, of {name}, "
                    f"which holds {sizes[name]} bytes (truncated, or sizes that lie)")
    claimed = 0  # bytes of all tensors: the shard files must hold at least that many
    for fqn, item in m.state_dict_metadata.items():
        if not isinstance(fqn, str):
            return "a key of its state_dict_metadata is not a string"
        if isinstance(item, md.BytesStorageMetadata):
            return (f"it declares {fqn!r} as pickled bytes, which difftrain never writes "
                    "(a crafted file? loading never runs code)")
        problem = _tensor_problem(fqn, item, m.storage_data)
        if problem:
            return problem
        claimed += math.prod(item.size) * item.properties.dtype.itemsize
    if claimed > sum(sizes.values()):
        return f"its tensors claim {claimed} bytes, its shard files hold {sum(sizes.values())} (sizes that lie)"
    return None


def _tensor_problem(fqn: str, item: Any, storage: dict) -> str | None:
    """What is wrong with the TensorStorageMetadata ``item`` of ``fqn``, or None."""
    if not (isinstance(item, md.TensorStorageMetadata) and isinstance(item.properties, md.TensorProperties)
            and isinstance(item.properties.dtype, torch.dtype) and isinstance(item.size, torch.Size)
            and isinstance(item.chunks, list)):
        return f"{fqn!r} is not described as DCP describes a tensor"
    itemsize = item.properties.dtype.itemsize
    covered = 0
    for chunk in item.chunks:
        if not (isinstance(chunk, md.ChunkStorageMetadata) and isinstance(chunk.offsets, torch.Size)
                and isinstance(chunk.sizes, torch.Size) and len(chunk.offsets) == len(chunk.sizes) == len(item.size)
                and all(0 <= o and 0 <= s and o + s <= d for o, s, d in zip(chunk.offsets, chunk.sizes, item.size))):
            return f"a chunk of {fqn!r} lies outside its size {list(item.size)}"
        info = storage.get(md.MetadataIndex(fqn, chunk.offsets))
        numel = math.prod(chunk.sizes)
        if info is None:
            return f"a chunk of {fqn!r} has no storage entry"
        if info.length < numel * itemsize:
            return (f"{fqn!r} claims {numel * itemsize} bytes of a chunk stored in {info.length} bytes "
                    "(sizes that lie)")
        covered += numel
    if covered != math.prod(item.size):
        return f"the chunks of {fqn!r} hold {covered} elements, its size {list(item.size)} {math.prod(item.size)}"
    return None


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` of ``folder`` whose metadata is :func:`read_metadata`'s: read and checked
    when the reader is made, so a bad file is refused before DCP's loader starts (which would log
    the failure with a traceback and try a rank-local ``__0.metadata`` next)."""

    def __init__(self, folder: Path):
        super().__init__(folder)
        self._metadata = read_metadata(Path(folder))

    def read_metadata(self, *args: Any, **kwargs: Any) -> md.Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = md.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id  # as torch's read_metadata does
        return self._metadata


class NoBytesPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a bytes entry (which it would read with
    ``torch.load(weights_only=False)``, running whatever the pickle names) raises instead: the second
    wall behind :func:`read_metadata`'s refusal of every bytes entry."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise CheckpointError(f"it holds {read_item.dest_index.fqn!r} as pickled bytes, which difftrain never "
                              "reads (loading never runs code)")


def load(state_dict: dict, reader: dcp.StorageReader, no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load`` of ``state_dict`` (its tensors filled in place) from ``reader``
    (a :class:`SafeReader`) with a :class:`NoBytesPlanner`; ``no_dist``: in this process alone. The one
    call of ``dcp.load`` in difftrain; DCP's failures are its ``CheckpointException``."""
    dcp.load(state_dict, storage_reader=reader, planner=NoBytesPlanner(), no_dist=no_dist)
