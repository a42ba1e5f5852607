"""LoRA adapters out of and into difftrain: one adapter, several file layouts.

    export_lora(state, "out/")                     # the layout that loads in the most programs (default_layout)
    export_lora(state, "out/", layout="kohya")     # kohya / LyCORIS names: lora_unet_<module>.lora_down.weight, .alpha
    read_adapter("out/")                           # -> the fields load_model needs (lora_import.py)
    read_adapter("their.safetensors", base="sd/")  # a file of diffusers' scripts, kohya, ComfyUI
    merged_state(state)                            # a LoRA checkpoint as a full network's, adapter folded in

An export is :func:`adapter_of` (the checkpoint's adapter, its base's record and the run's config)
followed by one writer of :data:`LORA_LAYOUTS`: ``diffusers`` (each family's own ``Family.save_lora``,
through the pipeline's ``save_lora_weights``, the scale alpha / rank folded into ``lora_B``), ``kohya``
(kohya's / LyCORIS' names with each module's alpha: ``lora_unet_`` on the UNets, ``lora_transformer_`` on
SD3 and the Flux families, ``lycoris_`` on Qwen-Image, Z-Image and HiDream: what ComfyUI maps; a family's
``kohya_prefix``) and ``difftrain`` (peft's names as they are: difftrain's own networks).
Every layout keeps difftrain's record of the base (its source, digest and the LoRA settings) in the file's
metadata, so ``difftrain sample --lora FILE`` finds the base again and refuses another one. Which file
loads where at the trained strength (difftrain, diffusers' ``load_lora_weights``, ComfyUI) is
docs/lora_files.md's table, tested by tests/integration/test_lora_comfyui.py; the export says in one line
which of them a file does not load in (:func:`where_it_loads`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save
from torch import Tensor

from difftrain.checkpoints.checkpoint import load_weights
from difftrain.config import config_from_dict, config_to_toml
from difftrain.families import family_of_record
from difftrain.networks.build import build_network
from difftrain.networks.conditioning import Conditioning, moved_parts
from difftrain.networks.lora import is_lora_record, peft_config, record_kind

# The file format and its reader live one layer down, in lora_import.py (re-exported here).
from difftrain.networks.lora_import import (  # noqa: F401
    ADAPTER_FORMAT,
    ADAPTER_KEY,
    DIFFUSERS_WEIGHT_NAME,
    LAYOUTS,
    adapter_file,
    fold_scale,
    kohya_name,
    read_adapter,
)
from difftrain.runtime.files import atomic_write_bytes


@dataclasses.dataclass
class Adapter:
    """One set of adapter weights and what it needs: ``tensors`` under difftrain's names (the
    base network's own: ``...to_q.lora_A.weight``), ``record`` (the checkpoint's LoRA network
    record: base record, source, digest, settings), and the run's ``config``, ``frozen`` parts,
    ``step`` and ``source`` file."""

    tensors: dict[str, Tensor]
    record: dict
    config: dict
    frozen: dict
    step: int
    source: str
    weights: str  # "ema" or "raw"

    def metadata(self, layout: str, folded_scale: float = 1.0) -> dict[str, str]:
        """difftrain's record of this adapter, as file metadata (strings); ``folded_scale``: the scale
        the layout multiplied into each module's up factor (:func:`fold_scale`), which the reader divides out."""
        cfg = config_from_dict(self.config, source=self.source)
        return {ADAPTER_KEY: json.dumps({
            "format": ADAPTER_FORMAT, "layout": layout, "network": self.record, "frozen": self.frozen,
            "config": config_to_toml(cfg), "step": self.step, "source": self.source, "weights": self.weights,
            "folded_scale": folded_scale,
        })}


def adapter_of(state: dict, use_ema: bool = True) -> Adapter:
    """The EMA (or raw) adapter of a LoRA checkpoint read by ``load_checkpoint``; a ValueError for
    a checkpoint of a whole network."""
    if not is_lora_record(state["network"]):
        raise ValueError(f"{state['path']} is not a LoRA run (lora.rank = 0): it has no adapter to export; "
                         "export --format diffusers or safetensors")
    tensors = state["ema"]["model"] if use_ema else state["model"]
    return Adapter(dict(tensors), state["network"], state["config"], state["frozen"], state["step"], str(state["path"]),
                   "ema" if use_ema else "raw")


# ---------------------------------------------------------------------------------------------
# Writers: one per file layout.


# The kinds each pipeline's load_lora_weights reads (SD, SDXL, SD3, Flux in diffusers 0.42): LoRA, and DoRA
# by its lora_magnitude_vector; LoHa and LoKr it refuses ("Invalid LoRA checkpoint"); kohya's DoRA
# (dora_scale) it drops with a warning.
DIFFUSERS_KINDS = ("lora", "dora")
# The kinds ComfyUI applies at the trained strength from the kohya layout (comfy/weight_adapter: lora, loha,
# lokr). Not DoRA: ComfyUI's dora_scale rule is not peft's decomposition (it divides by the norm of the base
# weight's rows, or of the adapted weight's columns; peft by the adapted weight's rows), so no file makes
# ComfyUI apply a peft DoRA exactly; --merge folds it into the base. docs/lora_files.md has the facts.
KOHYA_KINDS = ("lora", "loha", "lokr")


def _family_of(adapter: Adapter, layout: str):
    """The base family of ``adapter``, or one ValueError for difftrain's own networks."""
    family = family_of_record(adapter.record["base"])
    if not family.diffusers_lora:  # difftrain's own UNet
        raise ValueError(f"{adapter.source}: the adapter is of difftrain's own network, which diffusers cannot load: "
                         f"--layout {layout} is for a base family's; --layout difftrain writes the adapter file that "
                         "sample --lora reads (the default), --merge the adapted network")
    return family


def _refuse_kind(adapter: Adapter, layout: str, kinds: tuple[str, ...], why: str) -> None:
    kind = record_kind(adapter.record)
    if kind not in kinds:
        raise ValueError(f"{adapter.source}: a lora.kind={kind} adapter has no {layout} layout ({why}); "
                         "export --format lora --layout difftrain writes it for sample --lora, "
                         "--format diffusers --merge (or --format safetensors --merge) the adapted network")


def write_diffusers(adapter: Adapter, out: Path) -> Path:
    """``out/pytorch_lora_weights.safetensors`` in the layout of the base family's pipeline, written by
    its ``save_lora_weights`` (``Family.save_lora``: diffusers' names and peft's config as metadata),
    so that the pipeline's ``load_lora_weights(out)`` on the base gives difftrain's network. The scale
    alpha / rank is folded into ``lora_B`` and the file's ``lora_alpha`` is the rank: a reader that
    ignores peft's config (ComfyUI, which reads SD3's and Flux's ``transformer.`` names) applies the
    trained strength too; difftrain's record says so (``folded_scale``). LoRA and DoRA; LoHa and LoKr
    are refused (no pipeline of these families loads them)."""
    family = _family_of(adapter, "diffusers")
    _refuse_kind(adapter, "diffusers", DIFFUSERS_KINDS, f"{family.pipeline_class}.load_lora_weights loads LoRA "
                 "and DoRA only; --layout kohya writes it for ComfyUI")
    s = adapter.record["lora"]
    scale = float(s["alpha"]) / int(s["rank"])
    config = peft_config(record_kind(adapter.record), s["rank"], float(s["rank"]), s["dropout"], list(s["targets"]))
    family.save_lora(fold_scale(adapter.tensors, scale), config.to_dict(), out,
                     adapter.metadata("diffusers", folded_scale=scale))
    return out


def kohya_layout(tensors: dict[str, Tensor], prefix: str, kind: str, rank: int, alpha: float) -> dict[str, Tensor]:
    """An adapter (peft's names) in kohya's / LyCORIS' layout, as ComfyUI applies it at the trained strength:
    ``<prefix><module>.lora_down.weight`` (A) / ``.lora_up.weight`` (B) / ``.alpha`` (alpha; scale alpha /
    lora_down's rows) for LoRA; LoHa's ``hada_w1_a``... as peft names them, ``.alpha`` (scale alpha / hada_w1_b's
    rows, peft's); LoKr's ``lokr_w1``... with peft's scale folded into ``lokr_w1`` and ``.alpha`` = rank
    (ComfyUI and LyCORIS scale a LoKr by alpha / rank only where a factor is decomposed; peft always)."""
    out: dict[str, Tensor] = {}
    modules = set()
    names = {".lora_A.weight": ".lora_down.weight", ".lora_B.weight": ".lora_up.weight"}
    if kind == "lokr":
        tensors = fold_scale(tensors, alpha / rank)
    for key, t in tensors.items():
        module, _, leaf = key.rpartition(".lora_") if ".lora_" in key else key.rpartition(".")
        leaf = names.get(key[len(module):], "." + leaf)
        out[kohya_name(prefix, module) + leaf] = t.detach().cpu().contiguous().clone()
        modules.add(module)
    for module in modules:
        out[kohya_name(prefix, module) + ".alpha"] = torch.tensor(float(rank if kind == "lokr" else alpha))
    return out


KIND_NAMES = {"loha": "LoHa", "lokr": "LoKr"}
KOHYA_MODULES = {"lora": "networks.lora", "loha": "lycoris.kohya", "lokr": "lycoris.kohya"}  # ss_network_module


def write_kohya(adapter: Adapter, out: Path) -> Path:
    """``out/pytorch_lora_weights.safetensors`` in kohya sd-scripts' / LyCORIS' layout (:func:`kohya_layout`),
    which ComfyUI and A1111 read at the trained strength: ``lora_unet_<module with _>`` on the UNet families,
    ``<kohya_prefix><module with _>`` on the transformers (``lora_transformer_`` on SD3 and the Flux families,
    ``lycoris_`` where ComfyUI maps that; ``Family.comfyui_layouts`` says where it maps neither); kohya's own
    metadata (``ss_network_dim``, ``ss_network_alpha``) beside difftrain's. LoRA on the UNet families (their pipeline's
    ``load_lora_weights`` reads it back), LoHa and LoKr on every family (ComfyUI only: diffusers reads
    neither); DoRA is refused (ComfyUI's DoRA rule is not peft's), and so is a plain LoRA of SD3 or Flux (its
    diffusers layout is the one both load)."""
    family = _family_of(adapter, "kohya")
    kind = record_kind(adapter.record)
    if kind == "lora" and not family.writes_kohya_lora:
        raise ValueError(f"{adapter.source}: the kohya layout of a {family.name} LoRA names the original "
                         f"{family.name} network's modules, which {family.pipeline_class}.load_lora_weights does not "
                         f"read back from difftrain's names; export --layout diffusers (the default), which "
                         f"{family.pipeline_class}.load_lora_weights and ComfyUI both load at the trained strength")
    _refuse_kind(adapter, "kohya", KOHYA_KINDS, "ComfyUI's DoRA rule (dora_scale) is not peft's decomposition, and "
                 "diffusers drops kohya's DoRA scales; --layout diffusers loads it in diffusers")
    s = adapter.record["lora"]
    tensors = kohya_layout(adapter.tensors, family.kohya_prefix, kind, int(s["rank"]), float(s["alpha"]))
    metadata = {"ss_network_module": KOHYA_MODULES[kind], "ss_network_dim": str(s["rank"]),
                "ss_network_alpha": str(float(s["alpha"])), **adapter.metadata("kohya")}
    if kind != "lora":
        metadata["ss_network_args"] = json.dumps({"algo": kind})
    out.mkdir(parents=True, exist_ok=True)
    file = out / DIFFUSERS_WEIGHT_NAME
    atomic_write_bytes(file, save(tensors, metadata=metadata))
    return out


def write_difftrain(adapter: Adapter, out: Path) -> Path:
    """``out/pytorch_lora_weights.safetensors`` with peft's names as they are (no family prefix) and
    difftrain's record: any kind on any network, difftrain's own included; what ``sample --lora`` and
    ``model.init_lora_from`` read. No other program knows how to apply it (docs/lora_files.md)."""
    out.mkdir(parents=True, exist_ok=True)
    file = out / DIFFUSERS_WEIGHT_NAME
    tensors = {k: t.detach().cpu().contiguous().clone() for k, t in adapter.tensors.items()}
    atomic_write_bytes(file, save(tensors, metadata=adapter.metadata("difftrain")))
    return out


# layout -> writer(adapter, out) -> what was written
LORA_LAYOUTS: dict[str, Callable[[Adapter, Path], Path]] = {"diffusers": write_diffusers, "kohya": write_kohya,
                                                             "difftrain": write_difftrain}
assert tuple(LORA_LAYOUTS) == LAYOUTS  # the reader knows every layout a writer writes


def default_layout(record: dict) -> str:
    """The layout ``export --format lora`` writes unless told: the one that loads in the most programs at the
    trained strength (docs/lora_files.md). A plain LoRA: kohya's on the UNet families (diffusers, ComfyUI,
    A1111), the diffusers layout on SD3 and Flux (diffusers, ComfyUI); DoRA: the diffusers layout (diffusers);
    LoHa, LoKr: kohya's (ComfyUI); difftrain's own networks: difftrain's."""
    family, kind = family_of_record(record["base"]), record_kind(record)
    if not family.diffusers_lora:  # difftrain's own UNet
        return "difftrain"
    if kind == "lora":
        return "kohya" if family.writes_kohya_lora else "diffusers"
    return "diffusers" if kind == "dora" else "kohya"


def where_it_loads(record: dict, layout: str) -> str | None:
    """One line saying which of diffusers and ComfyUI a ``layout`` file of this adapter loads in at the trained
    strength and what to export for the other ("loads in diffusers, not in ComfyUI (...)"); None where it
    loads in both (and difftrain, which reads every file it writes). ComfyUI: where the family's
    ``comfyui_layouts`` name the layout (its names are ones ComfyUI maps onto the family's network)."""
    family, kind = family_of_record(record["base"]), record_kind(record)
    if not family.diffusers_lora:  # difftrain's own UNet: its adapters load in difftrain alone, as they are
        return None
    if layout == "difftrain":
        return "loads in difftrain only (sample --lora): --layout " + default_layout(record) + " for other programs"
    comfyui = layout in family.comfyui_layouts  # ComfyUI maps the layout's names onto the family's network
    unmapped = (f"ComfyUI maps none of a {family.name} LoRA's {layout}-layout names" if family.comfyui_layouts
                else f"ComfyUI loads no {family.name} LoRA file difftrain writes, in any layout")
    if kind == "dora":
        return ("loads in diffusers, not in ComfyUI (its dora_scale rule is not peft's DoRA, and it ignores "
                "lora_magnitude_vector): for ComfyUI export --format diffusers --merge, the adapted network")
    if kind in ("loha", "lokr") and not comfyui:
        return (f"loads in difftrain only ({family.pipeline_class}.load_lora_weights reads no {KIND_NAMES[kind]}, "
                f"and {unmapped}): export --format diffusers --merge writes the adapted network")
    if kind in ("loha", "lokr"):
        return (f"loads in ComfyUI, not in diffusers ({family.pipeline_class}.load_lora_weights reads no "
                f"{KIND_NAMES[kind]}): for diffusers export --format diffusers --merge, the adapted network")
    if layout == "diffusers" and family.writes_kohya_lora:
        return ("loads in diffusers, not in ComfyUI (it maps none of a UNet's peft-named keys): --layout kohya "
                "(the default) loads in both")
    if not comfyui:
        return f"loads in diffusers, not in ComfyUI ({unmapped})"
    return None


def export_lora(state: dict, out: str | Path, use_ema: bool = True, layout: str | None = None) -> Path:
    """Write a LoRA checkpoint's adapter in ``layout`` (a key of :data:`LORA_LAYOUTS`; None:
    :func:`default_layout`) to ``out``; one note line on stderr names the programs the file does not load
    in (:func:`where_it_loads`)."""
    if layout is not None and layout not in LORA_LAYOUTS:
        raise ValueError(f"LoRA layout must be one of {', '.join(LORA_LAYOUTS)}, got {layout!r}")
    adapter = adapter_of(state, use_ema)
    layout = layout or default_layout(adapter.record)
    written = LORA_LAYOUTS[layout](adapter, Path(out))
    note = where_it_loads(adapter.record, layout)
    if note:
        print(f"difftrain: note: {written}: {note}", file=sys.stderr)
    return written


# ---------------------------------------------------------------------------------------------
# Merging: the adapter folded into the base, a whole network's checkpoint.


def merged_state(state: dict, use_ema: bool = True, *, text_encoder: str | None = None,
                 vae: str | None = None) -> dict:
    """A LoRA checkpoint read by ``load_checkpoint`` as the checkpoint of its base network with
    W + (alpha / r) B A folded into every adapted layer (EMA or raw adapter in both weight slots),
    ``lora.rank`` 0 in its config: what ``export --merge`` hands to the whole-network writers."""
    adapter = adapter_of(state, use_ema)
    cfg = config_from_dict(state["config"], source=state["path"])
    moved_parts(cfg.model, text_encoder, vae)
    cfg.model.quantize_base = "off"  # folded into the float32 base, never into a quantized copy of it
    net = build_network(cfg, Conditioning.from_config(cfg, state["num_classes"]), state["network"], init_weights=False)
    load_weights(net, adapter.tensors, state["path"], "ema.model" if use_ema else "model")
    merged = net.merged_base_state()
    config = copy.deepcopy(state["config"])
    config.setdefault("lora", {})["rank"] = 0
    config["model"]["quantize_base"] = "off"  # a whole network: no frozen base left to quantize
    return {**state, "config": config, "network": state["network"]["base"], "model": merged,
            "ema": {**state["ema"], "model": merged}}
