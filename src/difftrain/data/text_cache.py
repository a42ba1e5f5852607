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
caption (each (1, ...) float32, exactly what ``PromptEncoder.encode([caption])`` returns) and whose
metadata names the store key and the caption; ``null.safetensors`` is the null condition
(``PromptEncoder.null(1)``: caption dropout's, guidance's). Only the text encoders' outputs are cached: a
run's own settings that enter the condition (``Family.run_conditions``: Flux's distilled guidance) are
added by ``Conditioning`` at each use, so changing them needs no new store.

KEY is a SHA-256 of the cache version, the family, its prompt options (``Family.prompt_options``: today SD3's
and Flux's T5 ``max_sequence_length``; any option a family adds there enters the key) and the (relative path, size, mtime) of every file of the
folder's text encoders and tokenizers (``text_encoder*/``, ``tokenizer*/`` and ``model_index.json`` of a
pipeline folder; every file of a bare text-model folder), the rule of the latent and decode caches:
change any of them and another store is used (built on first use); the old one stays until removed.
The key is computed without loading anything, which is what lets a complete cache leave the encoders
unloaded.

Every entry is checked when read (safetensors only, never pickle; its metadata's key and caption, its
tensors' names, shapes, dtype, all finite): a missing entry is encoded; a damaged or foreign one (crafted,
truncated, a header lying about sizes, NaN, another store's) gives one warning line naming the file and is
rebuilt in place. Each file is written to a temporary name (``NAME.safetensors.PID.tmp``) and renamed,
so a killed build leaves whole entries or none (and its temporary file, removed by the next build);
entries are not fsync'd one by one: one that a power loss left short fails its check and is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import Tensor, nn

from difftrain.runtime.files import atomic_write_bytes, files_fingerprint, unlink_quietly
from difftrain.runtime.files import cache_dir as default_cache_dir

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


def store_key(folder: Path, family: str, options: dict) -> str:
    """The SHA-256 naming the store of ``family``'s encoders in ``folder`` under ``options``."""
    folder = Path(folder).expanduser()
    salt = f"v{TEXT_CACHE_VERSION}:{family}:{json.dumps(options, sort_keys=True, default=str)}:"
    return files_fingerprint(folder, encoder_files(folder), salt)


def entry_name(caption: str) -> str:
    """The file stem of ``caption``'s entry."""
    return hashlib.sha256(caption.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def _warn(message: str) -> None:
    print(f"difftrain: warning: {message}", file=sys.stderr)


class TextCache:
    """One store folder (see the module docstring): read, check and write entries."""

    def __init__(self, folder: Path, key: str, family: str, source: str, options: dict):
        self.folder, self.key, self.family, self.source, self.options = Path(folder), key, family, source, options
        self.manifest = self.read_manifest()

    @classmethod
    def for_encoder(cls, folder: str | Path, family: str, options: dict,
                    cache_dir: str | Path | None = None) -> TextCache:
        """The store of ``family``'s text encoders in the base ``folder`` under ``options``, in
        ``cache_dir`` (default :func:`difftrain.runtime.files.cache_dir` ``("text")``)."""
        folder = Path(folder).expanduser()
        key = store_key(folder, family, options)
        root = default_cache_dir("text", cache_dir)
        return cls(root / f"text-{family}-{key[:24]}", key, family, str(folder), options)

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
                          for s in value["shapes"].values()) and value["shapes"])
        except (OSError, ValueError):
            ok = False
        if not ok:
            _warn(f"text cache {path} is damaged or another store's; it is rebuilt")
            return None
        return value

    def write_manifest(self, encoder, null: Condition, dry: bool = False) -> None:
        """Record ``encoder``'s weights digest, source and width and the condition's shapes (from ``null``);
        ``dry``: in ``self.manifest`` only, not on disk."""
        self.manifest = {"key": self.key, "version": TEXT_CACHE_VERSION, "family": self.family, "source": self.source,
                         "options": json.loads(json.dumps(self.options, default=str)), "digest": str(encoder.digest),
                         "dim": int(encoder.dim), "shapes": {k: list(v.shape[1:]) for k, v in null.items()}}
        if dry:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.folder / MANIFEST, json.dumps(self.manifest, indent=1).encode())

    # -- entries ----------------------------------------------------------------------------------

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.safetensors"

    def read(self, name: str, caption: str) -> Condition:
        """The entry ``name`` (of ``caption``) as (1, ...) float32 tensors; :class:`BadEntry` saying why
        it cannot be used (FileNotFoundError when it does not exist)."""
        from safetensors import SafetensorError, safe_open

        path = self.path(name)
        if self.manifest is None:
            raise BadEntry("no manifest")
        try:
            with safe_open(str(path), framework="pt") as f:
                self._check_header(f.metadata() or {}, caption, {k: f.get_slice(k) for k in f.keys()})  # noqa: SIM118 - a safe_open, not a dict
                cond = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        except FileNotFoundError:
            raise
        except BadEntry:
            raise
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise BadEntry(f"not a readable safetensors file ({reason})") from None
        for k, v in cond.items():
            if not torch.isfinite(v).all():
                raise BadEntry(f"{k} holds non-finite values")
        return cond

    def _check_header(self, meta: dict, caption: str, slices: dict) -> None:
        if meta.get("format") != MARK:
            raise BadEntry("not a text-cache entry (no difftrain metadata)")
        if meta.get("key") != self.key:
            raise BadEntry("written for another text encoder (its store key differs)")
        if meta.get("caption") != caption:
            raise BadEntry("holds another caption")
        shapes = self.manifest["shapes"]
        if set(slices) != set(shapes):
            raise BadEntry(f"holds {', '.join(sorted(slices)) or 'nothing'}, not {', '.join(sorted(shapes))}")
        for k, s in slices.items():
            if s.get_dtype() != "F32" or list(s.get_shape()) != [1, *shapes[k]]:
                raise BadEntry(f"{k} is {s.get_dtype()} {s.get_shape()}, not F32 {[1, *shapes[k]]}")

    def write(self, name: str, caption: str, cond: Condition) -> None:
        """Write ``cond`` (each (1, ...)) as the entry ``name`` of ``caption``, atomically."""
        from safetensors.torch import save

        tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in cond.items()}
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


class CachedPromptEncoder(nn.Module):
    """A family's :class:`~difftrain.families.base.PromptEncoder` served from a :class:`TextCache`:
    ``encode(captions, device)`` and ``null(n, device)`` return what the encoder returns, read from
    the store; ``source``, ``digest`` and ``dim`` come from the store's manifest. The encoder itself
    (``load()``) is loaded only to fill the store (a missing or damaged entry) and released after
    :meth:`ensure`.

    An ``nn.Module`` with one empty buffer-like parameter on the run's device, so that code asking
    ``next(text.parameters()).device`` finds where conditions go.
    """

    def __init__(self, store: TextCache, load: Callable[[], nn.Module], device: torch.device | str = "cpu"):
        super().__init__()
        self.store, self._load = store, load
        self._encoder: nn.Module | None = None
        self.loads = 0  # how many times the encoders were loaded (0 for a complete cache)
        self.anchor = nn.Parameter(torch.empty(0, device=device), requires_grad=False)
        self._memory: dict[str, Condition] = {}
        self._memory_bytes = 0
        self._null: Condition | None = None

    # -- what checkpoints and the start line ask -----------------------------------------------------

    @property
    def source(self) -> str:
        return self.store.source

    @property
    def digest(self) -> str:
        return self._manifest()["digest"]

    @property
    def dim(self) -> int:
        return int(self._manifest()["dim"])

    def reference(self) -> dict:
        return {"source": self.source, "digest": self.digest}

    def train(self, mode: bool = True) -> CachedPromptEncoder:
        return super().train(False)

    # -- the encoders, only when needed --------------------------------------------------------------

    def encoder(self) -> nn.Module:
        """The family's prompt encoder, loaded on first need (on the anchor's device); the manifest
        is written then if the store has none."""
        if self._encoder is None:
            self._encoder = self._load()
            self.loads += 1
            old = self.store.manifest
            self.store.write_manifest(self._encoder, self._encoder.null(1, self.anchor.device), dry=True)
            same = ("key", "digest", "dim", "shapes")
            if old is None or any(old.get(k) != self.store.manifest[k] for k in same):  # none, or not these encoders
                if old is not None:
                    _warn(f"text cache {self.store.folder / MANIFEST} does not describe {self.source}'s encoders; "
                          "it is rewritten")
                self.store.write_manifest(self._encoder, self._encoder.null(1, self.anchor.device))
        return self._encoder

    def release(self) -> None:
        """Drop the loaded encoders (their memory); they are loaded again only for a missing entry."""
        self._encoder = None

    def _manifest(self) -> dict:
        if self.store.manifest is None:
            self.encoder()
        return self.store.manifest

    def ensure(self, captions: Iterable[str], batch_size: int = 32) -> int:
        """Encode every caption of ``captions`` (and the null condition) the store lacks or holds
        damaged, ``batch_size`` at a time, then release the encoders; returns how many were encoded."""
        if self.store.manifest is None:
            self.encoder()
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

    def _usable(self, name: str, caption: str) -> bool:
        """Whether entry ``name`` exists and its header checks (one warning line if damaged)."""
        if not self.store.path(name).is_file():
            return False
        try:
            self._read(name, caption)
        except FileNotFoundError:
            return False
        except BadEntry as e:
            _warn(f"text cache entry {self.store.path(name)}: {e}; it is rebuilt")
            return False
        return True

    def _fill(self, todo: dict[str, str], batch_size: int, null: bool) -> None:
        encoder = self.encoder()
        device = self.anchor.device
        self.store.folder.mkdir(parents=True, exist_ok=True)
        if null:
            self.store.write(NULL_ENTRY, "", encoder.null(1, device))
        items = list(todo.items())
        for start in range(0, len(items), batch_size):
            chunk = items[start:start + batch_size]
            cond = encoder.encode([c for _, c in chunk], device)
            for row, (name, caption) in enumerate(chunk):
                self.store.write(name, caption, {k: v[row:row + 1] for k, v in cond.items()})
                self._memory.pop(name, None)

    # -- reading --------------------------------------------------------------------------------------

    def _read(self, name: str, caption: str) -> Condition:
        if name in self._memory:
            return self._memory[name]
        cond = self.store.read(name, caption)
        size = sum(v.numel() * v.element_size() for v in cond.values())
        if self._memory_bytes + size <= MEMORY_BYTES:
            self._memory[name] = cond
            self._memory_bytes += size
        return cond

    def _entry(self, name: str, caption: str) -> Condition:
        """Entry ``name``, encoded (and written) if missing, rebuilt with one warning line if damaged."""
        try:
            return self._read(name, caption)
        except FileNotFoundError:
            pass
        except BadEntry as e:
            _warn(f"text cache entry {self.store.path(name)}: {e}; it is rebuilt")
        self._fill({} if name == NULL_ENTRY else {name: caption}, 1, name == NULL_ENTRY)
        return self.store.read(name, caption)

    def encode(self, captions: list[str], device: torch.device | str) -> Condition:
        """The family's condition of B captions on ``device``: each key (B, ...) float32."""
        rows = [self._entry(entry_name(c), c) for c in captions]
        return {k: torch.cat([r[k] for r in rows]).to(device, non_blocking=True) for k in rows[0]}

    def null(self, n: int, device: torch.device | str) -> Condition:
        """The family's null condition for ``n`` rows (expanded views), read once per device."""
        device = torch.device(device)
        if self._null is None or next(iter(self._null.values())).device != device:
            self._null = {k: v.to(device) for k, v in self._entry(NULL_ENTRY, "").items()}
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
        store = TextCache.for_encoder(folder, family, options, cfg.data.cache_dir or None)
    except FileNotFoundError as e:
        raise ValueError(f"model.text_encoder: {e}") from None
    return CachedPromptEncoder(store, load, device)


def with_caption_options(data, cfg):
    """``data`` (``TrainingData``) with its captions passed through ``text.*`` (:class:`CaptionOptions`:
    trigger word, tag shuffling and dropout per sample seed); unchanged when none is set."""
    import dataclasses

    from .captions import CaptionOptions, TaggedCaptions

    options = CaptionOptions.from_config(cfg.text)
    if not options.active or not cfg.data.captions:
        return data
    heldout = None if data.heldout is None else TaggedCaptions(data.heldout, options)
    return dataclasses.replace(data, train=TaggedCaptions(data.train, options), heldout=heldout)


def run_captions(data, v) -> list[str]:
    """Every caption a run encodes: its training and held-out captions and ``validation.prompts`` (of the
    validation section ``v``)."""
    from .captions import dataset_captions

    captions = dataset_captions(data.train) + list(v.prompts)
    return captions + (dataset_captions(data.heldout) if data.heldout is not None else [])


def with_text_cache(data, conditioning, cfg, dctx) -> None:
    """Fill the text cache of a run whose text encoders are behind it (``conditioning.text`` a
    :class:`CachedPromptEncoder`; else nothing): rank 0 encodes the missing captions while the other
    ranks wait, then every rank reads the store. The encoders are released afterwards."""
    text = getattr(conditioning, "text", None)
    if not isinstance(text, CachedPromptEncoder):
        return
    from difftrain.runtime import distributed
    from difftrain.runtime.files import cache_dir_error

    def build() -> None:
        try:
            text.ensure(run_captions(data, cfg.validation), batch_size=cfg.validation.heldout_batch_size)
        except OSError as e:
            raise cache_dir_error(e, cfg.data.cache_dir, "text") from e

    distributed.run_on_main(build, dctx, long_wait=True)
    text.store.manifest = text.store.read_manifest()  # the other ranks: the one rank 0 wrote
    text.release()
