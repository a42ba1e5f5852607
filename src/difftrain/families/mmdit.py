"""What the transformer (MMDiT) families share: SD3 (sd3.py) and Flux (flux.py) wrap a diffusers
transformer, load their parts from a pipeline folder, export by replacing the folder's
``transformer/`` and keep LoRA files in the pipeline's own format (its ``save_lora_weights`` /
``lora_state_dict``, the ``transformer.`` prefix). diffusers and transformers are imported only
when a part is loaded.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from torch import nn

from difftrain.runtime.optional import require

_PREFIX = "transformer."  # the wrapped model's parameters inside a TransformerDenoiser, hidden from state dicts
LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' default LoRA file name


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def model_index(folder: str | Path) -> dict:
    """The pipeline folder's model_index.json, or a ValueError naming the folder."""
    path = Path(folder).expanduser() / "model_index.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the pipeline's model_index.json ({first_line(e)})") from None


def load_part(library: str, class_name: str, folder: str | Path, sub: str, what: str, **kwargs):
    """``class_name.from_pretrained(folder/sub)`` from ``library`` ("diffusers" or "transformers"),
    float32 for models; a ValueError of one line naming the folder and the missing part."""
    require(library, "text", f"the {what} of {folder}")
    import importlib

    path = Path(folder).expanduser() / sub
    if not path.is_dir():
        raise ValueError(f"{folder} has no {sub}/ (the {what}, a {class_name}); a complete pipeline folder has one")
    cls = getattr(importlib.import_module(library), class_name)
    try:
        return cls.from_pretrained(str(path), **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:
        raise ValueError(f"cannot load the {what} ({class_name}) in {path}: {first_line(e)}") from None


def part_config(folder: str | Path, sub: str) -> dict:
    """The JSON config of a part (``sub``/config.json), or a ValueError naming the file."""
    path = Path(folder).expanduser() / sub / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the {sub} config ({first_line(e)})") from None


def check_resolution(folder: str | Path, family: str, resolution: int, patch: int, most_patches: int | None) -> None:
    """A ValueError of one line unless ``resolution`` (pixels a side) divides into the VAE's factor
    times the transformer's ``patch`` (and, given ``most_patches``, is within that many patches)."""
    vae = part_config(folder, "vae")
    factor = 2 ** (len(vae.get("block_out_channels", (0,))) - 1)
    step = factor * patch
    if isinstance(resolution, bool) or not isinstance(resolution, int) or resolution < step or resolution % step:
        raise ValueError(f"data.resolution={resolution!r} does not divide into the {family} base {folder}: images "
                         f"must be multiples of {step} px (the VAE's factor {factor} x {patch}x{patch} patches)")
    if most_patches is not None and resolution // step > most_patches:
        raise ValueError(f"data.resolution={resolution} is larger than the {family} base {folder} takes: at most "
                         f"{most_patches * step} px (its transformer's pos_embed_max_size {most_patches})")


def load_codec(folder: str | Path):
    """The base's VAE (``vae/``) as a LatentCodec: model space (z - shift_factor) * scaling_factor."""
    from difftrain.models.vae import LatentCodec

    return LatentCodec.from_path(str(folder))


def frozen(module: nn.Module, device=None) -> nn.Module:
    """``module`` in eval mode, float32, without gradients, on ``device``."""
    module = module.float().eval().requires_grad_(False)
    return module.to(device) if device is not None else module


def parts_digest(models: list[nn.Module], tokenizers: list) -> str:
    """SHA-256 (hex) of the models' float weights by sorted name and the tokenizers' vocabularies."""
    h = hashlib.sha256()
    for i, model in enumerate(models):
        tensors = {n: t for n, t in model.state_dict().items() if t.is_floating_point()}
        for name in sorted(tensors):
            t = tensors[name].detach().to("cpu", torch.float32).contiguous()
            h.update(f"{i}.{name}:{tuple(t.shape)}\n".encode())
            h.update(t.numpy().tobytes())
    for tok in tokenizers:
        h.update(json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False).encode())
    return h.hexdigest()


def token_ids(tokenizer, captions: list[str], length: int, device) -> torch.Tensor:
    """(B, length) long: ``captions`` padded to ``length`` and truncated, as the pipelines do."""
    out = tokenizer(list(captions), padding="max_length", max_length=length, truncation=True,
                    return_tensors="pt")
    return out.input_ids.to(device)


def check_t5_length(length: int, tokenizer, folder, limit: int = 512) -> int:
    """``length`` if the base's T5 tokenizer (its model_max_length) and the pipelines (<= 512)
    take it; else a ValueError of one line."""
    most = min(int(getattr(tokenizer, "model_max_length", limit)), limit)
    if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= most:
        raise ValueError(f"T5 sequence length {length!r} is not one the base {folder} can take: its T5 tokenizer "
                         f"and pipeline take 1 to {most} tokens")
    return length


def _jsonable(config) -> dict:
    return json.loads(json.dumps(dict(config)))


class TransformerDenoiser(nn.Module):
    """A diffusers transformer as a difftrain denoiser. Its state dict is the wrapped model's
    (diffusers names, no prefix); subclasses define ``forward(x, t, cond)`` and ``family``."""

    family = ""
    num_classes = 0

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.transformer = transformer
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    @property
    def config(self) -> dict:
        """The wrapped transformer's config as a JSON-able dict (rebuilds the architecture)."""
        return _jsonable(self.transformer.config)

    @property
    def in_channels(self) -> int:
        return int(self.transformer.config.in_channels)

    def record(self) -> dict:
        """What a checkpoint keeps to rebuild the architecture."""
        return {"kind": "family", "family": self.family, "config": self.config}

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """diffusers' activation checkpointing of the transformer blocks, on or off."""
        if enabled:
            self.transformer.enable_gradient_checkpointing()
        else:
            self.transformer.disable_gradient_checkpointing()


def _strip_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + _PREFIX)]:
        state_dict[prefix + key[len(prefix) + len(_PREFIX):]] = state_dict.pop(key)


def _add_prefix(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + _PREFIX)]:
        state_dict[prefix + _PREFIX + key[len(prefix):]] = state_dict.pop(key)


def export_folder(transformer: nn.Module, base: str | Path, out: str | Path) -> Path:
    """A pipeline folder at ``out``: the base folder's parts (text encoders, tokenizers, VAE,
    scheduler, model_index.json) copied as they are, ``transformer/`` written by diffusers'
    ``save_pretrained`` from ``transformer`` (safetensors, float32)."""
    base, out = Path(base).expanduser(), Path(out).expanduser()
    model_index(base)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"export folder {out} exists and is not empty")
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("transformer"), dirs_exist_ok=True)
    transformer.save_pretrained(str(out / "transformer"), safe_serialization=True)
    return out


def save_lora(pipeline_class: str, state: dict, out: str | Path) -> Path:
    """Write ``state`` (peft's adapter state dict of the transformer: ``<module>.lora_A.weight``,
    ...) as ``out`` (a .safetensors file) through ``pipeline_class.save_lora_weights``."""
    require("diffusers", "text", "a LoRA file in diffusers' format")
    import diffusers

    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    getattr(diffusers, pipeline_class).save_lora_weights(
        str(out.parent), transformer_lora_layers={k: v.detach().cpu().contiguous() for k, v in state.items()},
        weight_name=out.name, safe_serialization=True)
    return out


def read_lora(pipeline_class: str, family: str, path: str | Path, foreign: tuple[str, ...] = (),
              denoiser: nn.Module | None = None) -> dict:
    """The transformer's LoRA tensors (peft names, no ``transformer.`` prefix) of a file that
    ``pipeline_class.lora_state_dict`` reads; a ValueError of one line for a file of another
    family (keys outside ``transformer.``, or with a module name in ``foreign``, or, given the
    ``denoiser``, naming a module it lacks or of another shape)."""
    require("diffusers", "text", f"the LoRA file {path}")
    import diffusers

    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"LoRA file {path} does not exist")
    try:
        state = getattr(diffusers, pipeline_class).lora_state_dict(str(path))
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:
        raise ValueError(f"LoRA file {path} is not a {family} LoRA file ({pipeline_class}): {first_line(e)}") from None
    state = state[0] if isinstance(state, tuple) else state
    outside = sorted({k.split(".")[0] for k in state if not k.startswith(_PREFIX)})
    if outside or not state:
        raise ValueError(f"LoRA file {path} is not a {family} LoRA file: it holds "
                         f"{'weights of ' + ', '.join(outside) if outside else 'no weights'}, not the transformer's")
    state = {k[len(_PREFIX):]: v for k, v in state.items()}
    strange = sorted({name for k in state for name in foreign if name in k.split(".")})
    if strange:
        raise ValueError(f"LoRA file {path} is not a {family} LoRA file: it names {', '.join(strange)}")
    if denoiser is not None:
        modules = dict(denoiser.transformer.named_modules())
        for key, value in state.items():
            owner = key.split(".lora_")[0]
            base = modules.get(owner)
            base = getattr(base, "base_layer", base)
            if base is None or not hasattr(base, "weight"):
                raise ValueError(f"LoRA file {path} is not a LoRA of this {family} base: it names {owner}, "
                                 f"which the base's transformer lacks")
            want = base.weight.shape[1] if ".lora_A." in key else base.weight.shape[0]
            got = value.shape[1] if ".lora_A." in key else value.shape[0]
            if want != got:
                raise ValueError(f"LoRA file {path} is not a LoRA of this {family} base: {key} has shape "
                                 f"{tuple(value.shape)}, the base's {owner} is {tuple(base.weight.shape)}")
    return state
