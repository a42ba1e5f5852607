"""LoRA adapters out of and into difftrain: one adapter, several file layouts.

    export_lora(state, "out/")                     # the base family's diffusers layout (difftrain's own for its networks)
    export_lora(state, "out/", layout="kohya")     # kohya / ComfyUI names: lora_unet_<module>.lora_down.weight, .alpha
    read_adapter("out/")                           # -> the fields load_model needs (lora_import.py)
    read_adapter("their.safetensors", base="sd/")  # a file of diffusers' scripts, kohya, ComfyUI
    merged_state(state)                            # a LoRA checkpoint as a full network's, adapter folded in

An export is :func:`adapter_of` (the checkpoint's adapter, its base's record and the run's config)
followed by one writer of :data:`LORA_LAYOUTS`: ``diffusers`` (each family's own ``Family.save_lora``,
through the pipeline's ``save_lora_weights``), ``kohya`` (diffusers' ``convert_state_dict_to_kohya`` of
that, with each module's alpha) and ``difftrain`` (peft's names as they are: difftrain's own networks,
and the kinds no diffusers pipeline loads). Every layout keeps difftrain's record of the base (its
source, digest and the LoRA settings) in the file's metadata, so ``difftrain sample --lora FILE`` finds
the base again and refuses another one. docs/lora_files.md has the matrix of which layout loads where.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from torch import Tensor

from difftrain.config import config_from_dict, config_to_toml

# The file format and its reader live one layer down, in lora_import.py (re-exported here).
from difftrain.lora_import import (  # noqa: F401
    ADAPTER_FORMAT,
    ADAPTER_KEY,
    DIFFUSERS_WEIGHT_NAME,
    LAYOUTS,
    adapter_file,
    read_adapter,
)
from difftrain.models.lora import is_lora_record, record_kind


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

    def metadata(self, layout: str) -> dict[str, str]:
        """difftrain's record of this adapter, as file metadata (strings)."""
        cfg = config_from_dict(self.config, source=self.source)
        return {ADAPTER_KEY: json.dumps({
            "format": ADAPTER_FORMAT, "layout": layout, "network": self.record, "frozen": self.frozen,
            "config": config_to_toml(cfg), "step": self.step, "source": self.source, "weights": self.weights,
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
KOHYA_KINDS = ("lora",)


def _family_of(adapter: Adapter, layout: str):
    """The base family of ``adapter``, or one ValueError for difftrain's own networks."""
    from difftrain.families import family_of_record

    family = family_of_record(adapter.record["base"])
    if family is None:
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
    so that the pipeline's ``load_lora_weights(out)`` on the base gives difftrain's network. LoRA and
    DoRA; LoHa and LoKr are refused (no pipeline of these families loads them)."""
    from difftrain.models.lora import peft_config

    family = _family_of(adapter, "diffusers")
    _refuse_kind(adapter, "diffusers", DIFFUSERS_KINDS, f"{family.pipeline_class}.load_lora_weights loads LoRA "
                 "and DoRA only")
    s = adapter.record["lora"]
    config = peft_config(record_kind(adapter.record), s["rank"], s["alpha"], s["dropout"], list(s["targets"]))
    family.save_lora(adapter.tensors, config.to_dict(), out, adapter.metadata("diffusers"))
    return out


def write_kohya(adapter: Adapter, out: Path) -> Path:
    """``out/pytorch_lora_weights.safetensors`` in kohya sd-scripts' layout, which ComfyUI and A1111 read:
    ``lora_unet_<module with _>.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha`` (this adapter's
    alpha, per module), converted from diffusers' names by diffusers' ``convert_state_dict_to_kohya``;
    kohya's own metadata (``ss_network_dim``, ``ss_network_alpha``) beside difftrain's. Plain LoRA on a
    UNet family (SD, SDXL); the pipeline's ``load_lora_weights`` reads it back."""
    import torch
    from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya
    from safetensors.torch import save

    from difftrain.runtime.files import atomic_write_bytes

    family = _family_of(adapter, "kohya")
    if not family.writes_kohya_lora:
        raise ValueError(f"{adapter.source}: the kohya layout of a {family.name} LoRA names the original "
                         f"{family.name} network's modules, which no diffusers converter writes; export --layout "
                         f"diffusers ({family.pipeline_class}.load_lora_weights and ComfyUI read it)")
    _refuse_kind(adapter, "kohya", KOHYA_KINDS, "diffusers drops kohya's DoRA scales on loading, and has no "
                 "kohya LoHa or LoKr reader for these families")
    s = adapter.record["lora"]
    prefix = family.lora_prefix + "."
    tensors = convert_state_dict_to_kohya({prefix + k: v.detach().cpu().contiguous() for k, v in adapter.tensors.items()})
    alpha = torch.tensor(float(s["alpha"]))  # the converter writes alpha = rank (scale 1); the adapter's is alpha / rank
    tensors = {k: (alpha.clone() if k.endswith(".alpha") else v.contiguous()) for k, v in tensors.items()}
    metadata = {"ss_network_module": "networks.lora", "ss_network_dim": str(s["rank"]),
                "ss_network_alpha": str(float(s["alpha"])), **adapter.metadata("kohya")}
    out.mkdir(parents=True, exist_ok=True)
    file = out / DIFFUSERS_WEIGHT_NAME
    atomic_write_bytes(file, save(tensors, metadata=metadata))
    return out


def write_difftrain(adapter: Adapter, out: Path) -> Path:
    """``out/pytorch_lora_weights.safetensors`` with peft's names as they are (no family prefix) and
    difftrain's record: any kind on any network, difftrain's own included; what ``sample --lora`` and
    ``model.init_lora_from`` read. No other program knows how to apply it (docs/lora_files.md)."""
    from safetensors.torch import save

    from difftrain.runtime.files import atomic_write_bytes

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
    """The layout ``export --format lora`` writes unless told: the base family's diffusers layout, or
    difftrain's own for its networks and for the kinds no pipeline loads (LoHa, LoKr)."""
    from difftrain.families import family_of_record

    if family_of_record(record["base"]) is None or record_kind(record) not in DIFFUSERS_KINDS:
        return "difftrain"
    return "diffusers"


def export_lora(state: dict, out: str | Path, use_ema: bool = True, layout: str | None = None) -> Path:
    """Write a LoRA checkpoint's adapter in ``layout`` (a key of :data:`LORA_LAYOUTS`; None:
    :func:`default_layout`) to ``out``."""
    if layout is not None and layout not in LORA_LAYOUTS:
        raise ValueError(f"LoRA layout must be one of {', '.join(LORA_LAYOUTS)}, got {layout!r}")
    adapter = adapter_of(state, use_ema)
    return LORA_LAYOUTS[layout or default_layout(adapter.record)](adapter, Path(out))


# ---------------------------------------------------------------------------------------------
# Merging: the adapter folded into the base, a whole network's checkpoint.


def merged_state(state: dict, use_ema: bool = True, *, text_encoder: str | None = None,
                 vae: str | None = None) -> dict:
    """A LoRA checkpoint read by ``load_checkpoint`` as the checkpoint of its base network with
    W + (alpha / r) B A folded into every adapted layer (EMA or raw adapter in both weight slots),
    ``lora.rank`` 0 in its config: what ``export --merge`` hands to the whole-network writers."""
    from difftrain.conditioning import Conditioning, moved_parts
    from difftrain.training.checkpoint import load_weights
    from difftrain.training.state import build_network

    adapter = adapter_of(state, use_ema)
    cfg = moved_parts(config_from_dict(state["config"], source=state["path"]), text_encoder, vae)
    cfg.model.quantize_base = "off"  # folded into the float32 base, never into a quantized copy of it
    net = build_network(cfg, Conditioning.from_config(cfg, state["num_classes"]), state["network"], init_weights=False)
    load_weights(net, adapter.tensors, state["path"], "ema.model" if use_ema else "model")
    merged = net.merged_base_state()
    config = copy.deepcopy(state["config"])
    config.setdefault("lora", {})["rank"] = 0
    config["model"]["quantize_base"] = "off"  # a whole network: no frozen base left to quantize
    return {**state, "config": config, "network": state["network"]["base"], "model": merged,
            "ema": {**state["ema"], "model": merged}}
