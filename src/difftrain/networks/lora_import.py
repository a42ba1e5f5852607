"""LoRA files into difftrain: difftrain's own exports (``adapters.py`` writes them), files of other
programs on a base of a family (diffusers' training scripts, kohya sd-scripts, ComfyUI), and a LoRA
file as the start of a run's adapter (``model.init_lora_from``).

    fields = read_adapter("adapter/")                         # the fields load_model takes (sample --lora)
    fields = read_foreign("their.safetensors", "sd-folder")   # another program's file, on a base folder
    init_adapter_from(net, "their.safetensors")               # a new LoraNetwork's adapter from a file
    adapter_start(net, "their.safetensors")                   # the same, as tensors (a net on the meta device)
    check_adapted_output(net, objective, conditioning, device, "LoRA adapter x.safetensors")  # its outputs finite

Another program's file goes through the base family's diffusers loader, never a key map of difftrain's: the
pipeline's ``lora_state_dict`` converts the file (kohya's ``lora_unet_...``, ComfyUI's, diffusers' old
and peft names; ``Family.lora_state``), diffusers' ``convert_unet_state_dict_to_peft`` names it as peft
does, and the denoiser's ``load_lora_adapter`` builds peft's layers with the file's ranks, alphas and
DoRA magnitudes. difftrain then reads those layers back as one adapter: one rank, the most common
alpha, each other module's alpha folded into its ``lora_B`` (the same function).

difftrain's own kohya-layout files (LoHa and LoKr too, which diffusers does not read) are named back by the
module names of their base (:func:`kohya_tensors`).

A file applies whole or not at all: a file some of whose modules are not in the base is refused with
one line saying how many matched (a LoRA of another base of the same family would change half the
layers it meant to); tensors of a text encoder are left out with one warning line (difftrain adapts
the denoiser). The file is read as safetensors (``interop.read_safetensors``: no code runs, every
weight finite) before diffusers opens it. Finite weights can still overflow (a kohya ``alpha`` of 1e30):
once the adapter is on its network, one forward on a fixed input must be finite, or the file is refused
(:func:`check_adapted_output`; ``sample --lora``, ``difftrain.load(lora=)``, ``model.init_lora_from``).
"""

from __future__ import annotations

import json
import sys
import tomllib
from collections import Counter
from pathlib import Path

import torch
from torch import Tensor, nn

from difftrain.checkpoints.checkpoint import CheckpointError, check_schema
from difftrain.checkpoints.weights_file import read_safetensors
from difftrain.config import config_to_dict, load_config
from difftrain.families import detect, family_of_record
from difftrain.families.base import read_json
from difftrain.models.text import first_line
from difftrain.networks.lora import ADAPTER, is_lora_record, record_kind
from difftrain.networks.probe import output_is_finite
from difftrain.runtime import meta_init

ADAPTER_FORMAT = "difftrain-lora-v1"
ADAPTER_KEY = "difftrain_adapter"  # the metadata key of difftrain's record (JSON)
DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # what save_lora_weights writes, load_lora_weights reads
LAYOUTS = ("diffusers", "kohya", "difftrain")  # adapters.LORA_LAYOUTS' keys: the layouts a record may name
_RECORD_KEYS = ("config", "network", "frozen", "step")  # of checkpoint.SCHEMA, checked in an adapter's record

LORA_TENSORS = (".lora_A.", ".lora_B.")  # peft's names of a LoRA's factors; DoRA adds lora_magnitude_vector
MAGNITUDE = ".lora_magnitude_vector"


def _module(key: str) -> str:
    """The module a peft adapter tensor belongs to (``a.to_q.lora_A.weight``, ``a.to_q.hada_w1_a`` -> ``a.to_q``)."""
    return key.split(".lora_")[0] if ".lora_" in key else key.rsplit(".", 1)[0]


def peft_names(state: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """``state`` (a family's ``lora_state``, keys under ``prefix.``) in peft's names, converted by
    diffusers' ``convert_unet_state_dict_to_peft`` (kohya's and diffusers' old ``to_q_lora.down`` names)."""
    from diffusers.utils import convert_unet_state_dict_to_peft  # optional (the lora extra)

    return convert_unet_state_dict_to_peft({k[len(prefix) + 1:]: v for k, v in state.items()})


def check_modules(modules: set[str], model: nn.Module, path, base) -> None:
    """One ValueError unless every module of a LoRA file (``modules``) is a module of ``model``,
    saying how many matched."""
    names = {n for n, _ in model.named_modules()}
    missing = sorted(modules - names)
    if missing:
        matched = len(modules) - len(missing)
        raise ValueError(f"LoRA file {path}: {matched} of its {len(modules)} modules match a module of the base "
                         f"{base} (first unmatched: {missing[0]}); a LoRA of another base? difftrain applies a "
                         "file whole or not at all")


def adopt(path: Path, family, denoiser: nn.Module, base) -> tuple[dict, dict[str, Tensor]]:
    """The LoRA file ``path`` of any layout the family's pipeline reads, loaded onto ``denoiser`` (a
    family :class:`~difftrain.families.Denoiser`; its weights do not matter, and it keeps the adapter)
    by diffusers' ``load_lora_adapter``: (settings as a LoRA record keeps them: ``rank``, ``alpha``,
    ``dropout``, ``targets`` (the module names), ``kind``; the adapter in peft's names, with each
    module's alpha folded into its ``lora_B``). One ValueError naming the file otherwise."""
    from peft import get_peft_model_state_dict  # optional (the lora extra): peft and diffusers inside, where used
    from peft.tuners.tuners_utils import BaseTunerLayer

    if not hasattr(denoiser.model, "load_lora_adapter"):
        raise ValueError(f"LoRA file {path}: difftrain reads other programs' LoRA files with diffusers' load_lora_adapter, "
                         f"which the {family.name} {family.lora_prefix} ({type(denoiser.model).__name__}) lacks: only "
                         "LoRA files difftrain exported are read on it")
    _, file = read_safetensors(path, "LoRA adapter")  # safetensors only, every weight finite
    renamed = family.renamed_lora(file, denoiser.model)
    state, alphas, metadata, others = family.lora_state(path, denoiser.config, renamed)
    if not state:
        raise ValueError(f"LoRA file {path} holds no tensor of a {family.name} {family.lora_prefix} (0 modules match "
                         f"the base {base}; {others} tensors of other parts): a LoRA of another family?")
    if others:
        print(f"difftrain: warning: LoRA file {path}: its {others} tensors outside the {family.lora_prefix} (text "
              "encoders) are not applied; difftrain adapts the denoiser alone", file=sys.stderr)
    peft_state = peft_names(state, family.lora_prefix)
    strange = sorted(k for k in peft_state if not any(t in k for t in LORA_TENSORS) and not k.endswith(MAGNITUDE))
    if strange:
        raise ValueError(f"LoRA file {path}: {strange[0]} is not a LoRA or DoRA tensor; difftrain reads other "
                         "programs' LoRA and DoRA files (LoHa and LoKr in its own layout only)")
    check_modules({_module(k) for k in peft_state}, denoiser.model, path, base)
    try:
        denoiser.model.load_lora_adapter(state, prefix=family.lora_prefix, network_alphas=alphas,
                                         metadata=None if alphas else metadata, adapter_name=ADAPTER)
    except Exception as e:  # noqa: BLE001 - peft and diffusers raise many kinds; one line naming the file
        raise ValueError(f"LoRA file {path} does not fit the base {base}: {type(e).__name__}: {first_line(e)}") from None
    layers = {n: m for n, m in denoiser.model.named_modules() if isinstance(m, BaseTunerLayer)}
    ranks = sorted({int(m.r[ADAPTER]) for m in layers.values()})
    if len(ranks) != 1:
        raise ValueError(f"LoRA file {path}: its modules have ranks {ranks}; difftrain reads files of one rank")
    doras = {bool(m.use_dora[ADAPTER]) for m in layers.values()}
    if len(doras) != 1:
        raise ValueError(f"LoRA file {path}: some of its modules are DoRA, some LoRA; difftrain reads one kind")
    rank = ranks[0]
    scales = {n: float(m.scaling[ADAPTER]) for n, m in layers.items()}
    # Each module's own alpha, where the file gives one: diffusers 0.42 names a kohya UNet file's alphas
    # "<module>.processor.to_q_lora.down.weight.alpha", which its alpha_pattern matches to no module, so a module
    # whose alpha is not the most common one would load at the wrong scale (diffusers' own converter names them).
    for key, value in peft_names(alphas or {}, family.lora_prefix).items():
        if _module(key) in scales:
            scales[_module(key)] = float(value) / rank
    scale = Counter(scales.values()).most_common(1)[0][0]
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(denoiser.model, adapter_name=ADAPTER).items()}
    for name, s in scales.items():
        if s != scale:  # (s / scale) B A at the common scale is s B A
            tensors[f"{name}.lora_B.weight"] *= s / scale
    settings = {"rank": rank, "alpha": scale * rank, "dropout": 0.0, "targets": sorted(layers)}
    return ({**settings, "kind": "dora"} if doras == {True} else settings), tensors


def check_adapted_output(model: nn.Module, objective, conditioning, device, where: str, autocast=None) -> None:
    """One ValueError naming ``where`` (the adapter file) unless ``model``, with the adapter loaded, gives a
    finite output on a fixed input (``probe.output_is_finite``: one forward of one sample at the network's
    shape, the null condition, the median training level of ``objective``; under ``autocast`` where given).
    Finite weights whose outputs overflow (a kohya ``alpha`` of 1e30) would sample black images and skip
    every training step."""
    if not output_is_finite(model, objective, conditioning, device, autocast):
        raise ValueError(f"{where}: the network with this adapter gives non-finite outputs (NaN or inf) on a fixed "
                         "test input: its weights or alpha overflow; difftrain refuses it")


def native_resolution(folder: Path, denoiser: nn.Module) -> int:
    """The image side a base samples by default: its denoiser's ``sample_size`` (latent; 128 where the
    config has none, as FluxPipeline's default) times its VAE's downsampling."""
    vae = read_json(folder / "vae" / "config.json", f"base {folder}")
    return int(denoiser.config.get("sample_size") or 128) * 2 ** (len(vae.get("block_out_channels", [0])) - 1)


def read_foreign(path: Path, base: str | Path) -> dict:
    """A LoRA file another program wrote, on the base folder ``base``, as the fields ``load_model``
    takes (``adapters.read_adapter``): the base's training config at its native resolution, a LoRA
    record without a digest (the file names no base; its modules must all fit this one), no frozen
    parts to check, step 0. One ValueError naming the file or the folder otherwise."""
    folder = Path(base).expanduser()
    family = detect(folder)
    denoiser = family.load_denoiser(folder)
    settings, tensors = adopt(path, family, denoiser, folder)
    cfg = load_config(None, [f"model.init_from={folder}", f"data.resolution={native_resolution(folder, denoiser)}",
                             f"lora.rank={settings['rank']}", f"lora.alpha={settings['alpha']}",
                             f"lora.kind={settings.get('kind', 'lora')}"])
    record = {"kind": "lora", "base": denoiser.record(), "base_source": str(folder), "base_digest": "",
              "lora": settings}
    return {"path": str(path), "config": config_to_dict(cfg), "network": record, "frozen": None, "num_classes": 0,
            "step": 0, "weights": "raw", "tensors": tensors}


def _folds(key: str) -> bool:
    """Whether ``key`` (peft's names) is the factor a kind's scale folds into: LoRA's and DoRA's ``lora_B``,
    LoKr's ``lokr_w1`` (or ``lokr_w1_a``); each kind's delta is linear in it."""
    return ".lora_B." in key or key.endswith((".lokr_w1", ".lokr_w1_a"))


def fold_scale(tensors: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
    """``tensors`` (peft's names) with ``scale`` multiplied into each module's up factor (:func:`_folds`): the
    same adapter at scale 1 (DoRA's m (W + s B A) / ||W + s B A|| sees s B alone); 1 / scale undoes it."""
    return {k: (t * scale if _folds(k) and scale != 1 else t).detach().cpu().contiguous() for k, t in tensors.items()}


def kohya_name(prefix: str, module: str) -> str:
    """kohya's (and ComfyUI's) name of a denoiser module: ``prefix`` + its diffusers path with "." -> "_"."""
    return prefix + module.replace(".", "_")


KOHYA_BACK = {".lora_down.weight": ".lora_A.weight", ".lora_up.weight": ".lora_B.weight"}


def kohya_tensors(path: Path, family, record: dict, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The adapter (peft's names) of a kohya-layout file difftrain exported (``adapters.kohya_layout``):
    each ``<kohya_prefix><module with _>`` named back after the module of the base (a stand-in built from
    the record, without weights) it names, ``.alpha`` dropped (the record holds it), LoKr's folded scale
    divided out. One CheckpointError for a name of no module."""
    with meta_init.empty_build():
        stand_in = family.denoiser_from_record(record["base"])
    modules = {kohya_name(family.kohya_prefix, n): n for n, _ in stand_in.model.named_modules() if n}
    out = {}
    for key, t in tensors.items():
        name, _, leaf = key.partition(".")
        if leaf == "alpha":
            continue
        if name not in modules:
            raise CheckpointError(f"LoRA adapter {path}: {key} names no module of its {family.name} base")
        out[modules[name] + KOHYA_BACK.get("." + leaf, "." + leaf)] = t
    s = record["lora"]
    return fold_scale(out, int(s["rank"]) / float(s["alpha"])) if record_kind(record) == "lokr" else out


# ---------------------------------------------------------------------------------------------
# difftrain's own adapter files (adapters.export_lora).


def adapter_file(path: str | Path) -> Path:
    """The adapter file of ``path``: itself, or the ``pytorch_lora_weights.safetensors`` of a folder."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / DIFFUSERS_WEIGHT_NAME
    if not path.is_file():
        raise ValueError(f"LoRA adapter {path} does not exist (a .safetensors file, or a folder holding "
                         f"{DIFFUSERS_WEIGHT_NAME})")
    return path


def read_adapter(path: str | Path, base: str | Path | None = None) -> dict:
    """An adapter file, as the fields ``load_model`` takes from a checkpoint: ``path``, ``config``,
    ``network`` (its LoRA record), ``frozen``, ``num_classes``, ``step``, ``weights``, ``tensors``
    (peft's names). A file ``adapters.export_lora`` wrote names its base itself; a file of another
    program (diffusers' scripts, kohya sd-scripts, ComfyUI) is read onto the base folder ``base``
    (:func:`read_foreign`). Safetensors only; one ValueError naming the file otherwise."""
    path = adapter_file(path)
    metadata, tensors = read_safetensors(path, "LoRA adapter")
    if ADAPTER_KEY not in metadata:
        if base is None:
            raise ValueError(f"LoRA file {path} carries no difftrain record of its base (written by diffusers' scripts, "
                             "kohya sd-scripts, ComfyUI...): name the base folder it was trained for with --base "
                             "(base= in the Python API)")
        return read_foreign(path, base)
    fields = _record_fields(path, metadata)
    fields["tensors"] = _own_tensors(path, fields, tensors)
    return fields


def _record_fields(path: Path, metadata: dict) -> dict:
    """The checkpoint-like fields of difftrain's record in an adapter file's metadata."""
    try:
        record = json.loads(metadata[ADAPTER_KEY])
        assert record["format"] == ADAPTER_FORMAT and record["layout"] in LAYOUTS
        fields = {"path": str(path), "config": tomllib.loads(record["config"]), "network": record["network"],
                  "frozen": record["frozen"], "num_classes": 0, "step": record["step"],
                  "weights": record.get("weights", "ema"), "layout": record["layout"],
                  "folded_scale": float(record.get("folded_scale", 1.0))}
    except (AssertionError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"LoRA adapter {path}: bad difftrain metadata ({type(e).__name__} {e})") from None
    check_schema(fields, path, _RECORD_KEYS, "LoRA adapter")  # the record, checked as a checkpoint's is
    if not is_lora_record(fields["network"]):
        raise CheckpointError(f"LoRA adapter {path}: its network record is not a LoRA adapter's")
    return fields


def _own_tensors(path: Path, fields: dict, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The adapter (peft's names) of a file difftrain wrote: as they are (difftrain layout), read back by
    the base family's pipeline (``read_lora``: diffusers layout, its folded scale divided out), or named back
    (kohya layout: :func:`kohya_tensors`)."""
    if fields["layout"] == "difftrain":
        return tensors
    family = family_of_record(fields["network"]["base"])
    if not family.diffusers_lora:  # difftrain's own UNet: only the difftrain layout
        raise CheckpointError(f"LoRA adapter {path}: its base is a network of no base family")
    if fields["layout"] == "diffusers":  # the adapter's scale folded into lora_B (files before issue 39: 1)
        return fold_scale(family.read_lora(path), 1 / fields["folded_scale"])
    return kohya_tensors(path, family, fields["network"], tensors)


def init_adapter_from(net, path: str | Path) -> None:
    """Copy the LoRA file ``path`` into the adapter of the new LoraNetwork ``net`` (``model.init_lora_from``):
    :func:`adapter_start` loaded into it."""
    with torch.no_grad():
        net.load_state_dict(adapter_start(net, path), strict=False)


def adapter_start(net, path: str | Path) -> dict[str, Tensor]:
    """The adapter tensors (``net``'s state-dict names) the LoRA file ``path`` (difftrain's export or another
    program's) starts the new LoraNetwork ``net`` from (``model.init_lora_from``): the file's kind and rank must
    be ``net``'s, its modules among ``net``'s adapted layers (modules it lacks keep their start, B = 0); its
    alpha is folded into ``lora_B`` where it differs from ``net``'s. One ValueError naming the file otherwise.
    Reads no weight of ``net`` (it may be on the meta device: FSDP fills its shards from these), and draws no
    random number: another program's file is put on a stand-in of the base without weights."""
    path = adapter_file(path)
    metadata, _ = read_safetensors(path, "model.init_lora_from")
    where = f"model.init_lora_from {path}"
    if ADAPTER_KEY in metadata:
        record = read_adapter(path)
        settings, tensors = record["network"]["lora"], record["tensors"]
        kind = record_kind(record["network"])
    else:
        family = family_of_record(net.base_record)
        if not family.diffusers_lora:  # difftrain's own UNet: only difftrain's files
            raise ValueError(f"{where}: a LoRA file of another program goes on a base family's network (a diffusers "
                             "base folder in model.init_from), not on difftrain's own")
        with torch.random.fork_rng(devices=[]):  # peft's layers draw their start, which the file replaces
            with meta_init.empty_build():
                stand_in = family.denoiser_from_record(net.base_record)
            meta_init.stand_in_weights(stand_in)
            settings, tensors = adopt(path, family, stand_in, net.base_source)
        kind = settings.get("kind", "lora")
    if kind != net.kind or int(settings["rank"]) != net.rank:
        raise ValueError(f"{where} holds a {kind} adapter of rank {settings['rank']}; this run's is a {net.kind} of rank "
                         f"{net.rank}: set lora.kind={kind} lora.rank={settings['rank']}")
    own = net.state_dict()
    ours = {_module(k) for k in own}
    theirs = {_module(k) for k in tensors}
    if not theirs <= ours:
        raise ValueError(f"{where}: {len(theirs & ours)} of its {len(theirs)} modules are among this run's adapted "
                         f"layers (first other: {sorted(theirs - ours)[0]}); set lora.target_modules to cover them")
    factor = (float(settings["alpha"]) / net.rank) / (net.alpha / net.rank)
    if factor != 1 and kind not in ("lora", "dora"):
        raise ValueError(f"{where} has alpha {settings['alpha']}; set lora.alpha to it (a {kind} adapter's scale "
                         "cannot be folded into its factors)")
    for key, value in tensors.items():
        if key not in own or own[key].shape != value.shape:
            got = "not in this adapter" if key not in own else f"shape {tuple(value.shape)}, this adapter's {tuple(own[key].shape)}"
            raise ValueError(f"{where}: {key} does not fit this run's adapter ({got})")
    return {k: v * factor if ".lora_B." in k else v for k, v in tensors.items()}
