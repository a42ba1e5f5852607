"""The weights a run starts from (``model.init_from``): a diffusers UNet2DModel folder, a difftrain
weights file, checkpoint or run directory, or a base folder of a family.

    load_init_weights(model, "unet_folder/")         # a diffusers UNet2DModel folder, .safetensors or .pt
    load_init_network("sd_folder/")                  # a base folder -> its family's denoiser (difftrain.families)

Reading a diffusers UNet folder needs only ``safetensors`` (or torch for a ``.bin``).
"""

from __future__ import annotations

import json
import tomllib
import zipfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor, nn

from difftrain.checkpoints import sharded as sharded
from difftrain.checkpoints.checkpoint import FORMAT, OLDER_FORMATS, CheckpointError, load_checkpoint, load_weights
from difftrain.checkpoints.store import RUN_STATE, find_checkpoint, is_sharded_checkpoint
from difftrain.checkpoints.weights_file import WEIGHTS_FORMAT, is_weights_file, load_weights_file
from difftrain.diffusion.scheduler_configs import diffusers_training
from difftrain.families import Denoiser, detect, is_base_folder
from difftrain.families.base import loaded_names
from difftrain.families.sd import is_condition_unet_folder
from difftrain.models.diffusers_export import diffusers_config, diffusers_name
from difftrain.runtime import meta_init
from difftrain.runtime.tensor_source import TensorSource


# config.json keys of a UNet2DModel that change the function it computes (dropout does not).
_FUNCTIONAL_KEYS = (
    "in_channels", "out_channels", "block_out_channels", "layers_per_block", "down_block_types",
    "up_block_types", "norm_num_groups", "norm_eps", "flip_sin_to_cos", "freq_shift", "time_embedding_type",
    "center_input_sample", "act_fn", "downsample_padding", "mid_block_scale_factor", "resnet_time_scale_shift",
    "attention_head_dim", "num_class_embeds", "class_embed_type", "add_attention", "downsample_type",
    "upsample_type", "attn_norm_num_groups",
)


def _unet_folder(path: Path) -> Path:
    """The UNet folder of ``path``: itself, or its ``unet/`` (a whole pipeline folder)."""
    if (path / "config.json").is_file():
        return path
    if (path / "unet" / "config.json").is_file():
        return path / "unet"
    raise ValueError(f"model.init_from {path}: not a diffusers UNet2DModel folder (no config.json, "
                     "nor unet/config.json)")


def _read_diffusers_weights(folder: Path) -> dict[str, Tensor]:
    """The state dict of a diffusers model folder (safetensors preferred, else the .bin)."""
    st, binary = folder / "diffusion_pytorch_model.safetensors", folder / "diffusion_pytorch_model.bin"
    if st.is_file():
        tensors = load_file(str(st), device="cpu")
    elif binary.is_file():
        tensors = torch.load(binary, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"model.init_from {folder}: no diffusion_pytorch_model.safetensors or .bin in it")
    renamed = _loaded_names(folder, set(tensors))
    return {renamed.get(name, name): t for name, t in tensors.items()}


def _normal(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def _check_unet_config(model: nn.Module, folder: Path) -> None:
    """One ValueError naming the first functional config.json key of the UNet2DModel ``folder`` that differs
    from ``model``'s."""
    theirs_cfg = json.loads((folder / "config.json").read_text())
    ours_cfg = diffusers_config(model)
    for key in _FUNCTIONAL_KEYS:
        if key in theirs_cfg and _normal(theirs_cfg[key]) != _normal(ours_cfg[key]):
            raise ValueError(f"model.init_from {folder}: the UNet does not match this model's architecture "
                             f"(model.* / data.* settings): first mismatched key {key!r}: folder "
                             f"{theirs_cfg[key]!r}, this model {_normal(ours_cfg[key])!r}")


def _loaded_names(folder: Path, names: set[str]) -> dict[str, str]:
    """Old -> new of the weight ``names`` of the UNet2DModel ``folder`` that diffusers renames on load
    (attention blocks saved before diffusers 0.15, google/ddpm-cifar10-32's ``.bin``: ``query`` -> ``to_q``...):
    diffusers' own renaming run on the names (``families.base.loaded_names``) of the folder's UNet2DModel
    built on the meta device, nothing initialised."""
    from diffusers import UNet2DModel  # optional (the text extra): imported only where a diffusers folder is read

    with meta_init.empty_build() if meta_init.available() else torch.device("meta"):
        unet = UNet2DModel.from_config(json.loads((folder / "config.json").read_text()))
    return loaded_names(unet, names)


def diffusers_to_difftrain(model: nn.Module, folder: str | Path) -> dict[str, Tensor]:
    """The weights of the diffusers UNet2DModel in ``folder`` under ``model``'s names, or one
    ValueError naming the folder and the first key (config or weight) that does not match."""
    folder = _unet_folder(Path(folder))
    _check_unet_config(model, folder)
    tensors = _read_diffusers_weights(folder)
    own = model.state_dict()
    training_only = {k: t for k, t in own.items() if k.startswith("logvar.")}  # the loss weighting: kept as built
    names = {diffusers_name(k): k for k in own if k not in training_only}
    for key in sorted(set(names) | set(tensors)):
        if key not in tensors or key not in names:
            where = "missing from the folder" if key not in tensors else "not in this model"
            raise ValueError(f"model.init_from {folder}: the UNet does not match this model's architecture: "
                             f"first mismatched key {key!r} ({where})")
        if tensors[key].shape != own[names[key]].shape:
            raise ValueError(f"model.init_from {folder}: the UNet does not match this model's architecture: "
                             f"first mismatched key {key!r} (shape {tuple(tensors[key].shape)} in the folder, "
                             f"{tuple(own[names[key]].shape)} in this model)")
    return {**training_only, **{names[k]: t for k, t in tensors.items()}}


def load_init_network(source: str | Path):
    """The denoiser (weights included) of a ``model.init_from`` naming a base folder of a family
    (``difftrain.families``: a Stable Diffusion folder or a bare UNet2DConditionModel folder, ...); a
    ValueError naming the folder otherwise."""
    try:
        return detect(source).load_denoiser(Path(source).expanduser())
    except ValueError as e:
        raise ValueError(f"model.init_from: {e}") from None


def _load_denoiser_weights(model: nn.Module, path: Path) -> None:
    """Load the base folder ``path`` into the family denoiser ``model``, or a ValueError naming the
    folder and the first config key that differs."""
    loaded = load_init_network(path)
    _check_same_denoiser(model, loaded, path)
    model.load_state_dict(loaded.state_dict())


def _check_same_denoiser(model: nn.Module, loaded: nn.Module, path: Path) -> None:
    """One ValueError naming the folder and the first config key where ``loaded`` (the folder's denoiser)
    differs from ``model``."""
    ours, theirs = model.config, loaded.config
    if type(loaded) is not type(model):
        raise ValueError(f"model.init_from {path}: a {loaded.family} base, this network is a {model.family} denoiser")
    for key in sorted(set(ours) | set(theirs)):
        if not key.startswith("_") and ours.get(key) != theirs.get(key):
            raise ValueError(f"model.init_from {path}: the UNet does not match this model's architecture: first "
                             f"mismatched key {key!r}: folder {theirs.get(key)!r}, this model {ours.get(key)!r}")


# The diffusion.* keys a model.init_from source may have been trained with otherwise than this run.
INIT_SOURCE_KEYS = ("objective", "prediction", "schedule", "num_timesteps", "zero_terminal_snr")
def init_source_training(source: str | Path) -> dict:
    """What the weights ``model.init_from`` names were trained with, as far as the source tells:
    the ``diffusion.*`` values of :data:`INIT_SOURCE_KEYS` it records (a difftrain weights file,
    checkpoint or run directory: its config; a diffusers pipeline or Stable Diffusion folder, or
    its ``unet/``: the ``scheduler/`` config beside it). {} when it tells nothing (a bare UNet
    folder) or cannot be read. Reads no weights."""
    path = Path(source).expanduser()
    try:
        if (path.is_dir() and not (path / "checkpoints").is_dir() and not list(path.glob("step_*.pt"))
                and not list(path.glob("step_*.dcp")) and not is_sharded_checkpoint(path)):
            for folder in (path, path.parent):
                config = folder / "scheduler" / "scheduler_config.json"
                if config.is_file() and (folder == path or path.name == "unet"):
                    return diffusers_training(json.loads(config.read_text()))
            return {}
        if is_weights_file(path):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                diffusion = tomllib.loads((f.metadata() or {})["config"]).get("diffusion", {})
        else:
            found = find_checkpoint(path)  # a file, or a sharded checkpoint's folder (its config is in RUN_STATE)
            saved = torch.load(found / RUN_STATE if found.is_dir() else found, map_location="cpu", weights_only=True,
                               mmap=True)
            diffusion = saved["config"].get("diffusion", {})
    except (OSError, ValueError, KeyError, RuntimeError, TypeError, AttributeError):
        return {}
    defaults = {"objective": "ddpm", "zero_terminal_snr": False}  # configs written before these keys
    return {k: diffusion.get(k, defaults.get(k)) for k in INIT_SOURCE_KEYS if k in diffusion or k in defaults}


def init_source_changes(m, diffusion) -> list[str]:
    """One line per diffusion.* key that this new run (its diffusion section ``diffusion``) sets otherwise
    than the weights of ``model.init_from`` (of its model section ``m``) were trained with. A fine-tune may
    switch them (Stable Diffusion 2.x went from epsilon to v prediction this way), while a resume refuses
    to; the line says so."""
    if not m.init_from:
        return []
    source = init_source_training(m.init_from)
    lines = []
    for key in INIT_SOURCE_KEYS:
        ours = getattr(diffusion, key)
        if key in source and source[key] != ours:
            lines.append(f"model.init_from {m.init_from} was trained with diffusion.{key}={source[key]!r}; "
                         f"this run fine-tunes it with {ours!r}: allowed for a new run (a resume refuses such a "
                         "change), and its first steps retrain the network to it")
    return lines


def defer_init_weights(model: nn.Module, source: str | Path, deferred) -> bool:
    """``model.init_from`` for a network built on the meta device (FSDP's sharded start): instead of loading,
    record in ``deferred`` (a ``runtime.tensor_source.DeferredWeights``) where each weight lies in the
    source's files, checked as :func:`load_init_weights` checks them (names, shapes, config), to be read one
    tensor at a time: safetensors, a ``.bin`` folder's or a checkpoint file's EMA weights (mapped by
    ``torch.load(weights_only=True, mmap=True)``); a sharded checkpoint's EMA weights, which a sharded network
    reads each rank its own part of once its shards exist (:func:`_sharded_checkpoint_source`). False, with nothing recorded, for a
    source that cannot be read so (a ``.bin`` in torch's legacy format, a file that is no difftrain
    checkpoint): :func:`load_init_weights` reads it whole, or says what is wrong with it."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"model.init_from {path} does not exist")
    built, load = frozenset(), None
    if isinstance(model, Denoiser):
        try:
            empty = detect(path).empty_denoiser(path)
        except ValueError:
            return False  # not a base folder: load_init_weights says so
        if empty is None:
            return False
        _check_same_denoiser(model, empty[0], path)
        found = empty[1]
    elif is_condition_unet_folder(path):
        return False  # load_init_weights refuses it
    elif path.is_dir() and ((path / "config.json").is_file() or (path / "unet" / "config.json").is_file()):
        folder = _unet_folder(path)
        _check_unet_config(model, folder)
        built = frozenset(k for k in model.state_dict() if k.startswith("logvar."))  # the loss weighting: kept as built
        ours = {diffusers_name(k): k for k in model.state_dict() if k not in built}
        found = TensorSource.of_folder(folder)
        if found is None:
            return False
        renamed = _loaded_names(folder, found.names())
        found = found.renamed({k: ours.get(renamed.get(k, k), "unknown:" + k) for k in found.names()})
    elif is_weights_file(path):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if (f.metadata() or {}).get("format") != WEIGHTS_FORMAT:
                return False  # load_weights_file says why
        found = TensorSource.of_files([path])
    else:
        found = _checkpoint_source(path)
        if found is None:
            found, load = _sharded_checkpoint_source(path)
            if found is None:
                return False
    try:
        deferred.add(model, found, built)
    except ValueError as e:
        raise ValueError(f"model.init_from {path}: the weights do not match this model's architecture: {e}") from None
    if load is not None:
        deferred.add_loaded(model, load)
    return True


def _sharded_checkpoint_source(path: Path):
    """(a ``TensorSource`` of the EMA weights, what :func:`load_init_weights` takes, of the sharded checkpoint
    folder ``path`` names (itself, or a run directory's newest), its loader) for a network built on the meta
    device: the source's names and shapes from the checkpoint's metadata alone (its tensors read one whole
    at a time, ``sharded_checkpoint.tensor_source``: a LoRA base's, a quantized base's), and the loader, which
    fills a sharded network in place with each rank reading only its own part of each tensor, no tensor made
    whole (``sharded_checkpoint.load_part``: ``torch.distributed.checkpoint.load``, the metadata read by
    ``training/dcp_reader.py``). (None, None) for anything else (a file that is no difftrain checkpoint:
    :func:`load_init_weights` refuses it)."""
    try:
        folder = find_checkpoint(path)
    except (FileNotFoundError, OSError):
        return None, None
    if not is_sharded_checkpoint(folder):
        return None, None
    load_checkpoint(folder, tensors=False)  # its run state, checked as load_init_weights checks it
    return sharded.tensor_source(folder, "ema"), lambda tensors, dctx: sharded.load_part(folder, "ema", tensors, dctx)


def _checkpoint_source(path: Path):
    """A ``TensorSource`` of the EMA weights (what :func:`load_init_weights` takes) of the checkpoint file
    ``path`` names (itself, or a run directory's newest), mapped, nothing read; None for anything else (a
    sharded checkpoint's folder, a file that is no difftrain checkpoint: ``load_checkpoint`` reads or refuses it)."""
    try:
        file = find_checkpoint(path)
        if not file.is_file() or not zipfile.is_zipfile(file):
            return None
        head = torch.load(file, map_location="cpu", weights_only=True, mmap=True)  # the index; no tensor read
        if not isinstance(head, dict) or head.get("format") not in (FORMAT, *OLDER_FORMATS):
            return None
        del head
        return TensorSource.of_torch_files([file], at=("ema", "model"))
    except Exception:  # noqa: BLE001 - whatever it is, load_checkpoint names it in one line
        return None


def load_init_weights(model: nn.Module, source: str | Path) -> None:
    """Load ``model.init_from`` into ``model``: a diffusers UNet2DModel folder (or pipeline
    folder), a difftrain weights file (``.safetensors``) or a checkpoint / run directory (its EMA
    weights); into a ``ConditionUNet``, a UNet2DConditionModel or Stable Diffusion folder.
    Weights only: no optimizer, step or data position."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"model.init_from {path} does not exist")
    if isinstance(model, Denoiser):
        if not is_base_folder(path):
            raise ValueError(f"model.init_from {path}: not a UNet2DConditionModel folder nor a Stable Diffusion "
                             f"folder (a base folder of a family), which this network (a {model.family} denoiser) needs")
        _load_denoiser_weights(model, path)
        return
    if is_condition_unet_folder(path) or is_base_folder(path):
        raise ValueError(f"model.init_from {path} is a UNet2DConditionModel (Stable Diffusion) UNet, not a "
                         "difftrain UNet or UNet2DModel: build the network with load_init_network")
    if path.is_dir() and ((path / "config.json").is_file() or (path / "unet" / "config.json").is_file()):
        tensors, key = diffusers_to_difftrain(model, path), "init_from"
    elif is_weights_file(path):
        tensors, key = load_weights_file(path)["tensors"], "init_from"
    else:
        tensors, key = load_checkpoint(path)["ema"]["model"], "ema.model"
    try:
        load_weights(model, {k: v.to(torch.float32) for k, v in tensors.items()}, path, key)
    except CheckpointError as e:
        raise ValueError(f"model.init_from {path}: the weights do not match this model's architecture: {e}") from None
