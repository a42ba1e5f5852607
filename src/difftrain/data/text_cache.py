"""A text-embedding cache: every caption's condition (all of a base family's text encoders' outputs,
pooled ones included) computed once by the frozen encoders, so that training never runs, nor even
loads, the text encoders once the cache is complete.

    store = TextCache.for_encoder(folder, family="sdxl", options={...}, cache_dir=None)
    text = CachedPromptEncoder(store, load=lambda: family.load_prompt_encoder(folder, ...), device=dev)
    text.ensure(captions, batch_size=32)    # encodes the missing captions (loading the encoders only then)
    cond = text.encode(["a photo of a dog"], dev)   # the family's dict, read back: {"prompt_embeds", "pooled", ...}
    null = text.null(n, dev)                 # the family's null condition (SDXL: zeros), cached too

Layout (beside the latent cache, in ``cache_dir("text", data.cache_dir)``): one folder per encoder,
``text-FAMILY-KEY/``, holding ``manifest.json`` (family, source, prompt options, the encoders' weights
digest that checkpoints name, the condition's keys and shapes) and one safetensors file per caption,
``SHA256(caption)[:32].safetensors``, whose tensors are the family's :class:`Condition` for that one
caption (each (1, ...), what ``PromptEncoder.encode([caption])`` returns, in the run's compute dtype:
bf16 / fp16 for a bf16 / fp16 run, else float32; the manifest's ``dtype``) and whose
metadata names the store key and the caption; ``null.safetensors`` is the null condition
(``PromptEncoder.null(1)``: caption dropout's, guidance's). Only the text encoders' outputs are cached: a
run's own settings that enter the condition (``Family.run_conditions``: Flux's distilled guidance) are
added by ``Conditioning`` at each use, so changing them needs no new store.

KEY is a SHA-256 of the cache version, the family, its prompt options (``Family.prompt_options``: today SD3's
and Flux's T5 ``max_sequence_length``; any option a family adds there enters the key), the entries' dtype
when not float32 (a float32 store keeps the key it had before entries had a dtype) and the (relative path, size, mtime) of every file of the
folder's text encoders and tokenizers (``text_encoder*/``, ``tokenizer*/`` and ``model_index.json`` of a
pipeline folder; every file of a bare text-model folder), the rule of the latent and decode caches:
change any of them and another store is used (built on first use); the old one stays until removed.
The key is computed without loading anything, which is what lets a complete cache leave the encoders
unloaded.

The fill (:func:`staged_conditions`) runs the family's encoder models one at a time (``PromptEncoder.parts``),
each read from its files in the compute dtype only for its turn (a deferred encoder: ``load_prompt_encoder(...,
deferred=True)``, tokenizers only until then) and freed before the next, so the host never holds one in float32
nor two at once; each runs on the run's device (on the CPU when a GPU cannot hold the largest:
:func:`fill_device`). The manifest's digest is the encoders' files' (``models.text.files_digest``, kind
"stored"; a store filled before holds the float32 one, no kind: :meth:`CachedPromptEncoder.digest_of`).
Entries are read in the training loader's workers (``CachedConditions``: a batch's captions come as a
``CaptionBatch`` with their conditions: ``data/cached_conditions.py``), not on the training thread.

Every entry is checked (safetensors only, never pickle): at the start by its header (its metadata's key and
caption, its tensors' names, shapes, dtype), when first read by its values too (all finite): a missing entry
is encoded; a damaged or foreign one (crafted,
truncated, a header lying about sizes, NaN, another store's) gives one warning line naming the file and is
rebuilt in place. Each file is written to a temporary name (``NAME.safetensors.PID.tmp``) and renamed,
so a killed build leaves whole entries or none (and its temporary file, removed by the next build);
entries are not fsync'd one by one: one that a power loss left short fails its check and is rebuilt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Callable, Generator, Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save
from torch import Tensor, nn

from difftrain.runtime.files import (atomic_write_bytes, cache_dir_error, files_fingerprint, safetensors_header,
                                     unlink_quietly)
from difftrain.runtime.files import cache_dir as default_cache_dir
from difftrain.runtime.precision import DTYPES
from difftrain.runtime.stored_digest import FLOAT32, STORED

from .captions import CaptionOptions, TaggedCaptions, dataset_captions

# Bump when what the cache holds for the same inputs changes. 2: Flux's entries no longer hold the
# distilled "guidance" (a setting of the run, Family.run_conditions, that version 1 stored in every entry
# though it was no part of the key); a version-1 store is another key, so it is never read: a run builds
# version 2 beside it.
TEXT_CACHE_VERSION = 2
MANIFEST = "manifest.json"
NULL_ENTRY = "null"
MARK = "difftrain-text-cache"  # the metadata value that tells a cache entry from another safetensors file
# Entries kept in memory once read (bytes); beyond it they are read from their files at each use.
MEMORY_BYTES = 256 << 20

Condition = dict[str, Tensor]
# The dtypes entries are stored in (the run's compute dtype: train.precision), by manifest name and by
# safetensors' header name.
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
HEADER_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class BadEntry(ValueError):
    """A cache file that cannot be used; ``str(e)`` says why."""


def encoder_files(folder: Path) -> list[Path]:
    """The files the text condition of a base folder depends on: a pipeline folder's (with
    ``model_index.json``) ``model_index.json`` and everything under ``text_encoder*/`` and
    ``tokenizer*/``; a bare text-model folder's every file. Sorted; raises FileNotFoundError when none."""
    folder = Path(folder).expanduser()
    if (folder / "model_index.json").is_file():
        roots = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(("text_encoder", "tokenizer"))]
        files = [folder / "model_index.json"] + [f for r in roots for f in r.rglob("*") if f.is_file()]
    else:
        files = [f for f in folder.rglob("*") if f.is_file()] if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(f"text encoder folder {folder} holds no files")
    return sorted(files)


def store_key(folder: Path, family: str, options: dict, dtype: torch.dtype = torch.float32) -> str:
    """The SHA-256 naming the store of ``family``'s encoders in ``folder`` under ``options``, its entries in
    ``dtype`` (float32 adds nothing to the key: a store written before entries had a dtype keeps its key)."""
    folder = Path(folder).expanduser()
    salt = f"v{TEXT_CACHE_VERSION}:{family}:{json.dumps(options, sort_keys=True, default=str)}:"
    salt += "" if dtype == torch.float32 else f"dtype={DTYPE_NAMES[dtype]}:"
    return files_fingerprint(folder, encoder_files(folder), salt)


def entry_name(caption: str) -> str:
    """The file stem of ``caption``'s entry."""
    return hashlib.sha256(caption.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def _warn(message: str) -> None:
    print(f"difftrain: warning: {message}", file=sys.stderr)


class TextCache:
    """One store folder (see the module docstring): read, check and write entries."""

    def __init__(self, folder: Path, key: str, family: str, source: str, options: dict,
                 dtype: torch.dtype = torch.float32):
        self.folder, self.key, self.family, self.source, self.options = Path(folder), key, family, source, options
        self.dtype = dtype
        self.manifest = self.read_manifest()

    @classmethod
    def for_encoder(cls, folder: str | Path, family: str, options: dict,
                    cache_dir: str | Path | None = None, dtype: torch.dtype = torch.float32) -> TextCache:
        """The store of ``family``'s text encoders in the base ``folder`` under ``options``, its entries in
        ``dtype`` (float32, bfloat16 or float16), in ``cache_dir`` (default
        :func:`difftrain.runtime.files.cache_dir` ``("text")``)."""
        folder = Path(folder).expanduser()
        key = store_key(folder, family, options, dtype)
        root = default_cache_dir("text", cache_dir)
        return cls(root / f"text-{family}-{key[:24]}", key, family, str(folder), options, dtype)

    # -- the manifest -----------------------------------------------------------------------------

    def read_manifest(self) -> dict | None:
        """The manifest if present and consistent with this store, else None (one warning if damaged)."""
        path = self.folder / MANIFEST
        if not path.is_file():
            return None
        try:
            value = json.loads(path.read_bytes()[: 1 << 20].decode("utf-8"))
            ok = (isinstance(value, dict) and value.get("key") == self.key and isinstance(value.get("digest"), str)
                  and isinstance(value.get("dim"), int) and isinstance(value.get("shapes"), dict)
                  and all(isinstance(s, list) and all(isinstance(n, int) and n >= 0 for n in s)
                          for s in value["shapes"].values()) and value["shapes"]
                  and value.get("dtype", "float32") == DTYPE_NAMES[self.dtype])  # none: a float32 store's
        except (OSError, ValueError):
            ok = False
        if not ok:
            _warn(f"text cache {path} is damaged or another store's; it is rebuilt")
            return None
        return value

    def write_manifest(self, digest: str, dim: int, shapes: dict[str, list[int]], kind: str = STORED) -> None:
        """Record the encoders' weights ``digest`` (of ``kind``: ``runtime.stored_digest``'s; a manifest without
        it was written with the FLOAT32 one), source, width ``dim``, the entries' dtype and the
        condition's ``shapes`` (each key's shape of one row, without the batch axis)."""
        self.manifest = {"key": self.key, "version": TEXT_CACHE_VERSION, "family": self.family, "source": self.source,
                         "options": json.loads(json.dumps(self.options, default=str)), "digest": str(digest),
                         "digest_kind": kind,
                         "dim": int(dim), "dtype": DTYPE_NAMES[self.dtype],
                         "shapes": {k: list(v) for k, v in shapes.items()}}
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.folder / MANIFEST, json.dumps(self.manifest, indent=1).encode())

    # -- entries ----------------------------------------------------------------------------------

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.safetensors"

    def check(self, name: str, caption: str) -> None:
        """Check entry ``name`` (of ``caption``) by its header only (metadata, tensor names, shapes, dtype; no
        value is read): :class:`BadEntry` saying why it cannot be used (FileNotFoundError when it does not exist)."""
        self._open(name, caption, values=False)

    def read(self, name: str, caption: str) -> Condition:
        """The entry ``name`` (of ``caption``) as (1, ...) tensors in the store's dtype, its header and values
        checked (all finite); :class:`BadEntry` saying why it cannot be used (FileNotFoundError when it does
        not exist)."""
        cond = self._open(name, caption, values=True)
        for k, v in cond.items():
            if not torch.isfinite(v).all():
                raise BadEntry(f"{k} holds non-finite values")
        return cond

    def _open(self, name: str, caption: str, values: bool) -> Condition:
        """The entry's header checked (:meth:`_check_header`), and with ``values`` its tensors read. Without, the
        header alone is read, with two plain reads (``runtime/files.safetensors_header``: a start-up check of
        every entry touches one page of each, where mapping each file reads ahead into its values)."""
        path = self.path(name)
        if self.manifest is None:
            raise BadEntry("no manifest")
        try:
            if not values:
                _, header = safetensors_header(path)
                meta = header.pop("__metadata__", None)
                self._check_header(meta if isinstance(meta, dict) else {}, caption,
                                   {k: (v["dtype"], v["shape"]) for k, v in header.items()})
                return {}
            with safe_open(str(path), framework="pt") as f:
                slices = {k: f.get_slice(k) for k in f.keys()}  # noqa: SIM118 - a safe_open, not a dict
                self._check_header(f.metadata() or {}, caption, {k: (v.get_dtype(), v.get_shape()) for k, v in slices.items()})
                return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        except FileNotFoundError:
            raise
        except BadEntry:
            raise
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise BadEntry(f"not a readable safetensors file ({reason})") from None

    def _check_header(self, meta: dict, caption: str, tensors: dict[str, tuple[str, list[int]]]) -> None:
        """``meta`` (the entry's metadata) and ``tensors`` (name -> (safetensors dtype, shape)) against the store."""
        if meta.get("format") != MARK:
            raise BadEntry("not a text-cache entry (no difftrain metadata)")
        if meta.get("key") != self.key:
            raise BadEntry("written for another text encoder (its store key differs)")
        if meta.get("caption") != caption:
            raise BadEntry("holds another caption")
        shapes = self.manifest["shapes"]
        if set(tensors) != set(shapes):
            raise BadEntry(f"holds {', '.join(sorted(tensors)) or 'nothing'}, not {', '.join(sorted(shapes))}")
        want = HEADER_DTYPES[self.dtype]
        for k, (dtype, shape) in tensors.items():
            if dtype != want or list(shape) != [1, *shapes[k]]:
                raise BadEntry(f"{k} is {dtype} {list(shape)}, not {want} {[1, *shapes[k]]}")

    def write(self, name: str, caption: str, cond: Condition) -> None:
        """Write ``cond`` (each (1, ...)) as the entry ``name`` of ``caption``, in the store's dtype, atomically."""
        tensors = {k: v.detach().to("cpu", self.dtype).contiguous() for k, v in cond.items()}
        data = save(tensors, metadata={"format": MARK, "key": self.key, "caption": caption})
        path = self.path(name)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # one per process: ranks may rebuild at once
        try:  # no fsync per entry: a file a power loss left short fails its check and is rebuilt
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except BaseException:
            unlink_quietly(tmp)
            raise

    def remove_stale_temporaries(self) -> None:
        """Remove ``*.safetensors.<pid>.tmp`` files of builds whose process is gone (killed)."""
        for tmp in self.folder.glob("*.safetensors.*.tmp"):
            pid = tmp.name.rsplit(".", 2)[-2]
            try:
                if pid.isdigit():
                    os.kill(int(pid), 0)
            except ProcessLookupError:
                unlink_quietly(tmp)
            except OSError:  # PermissionError: someone else's live process
                pass


class EntryReader:
    """Entries of a :class:`TextCache` read (header and values checked) and kept in memory up to
    :data:`MEMORY_BYTES`; beyond it they are read from their files at each use. Plain data: a copy goes
    to each DataLoader worker (:class:`CachedConditions`), with its own memory."""

    def __init__(self, store: TextCache):
        self.store = store
        self.memory: dict[str, Condition] = {}
        self.memory_bytes = 0

    def read(self, name: str, caption: str) -> Condition:
        """Entry ``name`` of ``caption`` (each (1, ...) in the store's dtype); BadEntry / FileNotFoundError."""
        if name in self.memory:
            return self.memory[name]
        cond = self.store.read(name, caption)
        size = sum(v.numel() * v.element_size() for v in cond.values())
        if self.memory_bytes + size <= MEMORY_BYTES:
            self.memory[name] = cond
            self.memory_bytes += size
        return cond

    def forget(self, name: str) -> None:
        """Drop entry ``name`` from memory (it was rewritten)."""
        cond = self.memory.pop(name, None)
        if cond is not None:
            self.memory_bytes -= sum(v.numel() * v.element_size() for v in cond.values())


def part_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """Bytes ``module``'s floating-point parameters and buffers take in ``dtype`` (others as they are)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * (torch.empty(0, dtype=dtype).element_size() if t.is_floating_point() else t.element_size())
               for t in tensors)


def fill_device(encoder: nn.Module, device: torch.device | str, dtype: torch.dtype) -> torch.device:
    """Where the fill runs ``encoder``'s parts: ``device``, or the CPU when ``device`` is a CUDA device whose
    free memory (``torch.cuda.mem_get_info``) cannot hold the largest part in ``dtype`` (one line says so)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    names = getattr(encoder, "parts", ()) or ("",)
    size = torch.empty(0, dtype=dtype).element_size()
    largest = max(encoder.part_numel(n) * size if n in getattr(encoder, "loaders", {})  # deferred: its files' headers
                  else part_bytes(encoder.get_submodule(n), dtype) for n in names)
    free, _ = torch.cuda.mem_get_info(device)
    if largest <= free:
        return device
    print(f"difftrain: the text cache's fill runs the text encoders on the CPU: their largest part takes "
          f"{largest / 2**30:.1f} GiB in {DTYPE_NAMES[dtype]}, {device} has {free / 2**30:.1f} GiB free", file=sys.stderr)
    return torch.device("cpu")


@torch.no_grad()
def staged_conditions(encoder: nn.Module, batches: list[list[str]], device: torch.device,
                      dtype: torch.dtype) -> Generator[Condition, None, None]:
    """The family's condition (float32 on the host, each (B, ...)) of each batch of captions, computed one
    encoder model at a time (``encoder.parts``: all batches through the first, which is then sent back to the
    host, then the second, ...), each part moved to ``device`` in ``dtype`` only for its turn (a deferred
    encoder's part, ``PromptEncoder.loaders``: read from its files in ``dtype`` for its turn, then freed); the last
    part's outputs are assembled batch by batch (the earlier parts' outputs wait on the host, in ``dtype``).
    An encoder without ``parts`` runs whole, in one stage."""
    names = tuple(getattr(encoder, "parts", ()))
    if not names:
        encoder.to(device, dtype)
        try:
            for batch in batches:
                yield {k: v.to("cpu", torch.float32) for k, v in encoder.encode(batch, device).items()}
        finally:
            encoder.to("cpu")
        return
    earlier: dict[str, list[Condition]] = {}
    deferred = getattr(encoder, "loaders", {})
    for name in names:
        # a deferred part is read from its files in dtype now (the host never holds it in float32, nor two at once)
        part = (encoder.load_model(name, dtype) if name in deferred else encoder.get_submodule(name)).to(device, dtype)
        try:
            if name != names[-1]:
                earlier[name] = [{k: v.to("cpu") for k, v in encoder.encode_part(name, b).items()} for b in batches]
                continue
            for i, batch in enumerate(batches):
                outputs = {n: {k: v.to(device) for k, v in earlier[n][i].items()} for n in earlier}
                outputs[name] = encoder.encode_part(name, batch)
                earlier_rows = [earlier[n][i] for n in earlier]
                for rows in earlier_rows:
                    rows.clear()  # this batch's earlier outputs are no longer needed
                yield encoder.assemble(outputs, "cpu")
        finally:
            if name in deferred:
                del part
                encoder.free_model(name)  # freed before the next is loaded
            else:
                part.to("cpu")  # the device holds one part at a time


class CachedPromptEncoder(nn.Module):
    """A family's :class:`~difftrain.families.base.PromptEncoder` served from a :class:`TextCache`:
    ``encode(captions, device)`` and ``null(n, device)`` return what the encoder returns, read from
    the store; ``source``, ``digest`` and ``dim`` come from the store's manifest. The encoder itself
    (``load()``: a training run's is deferred, its tokenizers only) is loaded only to fill the store (a missing
    or damaged entry), each part read or moved onto the run's device in the store's dtype for its turn
    (:func:`staged_conditions`), and released after :meth:`ensure`.

    An ``nn.Module`` with one empty buffer-like parameter on the run's device, so that code asking
    ``next(text.parameters()).device`` finds where conditions go.
    """

    def __init__(self, store: TextCache, load: Callable[[], nn.Module], device: torch.device | str = "cpu"):
        super().__init__()
        self.store, self._load = store, load
        self._encoder: nn.Module | None = None
        self.loads = 0  # how many times the encoders were loaded (0 for a complete cache)
        self.anchor = nn.Parameter(torch.empty(0, device=device), requires_grad=False)
        self.reader = EntryReader(store)
        self._null: Condition | None = None

    # -- what checkpoints and the start line ask -----------------------------------------------------

    @property
    def source(self) -> str:
        return self.store.source

    @property
    def digest(self) -> str:
        return self._manifest()["digest"]

    @property
    def digest_kind(self) -> str:
        """The kind of :attr:`digest` (``runtime.stored_digest``): a store filled before the stored digest
        recorded the FLOAT32 one (its manifest names no kind)."""
        return self._manifest().get("digest_kind", FLOAT32)

    def digest_of(self, kind: str) -> str:
        """These encoders' digest of ``kind``: the manifest's, or (a checkpoint recording the other kind) taken
        from the encoder: STORED from its files (the deferred encoder's tokenizers loaded, no model), FLOAT32
        by ``PromptEncoder.legacy_digest`` (each model loaded in float32 for its turn: slow, once)."""
        if kind == self.digest_kind:
            return self.digest
        try:
            encoder = self.encoder()
            return encoder.legacy_digest() if kind == FLOAT32 else str(encoder.digest)
        finally:
            self.release()

    @property
    def dim(self) -> int:
        return int(self._manifest()["dim"])

    def reference(self) -> dict:
        kind = self.digest_kind
        return {"source": self.source, "digest": self.digest, **({"digest_kind": kind} if kind != FLOAT32 else {})}

    def train(self, mode: bool = True) -> CachedPromptEncoder:
        return super().train(False)

    # -- the encoders, only when needed --------------------------------------------------------------

    def encoder(self) -> nn.Module:
        """The family's prompt encoder, loaded (on the host) on first need."""
        if self._encoder is None:
            self._encoder = self._load()
            self.loads += 1
        return self._encoder

    def release(self) -> None:
        """Drop the loaded encoders (their memory); they are loaded again only for a missing entry."""
        self._encoder = None

    def _manifest(self) -> dict:
        if self.store.manifest is None:  # the null condition encoded to learn the shapes, the manifest written
            self._fill({}, 1, True)
            self.release()
        return self.store.manifest

    def ensure(self, captions: Iterable[str], batch_size: int = 32) -> int:
        """Encode every caption of ``captions`` (and the null condition) the store lacks or holds
        damaged (its entry's header checked: values are checked when first read), ``batch_size`` at a
        time, then release the encoders; returns how many were encoded."""
        if self.store.manifest is None and self.store.folder.is_dir() and any(self.store.folder.glob("*.safetensors")):
            self._manifest()  # entries but no manifest (damaged): rewritten, so that they can be checked
        todo: dict[str, str] = {}
        for caption in dict.fromkeys(captions):
            name = entry_name(caption)
            if not self._usable(name, caption):
                todo[name] = caption
        null_missing = not self._usable(NULL_ENTRY, "")
        if todo or null_missing:
            self.store.remove_stale_temporaries()
            print(f"difftrain: encoding {len(todo)} captions into the text cache {self.store.folder}")
            self._fill(todo, batch_size, null_missing)
        self.release()
        return len(todo)

    def run_entries(self, data, validation, batch_size: int = 32) -> int:
        """:meth:`ensure` of every caption a run encodes (:func:`run_captions` of ``data`` and the ``validation``
        section's prompts)."""
        return self.ensure(run_captions(data, validation), batch_size)

    def _usable(self, name: str, caption: str) -> bool:
        """Whether entry ``name`` exists and its header checks (one warning line if damaged)."""
        if name in self.reader.memory:
            return True
        if self.store.manifest is None or not self.store.path(name).is_file():
            return False
        try:
            self.store.check(name, caption)
        except FileNotFoundError:
            return False
        except BadEntry as e:
            _warn(f"text cache entry {self.store.path(name)}: {e}; it is rebuilt")
            return False
        return True

    def _fill(self, todo: dict[str, str], batch_size: int, null: bool) -> None:
        """Encode ``todo`` (name: caption) ``batch_size`` at a time and, with ``null`` (or no manifest yet), the
        null condition (its own batch, "", first), one encoder part at a time (:func:`staged_conditions`);
        write the manifest (rewritten, one line, when the old one does not describe these encoders), then
        the entries."""
        encoder = self.encoder()
        digest, dim = str(encoder.digest), int(encoder.dim)  # of the files and configs: no part loaded for them
        kind = getattr(encoder, "digest_kind", FLOAT32)
        device = fill_device(encoder, self.anchor.device, self.store.dtype)
        items = list(todo.items())
        chunks = [items[i:i + batch_size] for i in range(0, len(items), batch_size)]
        need_null = null or self.store.manifest is None
        batches = ([[""]] if need_null else []) + [[c for _, c in chunk] for chunk in chunks]
        conds = staged_conditions(encoder, batches, device, self.store.dtype)
        null_cond = encoder.null_of(next(conds), 1) if need_null else None
        shapes = self.store.manifest["shapes"] if null_cond is None else {k: list(v.shape[1:]) for k, v in null_cond.items()}
        self._write_manifest(digest, dim, shapes, kind)
        self.store.folder.mkdir(parents=True, exist_ok=True)
        if null:
            self.store.write(NULL_ENTRY, "", null_cond)
            self._null = None
        for chunk, cond in zip(chunks, conds):
            for row, (name, caption) in enumerate(chunk):
                self.store.write(name, caption, {k: v[row:row + 1] for k, v in cond.items()})
                self.reader.forget(name)
        conds.close()  # the last part back on the host now

    def _write_manifest(self, digest: str, dim: int, shapes: dict[str, list[int]], kind: str = STORED) -> None:
        """Write the manifest of these encoders unless the store's already says the same; one warning line
        when an old one differs (not for its digest's kind alone: a store filled before the stored digest
        gets the new kind, quietly)."""
        old = self.store.manifest
        if old is not None and (old.get("digest"), old.get("digest_kind", FLOAT32), old.get("dim"), old["shapes"]) \
                == (digest, kind, dim, shapes):
            return
        if old is not None and ((old.get("dim"), old["shapes"]) != (dim, shapes)
                                or old.get("digest_kind", FLOAT32) == kind):
            _warn(f"text cache {self.store.folder / MANIFEST} does not describe {self.source}'s encoders; "
                  "it is rewritten")
        self.store.write_manifest(digest, dim, shapes, kind)

    # -- reading --------------------------------------------------------------------------------------

    def _entry(self, name: str, caption: str) -> Condition:
        """Entry ``name``, encoded (and written) if missing, rebuilt with one warning line if damaged."""
        try:
            return self.reader.read(name, caption)
        except FileNotFoundError:
            pass
        except BadEntry as e:
            _warn(f"text cache entry {self.store.path(name)}: {e}; it is rebuilt")
        self._fill({} if name == NULL_ENTRY else {name: caption}, 1, name == NULL_ENTRY)
        return self.store.read(name, caption)

    def encode(self, captions: list[str], device: torch.device | str) -> Condition:
        """The family's condition of B captions on ``device``: each key (B, ...) float32. A
        ``CaptionBatch`` (``data/cached_conditions.py``) brings its rows, read in a loader worker; other captions are read here."""
        if isinstance(getattr(captions, "cond", None), dict):  # a cached_conditions.CaptionBatch
            return {k: v.to(device, non_blocking=True).float() for k, v in captions.cond.items()}
        rows = [self._entry(entry_name(c), c) for c in captions]
        return {k: torch.cat([r[k] for r in rows]).to(device, non_blocking=True).float() for k in rows[0]}

    def null(self, n: int, device: torch.device | str) -> Condition:
        """The family's null condition for ``n`` rows (expanded views), read once per device."""
        device = torch.device(device)
        if self._null is None or next(iter(self._null.values())).device != device:
            self._null = {k: v.to(device).float() for k, v in self._entry(NULL_ENTRY, "").items()}
        return {k: v.expand(n, *v.shape[1:]) for k, v in self._null.items()}


# ---------------------------------------------------------------------------------------------
# A run's use of it.


def text_cache_wanted(t) -> bool:
    """Whether ``text.cache`` of the text section ``t`` asks for the cache: "on", or "auto" when no caption
    changes per sample (``text.shuffle_tags`` / ``text.tag_dropout``; "on" with them is refused by the config)."""
    mode = t.cache
    return mode == "on" or (mode == "auto" and not (t.shuffle_tags or t.tag_dropout > 0))


def cached_prompt_encoder(cfg, family: str, folder: Path, options: dict, load: Callable[[], nn.Module],
                          device: torch.device | str) -> CachedPromptEncoder | None:
    """The base ``family``'s text encoders behind the cache (``text.cache``), or None when it is off
    (difftrain's own text encoder is never cached: ``families/unet.py`` refuses ``text.cache='on'``)."""
    if not text_cache_wanted(cfg.text):
        return None
    try:
        # filled and stored in train.precision's dtype (bf16, fp16; float32 for fp32)
        dtype = DTYPES[cfg.train.precision]
        store = TextCache.for_encoder(folder, family, options, cfg.data.cache_dir or None, dtype)
    except FileNotFoundError as e:
        raise ValueError(f"model.text_encoder: {e}") from None
    return CachedPromptEncoder(store, load, device)


def with_caption_options(data, cfg):
    """``data`` (``TrainingData``) with its captions passed through ``text.*`` (:class:`CaptionOptions`:
    trigger word, tag shuffling and dropout per sample seed); unchanged when none is set."""
    options = CaptionOptions.from_config(cfg.text)
    if not options.active or not cfg.data.captions:
        return data
    heldout = None if data.heldout is None else TaggedCaptions(data.heldout, options)
    return dataclasses.replace(data, train=TaggedCaptions(data.train, options), heldout=heldout)


def run_captions(data, v) -> list[str]:
    """Every caption a run encodes: its training and held-out captions and ``validation.prompts`` (of the
    validation section ``v``)."""
    captions = dataset_captions(data.train) + list(v.prompts)
    return captions + (dataset_captions(data.heldout) if data.heldout is not None else [])


def with_text_cache(data, conditioning, cfg, dctx) -> None:
    """Fill the text cache of a run whose text encoders are behind it (``conditioning.text`` a
    :class:`CachedPromptEncoder`; else nothing): rank 0 encodes the missing captions while the other
    ranks wait, then every rank reads the store. The encoders are released afterwards."""
    text = getattr(conditioning, "text", None)
    if not isinstance(text, CachedPromptEncoder):
        return
    # inside: runtime.distributed imports torch's FSDP and DDP, 0.07 s more on import difftrain.data (measured)
    from difftrain.runtime import distributed

    def build() -> None:
        try:
            text.run_entries(data, cfg.validation, batch_size=cfg.validation.heldout_batch_size)
        except OSError as e:
            raise cache_dir_error(e, cfg.data.cache_dir, "text") from e

    distributed.run_on_main(build, dctx, long_wait=True)
    text.store.manifest = text.store.read_manifest()  # the other ranks: the one rank 0 wrote
    text.release()
