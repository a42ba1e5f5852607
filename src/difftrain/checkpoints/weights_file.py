"""difftrain's weights file: one set of weights (EMA or raw) in a ``.safetensors`` file, with the
config, class count, objective and step in its metadata: the file to share a trained model.

    save_weights_file(state, "model.safetensors")   # state: what load_checkpoint returns
    load_weights_file("model.safetensors")           # -> the fields load_model needs
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save

from difftrain.checkpoints.checkpoint import CheckpointError, check_schema, first_non_finite
from difftrain.config import config_from_dict, config_to_toml
from difftrain.runtime.files import atomic_write_bytes

WEIGHTS_FORMAT = "difftrain-weights-v1"
WEIGHTS_SUFFIX = ".safetensors"



def is_weights_file(path: str | Path) -> bool:
    """True for a ``.safetensors`` file (what :func:`save_weights_file` writes)."""
    return Path(path).suffix == WEIGHTS_SUFFIX and Path(path).is_file()


def save_weights_file(state: dict, out: str | Path, use_ema: bool = True) -> Path:
    """Write the EMA (or raw) weights of a checkpoint read by ``load_checkpoint`` to ``out``
    (``.safetensors``); the config (TOML), class count, objective and step go in its metadata."""
    out = Path(out)
    if out.suffix != WEIGHTS_SUFFIX:
        raise ValueError(f"the weights file must end in {WEIGHTS_SUFFIX}, got {out}")
    tensors = state["ema"]["model"] if use_ema else state["model"]
    cfg = config_from_dict(state["config"], source=state["path"])
    metadata = {
        "format": WEIGHTS_FORMAT,
        "config": config_to_toml(cfg),
        "num_classes": str(state["num_classes"]),
        "objective": cfg.diffusion.objective,
        "step": str(state["step"]),
        "images_seen": str(state["data_position"]),
        "weights": "ema" if use_ema else "raw",
        "source": str(state["path"]),
        "network": json.dumps(state["network"]),  # what rebuilds a fine-tuned diffusers UNet
        "frozen": json.dumps(state["frozen"]),  # the text encoder and VAE it needs, with digests
    }
    data = save({k: t.detach().cpu().contiguous().clone() for k, t in tensors.items()}, metadata=metadata)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, data)
    return out


def read_safetensors(path: Path, what: str) -> tuple[dict, dict]:
    """(metadata, tensors) of a .safetensors file, read on the CPU; one :class:`CheckpointError`
    naming the file (as ``what``, e.g. "weights file") when it cannot be read or a weight is not
    finite (naming the first such tensor)."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata, tensors = f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise CheckpointError(f"cannot read {what} {path}: {str(e).strip().splitlines()[0]}") from None
    bad = first_non_finite(tensors)  # a NaN adapter or network samples black or noise images
    if bad is not None:
        raise CheckpointError(f"{what} {path}: weight {bad} is not finite (NaN or infinity)")
    return metadata, tensors


def load_weights_file(path: str | Path) -> dict:
    """Read a weights file: ``path``, ``config`` (a dict as in checkpoints), ``num_classes``,
    ``step``, ``images_seen``, ``weights`` ("ema" or "raw") and ``tensors``; a file that is not
    one raises :class:`CheckpointError` naming it."""
    path = Path(path)
    metadata, tensors = read_safetensors(path, "weights file")
    if metadata.get("format") != WEIGHTS_FORMAT:
        raise CheckpointError(f"{path} is not a difftrain weights file (metadata format {WEIGHTS_FORMAT!r} "
                              "expected; a diffusers UNet folder goes in model.init_from)")
    try:
        config = tomllib.loads(metadata["config"])
        info = {k: int(metadata[k]) for k in ("num_classes", "step", "images_seen")}
        # files written before text models lack these: difftrain's UNet, no frozen parts
        info["network"] = json.loads(metadata.get("network", '{"kind": "unet"}'))
        info["frozen"] = json.loads(metadata.get("frozen", "{}"))
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"weights file {path}: bad metadata ({e})") from None
    check_schema({"config": config, **info}, path, ("config", "num_classes", "step", "network", "frozen"),
                 "weights file")
    return {"path": str(path), "config": config, "weights": metadata.get("weights", "ema"), "tensors": tensors,
            **info}


