"""What the transformer (MMDiT) families share: SD3 (sd3.py) and Flux (flux.py) wrap a diffusers
transformer (``Denoiser.model``), load their parts from a pipeline folder, are trained with
rectified flow as their scheduler config says, export by replacing the folder's ``transformer/``,
and keep LoRA files in their pipeline's own format (its ``save_lora_weights`` / ``lora_state_dict``,
the ``transformer.`` prefix, peft's LoraConfig as metadata). diffusers and transformers are
imported only when a part is loaded.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from torch import Tensor, nn

from difftrain.families.base import Denoiser, Family, load_part, read_json
from difftrain.models.text import first_line
from difftrain.runtime.device import to_device_async
from difftrain.runtime.optional import diffusers_pipeline

PATCH = 2  # the transformers' patch side (SD3's patch_size, Flux's 2x2 packing) in every released base


def parts_digest(models: list[nn.Module], tokenizers: list, extra: str = "") -> str:
    """SHA-256 (hex) of the models' float weights by sorted name, the tokenizers' vocabularies and ``extra``."""
    h = hashlib.sha256()
    for i, model in enumerate(models):
        tensors = {n: t for n, t in model.state_dict().items() if t.is_floating_point()}
        for name in sorted(tensors):
            t = tensors[name].detach().to("cpu", torch.float32).contiguous()
            h.update(f"{i}.{name}:{tuple(t.shape)}\n".encode())
            h.update(t.numpy().tobytes())
    for tok in tokenizers:
        h.update(json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False).encode())
    h.update(extra.encode())
    return h.hexdigest()


def frozen(module: nn.Module) -> nn.Module:
    """``module`` in eval mode, float32, without gradients."""
    return module.float().eval().requires_grad_(False)


def token_ids(tokenizer, captions: list[str], length: int, device) -> Tensor:
    """(B, length) long: ``captions`` padded to ``length`` and truncated, as the pipelines tokenize."""
    out = tokenizer(list(captions), padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    return to_device_async(out.input_ids, device)  # made on the host: copied without waiting for the device


def t5_length(requested: int, default: int, tokenizer, folder, limit: int = 512) -> int:
    """The T5 sequence length: ``requested`` (0 = ``default`` capped by the tokenizer's
    model_max_length) if the base's T5 tokenizer and pipeline (<= 512) take it; else one ValueError."""
    most = min(int(getattr(tokenizer, "model_max_length", limit)), limit)
    length = min(default, most) if requested == 0 else requested
    if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= most:
        raise ValueError(f"model.max_sequence_length={requested!r}: the base {folder} cannot take it: its T5 "
                         f"tokenizer and pipeline take 1 to {most} tokens")
    return length


class TransformerDenoiser(Denoiser):
    """A diffusers transformer on (B, 16, h, w) latents; ``check_latent_size`` refuses sides the
    patches cannot divide, in one line."""

    @property
    def patch(self) -> int:
        """The side of the square patches the transformer takes its latents in (Flux's 2x2 packing)."""
        return PATCH

    def check_latent_size(self, h: int, w: int) -> None:
        p = self.patch
        if h % p or w % p:
            raise ValueError(f"latents of {h}x{w} do not divide into the {self.family} transformer's "
                             f"{p}x{p} patches: image sides must be multiples of {p} x the VAE's factor")


class TransformerFamily(Family):
    """The shared half of the SD3 and Flux families; subclasses set ``transformer_class``,
    ``denoiser_class``, ``foreign_modules`` and write what differs."""

    transformer_class = ""
    denoiser_class: type[TransformerDenoiser] = TransformerDenoiser
    lora_prefix = "transformer"
    kohya_prefix = "lora_transformer_"  # what ComfyUI maps for SD3 and Flux (OneTrainer's names)
    denoiser_subfolder = "transformer"
    # Module names of the other transformer family: a LoRA file naming them is not this family's.
    foreign_modules: tuple[str, ...] = ()

    @staticmethod
    def scheduler_config(folder: Path) -> dict:
        """The base's FlowMatchEulerDiscreteScheduler config (scheduler/scheduler_config.json)."""
        return read_json(Path(folder) / "scheduler" / "scheduler_config.json", f"base {folder}")

    def prompt_options(self, cfg) -> dict[str, object]:
        """``max_sequence_length``: the T5 tokens per prompt (``model.max_sequence_length``; 0 = the
        pipeline's default)."""
        return {"max_sequence_length": int(getattr(cfg.model, "max_sequence_length", 0))}

    def _defaults(self, folder: Path) -> dict[str, object]:
        return {"model.text_encoder": str(folder), "model.vae": str(folder), "data.captions": True,
                "diffusion.objective": "flow"}

    def load_denoiser(self, folder: Path) -> TransformerDenoiser:
        import diffusers

        return self.denoiser_class(load_part(folder, "transformer", getattr(diffusers, self.transformer_class),
                                             f"{self.name} transformer"))

    def denoiser_from_record(self, record: dict) -> TransformerDenoiser:
        import diffusers

        return self.denoiser_class(getattr(diffusers, self.transformer_class).from_config(dict(record["config"])).float())

    def image_side_multiple(self, codec) -> int:
        """The VAE's factor times the 2x2 patches."""
        return int(codec.factor) * PATCH

    applies_shift_factor = True  # the pipelines decode latents / scaling + shift

    def export_scheduler(self, diffusion) -> dict:
        return self.flow_scheduler(diffusion)

    @staticmethod
    def flow_scheduler(diffusion) -> dict:
        """FlowMatchEulerDiscreteScheduler settings of difftrain's flow keys (``cfg.diffusion``), for
        :meth:`export_pipeline`: ``shift``, or ``use_dynamic_shifting`` with the base/max shift and
        sequence lengths, so that the exported pipeline samples on difftrain's grid (SD3's grid end
        follows from the shift, as ``training_defaults`` sets it)."""
        if diffusion.objective != "flow":
            raise ValueError(f"a transformer base exports a flow model; diffusion.objective is {diffusion.objective!r}")
        if not diffusion.flow_dynamic_shift:
            return {"shift": float(diffusion.flow_shift), "use_dynamic_shifting": False}
        return {"use_dynamic_shifting": True,  # the scheduler then ignores its shift
                "base_shift": float(diffusion.flow_base_shift), "max_shift": float(diffusion.flow_max_shift),
                "base_image_seq_len": int(diffusion.flow_base_seq_len),
                "max_image_seq_len": int(diffusion.flow_max_seq_len)}

    def export_pipeline(self, denoiser: Denoiser, base: Path, out: Path, scheduler: dict | None = None,
                        vae: Path | None = None) -> Path:
        """``base`` copied (text encoders, tokenizers, VAE, scheduler, model_index.json) with
        ``transformer/`` written from ``denoiser`` by diffusers' save_pretrained (safetensors, float32),
        given ``scheduler``, that scheduler config, and given ``vae``, that VAE folder (or a folder's vae/)."""
        base, out = Path(base).expanduser(), Path(out).expanduser()
        read_json(base / "model_index.json", f"base {base}")
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"export folder {out} exists and is not empty")
        shutil.copytree(base, out, ignore=shutil.ignore_patterns("transformer"), dirs_exist_ok=True)
        denoiser.model.save_pretrained(str(out / "transformer"), safe_serialization=True)
        if vae is not None:
            from difftrain.models.vae import vae_folder

            shutil.rmtree(out / "vae", ignore_errors=True)
            shutil.copytree(vae_folder(str(vae)), out / "vae")
        if scheduler is not None:
            config = {**read_json(base / "scheduler" / "scheduler_config.json", f"base {base}"), **scheduler}
            (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(config, indent=2))
        return out

    def save_lora(self, adapter: dict[str, Tensor], lora_config: dict, out: Path,
                  metadata: dict[str, str] | None = None) -> Path:
        """``out``/pytorch_lora_weights.safetensors through the pipeline's save_lora_weights
        (``transformer.`` + peft names, peft's LoraConfig as metadata), ``metadata`` added."""
        from difftrain.families.sd import save_pipeline_lora

        return save_pipeline_lora(self.pipeline_class, "transformer", adapter, lora_config, Path(out), metadata)

    def read_lora(self, path: Path, denoiser: Denoiser | None = None) -> dict[str, Tensor]:
        """The transformer's LoRA tensors (peft names) of a file the pipeline's lora_state_dict reads;
        one ValueError for a file of another family (tensors outside ``transformer.``, module names of
        the other transformer family, or, given ``denoiser``, a module it lacks or of another shape)."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise ValueError(f"LoRA file {path} does not exist")
        pipeline = diffusers_pipeline(self.pipeline_class)
        try:
            state = pipeline.lora_state_dict(str(path), use_safetensors=True)
        except Exception as e:  # noqa: BLE001 - safetensors and diffusers raise many kinds; one line naming the file
            raise ValueError(f"LoRA file {path} is not a {self.name} LoRA file ({self.pipeline_class} cannot read "
                             f"it: {first_line(e)})") from None
        state = state[0] if isinstance(state, tuple) else state
        outside = sorted({k.split(".")[0] for k in state if not k.startswith("transformer.")})
        if outside or not state:
            raise ValueError(f"LoRA file {path} is not a {self.name} LoRA file: it holds "
                             f"{'tensors of ' + ', '.join(outside) if outside else 'no tensors'}, not the transformer's")
        state = {k[len("transformer."):]: v for k, v in state.items()}
        strange = sorted({name for k in state for name in self.foreign_modules if name in k.split(".")})
        if strange:
            raise ValueError(f"LoRA file {path} is not a {self.name} LoRA file: it names {', '.join(strange)} "
                             f"(another family's transformer)")
        if denoiser is not None:
            check_lora_fits(state, denoiser.model, path, self.name)
        return state

    def fsdp_units(self, denoiser: Denoiser) -> list[nn.Module]:
        return list(denoiser.model.transformer_blocks)


def check_lora_fits(state: dict[str, Tensor], model: nn.Module, path, family: str) -> None:
    """One ValueError unless every ``<module>.lora_A/B.weight`` of ``state`` names a module of
    ``model`` with the matching in/out width."""
    modules = dict(model.named_modules())
    for key, value in state.items():
        owner = key.split(".lora_")[0]
        layer = modules.get(owner)
        layer = getattr(layer, "base_layer", layer)
        weight = getattr(layer, "weight", None)
        if weight is None:
            raise ValueError(f"LoRA file {path} is not a LoRA of this {family} base: it names {owner}, which the "
                             f"base's transformer lacks")
        want, got = (weight.shape[1], value.shape[1]) if ".lora_A." in key else (weight.shape[0], value.shape[0])
        if want != got:
            raise ValueError(f"LoRA file {path} is not a LoRA of this {family} base: {key} has shape "
                             f"{tuple(value.shape)}, the base's {owner} is {tuple(weight.shape)}")
