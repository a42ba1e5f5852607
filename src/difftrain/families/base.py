"""The interface of a base family (SD 1.x/2.x, SDXL, SD3, Flux...): what differs between them, behind
one object the loop, the step, checkpoints, export and the CLI ask instead of branching on a name.

    family = detect("sdxl-folder")                 # families/__init__.py, from model_index.json
    net = family.load_denoiser("sdxl-folder")      # a Denoiser: net(x, t, cond) -> out
    text = family.load_prompt_encoder("sdxl-folder", device)
    cond = text.encode(["a photo of a dog"], device) | family.image_conditions(geometry, (64, 64))
    out = net(x, t, cond)                          # cond: dict of batch-first tensors

Three objects, one file per family (families/sd.py, sdxl.py, sd3.py, flux.py):

- :class:`Family`: a registered, stateless description (name, detection, parts, defaults, LoRA
  targets, FSDP units, export, LoRA files).
- :class:`Denoiser`: the trained network, an ``nn.Module`` wrapping the family's diffusers model;
  ``forward(x, t, cond)`` with difftrain's 4-D latents and a dict condition.
- :class:`PromptEncoder`: the frozen text encoders and tokenizers, captions -> a dict condition.

Why a dict of batch-first tensors: caption dropout (:func:`drop_rows`, a ``torch.where`` per row, no
host read), each rank's rows, the latent and text-embedding caches and CUDA-graph static buffers then
treat every family alike.

Lower layers (data, runtime, diffusion, models) never import this package; training/ and the commands
do. diffusers and transformers are imported only when a part is loaded.
"""

from __future__ import annotations

import importlib
import contextlib
import json
import logging
import math
import re
import shutil
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from difftrain.models.text import (check_loading_info, first_line, model_weights_source, quiet_loading, streamed_digest,
                                   tokenize, tokenize_with_mask)
from difftrain.models.vae import LatentCodec, vae_folder
from difftrain.runtime import meta_init
from difftrain.runtime.device import to_device_async
from difftrain.runtime.files import atomic_write_bytes
from difftrain.runtime.optional import diffusers_pipeline
from difftrain.runtime.stored_digest import STORED
from difftrain.runtime.tensor_source import TensorSource, check_weight_indexes, index_files

Condition = dict[str, Tensor]  # every tensor batch-first (B, ...)

# The "kind" of a family network's record in checkpoints: {"kind": RECORD_KIND, "family": name, "config": {...}}.
RECORD_KIND = "family"
# The prefix of the wrapped diffusers model inside a Denoiser, hidden from state dicts.
_PREFIX = "model."
CLIP_TOKENS = 77  # the CLIP tokenizers' model_max_length in the released bases (prompts are padded to it)
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # what save_lora_weights writes, load_lora_weights reads


# ---------------------------------------------------------------------------------------------
# The denoiser.


class Denoiser(nn.Module):
    """``net(x (B, C, h, w), t (B,), cond: dict[str, Tensor]) -> (B, C, h, w)``: a family's diffusers
    denoiser (``self.model``) behind difftrain's call.

    Contract every family keeps:

    - ``x`` is the latent as difftrain holds it, 4-D, unchanged for every family (Flux packs 2x2
      patches and makes ``txt_ids`` / ``img_ids`` inside ``forward``, and unpacks its output);
    - ``t`` (B,) (a 0-d tensor is broadcast) is the objective's network condition (DDPM: the integer
      timestep; flow: 1000 t); the family maps it to its model's convention (Flux takes t in [0, 1]);
    - ``cond`` is what the family's :class:`PromptEncoder` and :meth:`Family.image_conditions` return
      (e.g. SD ``{"prompt_embeds": (B, L, D)}``; SDXL adds ``"pooled"`` (B, 1280) and ``"time_ids"``
      (B, 6)); a missing key is one ValueError naming it;
    - its ``state_dict`` is the wrapped model's (diffusers names, no prefix), so a checkpoint's
      weights load into the diffusers class as they are, and peft's adapter names are diffusers';
    - :meth:`record` (JSON-able) rebuilds the architecture without the base folder
      (:meth:`Family.denoiser_from_record`).

    Subclasses set ``family`` (the registry name) and implement :meth:`forward`.
    """

    family: str = ""
    num_classes = 0  # a text model: no class labels

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    def counted_on_meta(self) -> AbstractContextManager:
        """What a training forward on meta tensors needs (``tools/base_memory.py`` counts activations so): nothing
        by default; a model that reads values on the host (Lumina 2: its mask's token counts) says how to count."""
        return nullcontext()

    @property
    def config(self) -> dict:
        """The wrapped model's diffusers config as a JSON-able dict (``from_config`` takes it)."""
        return json.loads(json.dumps(dict(self.model.config)))

    def record(self) -> dict:
        """What rebuilds this network besides the run's config: ``{"kind": "family", "family": name,
        "config": the diffusers config, "lora_targets": the family's default LoRA targets}``."""
        return {"kind": RECORD_KIND, "family": self.family, "config": self.config,
                "lora_targets": list(family_named(self.family).lora_targets)}

    @property
    def in_channels(self) -> int:
        return int(self.model.config.in_channels)

    @property
    def out_channels(self) -> int:
        return int(getattr(self.model.config, "out_channels", None) or self.in_channels)

    def fsdp_units(self) -> list[nn.Module]:
        """The blocks FSDP shards one by one (``Family.fsdp_units``; ``runtime/fsdp.py`` calls this)."""
        return family_named(self.family).fsdp_units(self)

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """diffusers' activation checkpointing of the model's blocks, on or off."""
        if enabled:
            self.model.enable_gradient_checkpointing()
        else:
            self.model.disable_gradient_checkpointing()

    def forward(self, x: Tensor, t: Tensor, cond: Condition) -> Tensor:  # pragma: no cover - interface
        raise NotImplementedError(f"{type(self).__name__}.forward")


def require_keys(cond: Condition | None, keys: tuple[str, ...], batch: int, family: str) -> Condition:
    """``cond`` if it is a dict holding ``keys``, each with ``batch`` rows; else one ValueError naming
    what is missing (a Denoiser's first line of ``forward``)."""
    if not isinstance(cond, dict):
        raise ValueError(f"the {family} denoiser takes its condition as a dict with {', '.join(keys)}; "
                         f"got {'None' if cond is None else type(cond).__name__} (a text run needs captions)")
    for key in keys:
        if key not in cond:
            raise ValueError(f"the {family} denoiser's condition lacks {key!r} (has {', '.join(cond) or 'nothing'})")
        if cond[key].shape[0] != batch:
            raise ValueError(f"the {family} denoiser's condition {key!r} has {cond[key].shape[0]} rows, x has {batch}")
    return cond


def _strip_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict post-hook: ``{prefix}model.name`` -> ``{prefix}name``, in place, order kept."""
    for key in [k for k in state_dict if k.startswith(prefix + _PREFIX)]:
        state_dict[prefix + key[len(prefix) + len(_PREFIX):]] = state_dict.pop(key)


def _add_prefix(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Load pre-hook: ``{prefix}name`` -> ``{prefix}model.name``, in place."""
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + _PREFIX)]:
        state_dict[prefix + _PREFIX + key[len(prefix):]] = state_dict.pop(key)


# ---------------------------------------------------------------------------------------------
# The prompt encoder.


class PromptEncoder(nn.Module):
    """The frozen text encoders and tokenizers of one family: captions -> a dict condition.

    Attributes: ``dim`` (D, the width of ``prompt_embeds``), ``source`` (the folder it came from), ``digest`` (SHA-256 of every encoder's weights
    and every tokenizer's vocabulary: checkpoints name the source and check the digest, never save the
    weights). Frozen: no grad, stays in eval mode.

    The null (dropped) condition of caption dropout and guidance is ``encode([""])``, computed once
    (:meth:`null`); each family documents what its diffusers pipeline does for the negative prompt
    (SDXL and SD3 use zeros when ``force_zeros_for_empty_prompt``: their :meth:`null` says which).
    """

    source: str = ""
    digest: str = ""
    dim: int = 0
    # The encoder models (submodule names) that :meth:`encode_part` runs one at a time, in order, and
    # :meth:`assemble` combines: the text cache's fill holds one of them on the device at a time. () = one
    # stage, :meth:`encode` itself.
    parts: tuple[str, ...] = ()
    # The digest's kind (runtime.stored_digest: STORED, the encoders' files as stored; "float32" was before).
    digest_kind: str = STORED

    def __init__(self) -> None:
        super().__init__()
        self._null: Condition | None = None
        self._null_key = ""  # the device the null condition was encoded for
        # Deferred (``load_prompt_encoder(..., deferred=True)``: the text cache's fill): each part's
        # ``loader(dtype)`` and folder; the part is None until :meth:`load_model` and again after :meth:`free_model`.
        self.loaders: dict[str, Callable[[torch.dtype], nn.Module]] = {}
        self.folders: dict[str, Path] = {}
        self.float32_loads: dict[str, Callable[[], nn.Module]] = {}

    def add_part(self, name: str, folder: Path, load: Callable[[torch.dtype], nn.Module], deferred: bool) -> None:
        """Part ``name`` (a model in ``folder``, ``load(dtype)`` loads it on the host, frozen): loaded now in
        float32, or with ``deferred`` left None until :meth:`load_model`."""
        self.folders[name] = Path(folder)
        self.float32_loads[name] = lambda: load(torch.float32)  # the legacy digest's: read again from the files
        if deferred:
            self.loaders[name] = load
        _set_part(self, name, None if deferred else load(torch.float32))

    def load_model(self, name: str, dtype: torch.dtype) -> nn.Module:
        """A deferred part loaded from its files on the host in ``dtype`` (never float32 first), set in place."""
        module = self.loaders[name](dtype)
        _set_part(self, name, module)
        return module

    def free_model(self, name: str) -> None:
        """Drop a deferred part (its memory), until :meth:`load_model` loads it again."""
        _set_part(self, name, None)

    def part_numel(self, name: str) -> int:
        """Elements of part ``name``'s weights: its files' headers for a deferred part (nothing read), else its
        parameters and buffers."""
        module = self.get_submodule(name) if name not in self.loaders else None
        if module is not None:
            return sum(t.numel() for t in (*module.parameters(), *module.buffers()))
        source = model_weights_source(self.folders[name])
        return sum(math.prod(shape) for shape in source.shapes.values()) if source is not None else 0

    def legacy_digest(self) -> str:
        """The digest records written before the stored one hold (FLOAT32: every weight upcast, by
        ``models.text.weights_digest``), each part loaded in float32 for its turn only: slow, to check such a
        record once; read again from the files, whatever dtype the run holds them in. A family whose digest
        was not ``weights_digest`` of its parts overrides it."""
        return streamed_digest([self.float32_loads[n] for n in self.parts], self.legacy_extra())

    def legacy_extra(self) -> bytes:  # pragma: no cover - interface
        """The ``extra`` (tokenizers' vocabularies, settings) the FLOAT32 digest hashed after the weights."""
        raise NotImplementedError(type(self).__name__)

    @torch.no_grad()
    def encode(self, captions: list[str], device: torch.device | str = "cpu") -> Condition:
        """The condition of B captions on ``device``: a dict of float32 tensors, each (B, ...); by default
        :meth:`assemble` of every part's :meth:`encode_part` (a family with ``parts`` () overrides it)."""
        return self.assemble({name: self.encode_part(name, captions) for name in self.parts}, device)

    def encode_part(self, name: str, captions: list[str]) -> Condition:  # pragma: no cover - interface
        """The outputs of the encoder model ``name`` (one of ``parts``) for B captions, on its device, each (B, ...)."""
        raise NotImplementedError(f"{type(self).__name__} encodes in one stage")

    def assemble(self, outputs: dict[str, Condition], device: torch.device | str) -> Condition:  # pragma: no cover
        """The condition (float32 on ``device``) of B captions from each part's :meth:`encode_part` outputs."""
        raise NotImplementedError(f"{type(self).__name__} encodes in one stage")

    def null(self, n: int, device: torch.device | str) -> Condition:
        """The null condition for ``n`` rows (:meth:`null_of` ``encode([""])``, encoded once per device)."""
        key = str(device)  # as given: "cuda" and the tensors' "cuda:0" would never compare equal
        if self._null is None or self._null_key != key:
            self._null, self._null_key = self.encode([""], device), key
        return self.null_of(self._null, n)

    def null_of(self, empty: Condition, n: int) -> Condition:
        """The null condition of ``n`` rows given ``empty`` = ``encode([""])`` (1, ...): its rows, expanded
        (SDXL with ``force_zeros_for_empty_prompt``: zeros)."""
        return {k: v.expand(n, *v.shape[1:]) for k, v in empty.items()}

    def reference(self) -> dict:
        """``{"source", "digest", "digest_kind"}``: how checkpoints name these frozen parts."""
        return {"source": self.source, "digest": self.digest, "digest_kind": self.digest_kind}

    def digest_of(self, kind: str) -> str:
        """The digest of ``kind``: :attr:`digest` (STORED), or FLOAT32 (:meth:`legacy_digest`: slow, to check a
        record written before the stored digest)."""
        return self.digest if kind == self.digest_kind else self.legacy_digest()

    def train(self, mode: bool = True) -> PromptEncoder:
        """Frozen: stays in eval mode whatever a parent module asks."""
        return super().train(False)


def _set_part(encoder: nn.Module, name: str, module: nn.Module | None) -> None:
    """Set submodule ``name`` (dotted: ``encoders.0``) of ``encoder`` to ``module`` (None: an empty slot)."""
    parent, _, leaf = name.rpartition(".")
    setattr(encoder.get_submodule(parent) if parent else encoder, leaf, module)


def frozen_part(folder: Path, sub: str, cls, what: str) -> Callable[[torch.dtype], nn.Module]:
    """``load(dtype)``: the model ``folder/sub`` (:func:`load_part`) in ``dtype`` on the host, eval, no grad; a
    missing ``sub/`` is refused now (load_part's line), not when it is loaded."""
    if not (Path(folder) / sub).is_dir():
        raise ValueError(f"{folder}: no {sub}/ (the {what}); this base folder needs it")
    return lambda dtype: load_part(folder, sub, cls, what, dtype=dtype).eval().requires_grad_(False)


def token_ids(tokenizer, captions: list[str], length: int, device: torch.device | str) -> Tensor:
    """(B, length) long on ``device``: ``captions`` tokenized as the pipelines tokenize them (padded to
    ``length``, truncated: ``models.text.tokenize``), made on the host and copied without waiting for the
    device (``runtime.device.to_device_async``). The one tokenise-and-copy of every family's text encoders."""
    return to_device_async(tokenize(tokenizer, captions, length), device)


def token_ids_and_mask(tokenizer, captions: list[str], length: int, device: torch.device | str,
                       add_special_tokens: bool = True) -> tuple[Tensor, Tensor]:
    """(ids (B, length) long, mask (B, length) long: 1 on the tokens) on ``device``: :func:`token_ids` with the
    tokenizer's attention mask (``models.text.tokenize_with_mask``; ``add_special_tokens=False`` for text a chat
    template made), for the text encoders run with one."""
    ids, mask = tokenize_with_mask(tokenizer, captions, length, add_special_tokens)
    return to_device_async(ids, device), to_device_async(mask, device)


def drop_rows(cond: Condition, null: Condition, drop: Tensor) -> Condition:
    """``cond`` with the rows where ``drop`` (B,) bool is True replaced by ``null``'s (rows
    broadcastable to B): caption dropout as one ``torch.where`` per tensor, no host read."""
    out = {}
    for key, value in cond.items():
        mask = drop.to(value.device, non_blocking=True).view(-1, *([1] * (value.ndim - 1)))  # on it already
        out[key] = torch.where(mask, null[key].to(value.dtype), value)
    return out


# ---------------------------------------------------------------------------------------------
# The family.


def loaded_names(model: nn.Module, names: set[str]) -> dict[str, str]:
    """The name each of ``names`` (a diffusers model's weights file) is loaded under by ``from_pretrained``:
    diffusers' own renaming (``ModelMixin._fix_state_dict_keys_on_load``, which it applies to a model's
    weights when they are one file, not an index of shards) run on the names alone: given a dict of
    name -> name, it moves each entry it renames, so the dict it leaves maps new name -> old."""
    fix = getattr(model, "_fix_state_dict_keys_on_load", None)
    if fix is None:  # a diffusers version without it renames nothing
        return {}
    table = {name: name for name in names}
    fix(table)
    return {old: new for new, old in table.items() if old != new}


def transformers_loaded_names(model: nn.Module, names: set[str]) -> dict[str, str]:
    """The name (old -> new) each of ``names`` (a transformers model's weights files) is loaded under by its
    ``from_pretrained``: transformers' own renaming of the names its checkpoints keep (Qwen2.5-VL's ``model.*`` and
    ``visual.*`` load as ``model.language_model.*`` and ``model.visual.*``), run on the names alone; names a weight
    converter (fusing several tensors) takes are left as they are. {} when the installed transformers has none."""
    try:  # transformers (an optional package, [text]) >= 5: its loading's renaming
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key  # as above
    except ImportError:
        return {}
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    meta = model.state_dict()
    out = {}
    for name in names:
        new, converter = rename_source_key(name, renamings, converters, getattr(model, "base_model_prefix", None), meta)
        if converter is None and new != name and new in meta:
            out[name] = new
    return out


class Family(ABC):
    """One base family, registered by name (``families.register``) and detected from a folder.

    Attributes:
        name: the registry key and the value of ``model.family`` ("sd", "sdxl", "sd3", "flux").
        pipeline_class: the ``model_index.json`` ``_class_name`` it is detected by.
        model_classes: ``config.json`` ``_class_name`` values of a bare denoiser folder this family
            takes (SD: ``UNet2DConditionModel``); empty for most.
        lora_targets: peft ``target_modules`` of the denoiser (its attention projections), the
            default of ``lora.target_modules``.

    The methods are the only place a family's differences live; the loop, the step, checkpoints,
    validation and the CLI call them and never test ``name``. A method a new family needs is added
    here with a default, never as an ``if family == ...`` elsewhere.
    """

    name: str = ""
    pipeline_class: str = ""
    model_classes: tuple[str, ...] = ()
    lora_targets: tuple[str, ...] = ()
    # The VAE classes (config.json's _class_name) the family's :meth:`load_codec` takes (``model.vae``).
    # Whether the family's pipeline decodes with the VAE's shift_factor (z = latents / scaling + shift):
    # SD3 and Flux do; StableDiffusionPipeline and SDXL's do not, so their export refuses such a VAE.
    applies_shift_factor: bool = False
    # The denoiser's prefix in the pipeline's LoRA files ("unet." / "transformer.").
    lora_prefix: str = "unet"
    # Whether a plain LoRA in kohya's layout (lora_unet_<module>.lora_down.weight / lora_up.weight / alpha, what
    # ComfyUI and A1111 read) is also read by the pipeline's load_lora_weights: the UNet families. SD3's and
    # Flux's kohya names are another network's (SGM / BFL, fused qkv); their diffusers layout is the one that
    # loads in both diffusers and ComfyUI.
    writes_kohya_lora: bool = False
    # The prefix of the kohya-layout names ComfyUI maps to the denoiser: "lora_unet_" + the diffusers module path
    # with "_" for the UNets, "lora_transformer_" + the same for SD3 and the Flux families, "lycoris_" for Qwen-Image,
    # Z-Image and HiDream (comfy/lora.py model_lora_keys_unet; docs/lora_files.md). LoHa and LoKr files take these
    # names with LyCORIS' tensor names (hada_w1_a, lokr_w1).
    kohya_prefix: str = "lora_unet_"
    # The layouts (``export --layout``) whose names ComfyUI maps onto this family's network (comfy/lora.py
    # model_lora_keys_unet; the facts in tests/comfyui_rules.py): the diffusers layout's ``transformer.<module>`` and
    # the kohya layout's ``kohya_prefix`` names, where ComfyUI has them; () where it has no loader for the family.
    comfyui_layouts: tuple[str, ...] = ("diffusers", "kohya")
    # Module names of another family's denoiser: a LoRA file naming them is not this family's (SD3: Flux's).
    foreign_modules: tuple[str, ...] = ()
    # Whether the family is a base of diffusers folders (detect, model.family, model.init_from's defaults);
    # False: difftrain's own UNet (families/unet.py), built from the config.
    base: bool = True
    # Whether diffusers' load_lora_weights (and the programs reading kohya's layout) load this family's adapters;
    # False: difftrain's own UNet, whose adapters difftrain alone reads (export --format lora --layout difftrain).
    diffusers_lora: bool = True
    # Whether a run's step may be captured in a CUDA graph (train.cuda_graphs='on'): difftrain's own UNet only.
    cuda_graphs: bool = False
    # How ``export --format diffusers`` writes a checkpoint of this family (a key of interop/diffusers.py's
    # EXPORTS): "pipeline" (:meth:`export_pipeline`) or "unet2d" (difftrain's own UNet: a UNet2DModel folder).
    export_kind: str = "pipeline"
    # Reference images per sample of an edit family (FLUX.1 Kontext: 1): its runs train on (reference, target,
    # caption) items (data.references), its samples take reference images (validation.references, sample
    # --reference); 0: a family that takes none. The step adds :meth:`reference_condition` of their latents.
    references: int = 0
    # How a training run caches its prompts (``data/pair_cache.TEXT_CACHES``): "captions" (the text cache), or
    # "pairs" (an edit family whose prompt encoder sees the reference: each caption with its pair's reference)
    text_cache: str = "captions"

    # -- what the base decides ------------------------------------------------------------------

    @abstractmethod
    def training_defaults(self, folder: Path) -> dict[str, object]:
        """Config values the base decides unless the user set them, as dotted keys: e.g.
        ``{"diffusion.objective": "ddpm", "diffusion.schedule": ..., "diffusion.prediction": "v",
        "model.text_encoder": str(folder), "model.vae": str(folder), "data.captions": True}``
        (read from the folder's scheduler config)."""

    # The denoiser's sample_size (latent pixels) where its config gives none: FluxPipeline's fixed
    # default_sample_size (128); the other pipelines read the denoiser's config.
    default_sample_size: int | None = None

    def native_resolution(self, folder: Path) -> int | None:
        """The image side in pixels the base was made for: its pipeline's default height and width, the
        denoiser's config ``sample_size`` (else :attr:`default_sample_size`) times the VAE's factor
        2 ** (len(vae/config.json block_out_channels) - 1), as the diffusers pipelines compute them. None
        for a folder without ``vae/config.json`` (a bare UNet folder) or without an integer size; the
        config gives ``data.resolution`` this value unless the user set it (``config._follow_base``)."""
        folder = Path(folder)
        vae = folder / "vae" / "config.json"
        if not vae.is_file():
            return None
        try:
            blocks = read_json(vae, f"base {folder}").get("block_out_channels")
            config = read_json(self.denoiser_folder(folder) / "config.json", f"base {folder}")
        except ValueError:
            return None  # an unreadable config: loading that part says what is wrong, in one line
        size = config.get("sample_size", self.default_sample_size)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or not (isinstance(blocks, list) and blocks):
            return None
        return size * 2 ** (len(blocks) - 1)

    # -- parts ------------------------------------------------------------------------------------

    @abstractmethod
    def load_denoiser(self, folder: Path, quantization_config=None) -> Denoiser:
        """The base's denoiser, weights included, float32 on the CPU; one ValueError naming the folder.
        ``quantization_config``: diffusers' own (``networks.quantize.library_config``), passed to its
        ``from_pretrained``, the model then left in the dtypes it loads in (diffusers refuses to cast it)."""

    @abstractmethod
    def denoiser_from_record(self, record: dict) -> Denoiser:
        """The architecture of a checkpoint's network record (:meth:`Denoiser.record`), weights random."""

    # The denoiser's folder inside a base folder (its config.json and weights): "unet", "transformer".
    denoiser_subfolder: str = "unet"

    def denoiser_folder(self, folder: Path) -> Path:
        """The folder holding the denoiser's ``config.json`` and weights (SD: a bare UNet folder is its own)."""
        return Path(folder) / self.denoiser_subfolder

    def empty_denoiser(self, folder: Path):
        """(the base's denoiser on the meta device, a ``runtime.tensor_source.TensorSource`` of its weights):
        the architecture of the folder's config, built as ``from_pretrained`` builds it before loading (nothing
        initialised, no random number drawn: ``meta_init.empty_build``), and where each weight lies in its
        files (safetensors, or a ``.bin`` mapped by ``torch.load(mmap=True)``), read later one tensor at a time
        (FSDP fills its shards from them, a quantized base its layers). Weights saved under names diffusers
        renames on load (attention blocks saved before diffusers 0.15: ``query`` / ``key`` / ``value`` /
        ``proj_attn``) are found under the names ``from_pretrained`` gives them (:func:`loaded_names`). None
        when the folder has neither (a ``.bin`` in torch's legacy format) or their names are still not the
        denoiser's: :meth:`load_denoiser` then reads it whole (or says what is wrong)."""
        sub = self.denoiser_folder(folder)
        source = TensorSource.of_folder(sub)
        if source is None:
            return None
        with meta_init.empty_build():
            denoiser = self.denoiser_from_record({"config": read_json(sub / "config.json", f"base {folder}")})
        denoiser.model.register_to_config(_name_or_path=str(sub))  # as from_pretrained records it
        if set(denoiser.state_dict()) != source.names() and not source.from_index:
            source = source.renamed(loaded_names(denoiser.model, source.names()))
        if set(denoiser.state_dict()) != source.names():
            return None
        return denoiser, source

    @abstractmethod
    def load_prompt_encoder(self, folder: Path, device: torch.device | str = "cpu") -> PromptEncoder:
        """Every frozen text encoder and tokenizer of the folder, on ``device``; one ValueError naming
        the folder and the missing part. A base family's also takes ``deferred=True`` (the text cache's fill):
        the tokenizers and configs only, each encoder model read from its files by
        ``PromptEncoder.load_model`` in the compute dtype for its turn."""

    def run_prompt_encoder(self, cfg, device: torch.device | str = "cpu", cache=None) -> nn.Module:
        """The run's ``model.text_encoder`` (:meth:`load_prompt_encoder` with :meth:`prompt_options`) on
        ``device``; ``cache`` (training: ``data.text_cache.cached_prompt_encoder``): behind the text cache where
        ``text.cache`` asks for it, loaded only to fill it."""
        folder, options = Path(cfg.model.text_encoder).expanduser(), self.prompt_options(cfg.model)
        load = lambda where=device: self.load_prompt_encoder(folder, where, **options)
        # the cache's fill: tokenizers only, each encoder model read from its files in the compute dtype for its
        # turn (data/text_cache.py staged_conditions) and freed before the next
        deferred = lambda: self.load_prompt_encoder(folder, "cpu", deferred=True, **options)
        text = cache(cfg, self.name, folder, options, deferred, device) if cache is not None else None
        return load() if text is None else text  # without the cache: loaded now

    # -- a text run's condition (networks/conditioning.py's ``c``: its text, resolution, run values, memo) ---

    def condition(self, c, captions, drop: Tensor | None, device: torch.device, geometry: Tensor | None = None,
                  size: tuple[int, int] | None = None) -> Condition:
        """The condition of B captions: the prompt encoder's dict, the null's rows where ``drop`` (B,) bool is
        True (:func:`drop_rows`: no host read), | :meth:`image_conditions` of ``geometry`` (B, 4) at ``size``
        (H, W) | the run's scalars (:meth:`run_conditions`)."""
        cond = c.text.encode(captions if isinstance(captions, list) else list(captions), device)  # a CaptionBatch kept
        if drop is not None:
            cond = drop_rows(cond, c.text.null(1, device), drop)
        n = len(captions)
        image = self._image_rows(c, n, device, geometry, size)
        if geometry is None and image and not c.memo.get("warned_sizes"):
            c.memo["warned_sizes"] = True  # the one warning for training images without their sizes
            h, w = size if size is not None else (c.resolution, c.resolution)
            print(f"difftrain: warning: the training data gives no original size and crop per image; the "
                  f"{self.name} base's size conditioning takes each as {h}x{w}, uncropped", file=sys.stderr)
        return cond | image | self._run_rows(c, n, device)

    def prompt_condition(self, c, prompts, device: torch.device | str = "cpu") -> Condition:
        """The condition of N prompts (sampling: the samples' run scalars)."""
        return (c.text.encode(list(prompts), device) | self._image_rows(c, len(prompts), device)
                | self._run_rows(c, len(prompts), device, sampling=True))

    def null_condition(self, c, n: int, device: torch.device | str = "cpu") -> Condition:
        """The null condition of ``n`` rows (guidance): the prompt encoder's null | image | run scalars."""
        return c.text.null(n, device) | self._image_rows(c, n, device) | self._run_rows(c, n, device, True)

    def _image_rows(self, c, n: int, device, geometry: Tensor | None = None,
                    size: tuple[int, int] | None = None) -> Condition:
        """:meth:`image_conditions` of ``n`` rows at ``size`` (H, W) pixels (default the run's square), from
        each image's ``geometry`` (n, 4) where given (on the host), else uncropped."""
        size = tuple(size) if size is not None else (c.resolution, c.resolution)
        if geometry is not None:
            return self.image_conditions(geometry, size, device)
        return {k: v.expand(n, *v.shape[1:]) for k, v in self.image_conditions(None, size, device).items()}

    @staticmethod
    def _run_rows(c, n: int, device, sampling: bool = False) -> Condition:
        """The run's scalars as (n,) float32 rows: training's or, with ``sampling``, the samples'."""
        values = c.sample_values if sampling else c.train_values
        return {k: torch.full((n,), v, device=device) for k, v in values.items()}

    def export_scheduler(self, diffusion) -> dict | None:
        """The scheduler config :meth:`export_pipeline` writes for a run's ``cfg.diffusion``; None (the
        default): the DDPM-family scheduler ``scheduler_configs.scheduler_config`` makes (SD, SDXL). SD3 and Flux:
        FlowMatchEulerDiscreteScheduler settings of the flow keys."""
        return None

    def prompt_options(self, model) -> dict[str, object]:
        """Keyword arguments of :meth:`load_prompt_encoder` the run's ``model`` section (``cfg.model``) gives
        (none by default; SD3 and Flux: ``max_sequence_length`` from ``model.max_sequence_length``)."""
        return {}

    def run_conditions(self, section) -> dict[str, float]:
        """The scalars every sample of a run is conditioned on alike, by condition key: a setting of the
        run, not an output of the text encoders (so never in the text cache). ``section``: the config section
        that sets them, the run's ``model`` in training, its ``validation`` for the samples (validation grids,
        FID, ``sample``). None by default; Flux: ``{"guidance": section.distilled_guidance}``."""
        return {}

    def load_codec(self, folder: Path, device: torch.device | str = "cpu"):
        """The frozen VAE (``models.vae.LatentCodec``: scaling AND shift factor) of ``folder/vae``."""
        return LatentCodec.from_path(str(folder)).to(device)

    def image_conditions(self, geometry: Tensor | None, size: tuple[int, int], device: torch.device | str
                         ) -> Condition:
        """The condition the image itself adds (none by default). ``geometry`` (B, 4) long: each
        sample's original (height, width) and the (top, left) of its crop in the resized image, as the
        data side gives them (None: the image was the target size, uncropped); ``size``: the (H, W) in
        pixels the network trains at. SDXL returns ``{"time_ids": (B, 6)}``."""
        return {}

    def reference_condition(self, references: list[Tensor]) -> Condition:
        """The condition the reference images add, given their latents in the model's space, one (B, c, h', w')
        tensor per reference (:attr:`references` of them): what the family's denoiser packs into its input
        (Kontext: ``{"reference": ...}``, appended to the image tokens). A family that takes none refuses."""
        raise ValueError(f"the {self.name} family takes no reference images")

    def edit_condition(self, c, references: list[Tensor], captions=None, drop: Tensor | None = None,
                       images: list[Tensor] | None = None, device: torch.device | str = "cpu") -> Condition:
        """The condition an edit family's reference images add to B rows (``c``: the run's Conditioning):
        :meth:`reference_condition` of their latents by default. ``captions``: the rows' captions (B strings) and
        ``drop`` (B,) bool the rows whose caption is dropped (training), ``images``: each reference's pixels (B, 3,
        H, W) in [-1, 1] where the caller read them (validation, ``sample``; training holds cached latents only):
        a family whose prompt encoder sees the reference too (Qwen-Image-Edit) encodes the captions with it here."""
        return self.reference_condition(references)

    def cache_fill_tokens(self) -> int:
        """Tokens each prompt of the text cache's fill brings besides its text (what ``estimate`` counts the fill's
        activations with): none by default; an edit family whose encoder sees the reference says how many."""
        return 0

    def condition_shapes(self, config: dict, max_sequence_length: int = 0) -> dict[str, tuple[int, ...]]:
        """The shape of one sample's condition (what :meth:`load_prompt_encoder` and :meth:`image_conditions`
        give, without the batch) for a denoiser of diffusers ``config``; ``max_sequence_length``:
        ``model.max_sequence_length`` (0: the pipeline's default). ``difftrain estimate --base`` runs the
        denoiser on meta tensors of these shapes (``tools/base_memory.py``)."""
        raise NotImplementedError(f"the {self.name} family does not give its condition's shapes")

    def latent_channels(self, config: dict) -> int:
        """Channels of the latents difftrain gives the denoiser of diffusers ``config`` (Flux: its 2x2-packed
        ``in_channels`` / 4)."""
        return int(config["in_channels"])

    def image_side_multiple(self, codec) -> int:
        """The multiple every image side must be: the VAE's downsampling (Flux: times its 2x2 packing)."""
        return int(codec.factor)

    # -- parallelism and adapters -------------------------------------------------------------------

    @abstractmethod
    def fsdp_units(self, denoiser: Denoiser) -> list[nn.Module]:
        """The blocks ``fully_shard`` wraps one by one, in forward order (the root takes the rest)."""

    # -- files out and in ---------------------------------------------------------------------------

    def export_pipeline(self, denoiser: Denoiser, base: Path, out: Path, scheduler: dict | None = None,
                        vae: Path | None = None) -> Path:
        """A pipeline folder the family's diffusers pipeline loads: ``denoiser``'s weights, the base's
        frozen parts from ``base`` (the VAE from ``vae`` when given: a run's ``model.vae`` elsewhere),
        ``scheduler`` (a diffusers scheduler config, None: the base's). The one export path of every
        family, into ``out`` (absent or empty): the parts :meth:`export_parts` names, the frozen ones
        (text encoders, tokenizers, VAE, an unchanged scheduler) copied as the base holds them (their
        files' bytes, so their dtype: a half-precision base's stay half), the trained denoiser written by its
        ``save_pretrained`` (safetensors), then ``model_index.json``; then checked to load without reading a
        weight (:func:`check_written_folder`): a written folder that does not load is one ValueError naming it."""
        out = Path(out).expanduser()
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(f"export folder {out} exists and is not empty")
        parts = self.export_parts(denoiser, Path(base).expanduser(), scheduler,
                                  None if vae is None else Path(vae).expanduser())
        out.mkdir(parents=True, exist_ok=True)
        for name, (folder, cls) in parts.copied.items():
            copy_part(folder, out / name, cls)
        denoiser.model.save_pretrained(str(out / self.denoiser_subfolder), safe_serialization=True)
        if parts.scheduler is not None:
            parts.scheduler.save_pretrained(str(out / "scheduler"))
        atomic_write_bytes(out / "model_index.json", (json.dumps(parts.index, indent=2, sort_keys=True) + "\n").encode())
        check_written_folder(self.pipeline_class, out, self.part_checks())
        return out

    def part_checks(self) -> dict[str, Callable[[Path], object]]:
        """How :func:`check_written_folder` loads a part without weights that its class cannot load here, by
        model_index.json name: ``{name: load(folder)}`` (none by default; Qwen-Image-Edit's processor, whose
        transformers class needs torchvision: its tokenizer and image processor)."""
        return {}

    def export_parts(self, denoiser: Denoiser, base: Path, scheduler: dict | None, vae: Path | None) -> ExportParts:
        """What :meth:`export_pipeline` writes besides the denoiser: the base's ``model_index.json`` and each
        part it names copied from ``base`` as it is (the VAE from ``vae``, a VAE folder or a folder's
        ``vae/``, when given), the scheduler a scheduler of the base's class with ``scheduler`` merged into the
        base's config (None: copied). Reads configs only; one ValueError naming the base folder when a part
        is missing. SD makes its own (its text encoder may be a folder of its own)."""
        index = read_json(base / "model_index.json", f"base {base}")
        check_weight_indexes(base)  # the files a sharded part's index names: inside its folder
        copied: dict[str, tuple[Path, type]] = {}
        for name, entry in index.items():
            if name.startswith("_") or name == self.denoiser_subfolder or part_entry(entry) is None:
                continue
            if not (base / name).is_dir():
                raise ValueError(f"export: the {self.name} base {base} lacks {name}/ (its model_index.json names it)")
            copied[name] = (base / name, part_class(entry, f"base {base}: model_index.json's {name}"))
        if vae is not None:
            folder = vae_folder(str(vae))
            copied["vae"] = (folder, part_class(["diffusers", read_json(folder / "config.json", f"VAE {vae}")
                                                 ["_class_name"]], f"VAE {vae}"))
        made = None
        if scheduler is not None:
            config = read_json(base / "scheduler" / "scheduler_config.json", f"base {base}")
            cls = part_class(["diffusers", config.get("_class_name")], f"base {base}: scheduler/scheduler_config.json")
            made = cls.from_config({**config, **scheduler})
            copied.pop("scheduler", None)
        return ExportParts(index=index, copied=copied, scheduler=made)

    def lora_io_class(self) -> type:
        """The diffusers class whose ``save_lora_weights`` / ``lora_state_dict`` write and read this family's LoRA
        files (:meth:`save_lora`, :meth:`lora_file`): its pipeline class. A family whose pipeline has neither names
        a LoRA loader mixin of diffusers' that writes and reads the same layout."""
        return diffusers_pipeline(self.pipeline_class)

    def save_lora(self, adapter: dict[str, Tensor], lora_config: dict, out: Path,
                  metadata: dict[str, str] | None = None) -> Path:
        """Write ``adapter`` (peft's names of the denoiser, ``...to_q.lora_A.weight``) through the
        pipeline class's ``save_lora_weights`` (``<lora_prefix>_lora_layers``: diffusers adds the
        ``lora_prefix.`` and peft's ``LoraConfig`` fields ``lora_config`` as metadata), then difftrain's
        ``metadata`` added to the file's; returns the file (``out/`` :data:`LORA_WEIGHT_NAME`), which
        ``load_lora_weights`` and :meth:`read_lora` read. (The class: :meth:`lora_io_class`.)"""
        cls = self.lora_io_class()
        out = Path(out)
        tensors = {k: t.detach().cpu().contiguous().clone() for k, t in adapter.items()}
        cls.save_lora_weights(str(out), **{f"{self.lora_prefix}_lora_layers": tensors,
                                           f"{self.lora_prefix}_lora_adapter_metadata":
                                               dict(lora_config) if lora_config else None})
        file = out / LORA_WEIGHT_NAME
        if metadata:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                merged = {**(f.metadata() or {}), **metadata}
                written = {k: f.get_tensor(k) for k in f.keys()}
            atomic_write_bytes(file, save(written, metadata=merged))
        return file

    def lora_file(self, path: Path, config: dict | None = None,
                  renamed: dict[str, Tensor] | None = None) -> tuple[dict[str, Tensor], dict | None, dict | None]:
        """The one reader of LoRA files (:meth:`read_lora` and :meth:`lora_state` take its output): (every
        tensor, the network alphas or None, diffusers' adapter metadata or None) of ``path`` as the pipeline
        class's ``lora_state_dict`` returns them (safetensors only: it never unpickles), converting the
        layouts it knows (kohya sd-scripts', ComfyUI's...) with :meth:`lora_state_options` of the denoiser's
        diffusers config ``config`` (None: no options). ``renamed``: the file's tensors renamed by
        :meth:`renamed_lora`, given to ``lora_state_dict`` instead of the file. One ValueError naming the file
        when it does not exist or cannot be read."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise ValueError(f"LoRA file {path} does not exist" if not path.exists() else
                             f"LoRA file {path} is a folder, not a .safetensors file")
        cls = self.lora_io_class()
        try:
            with dropped_by_converter() as dropped:
                out = cls.lora_state_dict(str(path) if renamed is None else dict(renamed), use_safetensors=True,
                                          return_lora_metadata=True,
                                          **({} if config is None else self.lora_state_options(config)))
        except Exception as e:  # noqa: BLE001 - diffusers' converters raise many kinds; re-raised as one line
            raise ValueError(f"LoRA file {path} is not a {self.name} LoRA file: {cls.__name__}.lora_state_dict "
                             f"cannot read it ({type(e).__name__}: {first_line(e)})") from None
        if dropped:
            raise ValueError(f"LoRA file {path} is not a {self.name} LoRA file as a whole: {cls.__name__}.lora_state_dict "
                             f"leaves tensors of it out ({dropped[0][:300]}); difftrain applies a file whole or not at all")
        return (out[0], out[1], out[2]) if len(out) == 3 else (out[0], None, out[1])

    def read_lora(self, path: Path, denoiser: Denoiser | None = None) -> dict[str, Tensor]:
        """The denoiser's adapter (peft's names, as :meth:`save_lora` takes them) of a LoRA file in the
        pipeline's layout (:meth:`lora_file`); one ValueError naming the file for a file of another family:
        tensors outside ``lora_prefix.`` (or none), module names of :attr:`foreign_modules`, or, given
        ``denoiser``, a module it lacks or of another width (:func:`check_lora_fits`)."""
        state, _, _ = self.lora_file(path)
        prefix = self.lora_prefix + "."
        outside = sorted({k.split(".")[0] for k in state if not k.startswith(prefix)})
        if outside or not state:
            raise ValueError(f"LoRA file {path} is not a {self.name} LoRA file: it holds "
                             f"{'tensors of ' + ', '.join(outside) if outside else 'no tensors'}, not the "
                             f"{self.lora_prefix}'s (a file for another family?)")
        state = {k[len(prefix):]: v for k, v in state.items()}
        strange = sorted({name for k in state for name in self.foreign_modules if name in k.split(".")})
        if strange:
            raise ValueError(f"LoRA file {path} is not a {self.name} LoRA file: it names {', '.join(strange)} "
                             f"(another family's {self.lora_prefix})")
        if denoiser is not None:
            check_lora_fits(state, denoiser.model, path, self.name, self.lora_prefix)
        return state

    def lora_state(self, path: Path, config: dict,
                   renamed: dict[str, Tensor] | None = None) -> tuple[dict[str, Tensor], dict | None, dict | None, int]:
        """A LoRA file of any layout the family's pipeline reads (diffusers' and peft's names, kohya
        sd-scripts' and ComfyUI's ``lora_unet_...``, the other layouts its ``lora_state_dict`` converts),
        as diffusers' loader takes it: (the denoiser's tensors under ``lora_prefix + "."``, their
        network alphas or None, diffusers' adapter metadata or None, how many tensors are of other parts
        (text encoders)). ``config``: the denoiser's diffusers config (:attr:`Denoiser.config`); ``renamed``:
        the file's tensors as :meth:`renamed_lora` renamed them (None: the file as it is). Read by
        :meth:`lora_file` (the pipeline class's ``lora_state_dict``), not by a key map of difftrain's."""
        state, alphas, metadata = self.lora_file(path, config, renamed)
        prefix = self.lora_prefix + "."
        ours = {k: v for k, v in state.items() if k.startswith(prefix)}
        alphas = {k: v for k, v in (alphas or {}).items() if k.startswith(prefix)} or None
        return ours, alphas, metadata, len(state) - len(ours)

    def renamed_lora(self, tensors: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor] | None:
        """Another program's LoRA file (``tensors``, as the file holds them) in a layout the pipeline's
        ``lora_state_dict`` does not convert, renamed to one it reads (a renaming, a fused module's factors
        split by its parts' rows where the program fuses them: docs/lora_files.md); None: the file goes to it as
        it is (every family but those that say otherwise). ``model``: the denoiser's diffusers model (its module
        names and widths; its weights are not read)."""
        return None

    def lora_state_options(self, config: dict) -> dict:
        """Keyword arguments of the pipeline's ``lora_state_dict`` for a denoiser of diffusers config
        ``config`` (SDXL: the UNet's config, which maps kohya's SGM block names to diffusers')."""
        return {}

    def __repr__(self) -> str:
        return f"<family {self.name}: {self.pipeline_class}>"


# ---------------------------------------------------------------------------------------------
# Shared helpers of the family files.


# diffusers' LoRA converters that leave a file's tensors they cannot name out with a warning instead of raising
# (diffusers 0.42: the kohya FLUX.1 and FLUX.2 converters, "Unsupported keys ..."): their logger and the message.
CONVERTER_LOGGER = "diffusers.loaders.lora_conversion_utils"
DROPPED = "Unsupported keys"


@contextlib.contextmanager
def dropped_by_converter():
    """A list, filled with the first line of each warning by which a diffusers LoRA converter, inside the block,
    says it left tensors of the file out (:data:`DROPPED`), whatever diffusers' verbosity; it is logged as before."""
    found: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage().strip()
            if text.startswith(DROPPED):
                found.append(text.splitlines()[0])

    logger, catch = logging.getLogger(CONVERTER_LOGGER), Catch(logging.WARNING)
    level = logger.level
    logger.addHandler(catch)
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)
    try:
        yield found
    finally:
        logger.removeHandler(catch)
        logger.setLevel(level)


def read_json(path: Path, what: str) -> dict:
    """A JSON file as a dict, or one ValueError naming the file."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{what}: unreadable {path} ({first_line(e)})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what}: {path} does not hold a JSON object")
    return value


def check_lora_fits(state: dict[str, Tensor], model: nn.Module, path, family: str, part: str = "transformer") -> None:
    """One ValueError unless every ``<module>.lora_A/B.weight`` of ``state`` names a module of
    ``model`` (the base's ``part``) with the matching in/out width."""
    modules = dict(model.named_modules())
    for key, value in state.items():
        owner = key.split(".lora_")[0]
        layer = modules.get(owner)
        layer = getattr(layer, "base_layer", layer)
        weight = getattr(layer, "weight", None)
        if weight is None:
            raise ValueError(f"LoRA file {path} is not a LoRA of this {family} base: it names {owner}, which the "
                             f"base's {part} lacks")
        want, got = (weight.shape[1], value.shape[1]) if ".lora_A." in key else (weight.shape[0], value.shape[0])
        if want != got:
            raise ValueError(f"LoRA file {path} is not a LoRA of this {family} base: {key} has shape "
                             f"{tuple(value.shape)}, the base's {owner} is {tuple(weight.shape)}")


# The weights files a part's from_pretrained reads (diffusers', transformers'), without a variant: each the
# single file, else the index of its shards. Other weight formats and variants in a base's part folder
# (.bin, .ckpt, .msgpack, .onnx, *.fp16.safetensors...) are not copied: the written parts are safetensors.
WEIGHTS_STEMS = ("diffusion_pytorch_model", "model")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".onnx", ".onnx_data", ".pb",
                   ".gguf")
# The libraries a model_index.json entry may name (its classes are looked up in them, never imported by name).
PART_LIBRARIES = ("diffusers", "transformers")
# A safetensors header's floating dtypes (``get_slice(key).get_dtype()``).
SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


@dataclass
class ExportParts:
    """What :meth:`Family.export_pipeline` writes besides the denoiser: ``index`` (``model_index.json``),
    ``copied`` (part name -> (the folder it is copied from as it is, the part's class)) and ``scheduler``
    (a scheduler object saved in ``scheduler/``, or None: the scheduler is one of ``copied``)."""

    index: dict
    copied: dict[str, tuple[Path, type]]
    scheduler: object | None = None


def part_entry(entry) -> tuple[str, str] | None:
    """(library, class name) of a ``model_index.json`` entry naming a part, None for a setting or an absent
    part (``[null, null]``)."""
    if isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry):
        return entry[0], entry[1]
    return None


def part_class(entry, what: str) -> type:
    """The class a ``model_index.json`` entry ``[library, class name]`` names, looked up among diffusers' and
    transformers' public names (a pipeline's own module, ``"stable_diffusion"``, is diffusers'); one
    ValueError naming ``what`` when it is none of theirs."""
    found = part_entry(entry)
    for library in PART_LIBRARIES if found else ():
        try:
            module = importlib.import_module(library)  # diffusers, transformers: optional packages ([text])
        except ImportError:
            continue
        cls = getattr(module, found[1], None)
        if isinstance(cls, type):
            return cls
    raise ValueError(f"{what}: {entry!r} names no diffusers or transformers class")


def weights_files(folder: Path) -> list[Path]:
    """The safetensors files a model part's ``from_pretrained`` reads in ``folder`` (a single
    ``<stem>.safetensors``, else the files its ``<stem>.safetensors.index.json`` names, checked to lie in
    the folder: ``runtime.tensor_source.index_files``), [] when it has none."""
    for stem in WEIGHTS_STEMS:
        single, index = folder / f"{stem}.safetensors", folder / f"{stem}.safetensors.index.json"
        if single.is_file():
            return [single]
        if index.is_file():
            return [index, *index_files(index)]
    return []


def _is_weights(file: Path) -> bool:
    return file.suffix in WEIGHT_SUFFIXES or file.name.endswith(".index.json") or ".index." in file.name


def copy_part(source: Path, dest: Path, cls: type) -> None:
    """Write the part ``cls`` (a model, tokenizer, scheduler... class) of folder ``source`` into ``dest`` as the
    base holds it: every file of ``source`` but weights, and a model's safetensors weights
    (:func:`weights_files`) copied byte for byte (links followed: the Hugging Face cache's). A model part
    without them (only ``.bin``), or a transformers model whose config is another model's (a whole CLIP
    model as a CLIP text encoder), is loaded in the dtype its files hold and saved by its ``save_pretrained``."""
    dest.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()):
        if file.is_file() and not _is_weights(file):
            shutil.copyfile(file, dest / file.name)
    if not issubclass(cls, nn.Module):
        return
    files = weights_files(source)
    config_type = getattr(getattr(cls, "config_class", None), "model_type", None)
    if files and (not config_type or read_json(source / "config.json", f"{source}").get("model_type") == config_type):
        for file in files:
            shutil.copyfile(file, dest / file.name)
        return
    dtype = stored_dtype(source)
    part = load_part(source.parent, source.name, cls, f"{cls.__name__} to export", dtype=dtype)
    (dest / "config.json").unlink(missing_ok=True)
    part.save_pretrained(str(dest), safe_serialization=True)


def stored_dtype(folder: Path) -> torch.dtype:
    """The dtype of the first floating weight in a model folder's files (a safetensors header, else a ``.bin``
    mapped by ``torch.load(weights_only=True, mmap=True)``: no tensor read, no code run); float32 when none."""
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - a safe_open, not a dict
                dtype = SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype())
                if dtype is not None:
                    return dtype
    for file in sorted(folder.glob("*.bin")):
        try:
            tensors = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001, S112 - a legacy or damaged file: its loader says what is wrong
            continue
        for tensor in tensors.values() if isinstance(tensors, dict) else ():
            if isinstance(tensor, Tensor) and tensor.is_floating_point():
                return tensor.dtype
    return torch.float32


def load_config_part(cls: type, folder: Path):
    """``cls.from_pretrained(folder)`` of a part without weights (a tokenizer, a scheduler, an image
    processor: small files), quiet."""
    from diffusers.utils import logging  # diffusers: an optional package ([text])

    with quiet_loading(logging):
        return cls.from_pretrained(str(folder))


def check_written_folder(pipeline_class: str, out: Path, checks: dict[str, Callable[[Path], object]] | None = None
                         ) -> None:
    """One ValueError naming ``out`` unless the pipeline folder loads in ``pipeline_class.from_pretrained``,
    checked without reading a weight: ``model_index.json`` names that class and a folder for each of its
    parts; each model part's class built from its config on the meta device (:func:`meta_init.empty_build`)
    and its state dict's names and shapes found in its safetensors files' headers (:func:`check_model_part`);
    tokenizers, schedulers and the other parts without weights loaded (their small files; a part named in
    ``checks`` by its ``checks[name](folder)``: ``Family.part_checks``)."""
    name = "model_index.json"
    try:
        index = read_json(out / name, "model_index.json")
        if index.get("_class_name") != pipeline_class:
            raise ValueError(f"model_index.json names the pipeline {index.get('_class_name')!r}")
        for name, entry in sorted(index.items()):
            if name.startswith("_") or part_entry(entry) is None:
                continue
            folder = out / name
            if not folder.is_dir():
                raise ValueError("no such folder (model_index.json names it)")
            cls = part_class(entry, "model_index.json")
            if issubclass(cls, nn.Module):
                check_model_part(cls, folder)
            elif name in (checks or {}):
                checks[name](folder)
            else:
                load_config_part(cls, folder)
    except Exception as e:  # noqa: BLE001 - configs, tokenizers and headers fail in many kinds; one line naming the folder
        raise ValueError(f"export: the written folder {out} does not load in {pipeline_class}.from_pretrained "
                         f"({name}: {type(e).__name__}: {first_line(e)})") from None


def check_model_part(cls: type, folder: Path) -> None:
    """One ValueError unless ``cls.from_pretrained(folder)`` would find every weight of the model its config
    builds, in its shape: the model built on the meta device (nothing allocated, nothing read), its state
    dict's names (a tied weight: any one of its names) and shapes against the headers of the folder's
    safetensors files (``TensorSource.of_files``: headers only), under the names the loader gives them
    (diffusers' renaming of one file's names: :func:`loaded_names`). Names the model lacks are not checked
    (both loaders leave them out)."""
    files = weights_files(folder)
    if not files:
        raise ValueError(f"{folder.name}/ holds no safetensors weights ({' or '.join(s + '.safetensors' for s in WEIGHTS_STEMS)})")
    transformers = cls.__module__.split(".")[0] == "transformers"
    with meta_init.empty_build():
        model = cls(cls.config_class.from_pretrained(str(folder))) if transformers else cls.from_config(
            cls.load_config(str(folder)))
    if transformers:  # tied as from_pretrained ties them (T5's embed_tokens is its shared weight), outside the
        model.tie_weights()  # empty build, whose register_parameter would make the tied weight a new one
    source = TensorSource.of_files([f for f in files if not f.name.endswith(".index.json")])
    if len(files) == 1 and not transformers:
        source = source.renamed(loaded_names(model, source.names()))
    if transformers:
        source = source.renamed(transformers_loaded_names(model, source.names()))
    groups: dict[int, list[tuple[str, Tensor]]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append((key, tensor))
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or ()]
    for group in groups.values():
        found = [(key, tensor) for key, tensor in group if key in source.shapes]
        if not found and not any(p.search(key) for key, _ in group for p in ignored):
            raise ValueError(f"{folder.name}/ lacks the weight {group[0][0]} of its {cls.__name__}")
        for key, tensor in found:
            if source.shapes[key] != tuple(tensor.shape):
                raise ValueError(f"{folder.name}/'s weight {key} has shape {source.shapes[key]}, its {cls.__name__} "
                                 f"config makes it {tuple(tensor.shape)}")


def quantized(quantization_config) -> dict:
    """``from_pretrained``'s keyword for diffusers' ``quantization_config`` (none without one): what a family's
    ``load_denoiser`` passes on."""
    return {} if quantization_config is None else {"quantization_config": quantization_config}


def load_part(folder: Path, sub: str, cls, what: str, dtype: torch.dtype = torch.float32, **kwargs):
    """``cls.from_pretrained(folder/sub)`` (a diffusers or transformers class) in ``dtype`` on the CPU,
    quiet, every weight checked; one ValueError naming the folder and the missing or broken part."""
    path = Path(folder) / sub
    if not path.is_dir():
        raise ValueError(f"{folder}: no {sub}/ (the {what}); this base folder needs it")
    module = cls.__module__.split(".")[0]
    if module == "transformers":  # transformers and diffusers: optional packages ([text])
        from transformers.utils import logging
    else:
        from diffusers.utils import logging  # diffusers: an optional package ([text])

    is_tokenizer = "Tokenizer" in cls.__name__
    check_weight_indexes(path)  # from_pretrained reads the files a sharded part's index names, unchecked
    try:
        with quiet_loading(logging):
            if is_tokenizer:
                return cls.from_pretrained(str(path), **kwargs)
            typed = {"dtype": dtype} if module == "transformers" else {"torch_dtype": dtype}
            part, info = cls.from_pretrained(str(path), **typed, output_loading_info=True, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError, SafetensorError) as e:
        raise ValueError(f"{folder}: cannot load the {what} in {sub}/: {first_line(e)}") from None
    check_loading_info(info, what, path)
    if kwargs.get("quantization_config") is not None:  # diffusers refuses to cast a model it quantized
        return part
    return part.float() if dtype == torch.float32 else part.to(dtype)


# ---------------------------------------------------------------------------------------------
# The registry (families/__init__.py re-exports it; kept here so the interface needs no import of the package).

FAMILIES: dict[str, Family] = {}
# The family modules, imported on first use (each calls register); cheap: diffusers loads lazily.
MODULES = ("sd", "sdxl", "sd3", "flux", "hidream", "z_image", "pixart", "qwen_image", "chroma", "auraflow",
           "sana", "lumina2", "flux2", "flux2_klein", "flux_kontext",
           "qwen_image_edit")


def register(family: Family) -> Family:
    """Add ``family`` to :data:`FAMILIES` under ``family.name`` (a family module calls this once)."""
    if not family.name or family.name in FAMILIES and FAMILIES[family.name] is not family:
        raise ValueError(f"family name {family.name!r} is empty or taken")
    FAMILIES[family.name] = family
    return family


def load_all() -> dict[str, Family]:
    """:data:`FAMILIES` with every module of :data:`MODULES` imported (each registers its family)."""
    for module in MODULES:
        try:
            importlib.import_module(f"difftrain.families.{module}")
        except ModuleNotFoundError as e:  # a family file not written yet (on this branch)
            if e.name != f"difftrain.families.{module}":
                raise
    return FAMILIES


def family_named(name: str) -> Family:
    """The registered base family ``name`` (``model.family``), or one ValueError naming the choices."""
    families = {n: f for n, f in load_all().items() if f.base}
    if name not in families:
        raise ValueError(f"model.family must be one of {', '.join(sorted(families))} (or auto), got {name!r}")
    return families[name]
