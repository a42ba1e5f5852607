"""Load a trained model from a checkpoint and write samples to a folder."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from difftrain.config import Config, config_from_dict
from difftrain.diffusion.objective import Objective, build_objective
from difftrain.runtime.device import resolve_device
from difftrain.sampling import generate, grid_class_labels, initial_noise, make_grid, save_png, to_uint8
from difftrain.training.checkpoint import load_checkpoint, load_weights
from difftrain.runtime.progress import CountProgress
from difftrain.training.state import build_model


@dataclasses.dataclass
class LoadedModel:
    model: nn.Module  # in eval mode, float32
    cfg: Config
    objective: Objective  # what it was trained with; it holds the samplers
    num_classes: int
    step: int
    path: str
    ema: bool


def load_model(checkpoint: str | Path, use_ema: bool = True, device: str = "auto") -> LoadedModel:
    """The network of a checkpoint (file, checkpoints/ folder or run directory), EMA weights
    unless ``use_ema`` is False, on ``device``. A weights file (``.safetensors``, from ``difftrain
    export --format safetensors``) holds one set of weights, used whatever ``use_ema`` says."""
    from difftrain.interop import is_weights_file, load_weights_file

    if is_weights_file(checkpoint):
        state = load_weights_file(checkpoint)
        tensors, key, use_ema = state["tensors"], "weights", state["weights"] == "ema"
    else:
        state = load_checkpoint(checkpoint)
        key = "ema.model" if use_ema else "model"
        tensors = state["ema"]["model"] if use_ema else state["model"]
    cfg = config_from_dict(state["config"], source=state["path"])
    num_classes = state["num_classes"]
    model = build_model(cfg, num_classes)
    load_weights(model, tensors, state["path"], key)
    model = model.to(resolve_device(device)).eval()
    return LoadedModel(model, cfg, build_objective(cfg.diffusion), num_classes, state["step"], state["path"], use_ema)


def class_labels_for(num: int, num_classes: int, class_label: int | Sequence[int] | None) -> torch.Tensor | None:
    """(num,) labels: the given class, one given class per image, or one class per grid row;
    None when unconditional."""
    if class_label is None:
        return grid_class_labels(num, num_classes)
    if num_classes == 0:
        raise ValueError("--class-label given, but the model is not class-conditional")
    labels = torch.as_tensor(class_label, dtype=torch.long).reshape(-1)
    if labels.numel() == 1:
        labels = labels.expand(num).clone()
    if labels.shape != (num,):
        raise ValueError(f"--class-label must be one class or {num} classes, got {labels.numel()}")
    if not bool(((labels >= 0) & (labels < num_classes)).all()):
        raise ValueError(f"--class-label must be in [0, {num_classes}), got {class_label}")
    return labels


def generate_images(
    loaded: LoadedModel,
    num: int,
    *,
    sampler: str = "ddim",
    steps: int = 50,
    seed: int = 0,
    batch_size: int = 256,
    class_label: int | Sequence[int] | None = None,
    guidance_scale: float = 1.0,
    **sampler_options,
) -> torch.Tensor:
    """(num, C, H, W) float32 images in [-1, 1] on the CPU, from the initial noise of ``seed``:
    what ``difftrain sample`` writes. Class-conditional models: ``class_label``, else one class
    per grid row."""
    d = loaded.cfg.data
    noise = initial_noise(num, (d.channels, d.resolution, d.resolution), seed)
    labels = class_labels_for(num, loaded.num_classes, class_label)
    return generate(
        loaded.model,
        objective=loaded.objective,
        noise=noise,
        sampler=sampler,
        steps=steps,
        seed=seed,
        class_labels=labels,
        null_label=loaded.num_classes,
        guidance_scale=guidance_scale,
        batch_size=batch_size,
        **sampler_options,
    )


def sample_to_folder(
    loaded: LoadedModel,
    out_dir: str | Path,
    *,
    num: int = 64,
    sampler: str = "ddim",
    steps: int = 50,
    seed: int = 0,
    batch_size: int = 256,
    class_label: int | None = None,
    guidance_scale: float = 1.0,
    progress: bool = False,
    **sampler_options,
) -> Path:
    """Write ``num`` images as ``out_dir/NNNNNN.png`` plus ``out_dir/grid.png``; return the grid.
    With ``progress``, a progress line with rate and ETA on stderr."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    images = generate_images(loaded, num, sampler=sampler, steps=steps, seed=seed, batch_size=batch_size,
                             class_label=class_label, guidance_scale=guidance_scale, progress=CountProgress("sample", num, enabled=progress),
                             **sampler_options)
    pixels = to_uint8(images)
    for i, image in enumerate(pixels):
        save_png(image, out_dir / f"{i:06d}.png")
    grid_path = out_dir / "grid.png"
    save_png(make_grid(pixels), grid_path)
    return grid_path
