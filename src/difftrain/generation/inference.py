"""Load a trained model from a checkpoint and write samples to a folder."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from difftrain.checkpoints.checkpoint import load_checkpoint, load_weights
from difftrain.checkpoints.weights_file import is_weights_file, load_weights_file
from difftrain.config import Config, config_from_dict
from difftrain.diffusion.objective import Objective, build_objective
from difftrain.generation.sampling import (GRID_NAME, GRID_TEXT, generate, grid_class_labels, initial_noise, make_grid,
                                           naming_samples, save_png, to_uint8)
from difftrain.networks.build import build_network
from difftrain.networks.conditioning import Conditioning, map_condition, moved_parts
from difftrain.networks.lora import is_lora_record
from difftrain.networks.lora_import import check_adapted_output, read_adapter
from difftrain.runtime.device import resolve_device
from difftrain.runtime.progress import CountProgress


@dataclasses.dataclass
class LoadedModel:
    model: nn.Module  # in eval mode, float32
    cfg: Config
    objective: Objective  # what it was trained with; it holds the samplers
    num_classes: int
    step: int
    path: str
    ema: bool
    conditioning: Conditioning  # labels or text, and the frozen text encoder and VAE
    guide: str | None = None  # autoguidance (autoguidance.with_guide): the guide's checkpoint
    guide_step: int | None = None  # its training step
    guide_weight: float = 1.0  # w of D_guide + w (D_main - D_guide); 1 = unguided


def load_model(checkpoint: str | Path | None, use_ema: bool = True, device: str = "auto", *,
               text_encoder: str | None = None, vae: str | None = None, lora: str | Path | None = None,
               lora_scale: float = 1.0, base: str | None = None,
               distilled_guidance: float | None = None) -> LoadedModel:
    """The network of a checkpoint (file, checkpoints/ folder or run directory), EMA weights
    unless ``use_ema`` is False, on ``device``. A weights file (``.safetensors``, from ``difftrain
    export --format safetensors``) holds one set of weights, used whatever ``use_ema`` says.

    ``text_encoder``, ``vae``: where the frozen parts are now, when their folders moved since
    training (default: the config's ``model.text_encoder`` / ``model.vae``); their digests must
    match the checkpoint's.

    LoRA: ``lora`` (instead of ``checkpoint``) is an adapter written by ``export --format lora``,
    put on the base it was trained on (its ``model.init_from``, or ``base`` where that moved; the
    digest must match), or a LoRA file of another program (diffusers' scripts, kohya sd-scripts,
    ComfyUI) put on the base folder ``base`` (``lora_import.py``); ``lora_scale`` scales the adapter of
    it or of a LoRA run's checkpoint (1 = as trained, 0 = the base alone). ``distilled_guidance``: a Flux
    base's guidance input for the samples instead of the run's ``validation.distilled_guidance``. An adapter
    whose network gives a non-finite output on a fixed input (finite weights that overflow) is refused: one
    ValueError naming it."""
    if (checkpoint is None) == (lora is None):
        raise ValueError("give a checkpoint (--checkpoint) or a LoRA adapter file (--lora), one of them")
    if lora is not None:
        state = read_adapter(lora, base=base)
        tensors, key, use_ema = state["tensors"], "adapter", state["weights"] == "ema"
    elif is_weights_file(checkpoint):
        state = load_weights_file(checkpoint)
        tensors, key, use_ema = state["tensors"], "weights", state["weights"] == "ema"
    else:
        state = load_checkpoint(checkpoint)
        key = "ema.model" if use_ema else "model"
        tensors = state["ema"]["model"] if use_ema else state["model"]
    cfg = config_from_dict(state["config"], source=state["path"])
    moved_parts(cfg.model, text_encoder, vae)
    if base is not None:
        if not is_lora_record(state.get("network")):
            raise ValueError(f"--base given, but {state['path']} holds no LoRA adapter (--base is where an "
                             "adapter's base is now)")
        cfg.model.init_from = base  # where the adapter's base is now (checked by digest); validated like any change
    if distilled_guidance is not None:
        cfg.validation.distilled_guidance = distilled_guidance  # validated: one line naming the key
    num_classes = state["num_classes"]
    device = resolve_device(device)
    conditioning = Conditioning.from_config(cfg, num_classes, device)
    if distilled_guidance is not None and "guidance" not in conditioning.sample_values:
        raise ValueError(f"--distilled-guidance given, but {state['path']} is not a model of a guidance-distilled base "
                         "(Flux): it has no guidance input")
    if state.get("frozen", {}) is not None:  # None: another program's LoRA file, on the base's own parts
        conditioning.check_references(state.get("frozen", {}), state["path"])
    # device: a quantized base's run samples on its quantized base, as it validated (refused where it cannot run)
    model = build_network(cfg, conditioning, state.get("network"), init_weights=False, device=device)
    load_weights(model, tensors, state["path"], key)
    if lora_scale != 1.0:
        if not hasattr(model, "set_scale"):
            raise ValueError(f"--lora-scale given, but {state['path']} holds no LoRA adapter")
        model.set_scale(lora_scale)
    model = model.to(device).eval()
    objective = build_objective(cfg.diffusion)
    if lora is not None:  # finite weights can still overflow: one forward on a fixed input must be finite
        check_adapted_output(model, objective, conditioning, device, f"LoRA adapter {state['path']}")
    return LoadedModel(model, cfg, objective, num_classes, state["step"], state["path"], use_ema, conditioning)


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


def prompts_for(num: int, prompt: str | Sequence[str] | None) -> list[str]:
    """(num,) prompts: one prompt for every image, or one per image."""
    if prompt is None:
        raise ValueError("this model is text-conditioned: give a prompt (--prompt \"a red disc on a dark background\")")
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if len(prompts) == 1:
        prompts = prompts * num
    if len(prompts) != num:
        raise ValueError(f"--prompt must be one prompt or {num} prompts, got {len(prompts)}")
    return prompts


def generate_images(
    loaded: LoadedModel,
    num: int,
    *,
    sampler: str = "ddim",
    steps: int = 50,
    seed: int = 0,
    batch_size: int = 256,
    class_label: int | Sequence[int] | None = None,
    prompt: str | Sequence[str] | None = None,
    guidance_scale: float = 1.0,
    reference: str | Sequence[str | Sequence[str]] | None = None,
    **sampler_options,
) -> torch.Tensor:
    """(num, C, H, W) float32 images in [-1, 1] on the CPU, from the initial noise of ``seed``:
    what ``difftrain sample`` writes. Class-conditional models: ``class_label``, else one class
    per grid row; text models: ``prompt`` (one, or one per image). Samples that come out NaN or
    infinite raise ``NonFiniteSamples`` naming ``loaded.path``. An edit family's models (``Family.references``)
    take ``reference``: the reference image's file (one, or one per image; several per image: a list of files for
    an entry, ``[["a.png", "b.png"]]``), resized and centre-cropped to the samples' size."""
    c = loaded.conditioning
    channels, resolution = c.network_shape()
    noise = initial_noise(num, (channels, resolution, resolution), seed)
    device = next(loaded.model.parameters()).device
    if c.kind == "text":
        condition = map_condition(lambda t: t.cpu(), c.prompts(prompts_for(num, prompt), device))
        references = _reference_condition(c, num, reference, resolution, prompts_for(num, prompt))
        if references:  # an edit family's (its conditions are dicts); difftrain's UNet conditions on a tensor
            condition = condition | references
    else:
        if prompt is not None:
            raise ValueError("--prompt given, but the model is not text-conditioned")
        if reference:
            raise ValueError("--reference given, but the model is not text-conditioned (no edit model)")
        condition = class_labels_for(num, loaded.num_classes, class_label)
    with naming_samples(sampled_from(loaded)):  # NaN or inf samples: one line naming the checkpoint or adapter
        return generate(
            loaded.model,
            objective=loaded.objective,
            noise=noise,
            sampler=sampler,
            steps=steps,
            seed=seed,
            condition=condition,
            null_condition=c.null(1, device) if condition is not None else None,
            guidance_scale=guidance_scale,
            batch_size=batch_size,
            decode=c.decode if c.codec is not None else None,
            clip=c.codec is None,  # latents are not bounded to [-1, 1]
            **sampler_options,
        )


def _reference_condition(c: Conditioning, num: int, reference, resolution: int,
                         prompts: list[str] | None = None) -> dict:
    """The reference condition of ``num`` samples of an edit family's model (one ValueError without a
    ``reference``, or with one for a family that takes none): ``reference`` one file for every sample, a list of one
    entry for every sample or one per sample, each entry a file or a list of files (several references per sample,
    in order: Qwen-Image-Edit-Plus's "Picture 1", "Picture 2", ...; as many for every sample). Each image encoded at
    the samples' size (and given with its pixels and ``prompts`` to a family whose prompt encoder sees it)."""
    if not c.family.references:
        if reference:
            raise ValueError(f"--reference given, but the {c.family.name} model takes no reference image")
        return {}
    rows = [[reference]] if isinstance(reference, str) else [[r] if isinstance(r, str) else list(r)
                                                               for r in reference or ()]
    if len(rows) not in (1, num):
        raise ValueError(f"the {c.family.name} model edits a reference image: give --reference IMAGE (one for every "
                         f"image, or one per image: {num}), got {len(rows)}")
    counts = sorted({len(row) for row in rows})
    if len(counts) != 1 or not counts[0]:
        raise ValueError(f"--references: every sample takes as many reference images, got {', '.join(map(str, counts))}")
    side = resolution * c.codec.factor
    grow = lambda t: t.expand(num, *t.shape[1:]) if len(rows) == 1 else t  # noqa: E731
    latents, images = [], []
    for k in range(counts[0]):  # reference k of every sample: (num, 3, H, W) pixels, (num, c, h, w) latents
        pixels = c.reference_images([row[k] for row in rows], (side, side))
        latents.append(grow(c.encode_references(pixels)))
        images.append(grow(pixels))
    return c.reference_condition(latents, prompts, images=images)


def sampled_from(loaded: LoadedModel) -> str:
    """What a loaded model's samples come from, for a line about them: its file, step and weights."""
    guide = f", autoguided by {loaded.guide}" if loaded.guide else ""
    return f"{loaded.path} (step {loaded.step}, {'EMA' if loaded.ema else 'raw'} weights{guide})"


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
    prompt: str | Sequence[str] | None = None,
    guidance_scale: float = 1.0,
    reference: str | Sequence[str | Sequence[str]] | None = None,
    progress: bool = False,
    **sampler_options,
) -> Path:
    """Write ``num`` images as ``out_dir/NNNNNN.png`` plus ``out_dir/grid.png`` (marked, so that
    ``difftrain fid`` / ``eval`` of ``out_dir`` read the samples alone); return the grid.
    With ``progress``, a progress line with rate and ETA on stderr."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    images = generate_images(loaded, num, sampler=sampler, steps=steps, seed=seed, batch_size=batch_size,
                             class_label=class_label, prompt=prompt, guidance_scale=guidance_scale, reference=reference,
                             progress=CountProgress("sample", num, enabled=progress),
                             **sampler_options)
    pixels = to_uint8(images)
    for i, image in enumerate(pixels):
        save_png(image, out_dir / f"{i:06d}.png")
    grid_path = out_dir / GRID_NAME
    save_png(make_grid(pixels), grid_path, text=GRID_TEXT)  # marked: fid and eval of out_dir leave it out
    return grid_path
