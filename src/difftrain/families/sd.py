"""Stable Diffusion 1.x / 2.x (``StableDiffusionPipeline``): a UNet2DConditionModel cross-attending
to one CLIP text encoder's last hidden states, epsilon or v prediction on the base's DDPM schedule.

    family = FAMILIES["sd"]                            # or families.detect("sd-folder")
    net = family.load_denoiser("sd-folder")            # ConditionUNet: the folder or its unet/
    out = net(x, t, {"prompt_embeds": emb})            # (B, C, H, W); emb (B, L, D)
    rebuilt = family.denoiser_from_record(net.record())   # the architecture, random weights

Its ``state_dict`` is the wrapped UNet's (diffusers names, no prefix), so a checkpoint's weights
load into ``UNet2DConditionModel`` as they are. diffusers is imported only when a network is built.
The negative prompt of ``StableDiffusionPipeline`` is the empty caption's encoding, as difftrain's
null condition.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import torch
from torch import Tensor, nn

from difftrain.diffusion.scheduler_configs import diffusers_training
from difftrain.families import register
from difftrain.families.base import (CLIP_TOKENS, Denoiser, ExportParts, Family, PromptEncoder, quantized, read_json,
                                     require_keys, token_ids)
from difftrain.models.text import TextEncoder, files_digest, first_line, text_model_folders
from difftrain.models.vae import vae_folder as find_vae_folder
from difftrain.runtime.optional import require
from difftrain.runtime.tensor_source import check_weight_indexes

CONDITION_UNET_CLASS = "UNet2DConditionModel"
# The "kind" of the network record checkpoints kept of a ConditionUNet before the families package.
LEGACY_KIND = "diffusers.UNet2DConditionModel"


def _config_file(path: Path) -> Path | None:
    """The config.json of the UNet in ``path`` (itself, or its ``unet/``), or None."""
    for folder in (path, path / "unet"):
        if (folder / "config.json").is_file():
            return folder / "config.json"
    return None


def _is_condition_config(config: dict) -> bool:
    name = config.get("_class_name")
    return name == CONDITION_UNET_CLASS or (name is None and "cross_attention_dim" in config)


def is_condition_unet_folder(path: str | Path) -> bool:
    """True when ``path`` is a UNet2DConditionModel folder or a pipeline folder whose ``unet/``
    is one (a Stable Diffusion folder); False for anything else, a UNet2DModel folder included."""
    config_file = _config_file(Path(path).expanduser()) if Path(path).expanduser().is_dir() else None
    if config_file is None:
        return False
    try:
        return _is_condition_config(json.loads(config_file.read_text()))
    except (OSError, ValueError):
        return False


def unet_folder(path: str | Path) -> Path:
    """The UNet2DConditionModel folder of ``path`` (itself or its ``unet/``), or a ValueError
    naming ``path`` and what it lacks."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ValueError(f"UNet2DConditionModel folder {path} does not exist or is not a folder")
    config_file = _config_file(path)
    if config_file is None:
        raise ValueError(f"{path} is not a UNet2DConditionModel folder nor a Stable Diffusion folder "
                         "(no config.json, nor unet/config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_file}: unreadable UNet config ({e})") from None
    if not _is_condition_config(config):
        raise ValueError(f"{config_file} describes a {config.get('_class_name', 'model without _class_name')}, "
                         f"not a {CONDITION_UNET_CLASS}")
    return config_file.parent


class ConditionUNet(Denoiser):
    """``net(x (B, C, H, W), t (B,), cond) -> (B, C, H, W)``: a diffusers UNet2DConditionModel
    called with ``encoder_hidden_states=cond["prompt_embeds"]`` (B, L, D) (a bare (B, L, D) tensor
    is taken too).

    Attributes: ``unet`` (the wrapped model), ``unet_config`` (its config as a JSON-able dict),
    ``context_dim`` (its cross_attention_dim D), ``in_channels``, ``out_channels``,
    ``num_classes`` (0: it is a text model).
    """

    family = "sd"

    @property
    def unet(self) -> nn.Module:
        return self.model

    @property
    def unet_config(self) -> dict:
        """The wrapped UNet's config, as ``from_config`` takes it and a checkpoint can store it."""
        return self.config

    @property
    def context_dim(self) -> int:
        dim = self.unet.config.cross_attention_dim
        return int(dim if isinstance(dim, int) else dim[0])

    @classmethod
    def from_config(cls, config: dict) -> ConditionUNet:
        """The architecture of a UNet2DConditionModel config (``unet_config``), weights random,
        in float32."""
        require("diffusers", "text", "a checkpoint of a diffusers UNet2DConditionModel")
        from diffusers import UNet2DConditionModel  # diffusers: an optional package ([text])

        return cls(UNet2DConditionModel.from_config(dict(config)).float())

    @classmethod
    def from_folder(cls, path: str | Path, quantization_config=None) -> ConditionUNet:
        """The UNet2DConditionModel of a UNet folder or of a Stable Diffusion folder (its
        ``unet/``), weights included, in float32 (with diffusers' ``quantization_config``: as that loads it);
        a ValueError naming the folder if it is not one or its weights do not load."""
        require("diffusers", "text", f"model.init_from={path} (a diffusers UNet2DConditionModel)")
        from diffusers import UNet2DConditionModel  # diffusers: an optional package ([text])

        folder = unet_folder(path)
        check_weight_indexes(folder)  # from_pretrained reads the files a sharded UNet's index names, unchecked
        try:
            unet = UNet2DConditionModel.from_pretrained(str(folder), torch_dtype=torch.float32,
                                                        **quantized(quantization_config))
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            raise ValueError(f"cannot load the UNet2DConditionModel in {folder}: {first_line(e)}") from None
        return cls(unet if quantization_config is not None else unet.float())  # diffusers refuses to cast it

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor] | Tensor | None = None) -> Tensor:
        """x: (B, in_channels, H, W), t: (B,) timesteps (a 0-d tensor is broadcast), cond:
        ``{"prompt_embeds": (B, L, context_dim)}`` or that tensor (required) -> (B, out_channels, H, W)."""
        if isinstance(cond, dict):
            cond = require_keys(cond, ("prompt_embeds",), x.shape[0], self.family)["prompt_embeds"]
        if cond is None or cond.ndim != 3 or cond.shape[0] != x.shape[0] or cond.shape[2] != self.context_dim:
            got = "None" if cond is None else f"shape {tuple(cond.shape)}"
            raise ValueError(f"cond of this UNet2DConditionModel must be text embeddings "
                             f"({x.shape[0]}, L, {self.context_dim}); got {got}")
        return self.unet(x, t.expand(x.shape[0]), encoder_hidden_states=cond, return_dict=False)[0]


# ---------------------------------------------------------------------------------------------
# The prompt encoder: one CLIP text encoder, its last hidden state.


class SDPromptEncoder(PromptEncoder):
    """Stable Diffusion's frozen CLIP text encoder: captions -> ``{"prompt_embeds": (B, L, D)}``, the
    last hidden state (as ``StableDiffusionPipeline.encode_prompt`` with ``clip_skip`` None).

    ``text``: a ``models.text.TextEncoder`` of ``folder`` (a CLIP text model folder or a pipeline's), one part;
    ``deferred``: loaded only by ``load_model`` (the text cache's fill), in its dtype. The digest is of its files
    (``models.text.files_digest``); :meth:`legacy_digest` the one records before it hold (``TextEncoder.digest``)."""

    parts = ("text",)

    def __init__(self, folder: Path, deferred: bool = False) -> None:
        super().__init__()
        self.source = str(folder)
        model_dir, tokenizer_dir = text_model_folders(self.source)
        self.add_part("text", model_dir, lambda dtype: TextEncoder.from_path(self.source, dtype), deferred)
        self.tokenizer_dir = tokenizer_dir
        self.digest = files_digest([model_dir], [tokenizer_dir])
        self.width = int(read_json(model_dir / "config.json", f"text encoder {folder}")["hidden_size"])

    @property
    def dim(self) -> int:
        return self.width

    def legacy_digest(self) -> str:
        return TextEncoder.from_path(self.source).digest  # float32, as records before the stored digest

    def encode(self, captions: list[str], device: torch.device | str) -> dict[str, Tensor]:
        ids = token_ids(self.text.tokenizer, captions, self.text.max_length, device)  # (B, L), no wait
        return {"prompt_embeds": self.text.encode_ids(ids)}

    def encode_part(self, name: str, captions: list[str]) -> dict[str, Tensor]:
        """The text encoder's ``{"prompt_embeds": (B, L, D)}`` last hidden state, on its device."""
        ids = token_ids(self.text.tokenizer, captions, self.text.max_length, self.text.device)
        return {"prompt_embeds": self.text.encode_ids(ids)}

    def assemble(self, outputs: dict[str, dict[str, Tensor]], device: torch.device | str) -> dict[str, Tensor]:
        return {"prompt_embeds": outputs["text"]["prompt_embeds"].float().to(device)}


# ---------------------------------------------------------------------------------------------
# The family.


def scheduler_training(scheduler: dict) -> dict[str, object]:
    """The ``diffusion.*`` values (dotted keys) a diffusers DDPM-style scheduler config describes
    (``scheduler_configs.diffusers_training``: diffusers' defaults where it is silent)."""
    return {f"diffusion.{k}": v for k, v in diffusers_training(scheduler).items()}


def check_condition_unet(unet: Denoiser) -> None:
    """One ValueError unless ``unet`` is a UNet2DConditionModel's (what StableDiffusionPipeline loads)."""
    if not isinstance(unet, ConditionUNet):
        raise ValueError("export to a Stable Diffusion pipeline needs a UNet2DConditionModel (a run with "
                         "model.init_from naming one); difftrain's own text UNet has a different architecture, "
                         "which StableDiffusionPipeline cannot load")


def write_pipeline(unet: ConditionUNet, scheduler: dict, text_encoder_source: str, vae_source: str | None,
                   out_dir: str | Path) -> Path:
    """Write a ``StableDiffusionPipeline`` folder (:meth:`Family.export_pipeline`, the one export path,
    checked to load): ``unet/`` (``unet``'s weights), ``text_encoder/`` and ``tokenizer/`` (from
    ``text_encoder_source``: a Stable Diffusion folder or one folder with both), ``vae/`` (from
    ``vae_source``), ``scheduler/`` (a DDPMScheduler of the config ``scheduler``) and ``model_index.json``;
    no safety checker. One ValueError saying why a network cannot be one."""
    check_condition_unet(unet)
    if vae_source is None:
        raise ValueError("export to a Stable Diffusion pipeline needs a VAE (model.vae): StableDiffusionPipeline "
                         "denoises latents, and this model has none")
    return SD.export_pipeline(unet, Path(text_encoder_source), Path(out_dir), scheduler, vae=Path(vae_source))


class SDFamily(Family):
    """Stable Diffusion 1.x / 2.x."""

    name = "sd"
    pipeline_class = "StableDiffusionPipeline"
    model_classes = (CONDITION_UNET_CLASS,)
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    writes_kohya_lora = True

    def training_defaults(self, folder: Path) -> dict[str, object]:
        """The base's text encoder and VAE, captions on, and what its ``scheduler/`` config says it was
        trained with (schedule, prediction, T, zero terminal SNR). A bare UNet folder decides nothing."""
        folder = Path(folder)
        if not (folder / "model_index.json").is_file():
            return {}
        out: dict[str, object] = {"model.text_encoder": str(folder), "model.vae": str(folder), "data.captions": True}
        scheduler = folder / "scheduler" / "scheduler_config.json"
        if scheduler.is_file():
            out.update(scheduler_training(read_json(scheduler, f"base {folder}")))
        return out

    def load_denoiser(self, folder: Path, quantization_config=None) -> ConditionUNet:
        return ConditionUNet.from_folder(folder, quantization_config)

    def denoiser_from_record(self, record: dict) -> ConditionUNet:
        return ConditionUNet.from_config(record["config"])

    def denoiser_folder(self, folder: Path) -> Path:
        return unet_folder(folder)

    def condition_shapes(self, config: dict, max_sequence_length: int = 0) -> dict[str, tuple[int, ...]]:
        """CLIP's 77 tokens of ``cross_attention_dim``."""
        dim = config["cross_attention_dim"]
        return {"prompt_embeds": (CLIP_TOKENS, int(dim if isinstance(dim, int) else dim[0]))}

    def load_prompt_encoder(self, folder: Path, device: torch.device | str = "cpu",
                            deferred: bool = False) -> SDPromptEncoder:
        return SDPromptEncoder(Path(folder), deferred).to(device)

    def fsdp_units(self, denoiser: Denoiser) -> list[nn.Module]:
        return unet_blocks(denoiser.model)

    def export_parts(self, denoiser: Denoiser, base: Path, scheduler: dict | None, vae: Path | None) -> ExportParts:
        """A ``StableDiffusionPipeline`` made from parts: ``denoiser``'s UNet, the CLIP text encoder and
        tokenizer of ``base`` (a Stable Diffusion folder or one folder with both) and the VAE of ``vae``
        (else ``base``), each copied as it is (its files, its dtype), a DDPMScheduler of ``scheduler`` (None:
        the base's ``scheduler/`` config); no safety checker. Reads configs only; one ValueError saying why a
        network or a part cannot be one."""
        check_condition_unet(denoiser)
        try:
            from diffusers import AutoencoderKL, DDPMScheduler  # diffusers, transformers: optional ([text])
            from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer
        except ImportError:
            raise ValueError("export to a Stable Diffusion pipeline needs diffusers and transformers: "
                             "pip install 'difftrain[text]'") from None
        if scheduler is None:
            scheduler = read_json(Path(base) / "scheduler" / "scheduler_config.json", f"base {base}")
            scheduler = {k: v for k, v in scheduler.items() if not k.startswith("_")}
        text_encoder_source = str(base)
        text_folder, tokenizer_folder = text_model_folders(text_encoder_source)
        vae_folder = find_vae_folder(str(vae or base))
        check_weight_indexes(text_folder)  # the files an index names: inside its folder
        check_weight_indexes(vae_folder)
        try:
            width = CLIPTextConfig.from_pretrained(str(text_folder)).hidden_size
        except (OSError, ValueError) as e:
            raise ValueError(f"text encoder {text_encoder_source}: cannot read a CLIP text model's config "
                             f"({first_line(e)})") from None
        channels = read_json(vae_folder / "config.json", f"VAE {vae_folder}").get("latent_channels", 4)
        if width != denoiser.context_dim:
            raise ValueError(f"text encoder {text_encoder_source} has width {width}, the "
                             f"UNet cross-attends to width {denoiser.context_dim}")
        if channels != denoiser.in_channels:
            raise ValueError(f"VAE {vae_folder} has {channels} latent channels, the UNet "
                             f"takes {denoiser.in_channels}")
        index = {"_class_name": self.pipeline_class, "_diffusers_version": version("diffusers"),
                 "feature_extractor": [None, None], "image_encoder": [None, None], "requires_safety_checker": False,
                 "safety_checker": [None, None], "scheduler": ["diffusers", "DDPMScheduler"],
                 "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
                 "unet": ["diffusers", CONDITION_UNET_CLASS], "vae": ["diffusers", "AutoencoderKL"]}
        return ExportParts(index=index, copied={"text_encoder": (text_folder, CLIPTextModel),
                                                "tokenizer": (tokenizer_folder, CLIPTokenizer),
                                                "vae": (vae_folder, AutoencoderKL)},
                           scheduler=DDPMScheduler(**scheduler))


def unet_blocks(unet: nn.Module) -> list[nn.Module]:
    """FSDP units of a diffusers UNet2DConditionModel, in forward order: the ResNet, transformer and
    resampling modules of its ``down_blocks``, ``mid_block`` and ``up_blocks`` (whole blocks are too
    uneven: SDXL's ``up_blocks.0`` holds 1.2B of its 2.6B parameters). The rest goes to the root."""
    mid = [unet.mid_block] if getattr(unet, "mid_block", None) is not None else []
    found: list[nn.Module] = []
    for block in [*unet.down_blocks, *mid, *unet.up_blocks]:
        res, attn = list(getattr(block, "resnets", [])), list(getattr(block, "attentions", None) or [])
        found += [m for i in range(max(len(res), len(attn))) for m in (res[i:i + 1] + attn[i:i + 1])]
        found += [*(getattr(block, "downsamplers", None) or []), *(getattr(block, "upsamplers", None) or [])]
    return [m for m in found if next(m.parameters(), None) is not None]


SD = register(SDFamily())
