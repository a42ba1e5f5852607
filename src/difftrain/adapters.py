"""LoRA adapters out of and into difftrain: one adapter, several file layouts.

    export_lora(state, "out/")                     # diffusers' layout: out/pytorch_lora_weights.safetensors
    read_adapter("out/")                           # -> the fields load_model needs (like a weights file)
    merged_state(state)                            # a LoRA checkpoint as a full network's, adapter folded in

An export is :func:`adapter_of` (the checkpoint's adapter, its base's record and the run's config)
followed by one writer of :data:`LORA_LAYOUTS`; another layout (kohya / ComfyUI names) is one more
writer; the diffusers layout is each family's own (``Family.save_lora`` / ``read_lora``, through the
pipeline's ``save_lora_weights`` / ``lora_state_dict``). Every layout keeps difftrain's record of the
base (its source, digest and the LoRA settings) in the file's metadata, so ``difftrain sample
--lora FILE`` finds the base again and refuses another one.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import tomllib
from collections.abc import Callable
from pathlib import Path

from torch import Tensor

from difftrain.config import config_from_dict, config_to_toml
from difftrain.models.lora import is_lora_record
from difftrain.training.checkpoint import CheckpointError

ADAPTER_FORMAT = "difftrain-lora-v1"
ADAPTER_KEY = "difftrain_adapter"  # the metadata key of difftrain's record (JSON)
DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # what save_lora_weights writes, load_lora_weights reads


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


def write_diffusers(adapter: Adapter, out: Path) -> Path:
    """``out/pytorch_lora_weights.safetensors`` in the layout of the base family's pipeline, written by
    its ``save_lora_weights`` (``Family.save_lora``: diffusers' names and peft's LoraConfig metadata),
    so that the pipeline's ``load_lora_weights(out)`` on the base gives difftrain's network."""
    from difftrain.families import family_of_record
    from difftrain.models.lora import import_peft

    family = family_of_record(adapter.record["base"])
    if family is None:
        raise ValueError(f"{adapter.source}: the adapter is of difftrain's own UNet, which diffusers cannot load; "
                         "export --format safetensors --merge gives the adapted network as a difftrain weights file")
    s = adapter.record["lora"]
    lora_config = import_peft().LoraConfig(r=s["rank"], lora_alpha=s["alpha"], lora_dropout=s["dropout"],
                                           target_modules=list(s["targets"]), init_lora_weights="gaussian")
    family.save_lora(adapter.tensors, lora_config.to_dict(), out, adapter.metadata("diffusers"))
    return out


# layout -> writer(adapter, out) -> what was written
LORA_LAYOUTS: dict[str, Callable[[Adapter, Path], Path]] = {"diffusers": write_diffusers}


def export_lora(state: dict, out: str | Path, use_ema: bool = True, layout: str = "diffusers") -> Path:
    """Write a LoRA checkpoint's adapter in ``layout`` (a key of :data:`LORA_LAYOUTS`) to ``out``."""
    if layout not in LORA_LAYOUTS:
        raise ValueError(f"LoRA layout must be one of {', '.join(LORA_LAYOUTS)}, got {layout!r}")
    return LORA_LAYOUTS[layout](adapter_of(state, use_ema), Path(out))


# ---------------------------------------------------------------------------------------------
# Reading an adapter file back (sample --lora).


def adapter_file(path: str | Path) -> Path:
    """The adapter file of ``path``: itself, or the ``pytorch_lora_weights.safetensors`` of a folder."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / DIFFUSERS_WEIGHT_NAME
    if not path.is_file():
        raise ValueError(f"LoRA adapter {path} does not exist (a .safetensors file, or a folder holding "
                         f"{DIFFUSERS_WEIGHT_NAME})")
    return path


def read_adapter(path: str | Path) -> dict:
    """An adapter file written by :func:`export_lora`, as the fields ``load_model`` takes from a
    checkpoint: ``path``, ``config``, ``network`` (its LoRA record), ``frozen``, ``num_classes``,
    ``step``, ``tensors`` (difftrain's names, read by the base family's ``read_lora``). One
    ValueError naming the file otherwise."""
    from difftrain.families import family_of_record
    from difftrain.interop import read_safetensors

    path = adapter_file(path)
    metadata, _ = read_safetensors(path, "LoRA adapter")
    if ADAPTER_KEY not in metadata:
        raise ValueError(f"LoRA adapter {path} carries no difftrain record of its base (written by another "
                         "program?); difftrain samples adapters it exported with export --format lora")
    try:
        record = json.loads(metadata[ADAPTER_KEY])
        assert record["format"] == ADAPTER_FORMAT and record["layout"] in LORA_LAYOUTS
        family = family_of_record(record["network"]["base"])
        assert family is not None, "the base is no family's"
        fields = {"path": str(path), "config": tomllib.loads(record["config"]), "network": record["network"],
                  "frozen": record["frozen"], "num_classes": 0, "step": int(record["step"]),
                  "weights": record.get("weights", "ema")}
    except (AssertionError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"LoRA adapter {path}: bad difftrain metadata ({type(e).__name__} {e})") from None
    return {**fields, "tensors": family.read_lora(path)}


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
    net = build_network(cfg, Conditioning.from_config(cfg, state["num_classes"]), state["network"], init_weights=False)
    load_weights(net, adapter.tensors, state["path"], "ema.model" if use_ema else "model")
    merged = net.merged_base_state()
    config = copy.deepcopy(state["config"])
    config.setdefault("lora", {})["rank"] = 0
    return {**state, "config": config, "network": state["network"]["base"], "model": merged,
            "ema": {**state["ema"], "model": merged}}
