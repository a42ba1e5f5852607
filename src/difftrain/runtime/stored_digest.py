"""The digest of a base's weights as its files store them, cached by the files' fingerprint.

    value = stored_digest(source)            # hex SHA-256 of source's tensors as stored (a TensorSource)

What a LoRA checkpoint or adapter file records of the base it was trained on (``networks/lora.py``), for a
base family's denoiser read from its folder (``networks/build.py``); and, one per encoder, what a base family's
text encoders' digest is made of (``models.text.files_digest``: checkpoints' ``frozen`` references, the text
cache's manifest). Each tensor, by sorted name (the names
the network gives them): its name, its stored dtype (safetensors' names: ``F32``, ``BF16`` ...) and shape,
then its bytes exactly as the file holds them: never upcast, so a bf16 base hashes 2 bytes a weight, and the
dtype a run holds the base in (float32, or bf16 frozen: ``networks/frozen_dtype.py``) does not count. A
safetensors file is hashed from its header's offsets with plain reads (the page cache's pages, not this
process's); a torch ``.bin`` mapped by ``TensorSource.of_torch_files`` one tensor at a time. The same weights
in a ``.bin`` or in ``.safetensors`` (same names and dtype) have the same digest.

The value is kept in a small JSON file in ``cache_dir("digests")`` (``$DIFFTRAIN_CACHE/digests``, as the
other caches), named by the files' fingerprint (absolute path, size, mtime in ns: ``files.files_fingerprint``)
and the names, so a second start reads 100 bytes instead of the base. A cache that cannot be written (a
read-only home) is skipped: the digest is taken again at the next start.

Kinds (the ``base_digest_kind`` of a LoRA record): :data:`STORED` for this one; :data:`FLOAT32` for the one
written before (``models.text.tensors_digest``: every float tensor upcast to float32, a record without the
field), still taken for bases that are not a family's folder (difftrain's UNet, a checkpoint) and, once, to
check a record written the old way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch

from difftrain.runtime.files import atomic_write_bytes, cache_dir, files_fingerprint, safetensors_header

STORED = "stored"  # sha256 of the files' tensors as stored (this module)
FLOAT32 = "float32"  # sha256 of the float tensors upcast to float32 (models.text.tensors_digest): records before
DIGEST_KINDS = (STORED, FLOAT32)
VERSION = 1
CHUNK = 16 << 20  # bytes hashed per read

_TORCH_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                 torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                 torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _hash_safetensors(h, entries: list[tuple[str, Path, str]], on_read: Callable[[int], None] | None) -> None:
    headers: dict[Path, tuple[int, dict]] = {}
    handles = {}
    try:
        for name, file, key in entries:
            if file not in headers:
                headers[file] = safetensors_header(file)  # bounded: a header that lies is one ValueError
                handles[file] = open(file, "rb")  # noqa: SIM115 - closed below, one per file
            start, header = headers[file]
            info = header[key]
            begin, end = info["data_offsets"]
            h.update(f"{name}:{info['dtype']}:{tuple(info['shape'])}\n".encode())
            f = handles[file]
            f.seek(start + begin)
            left = end - begin
            while left:
                block = f.read(min(CHUNK, left))
                if not block:
                    raise ValueError(f"weights file {file} ends inside the tensor {key}")
                h.update(block)
                left -= len(block)
            if on_read is not None:
                on_read(end - begin)
    finally:
        for f in handles.values():
            f.close()


def compute(source, on_read: Callable[[int], None] | None = None) -> str:
    """:func:`stored_digest` of ``source`` (a ``tensor_source.TensorSource``), not cached; ``on_read(n)`` is
    told the bytes of each tensor hashed."""
    h = hashlib.sha256(f"difftrain stored tensors v{VERSION}\n".encode())
    names = sorted(source.keys)
    if source.safetensors:
        _hash_safetensors(h, [(n, *source.keys[n]) for n in names], on_read)
        return h.hexdigest()
    for name in names:
        t = source.read_stored(name).detach().contiguous()
        dtype = _TORCH_DTYPES.get(t.dtype, str(t.dtype))
        h.update(f"{name}:{dtype}:{tuple(t.shape)}\n".encode())
        data = t.reshape(-1).view(torch.uint8).numpy()
        h.update(memoryview(data))
        if on_read is not None:
            on_read(data.nbytes)
    return h.hexdigest()


def cache_key(source) -> str:
    """The name of ``source``'s cached digest: its files' fingerprint (absolute path, size, mtime_ns) and
    which of their tensors it reads under which names."""
    files = sorted({Path(file).resolve() for file, _ in source.keys.values()})
    names = hashlib.sha256("\n".join(f"{n}\0{source.keys[n][0].name}\0{source.keys[n][1]}"
                                     for n in sorted(source.keys)).encode()).hexdigest()
    return files_fingerprint(Path("/"), files, salt=f"stored-digest-v{VERSION}:{names}:")


def stored_digest(source, cache: bool = True) -> str:
    """The hex SHA-256 of ``source``'s tensors as stored (module docstring), read from the cache when its
    files are unchanged since it was taken, else taken and cached."""
    path = cache_dir("digests") / f"{cache_key(source)}.json" if cache else None
    if path is not None:
        try:
            saved = json.loads(path.read_text())
            if saved.get("kind") == STORED and isinstance(saved.get("digest"), str) and len(saved["digest"]) == 64:
                return saved["digest"]
        except (OSError, ValueError, AttributeError):
            pass  # no cache yet, or a damaged one: taken again
    value = compute(source)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, json.dumps({"kind": STORED, "digest": value}).encode())
        except OSError:
            pass  # a cache that cannot be written: taken again next time
    return value
