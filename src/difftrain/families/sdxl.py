"""SDXL (``StableDiffusionXLPipeline``): a UNet2DConditionModel with ``addition_embed_type = "text_time"``,
cross-attending to two CLIP text encoders' penultimate hidden states (concatenated), and conditioned on
the second encoder's projected pooled embedding and six size numbers (Podell et al. 2023, "SDXL", sec. 2.2:
original size, crop top-left, target size).

    family = FAMILIES["sdxl"]                      # or families.detect("sdxl-folder")
    net = family.load_denoiser("sdxl-folder")      # SDXLUNet
    text = family.load_prompt_encoder("sdxl-folder")
    cond = text.encode(captions, device) | family.image_conditions(geometry, (H, W), device)
    out = net(x, t, cond)    # cond: prompt_embeds (B, L, D1 + D2), pooled (B, P), time_ids (B, 6)

Facts from diffusers' ``StableDiffusionXLPipeline.encode_prompt`` and ``_get_add_time_ids``: each
tokenizer pads to its ``model_max_length``; ``hidden_states[-2]`` of each encoder, concatenated on the
last axis; the pooled embedding is the second encoder's ``text_embeds``; ``time_ids`` = (orig_h, orig_w,
crop_top, crop_left, target_h, target_w) in pixels. Its negative prompt is zeros (prompt_embeds and
pooled) when the folder's ``force_zeros_for_empty_prompt`` (the default), else the encoded "": this
family's :meth:`SDXLPromptEncoder.null` does the same, so difftrain's guidance is the pipeline's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from difftrain.families import register
from difftrain.families.base import (CLIP_TOKENS, Denoiser, Family, PromptEncoder, frozen_part, load_part, quantized,
                                     read_json, require_keys, token_ids)
from difftrain.families.sd import scheduler_training, unet_blocks
from difftrain.models.text import files_digest, vocab_bytes
from difftrain.runtime.device import to_device_async
from difftrain.runtime.optional import require

KEYS = ("prompt_embeds", "pooled", "time_ids")


class SDXLUNet(Denoiser):
    """``net(x (B, 4, h, w), t (B,), cond) -> (B, 4, h, w)``: SDXL's UNet with ``encoder_hidden_states =
    cond["prompt_embeds"]`` (B, L, D) and ``added_cond_kwargs = {"text_embeds": cond["pooled"] (B, P),
    "time_ids": cond["time_ids"] (B, 6)}``."""

    family = "sdxl"

    @classmethod
    def from_config(cls, config: dict) -> SDXLUNet:
        require("diffusers", "text", "an SDXL UNet")
        from diffusers import UNet2DConditionModel  # diffusers: an optional package ([text])

        return cls(UNet2DConditionModel.from_config(dict(config)).float())

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        cond = require_keys(cond, KEYS, x.shape[0], self.family)
        added = {"text_embeds": cond["pooled"], "time_ids": cond["time_ids"]}
        return self.model(x, t.expand(x.shape[0]), encoder_hidden_states=cond["prompt_embeds"],
                          added_cond_kwargs=added, return_dict=False)[0]


class SDXLPromptEncoder(PromptEncoder):
    """SDXL's two frozen CLIP text encoders: captions -> ``{"prompt_embeds": (B, L, D1 + D2), "pooled":
    (B, P)}``, as ``StableDiffusionXLPipeline.encode_prompt`` (clip_skip None) makes them; the null
    condition is zeros when ``force_zeros_for_empty_prompt`` (the pipeline's negative prompt)."""

    def __init__(self, folder: Path, force_zeros: bool, deferred: bool = False) -> None:
        super().__init__()
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer  # optional ([text])

        folder = Path(folder)
        self.encoders = nn.ModuleList([nn.Module(), nn.Module()])  # the slots; each part set by add_part
        self.add_part("encoders.0", folder / "text_encoder", frozen_part(
            folder, "text_encoder", CLIPTextModel, "first text encoder (CLIP-L)"), deferred)
        self.add_part("encoders.1", folder / "text_encoder_2", frozen_part(
            folder, "text_encoder_2", CLIPTextModelWithProjection, "second text encoder (CLIP-G)"), deferred)
        tokenizers = [load_part(folder, "tokenizer", CLIPTokenizer, "first tokenizer"),
                      load_part(folder, "tokenizer_2", CLIPTokenizer, "second tokenizer")]
        self.tokenizers, self.source, self.force_zeros = tokenizers, str(folder), force_zeros
        self.digest = files_digest([folder / "text_encoder", folder / "text_encoder_2"],
                                   [folder / "tokenizer", folder / "tokenizer_2"])
        self.dim = sum(int(read_json(folder / sub / "config.json", f"base {folder}")["hidden_size"])
                       for sub in ("text_encoder", "text_encoder_2"))  # D of prompt_embeds

    def legacy_extra(self) -> bytes:
        return vocab_bytes(self.tokenizers, ascii_only=True)

    parts = ("encoders.0", "encoders.1")

    def encode_part(self, name: str, captions: list[str]) -> dict[str, Tensor]:
        """Encoder ``encoders.I``'s ``{"hidden": (B, 77, D_I) penultimate states}``, with ``"pooled"`` (B, P)
        for the one with a projection (CLIP-G's text_embeds)."""
        i = int(name.rsplit(".", 1)[1])
        tokenizer, encoder = self.tokenizers[i], self.encoders[i]
        ids = token_ids(tokenizer, captions, tokenizer.model_max_length, encoder.device)  # (B, 77) made on the host
        out = encoder(ids, output_hidden_states=True)
        pooled = {"pooled": out[0]} if out[0].ndim == 2 else {}  # CLIPTextModelWithProjection: text_embeds
        return {"hidden": out.hidden_states[-2], **pooled}

    def assemble(self, outputs: dict[str, dict[str, Tensor]], device: torch.device | str) -> dict[str, Tensor]:
        parts = [outputs[name] for name in self.parts]
        pooled = [p["pooled"] for p in parts if "pooled" in p][-1]
        hidden = torch.cat([p["hidden"] for p in parts], dim=-1)  # every part's on one device (the fill's too)
        return {"prompt_embeds": hidden.float(), "pooled": pooled.float()}  # on the encoders' device: the run's

    def null_of(self, empty: dict[str, Tensor], n: int) -> dict[str, Tensor]:
        if not self.force_zeros:
            return super().null_of(empty, n)
        return {k: torch.zeros_like(v).expand(n, *v.shape[1:]) for k, v in empty.items()}


def time_ids(geometry: Tensor | None, size: tuple[int, int], batch: int, device) -> Tensor:
    """(B, 6) float32 on ``device``: (orig_h, orig_w, crop_top, crop_left, target_h, target_w) of each
    sample, from ``geometry`` (B, 4) (original size and crop in pixels, as the loader gives it on the host;
    None: uncropped at ``size``), as diffusers' SDXL training script makes ``add_time_ids``. Built on the
    host and copied without waiting for the device (a step never synchronises for it)."""
    if geometry is None:
        geometry = torch.tensor([size[0], size[1], 0, 0]).expand(batch, 4)
    target = torch.tensor([size[0], size[1]], dtype=torch.float32).expand(geometry.shape[0], 2)
    if geometry.device.type != "cpu":  # already on a device: the target joins it there
        return torch.cat([geometry.float(), to_device_async(target, geometry.device)], dim=1).to(device)
    return to_device_async(torch.cat([geometry.float(), target], dim=1), device)


class SDXLFamily(Family):
    """SDXL (base 1.0 and its fine-tunes)."""

    name = "sdxl"
    pipeline_class = "StableDiffusionXLPipeline"
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    writes_kohya_lora = True

    def lora_state_options(self, config: dict) -> dict:
        """kohya sd-scripts names SDXL's UNet blocks as SGM does (input_blocks.4.1...); diffusers maps them
        with the UNet's config, as StableDiffusionXLPipeline.load_lora_weights does."""
        from diffusers.configuration_utils import FrozenDict  # diffusers: an optional package ([text])

        return {"unet_config": FrozenDict(config)}

    def training_defaults(self, folder: Path) -> dict[str, object]:
        folder = Path(folder)
        out: dict[str, object] = {"model.text_encoder": str(folder), "model.vae": str(folder), "data.captions": True}
        scheduler = folder / "scheduler" / "scheduler_config.json"
        if scheduler.is_file():
            out.update(scheduler_training(read_json(scheduler, f"base {folder}")))
        return out

    def load_denoiser(self, folder: Path, quantization_config=None) -> SDXLUNet:
        require("diffusers", "text", f"the SDXL base {folder}")
        from diffusers import UNet2DConditionModel  # diffusers: an optional package ([text])

        return SDXLUNet(load_part(Path(folder), "unet", UNet2DConditionModel, "SDXL UNet",
                                  **quantized(quantization_config)))

    def denoiser_from_record(self, record: dict) -> SDXLUNet:
        return SDXLUNet.from_config(record["config"])

    def load_prompt_encoder(self, folder: Path, device: torch.device | str = "cpu",
                            deferred: bool = False) -> SDXLPromptEncoder:
        require("transformers", "text", f"the SDXL base {folder}")
        folder = Path(folder)
        index = read_json(folder / "model_index.json", f"base {folder}")
        force_zeros = bool(index.get("force_zeros_for_empty_prompt", True))
        return SDXLPromptEncoder(folder, force_zeros, deferred).to(device)

    def condition_shapes(self, config: dict, max_sequence_length: int = 0) -> dict[str, tuple[int, ...]]:
        """Both CLIPs' 77 tokens (``cross_attention_dim`` wide), the pooled embedding (the class
        embedding's input less the six time ids' embeddings) and the six time ids."""
        pooled = int(config["projection_class_embeddings_input_dim"]) - 6 * int(config["addition_time_embed_dim"])
        return {"prompt_embeds": (CLIP_TOKENS, int(config["cross_attention_dim"])), "pooled": (pooled,), "time_ids": (6,)}

    def image_conditions(self, geometry: Tensor | None, size: tuple[int, int], device) -> dict[str, Tensor]:
        batch = 1 if geometry is None else geometry.shape[0]
        return {"time_ids": time_ids(geometry, size, batch, device)}

    def fsdp_units(self, denoiser: Denoiser) -> list[nn.Module]:
        return unet_blocks(denoiser.model)


SDXL = register(SDXLFamily())
