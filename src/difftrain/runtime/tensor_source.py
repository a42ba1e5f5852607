"""Weights read one whole tensor at a time from a base's files (safetensors, or torch's zip pickles:
a ``.bin`` folder, a ``.pt`` checkpoint), and the record of which weights a network built on the meta
device is still to be filled from them.

    source = TensorSource.of_folder(Path("sd/unet"))      # diffusion_pytorch_model(.safetensors | .bin | index)
    t = source.read("conv_in.weight")                      # float32, on the CPU: that tensor alone
    rows = source.read("conv_in.weight", (0, 160))         # its rows 0:160 alone (an FSDP rank's shard)
    deferred = DeferredWeights()
    deferred.add(denoiser, source)                         # the denoiser's weights lie in source
    readers = deferred.bind(model)                         # model's parameter / buffer name -> reader
    deferred.add_loaded(unet, load)                        # or: filled in place once sharded, each rank its part

FSDP (``runtime/fsdp.py``) fills each rank's shards from these readers, each rank reading its rows alone
(a safetensors ``get_slice``; a mapped torch tensor's rows), and a quantized base
(``networks/quantize.py``) its layers, so no process holds a base's whole weights. A safetensors read
opens the file, copies one tensor out and closes it (safetensors maps the file; a file kept open would
leave every page read resident in this process). A torch file (``torch.save``'s zip format) is opened
once with ``torch.load(weights_only=True, mmap=True)``: no code runs, and no tensor's bytes are read
until it is (each read copies that tensor out of the mapping); reopening it per read would unpickle its
whole index each time. The pages read stay mapped while the source lives: the page cache's (shared by
every process reading the file, and dropped under memory pressure), not a copy.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePath, PureWindowsPath

import torch
from safetensors import safe_open
from torch import Tensor, nn

WEIGHTS_STEM = "diffusion_pytorch_model"  # a diffusers model folder's weights file(s)


def _safetensors_tensor(file: Path, key: str) -> Tensor:
    with safe_open(str(file), framework="pt", device="cpu") as f:
        return f.get_tensor(key)


def _safetensors_rows(file: Path, key: str, start: int, stop: int) -> Tensor:
    """Rows ``start:stop`` (dim 0) of one tensor of a safetensors file, the others' bytes never read."""
    with safe_open(str(file), framework="pt", device="cpu") as f:
        return f.get_slice(key)[start:stop]


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def index_files(index: Path) -> list[Path]:
    """The weights files a sharded model's index (``*.safetensors.index.json`` / ``*.bin.index.json``: a JSON
    object whose ``weight_map`` maps each tensor name to its file) names, each once, in the index's folder.
    A file name must be relative and without ``..`` (checked on the name, not on where symbolic links lead:
    the Hugging Face cache links each file to its blob), so that no index reads a file outside its folder;
    that, and an index that is not such JSON, is one ValueError naming the index file."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise ValueError(f"weights index {index}: not a JSON object with a weight_map ({_first_line(e)})") from None
    if not (isinstance(weight_map, dict) and weight_map
            and all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())):
        raise ValueError(f"weights index {index}: its weight_map is not a table of tensor names to file names")
    files = []
    for name in sorted(set(weight_map.values())):
        path = PurePath(name)
        if (not name or "\0" in name or ".." in path.parts or path.is_absolute()
                or PureWindowsPath(name).is_absolute()):
            raise ValueError(f"weights index {index} names the file {name!r}, outside its folder "
                             "(a crafted index? a weights file is a file of the index's folder)")
        files.append(index.parent / path)
    return files


def check_weight_indexes(folder: Path) -> None:
    """:func:`index_files` of every ``*.index.json`` in ``folder`` and its subfolders one level down (a model
    folder, or a pipeline folder's parts): what diffusers' and transformers' ``from_pretrained`` would read a
    sharded model's files from, checked before they do (they join the names to the folder unchecked)."""
    for index in sorted([*Path(folder).glob("*.index.json"), *Path(folder).glob("*/*.index.json")]):
        if index.name != "model_index.json":  # a pipeline's list of parts, not a weights index
            index_files(index)


class TensorSource:
    """Name -> (file, the tensor's key in it); :meth:`read` gives one whole tensor (or some of its rows), float32.

    get: how one tensor is read, ``get(file, key)`` (default: from a safetensors file); get_rows: how rows
    ``start:stop`` of one are, ``get_rows(file, key, start, stop)`` (default: a safetensors slice with the
    default ``get``, else rows of what ``get`` gives)."""

    def __init__(self, keys: dict[str, tuple[Path, str]], shapes: dict[str, tuple[int, ...]],
                 get: Callable[[Path, str], Tensor] = _safetensors_tensor,
                 get_rows: Callable[[Path, str, int, int], Tensor] | None = None) -> None:
        self.keys, self.shapes, self._get = keys, shapes, get
        if get_rows is None:
            get_rows = _safetensors_rows if get is _safetensors_tensor else (
                lambda file, key, start, stop: get(file, key)[start:stop])
        self._get_rows = get_rows
        self.safetensors = get is _safetensors_tensor  # its tensors lie in safetensors files (runtime/stored_digest.py)
        self.from_index = False  # of_folder: the files an index (``*.index.json``) names, not one weights file

    @classmethod
    def of_files(cls, files: list[Path], rename: Callable[[str], str] = str) -> TensorSource:
        """Every tensor of ``files`` (safetensors), under ``rename(key)``; one ValueError naming a file
        whose header cannot be read."""
        keys: dict[str, tuple[Path, str]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for file in files:
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for k in f.keys():  # noqa: SIM118 - a safe_open, not a dict
                        keys[rename(k)] = (file, k)
                        shapes[rename(k)] = tuple(f.get_slice(k).get_shape())
            except Exception as e:  # noqa: BLE001 - safetensors raises several kinds; one line naming the file
                raise ValueError(f"cannot read the weights file {file}: {_first_line(e)}") from None
        return cls(keys, shapes)

    @classmethod
    def of_torch_files(cls, files: list[Path], at: tuple[str, ...] = (),
                       rename: Callable[[str], str] = str) -> TensorSource:
        """Every tensor of the state dicts in ``files`` (``torch.save``'s zip format: a ``.bin``; ``at``: the
        keys leading to it inside each file's dict, ``("ema", "model")`` in a checkpoint), under
        ``rename(key)``, each file opened once with ``torch.load(weights_only=True, mmap=True)`` (no code
        runs, no tensor read yet) and kept mapped while the source lives; one ValueError naming a file that
        cannot be read so or holds no dict of tensors there."""
        keys: dict[str, tuple[Path, str]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        mapped: dict[Path, dict[str, Tensor]] = {}
        for file in files:
            try:
                tensors = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # noqa: BLE001 - torch raises several kinds; one line naming the file
                raise ValueError(f"cannot read the weights file {file}: {_first_line(e)}") from None
            for key in at:
                tensors = tensors.get(key) if isinstance(tensors, dict) else None
            if not isinstance(tensors, dict) or not all(
                    isinstance(k, str) and isinstance(t, Tensor) for k, t in tensors.items()):
                where = f" at {'.'.join(at)}" if at else ""
                raise ValueError(f"weights file {file} holds no state dict (names -> tensors){where}")
            mapped[file] = tensors
            for k, t in tensors.items():
                keys[rename(k)] = (file, k)
                shapes[rename(k)] = tuple(t.shape)
        return cls(keys, shapes, lambda file, key: mapped[file][key].clone(),  # the copy leaves the mapping
                   lambda file, key, start, stop: mapped[file][key][start:stop].clone())

    @classmethod
    def of_tensors(cls, tensors: dict[str, Tensor], where: Path) -> TensorSource:
        """Tensors already in memory (a small file read whole: a LoRA adapter's start), read from ``where``."""
        return cls({k: (where, k) for k in tensors}, {k: tuple(t.shape) for k, t in tensors.items()},
                   lambda _file, key: tensors[key])

    @classmethod
    def of_folder(cls, folder: Path, rename: Callable[[str], str] = str) -> TensorSource | None:
        """The weights of a diffusers model folder: ``diffusion_pytorch_model.safetensors`` or ``.bin``, or the
        files its ``.safetensors.index.json`` / ``.bin.index.json`` names; None when it has none of them, or a
        ``.bin`` that cannot be mapped (torch's legacy pre-zip format, a damaged file, not a state dict): its
        loader reads it whole, or says what is wrong with it."""
        for suffix, of in ((".safetensors", cls.of_files), (".bin", cls.of_torch_files)):
            single, index = folder / f"{WEIGHTS_STEM}{suffix}", folder / f"{WEIGHTS_STEM}{suffix}.index.json"
            if single.is_file():
                files = [single]
            elif index.is_file():
                files = index_files(index)
            else:
                continue
            try:
                source = of(files, rename=rename) if suffix == ".safetensors" or all(
                    zipfile.is_zipfile(f) for f in files) else None
            except ValueError:
                if suffix == ".safetensors":
                    raise
                return None  # a .bin that cannot be mapped so: its loader reads it, or says what is wrong with it
            if source is not None:
                source.from_index = not single.is_file()
            return source
        return None

    def renamed(self, names: dict[str, str]) -> TensorSource:
        """This source with each name ``old`` of ``names`` (old -> new) read as ``new`` (the other names kept):
        the same files and keys in them."""
        source = TensorSource({names.get(n, n): where for n, where in self.keys.items()},
                              {names.get(n, n): shape for n, shape in self.shapes.items()}, self._get,
                              self._get_rows)
        source.from_index = self.from_index
        return source

    def names(self) -> set[str]:
        return set(self.keys)

    def read_stored(self, name: str) -> Tensor:
        """The whole tensor ``name`` on the CPU in the dtype its file stores it in (no check, no upcast)."""
        file, key = self.keys[name]
        return self._get(file, key)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> Tensor:
        """The whole tensor ``name`` on the CPU (a floating one as float32), a copy of its own (a safetensors
        file closed again), or (``rows``: (start, stop)) only its rows ``start:stop`` along dim 0, the other
        rows never read (an FSDP rank's shard: ``fsdp.fill_shard``); one ValueError naming the file when what
        is read is not finite."""
        file, key = self.keys[name]
        t = self._get(file, key) if rows is None else self._get_rows(file, key, *rows)
        if not t.is_floating_point():
            return t
        if not torch.isfinite(t).all():  # a NaN base trains and samples nothing
            raise ValueError(f"weights file {file}: weight {key} is not finite (NaN or infinity)")
        return t.to(torch.float32)


class DeferredWeights:
    """Modules built on the meta device whose weights are to be read from a :class:`TensorSource`
    (each module's state-dict names are the source's names), filled after the network is sharded."""

    def __init__(self) -> None:
        self.parts: list[tuple[nn.Module, TensorSource]] = []
        self._where: dict[int, Callable[[], Tensor]] = {}  # id of a tensor -> its reader
        self._later: list[tuple[nn.Module, Callable[[], tuple[TensorSource, frozenset[str]]]]] = []
        self._loaders: list[tuple[nn.Module, frozenset[str], Callable]] = []  # (module, its names, load): add_loaded

    def add_later(self, module: nn.Module, source: Callable[[], tuple[TensorSource, frozenset[str]]]) -> None:
        """:meth:`add` ``module`` with the (source, built) that ``source()`` gives, called by :meth:`bind`: for a
        source that must be made outside the meta build in progress (a LoRA file put on a base by peft, whose
        layers an empty build would leave on the meta device)."""
        self._later.append((module, source))

    def add(self, module: nn.Module, source: TensorSource, built: frozenset[str] = frozenset()) -> None:
        """``module``'s state-dict entries (parameters and persistent buffers) lie in ``source``, but for
        ``built`` (kept as the build makes them); a ValueError naming the first tensor missing, unknown or
        of another shape."""
        own = {k: tuple(t.shape) for k, t in module.state_dict().items()}
        missing, extra = sorted(set(own) - source.names() - built), sorted(source.names() - set(own))
        if missing or extra:
            raise ValueError(f"first mismatched key {(missing or extra)[0]!r} "
                             f"({'missing from the files' if missing else 'not in this model'})")
        for name in sorted(source.names()):
            if source.shapes[name] != own[name]:
                raise ValueError(f"first mismatched key {name!r} (shape {source.shapes[name]} in the files, "
                                 f"{own[name]} in this model)")
        self.parts.append((module, source))
        for name, t in module.state_dict(keep_vars=True).items():  # now: a wrapper (peft) may rename them later
            if name in source.keys:  # a reader of the whole tensor, or of rows (start, stop) of it
                self._where[id(t)] = lambda rows=None, source=source, name=name: source.read(name, rows)

    def add_loaded(self, module: nn.Module, load: Callable) -> None:
        """``module`` (added with its source too) can be filled without making any tensor whole:
        ``load(module.state_dict(), dctx)`` once the network is sharded (:meth:`load_sharded`), in place, each
        rank reading its own part only (a sharded checkpoint: ``sharded.load_part``) -- as long as
        its state-dict names are still those it has now (a wrapper that renames them, peft's, leaves it to its
        source, read one tensor at a time)."""
        self._loaders.append((module, frozenset(module.state_dict()), load))

    def _active_loaders(self) -> list[tuple[nn.Module, Callable]]:
        return [(m, load) for m, names, load in self._loaders if set(m.state_dict()) == names]

    def loaded(self, model: nn.Module) -> set[str]:
        """``model``'s parameter and buffer names (as :meth:`bind` names them) that :meth:`load_sharded` fills."""
        ids = {id(t) for m, _ in self._active_loaders() for t in m.state_dict(keep_vars=True).values()}
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        return {name for name, t in named if id(t) in ids}

    def load_sharded(self, dctx) -> None:
        """Every rank (a collective): run each loader of :meth:`add_loaded` whose module keeps its names on
        its module's state dict, the module sharded by now (``runtime/fsdp.py``; ``dctx``: its ranks)."""
        for module, load in self._active_loaders():
            load(module.state_dict(), dctx)

    def covers(self, module: nn.Module) -> bool:
        return any(m is module for m, _ in self.parts)

    def source_of(self, module: nn.Module) -> TensorSource | None:
        """The source ``module`` was added with (:meth:`add`), or None."""
        return next((s for m, s in self.parts if m is module), None)

    def tensors(self, module: nn.Module) -> Iterator[tuple[str, Tensor]]:
        """(state-dict name, whole tensor) of ``module`` (added here), one read at a time, by sorted name
        (a tensor the build keeps: its own value)."""
        source = next(s for m, s in self.parts if m is module)
        own = module.state_dict()  # before a wrapper renames them (the LoRA base's digest is taken first)
        for name in sorted(own):
            yield name, source.read(name) if name in source.keys else own[name]

    def bind(self, model: nn.Module) -> dict[str, Callable[[], Tensor]]:
        """``model``'s parameter and buffer names (``named_parameters`` / ``named_buffers``, before anything
        replaces them) -> a reader of that tensor's whole value (``read()``; ``read((start, stop))``: its
        rows start:stop alone), for every tensor a part holds (found by
        identity, so a wrapper's renaming -- peft's ``base_layer``, a denoiser's hidden prefix -- is followed);
        the sources given to :meth:`add_later` are made first."""
        for module, source in self._later:
            self.add(module, *source())
        self._later.clear()
        where = self._where
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        return {name: where[id(t)] for name, t in named if id(t) in where}
