"""The Python API, for notebooks and scripts: train, load, generate, export.

    import difftrain
    result = difftrain.train("configs/tiny.toml", "runs/tiny", train__total_steps=200)
    model = difftrain.load("runs/tiny")
    images = difftrain.generate(model, 16, sampler="ddim", steps=50, seed=0)   # (16, C, H, W) in [-1, 1]

Each call does what the command of the same name does, with the same checks and results.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from difftrain.checkpoints.checkpoint import load_checkpoint
from difftrain.checkpoints.weights_file import save_weights_file
from difftrain.config import Config, ConfigError, _apply, check_environment, config_from_dict, load_config, validate
from difftrain.generation.autoguidance import with_guide
from difftrain.generation.inference import LoadedModel, generate_images, load_model
from difftrain.interop.adapters import export_lora, merged_state
from difftrain.interop.diffusers import export_diffusers
from difftrain.networks.lora import is_lora_record
from difftrain.networks.quantize import device_refusal
from difftrain.runtime.device import resolve_device
from difftrain.tools.base_memory import HEADROOM, check_fits, read_base, size_text
from difftrain.training.loop import train as train_loop


def make_config(config_or_path: Config | str | Path | dict | None = None, **overrides: Any) -> Config:
    """A validated config from a :class:`Config` (copied, not changed), a TOML path, a nested
    dict or None (the defaults), with ``overrides`` applied: ``section__key=value`` (e.g.
    ``train__total_steps=10``), ``**{"section.key": value}``, or ``section={"key": value}``."""
    nested: dict[str, dict[str, Any]] = {}
    for name, value in overrides.items():
        if isinstance(value, dict) and "." not in name and "__" not in name:
            nested.setdefault(name, {}).update(value)
            continue
        section, sep, key = name.replace("__", ".").partition(".")
        if not sep or not key:
            raise ConfigError(f"override {name!r} must look like section__key=value (e.g. train__total_steps=10)")
        nested.setdefault(section, {})[key] = value
    if config_or_path is None or isinstance(config_or_path, (str, Path)):
        # As with --set: samplers that neither the preset nor an override names follow the objective.
        return load_config(config_or_path, values=nested)
    if isinstance(config_or_path, Config):
        cfg = copy.deepcopy(config_or_path)
    elif isinstance(config_or_path, dict):
        cfg = config_from_dict(config_or_path, source="the config dict")
    else:
        raise ConfigError(f"expected a Config, a TOML path, a dict or None, got {type(config_or_path).__name__}")
    _apply(cfg, nested, "the keyword overrides")
    validate(cfg)
    return cfg


def check_machine(cfg: Config) -> None:
    """A config against this machine, where a run starts (:func:`train`, ``difftrain train``), before
    anything is written: :func:`difftrain.config.check_environment` (the device, the packages, the data
    folders), then what needs the run's device: that ``model.quantize_base`` runs on it
    (``networks/quantize.py``). A :class:`ConfigError` of one line, naming the option."""
    check_environment(cfg)
    if cfg.model.quantize_base != "off":
        refusal = device_refusal(cfg.model.quantize_base, resolve_device(cfg.train.device))
        if refusal:
            raise ConfigError(refusal)
    check_device_memory(cfg)


def check_device_memory(cfg: Config) -> None:
    """On CUDA, a run on a base family folder (``model.init_from`` with a ``model_index.json`` a family reads)
    against the device's memory, before any weight is loaded: ``difftrain estimate --base``'s figure for the run's
    setting (``tools/base_memory.check_fits``, counted on the meta device: seconds for Flux) against
    ``base_memory.HEADROOM`` of the device's memory (``torch.cuda.mem_get_info``'s total). Where it cannot fit,
    a :class:`ConfigError` of one line (exit 2) naming the figure, the card's and the smallest change that fits.
    Elsewhere (the CPU, MPS, difftrain's own networks) nothing is counted. Not counted (so not refused): FSDP's CPU
    offload, which the count does not model (a block swap, ``model.swap_blocks``, is counted)."""
    device = resolve_device(cfg.train.device)
    folder = Path(cfg.model.init_from).expanduser() if cfg.model.init_from else None
    if (device.type != "cuda" or folder is None or not (folder / "model_index.json").is_file()
            or cfg.train.fsdp_offload):
        return
    try:
        base = read_base(cfg, str(folder))
    except ValueError:  # not a family base folder the count reads: training's own checks say what is wrong
        return
    _, total = torch.cuda.mem_get_info(device)
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    r = check_fits(cfg, base, total, ranks)
    if r["fits"]:
        return
    need = (f"this run's setting needs {size_text(r['total'])} per GPU by `difftrain estimate --base {folder}`, "
            f"over {HEADROOM:.0%} of {torch.cuda.get_device_properties(device).name}'s {size_text(total)} ({device})")
    if r["change"]:
        raise ConfigError(f"{need}; the smallest change that fits: {' '.join(r['change'])} "
                          f"({size_text(r['total'])} -> {size_text(r['changed_total'])})")
    raise ConfigError(f"{need}; no single change or pair of checkpointing, 8-bit AdamW or a quantized base fits: "
                      "lower data.resolution or train.batch_size, or shard the run over several GPUs (train.parallel=fsdp)")


def train(
    config_or_path: Config | str | Path | dict | None = None,
    run_dir: str | Path = "runs/default",
    *,
    resume: str | Path | None = None,
    stop_at_step: int | None = None,
    **overrides: Any,
):
    """Train (or resume the run in ``run_dir``), as ``difftrain train``; returns a ``TrainResult``
    (step, images_seen, checkpoint, skipped_steps, stopped_by). The config is validated and
    checked against this machine before anything is written. See :func:`make_config` for
    ``config_or_path`` and ``overrides``."""
    cfg = make_config(config_or_path, **overrides)
    check_machine(cfg)
    return train_loop(cfg, run_dir, resume=resume, stop_at_step=stop_at_step)


def load(run_or_checkpoint: str | Path | None = None, *, ema: bool = True, device: str = "auto",
         lora: str | Path | None = None, lora_scale: float = 1.0, base: str | Path | None = None,
         guide: str | Path | None = None, guide_step: int | None = None, guide_weight: float = 2.0):
    """A trained model (``LoadedModel``: model, cfg, objective, num_classes, step, path) from a
    run directory, a checkpoint file or a ``.safetensors`` weights file, EMA weights unless
    ``ema`` is False. Or, with ``lora`` instead, an adapter from ``export(..., format="lora")``
    on the base it was trained on (``base``: where that base is now, if it moved).
    ``lora_scale`` scales the adapter (of ``lora`` or of a LoRA run): 1 as trained, 0 none.
    ``guide`` / ``guide_step``: autoguidance (Karras et al. 2024) by that checkpoint or run, or by
    the checkpoint of that step of this run (or of ``guide``), weight ``guide_weight``: every
    sample of ``generate`` then costs two network evaluations per step."""
    loaded = load_model(run_or_checkpoint, use_ema=ema, device=device, lora=lora, lora_scale=lora_scale,
                        base=None if base is None else str(base))
    return with_guide(loaded, guide, guide_weight, guide_step=guide_step, use_ema=ema)


def generate(
    model,
    n: int,
    *,
    sampler: str | None = None,
    steps: int = 50,
    seed: int = 0,
    class_label: int | Sequence[int] | None = None,
    prompt: str | Sequence[str] | None = None,
    guidance_scale: float = 1.0,
    batch_size: int = 256,
    **sampler_options: Any,
) -> torch.Tensor:
    """``n`` images, (n, C, H, W) float32 in [-1, 1] on the CPU: the images ``difftrain sample``
    writes for the same seed and settings. ``model``: what :func:`load` returns, or a path to
    load. ``class_label``: one class for all, one per image, or None (one class per grid row for
    a class-conditional model). ``prompt``: a text model's prompt, one for all or one per image.
    ``sampler``: None for the run's own (``validation.sampler``, as ``difftrain sample``: DDIM for
    a DDPM model, Heun for EDM and flow). ``sampler_options``: e.g. ``eta=0.5`` for DDIM."""
    if not isinstance(model, LoadedModel):
        model = load(model)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    sampler = sampler or model.cfg.validation.sampler
    return generate_images(model, n, sampler=sampler, steps=steps, seed=seed, batch_size=batch_size,
                           class_label=class_label, prompt=prompt, guidance_scale=guidance_scale, **sampler_options)


def export(run_or_checkpoint: str | Path, out: str | Path, *, format: str = "diffusers", ema: bool = True,
           text_encoder: str | None = None, vae: str | None = None, merge: bool = False,
           lora_layout: str | None = None) -> Path:
    """Write a checkpoint's EMA (or raw) weights as a diffusers pipeline folder
    (``format="diffusers"``) or as one ``.safetensors`` file with its config
    (``format="safetensors"``), as ``difftrain export``; returns what was written.
    ``text_encoder`` / ``vae``: where a Stable Diffusion fine-tune's frozen parts are now.

    A LoRA run: ``format="lora"`` writes the adapter alone in ``lora_layout`` (``out/pytorch_lora_weights.safetensors``:
    "diffusers", which the family pipeline's ``load_lora_weights(out)`` reads (and ComfyUI, for SD3 and Flux);
    "kohya", which ComfyUI and A1111 read (and load_lora_weights, for a plain LoRA of SD or SDXL); "difftrain",
    for difftrain alone; None: the one that loads in the most programs, ``adapters.default_layout``;
    docs/lora_files.md); ``merge`` folds it into the base first, for the whole-network formats."""
    if format not in ("diffusers", "safetensors", "lora"):
        raise ValueError(f"format must be 'diffusers', 'safetensors' or 'lora', got {format!r}")
    if merge and format == "lora":
        raise ValueError("--merge folds the adapter into the base for --format diffusers or safetensors; "
                         "--format lora writes the adapter alone")
    state = load_checkpoint(run_or_checkpoint)
    if format == "lora":
        return export_lora(state, out, use_ema=ema, layout=lora_layout)
    if merge:
        state = merged_state(state, use_ema=ema, text_encoder=text_encoder, vae=vae)
    elif format == "diffusers" and is_lora_record(state["network"]):
        raise ValueError(f"{state['path']} is a LoRA run: export --format lora writes the adapter, and --merge "
                         "the pipeline with the adapter folded into the UNet")
    if format == "safetensors":
        return save_weights_file(state, out, use_ema=ema)
    return export_diffusers(state, out, use_ema=ema, text_encoder=text_encoder, vae=vae)
