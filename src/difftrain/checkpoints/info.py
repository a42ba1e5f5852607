"""What a checkpoint holds: step, config, parameter count and weight digests."""

from __future__ import annotations

from pathlib import Path

from difftrain.config import config_from_dict, config_to_toml
from difftrain.checkpoints.checkpoint import load_checkpoint, state_dict_sha256
from difftrain.checkpoints.weights_file import is_weights_file, load_weights_file


def describe_checkpoint(path: str | Path) -> dict:
    """A JSON-ready description of the checkpoint at ``path`` (file or run directory), or of a
    weights file (``.safetensors``: one set of weights, so one digest; the other is None)."""
    if is_weights_file(path):
        state = load_weights_file(path)
        cfg = config_from_dict(state["config"], source=state["path"])
        tensors, digest = state["tensors"], state_dict_sha256(state["tensors"])
        return {
            "path": state["path"],
            "step": state["step"],
            "images_seen": state["images_seen"],
            "parameters": sum(t.numel() for t in tensors.values()),
            "weights": state["weights"],
            "model_sha256": digest if state["weights"] == "raw" else None,
            "ema_sha256": digest if state["weights"] == "ema" else None,
            "skipped_steps": None,
            "posthoc_ema_stds": [],  # a weights file holds one set of weights, no tracked EMAs
            "ema_posthoc": None,
            "network": state["network"]["kind"],
            "frozen": state["frozen"],
            "lora": state["network"] if state["network"]["kind"] == "lora" else None,
            "config": state["config"],
            "config_toml": config_to_toml(cfg),
        }
    state = load_checkpoint(path)
    cfg = config_from_dict(state["config"], source=state["path"])
    model = state["model"]
    return {
        "path": state["path"],
        "step": state["step"],
        "images_seen": state["data_position"],
        "parameters": sum(t.numel() for t in model.values()),
        "model_sha256": state_dict_sha256(model),
        "ema_sha256": state_dict_sha256(state["ema"]["model"]),
        "skipped_steps": state["skipped_steps"],
        "posthoc_ema_stds": state["posthoc_ema"]["stds"],  # sigma_rel of the tracked power EMAs
        "ema_posthoc": state["ema"].get("posthoc"),  # how `posthoc-ema` made the EMA weights, or None
        "network": state["network"]["kind"],  # "unet" (difftrain's) or a diffusers UNet2DConditionModel
        "frozen": state["frozen"],  # the text encoder and VAE it needs: {"source", "digest"} each, never their weights
        "lora": state["network"] if state["network"]["kind"] == "lora" else None,  # base record, digest, settings
        "config": state["config"],
        "config_toml": config_to_toml(cfg),
    }
