"""How this run's network is made: the one question this module answers, through :func:`build_network`.

    net = build_network(cfg, conditioning)                       # a fresh run's network, on the CPU
    net = build_network(cfg, conditioning, state["network"], init_weights=False)   # a checkpoint's, to load into
    network_record(net)                                          # what rebuilds it: a checkpoint's "network"

From scratch (difftrain's UNet, ``models/``), from a base family's denoiser (``difftrain.families``), from
weights or a checkpoint (``model.init_from``: ``networks/init_from.py``), with LoRA and its variants
(``networks/lora.py``), over a quantized base (``model.quantize_base``: ``networks/quantize.py``), its adapter
started from another program's LoRA file (``model.init_lora_from``: ``networks/lora_import.py``). Under FSDP's
sharded start the network is built on the meta device and where its weights lie is recorded to be read later
(``deferred``: ``runtime/tensor_source.py``, ``runtime/meta_init.py``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from difftrain.config import Config
from difftrain.families import Denoiser, detect, family_of_config, family_of_record
from difftrain.families.unet import NETWORK_KIND as UNET_KIND
from difftrain.models import build_model
from difftrain.models.text import tensors_digest
from difftrain.networks.conditioning import Conditioning
from difftrain.networks.init_from import defer_init_weights, load_init_weights
from difftrain.networks.lora import BaseDigest, LoraNetwork, apply_lora, is_lora_record
from difftrain.networks.lora_import import adapter_start, init_adapter_from
from difftrain.networks.quantize import compute_dtype, device_refusal, quantize_while_loading
from difftrain.runtime import meta_init
from difftrain.runtime.stored_digest import STORED, stored_digest
from difftrain.runtime.tensor_source import DeferredWeights, TensorSource


def build_network(cfg: Config, conditioning: Conditioning, network: dict | None = None,
                  init_weights: bool = True, deferred: DeferredWeights | None = None,
                  device: torch.device | None = None, world_size: int = 1) -> nn.Module:
    """The network of a run, on the CPU: difftrain's UNet at the conditioning's shape (latent
    channels and resolution in a latent run, cross-attention in a text run), or a base family's
    denoiser (``difftrain.families``) when ``model.init_from`` names a base folder (or a
    checkpoint's ``network`` record says so: rebuilt from its config, without the folder).

    With ``model.init_from`` and ``init_weights``, the weights it names are loaded.

    ``model.gradient_checkpointing`` acts on every network: difftrain's UNet's ResBlocks (and
    cross-attention blocks), a family denoiser's blocks through diffusers'
    ``enable_gradient_checkpointing`` (UNet down/mid/up blocks, SD3/Flux transformer blocks).

    With ``lora.rank`` (or a checkpoint's LoRA record), the network is that base, always loaded
    from ``model.init_from`` (checkpoints hold the adapter alone), frozen, with LoRA layers
    injected (``networks/lora.py``); a base whose digest differs from the record's is refused.

    deferred: under FSDP's sharded start (built on the meta device, ``RunState._build_sharded``), the
    weights of ``model.init_from`` are not read: where each lies in its files (safetensors, a ``.bin`` folder
    or a checkpoint file, mapped) is recorded in ``deferred`` (a family's base: ``Family.empty_denoiser``;
    ``init_from.defer_init_weights``), as are the tensors of ``model.init_lora_from``, and the caller fills the
    shards from them one tensor at a time (a LoRA base's digest is read so too); a sharded checkpoint's folder
    (difftrain's UNet) is recorded to be read by each rank into its own shards (a LoRA base of one: one tensor
    at a time). A source that cannot be read so (a legacy ``.bin``) is loaded as without ``deferred``; a LoRA
    base of one raises ``meta_init.NotReplayable`` (the caller builds the network whole).

    ``model.quantize_base`` (no ``deferred``): a family base is quantized as it loads (:func:`_quantized_base`).

    device, world_size: where the network is to run, in how many processes (it is built on the CPU): a
    ``model.quantize_base`` that cannot run there raises one ValueError before anything is built
    (:func:`_check_quantize_device`). None: not checked.
    """
    if device is not None:
        _check_quantize_device(cfg.model, device, world_size)
    init_from = cfg.model.init_from
    saved_lora = network if is_lora_record(network) else None
    if saved_lora is not None or (network is None and cfg.lora.rank):
        quantized = _quantized_base(cfg, conditioning, saved_lora) if deferred is None else None
        if quantized is not None:  # model.quantize_base, each layer quantized as it is read from the files
            base, digest = quantized
        else:
            base = build_network(without_lora(cfg), conditioning,
                                 saved_lora["base"] if saved_lora else None, init_weights=True, deferred=deferred)
            if saved_lora is not None and family_of_record(saved_lora["base"]).base:  # its config, weights from init_from
                _init_weights(base, init_from, deferred)
            digest = _stored_digest(base, init_from, deferred) or _deferred_digest(base, deferred)
        net = apply_lora(base, cfg.lora, base_record=network_record(base), base_source=str(init_from),
                         saved=saved_lora, where=f"the adapter's base (model.init_from {init_from})",
                         quantize=cfg.model.quantize_base, quantize_dtype=compute_dtype(cfg.train.precision),
                         digest=digest)
        if saved_lora is None and cfg.model.init_lora_from:  # a new run's adapter from a LoRA file
            _start_adapter(net, cfg.model.init_lora_from, deferred)
        return net
    family = family_of_record(network) if network is not None else family_of_config(cfg.model)
    if family.base and not init_from and network is None:
        raise ValueError(f"model.family={family.name} needs model.init_from: the base folder to fine-tune")
    if family.base:
        if network is not None:
            denoiser = family.denoiser_from_record(network)
        else:
            try:
                empty = family.empty_denoiser(init_from) if deferred is not None else None
                denoiser = family.load_denoiser(init_from) if empty is None else empty[0]
            except ValueError as e:
                raise ValueError(f"model.init_from: {e}") from None
            if empty is not None:
                deferred.add(*empty)
            elif deferred is not None:
                raise meta_init.NotReplayable(f"the base {init_from} holds no safetensors weights of its denoiser")
        # diffusers' activation checkpointing of its blocks (difftrain's UNet: build_model sets its own)
        denoiser.set_gradient_checkpointing(cfg.model.gradient_checkpointing)
        return denoiser
    channels, resolution = conditioning.network_shape()
    model = build_model(cfg, conditioning.num_classes, context_dim=conditioning.context_dim,
                        in_channels=channels, resolution=resolution)
    if init_from and init_weights:  # existing weights (fine-tuning); the EMA starts from them too
        _init_weights(model, init_from, deferred)
    return model


def network_record(model: nn.Module) -> dict:
    """What rebuilds ``model`` besides the config: {"kind": "unet"} for difftrain's UNet, a
    family denoiser's record (its family and diffusers config), the LoRA record of a LoraNetwork."""
    if isinstance(model, LoraNetwork):
        return model.network_record()
    if isinstance(model, Denoiser):
        return model.record()
    return {"kind": UNET_KIND}


def without_lora(cfg: Config) -> Config:
    """``cfg`` with ``lora.rank`` 0: the config of the base network."""
    base = copy.deepcopy(cfg)
    base.model.init_lora_from = ""
    base.model.quantize_base = "off"  # the base is quantized by apply_lora, after its digest
    base.model.swap_blocks = 0  # the block swap is the training loop's (training/state.py), over the LoRA network
    base.lora.rank = 0  # validated like any change
    return base


def _check_quantize_device(model_cfg, device: torch.device, world_size: int = 1) -> None:
    """One ValueError when ``model.quantize_base`` (of the config's ``model`` section) cannot run on
    ``device`` in ``world_size`` processes (``networks/quantize.py``)."""
    refusal = device_refusal(model_cfg.quantize_base, device, world_size)
    if refusal:
        raise ValueError(refusal)


def _init_weights(model: nn.Module, init_from: str, deferred: DeferredWeights | None) -> None:
    """``model.init_from`` into ``model``: loaded, or, with ``deferred``, recorded there to be read later
    where its source allows (``init_from.defer_init_weights``)."""
    if deferred is None or not defer_init_weights(model, init_from, deferred):
        load_init_weights(model, init_from)


def _start_adapter(net: nn.Module, path: str, deferred: DeferredWeights | None) -> None:
    """``model.init_lora_from`` into the new adapter of ``net``: loaded, or, with ``deferred`` (``net`` on the
    meta device), its tensors recorded there to fill the adapter's shards from (the rest of the adapter keeps
    the start the build records), read once the meta build is over (another program's file is put on a
    stand-in of the base by peft, which must make real layers)."""
    if deferred is None:
        init_adapter_from(net, path)
        return

    def source() -> tuple[TensorSource, frozenset[str]]:
        start = adapter_start(net, path)
        return TensorSource.of_tensors(start, Path(path)), frozenset(net.state_dict()) - set(start)

    deferred.add_later(net, source)


def _quantized_base(cfg: Config, conditioning: Conditioning, saved_lora: dict | None) -> tuple[nn.Module, str] | None:
    """(the LoRA base of ``cfg`` quantized as it loads, its digest) under ``model.quantize_base``: a family's
    denoiser built on the meta device, its digest read from its files one tensor at a time, then filled from
    them layer by layer, each Linear quantized as soon as its weight is read (``quantize.quantize_while_loading``):
    the peak is the quantized base and one float layer, where loading first held the whole float base. The
    same layers and digest as quantizing after a whole load. difftrain's UNet (from a weights file, a
    checkpoint file, a sharded checkpoint's folder or a diffusers folder) is built so too, with its initialisation recorded and replayed on
    scratch tensors one at a time, so that the adapter then draws the whole build's random numbers (and what
    the files do not hold is made as the whole build makes it: :func:`_replayed_unet`). None (built whole, quantized after) for quantize_base "off" and a base whose
    weights are not all in files it can map (``Family.empty_denoiser``)."""
    if cfg.model.quantize_base == "off" or not cfg.model.init_from or not meta_init.available():
        return None
    record = saved_lora["base"] if saved_lora is not None else None
    files = DeferredWeights()
    if not (family_of_record(record) if record is not None else family_of_config(cfg.model)).base:
        base = _replayed_unet(cfg, conditioning, record, files)
        if base is None:
            return None
    else:
        with meta_init.empty_build():
            try:
                base = build_network(without_lora(cfg), conditioning, record, deferred=files)
            except meta_init.NotReplayable:  # no files to read it from
                return None
        if record is not None and not defer_init_weights(base, cfg.model.init_from, files):
            return None
    readers = files.bind(base)
    if any(p.is_meta for name, p in base.named_parameters() if name not in readers):
        return None
    digest = _deferred_digest(base, files)
    quantize_while_loading(base, cfg.model.quantize_base, readers, compute_dtype(cfg.train.precision))
    return base, digest


def _replayed_unet(cfg: Config, conditioning: Conditioning, record: dict | None,
                   files: DeferredWeights) -> nn.Module | None:
    """difftrain's UNet, the LoRA base of ``cfg``, built on the meta device with its initialisation recorded
    and where its weights lie in ``model.init_from``'s files recorded in ``files``; each parameter the files do
    not hold made whole from the replayed initialisation, every other recorded call replayed on scratch, so
    that the global CPU generator ends where the whole build leaves it. None, the generator where it was,
    when the files do not hold it one tensor at a time or the build cannot be replayed."""
    with meta_init.recorded_build() as recording:
        base = build_network(without_lora(cfg), conditioning, record, deferred=files)
    recording.bind(base)
    readers = files.bind(base)
    try:
        if not files.covers(base):
            raise meta_init.NotReplayable("its weights are not all in files read one tensor at a time")
        built = {name for name, _ in base.named_parameters()} - set(readers)
        meta_init.replay(recording, lambda name, whole: _set_parameter(base, name, whole), built)
    except meta_init.NotReplayable:
        torch.random.set_rng_state(recording.rng)  # the whole build starts where this one did
        return None
    return base


def _set_parameter(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """The parameter ``name`` of ``module`` (on the meta device) replaced by ``value``."""
    owner, _, leaf = name.rpartition(".")
    parent = module.get_submodule(owner)
    setattr(parent, leaf, nn.Parameter(value, requires_grad=getattr(parent, leaf).requires_grad))


def _stored_digest(base: nn.Module, init_from: str, deferred: DeferredWeights | None) -> BaseDigest | None:
    """The digest of a family's LoRA base (a ``Denoiser``) from its files as stored (``runtime/stored_digest.py``:
    never upcast, cached by the files' fingerprint), with the FLOAT32 digest of the same files as its legacy (to
    check a record written before, read one tensor at a time); the files are the deferred build's source, else
    those ``model.init_from``'s folder holds (``Family.empty_denoiser``: headers only). None for any other base
    (difftrain's UNet, a checkpoint: its FLOAT32 digest as before) and a folder whose weights cannot be read
    one tensor at a time (a legacy ``.bin``)."""
    if not isinstance(base, Denoiser):
        return None
    source = deferred.source_of(base) if deferred is not None else None
    if source is None:
        if not init_from:
            return None
        folder = Path(init_from).expanduser()
        try:
            family = detect(folder)
            if meta_init.available():  # the names the loader gives them (diffusers' renaming of old names)
                source = (family.empty_denoiser(folder) or (None, None))[1]
            else:  # no accelerate: no empty build, the files' own names
                source = TensorSource.of_folder(family.denoiser_folder(folder))
        except ValueError:
            return None
        if source is None:
            return None
    if set(source.names()) != set(base.state_dict()):
        return None
    return BaseDigest(stored_digest(source), STORED,
                      lambda: tensors_digest((name, source.read(name)) for name in sorted(source.names())))


def _deferred_digest(base: nn.Module, deferred: DeferredWeights | None) -> str | BaseDigest | None:
    """The LoRA base's digest read from its files one tensor at a time (``deferred``): a family's base as
    stored (:func:`_stored_digest`), another's upcast to float32; or None (no deferred build: ``apply_lora``
    takes it from the weights); ``meta_init.NotReplayable`` for a base on the meta device whose weights are
    not all in files."""
    if deferred is None:
        return None
    stored = _stored_digest(base, "", deferred)
    if stored is not None:
        return stored
    if deferred.covers(base):
        try:
            return tensors_digest(deferred.tensors(base))
        except NotImplementedError:  # a weight the build keeps, on the meta device until replayed
            pass
    raise meta_init.NotReplayable("the LoRA base's weights are not all in safetensors files (model.init_from)")
