"""Flux.1 (FluxPipeline): a guidance-distilled MMDiT (double- and single-stream blocks) trained
with rectified flow on 2x2-packed latents.

Facts, checked in the installed diffusers (pipeline_flux.py, transformer_flux.py,
scheduling_flow_match_euler_discrete.py) and diffusers' train_dreambooth_lora_flux.py:

Prompts -> conditioning (``encode_prompt``):
  pooled = CLIPTextModel(tokens padded to 77).pooler_output  (B, 768): the CLIP text model's
           pooled EOS state (no projection; Flux's text_encoder is a plain CLIPTextModel)
  prompt_embeds = T5EncoderModel(tokens padded to max_sequence_length)[0]   (B, L_t5, 4096)
           (the pipeline's default max_sequence_length 512, the most it takes; schnell: 256)
  txt_ids = zeros (L_t5, 3); the dropped prompt is ``encode([""])``. The pipeline uses no
  negative prompt unless true_cfg_scale > 1 (FLUX.1-dev's guidance is distilled into the
  ``guidance`` input instead).
Latents: the VAE's 16 channels, latents = (z - shift_factor) * scaling_factor (0.1159, 0.3611),
  packed into 2x2 patches: (B, 16, h, w) -> (B, (h/2)(w/2), 64) in the order
  view(B, C, h/2, 2, w/2, 2).permute(0, 2, 4, 1, 3, 5); img_ids (hw/4, 3) = (0, row, col) of the
  packed grid. The transformer's output is unpacked the same way back to (B, 16, h, w); h and w
  must be even (the image a multiple of 2 x the VAE factor: 16 px for the real VAE).
Transformer call: transformer(hidden_states=packed, timestep=sigma in [0, 1] (it multiplies by
  1000 inside), guidance=(B,) guidance scale (also x 1000 inside; when config.guidance_embeds),
  pooled_projections=pooled, encoder_hidden_states=prompt_embeds, txt_ids, img_ids). difftrain's
  flow objective conditions on 1000 t, so forward() passes t / 1000. The output is the velocity
  noise - x0 (the script's target; the scheduler steps x += (sigma_next - sigma) out),
  difftrain's v = eps - x0 exactly: no sign flip.
Training (the script): sigma = the scheduler's sigmas at floor(1000 u), u by weighting_scheme
  "none" (uniform) by default; the scheduler has use_dynamic_shifting, so those sigmas are NOT
  shifted: training t is uniform and unshifted here too (diffusion.flow_t_sampling = "uniform",
  flow_train_shift 1); the loss is the velocity error, weight 1 (difftrain's flow_loss "velocity").
  guidance = the script's --guidance_scale (default 3.5) for every sample: here
  model.distilled_guidance (default 3.5, the script's), a setting of the run that Conditioning adds to
  every condition (Family.run_conditions), not a text-encoder output: the text cache does not hold it.
Sampling (the pipeline): sigmas linspace(1, 1/N, N), shifted by e^mu with mu linear in the
  packed token count (h/2)(w/2) through (base_image_seq_len, base_shift) and (max_image_seq_len,
  max_shift) (calculate_shift), then 0: here diffusion.flow_dynamic_shift with the scheduler's
  four values; guidance_scale 3.5 by default, no CFG: here validation.distilled_guidance (3.5), which
  ``sample --distilled-guidance`` overrides.
LoRA: peft on the attention projections and feed-forwards (the script's default targets); files
  in FluxLoraLoaderMixin's format (``transformer.`` + peft names), written by
  FluxPipeline.save_lora_weights, read by its lora_state_dict.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from difftrain.families import register
from difftrain.families.base import Denoiser, PromptEncoder, frozen_part, load_part, read_json, require_keys, token_ids
from difftrain.families.mmdit import TransformerDenoiser, TransformerFamily, t5_length
from difftrain.models.text import files_digest, vocab_bytes

DEFAULT_T5_LENGTH = 512  # FluxPipeline's max_sequence_length default (and its most); diffusers' script: 512
KEYS = ("prompt_embeds", "pooled", "guidance")


def pack(x: Tensor) -> Tensor:
    """(B, C, h, w) -> (B, (h/2)(w/2), 4C): 2x2 patches, FluxPipeline's packing."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(x: Tensor, h: int, w: int) -> Tensor:
    """(B, (h/2)(w/2), 4C) -> (B, C, h, w): the inverse of :func:`pack`."""
    b, _, d = x.shape
    return x.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h, w)


def image_ids(h: int, w: int, device=None, dtype=torch.float32) -> Tensor:
    """((h/2)(w/2), 3): (0, row, col) of each packed patch of (h, w) latents."""
    rows = torch.arange(h // 2, device=device, dtype=dtype)[:, None].expand(h // 2, w // 2)
    cols = torch.arange(w // 2, device=device, dtype=dtype)[None, :].expand(h // 2, w // 2)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)


class FluxDenoiser(TransformerDenoiser):
    """``net(x (B, 16, h, w), t (B,) = 1000 t, cond) -> (B, 16, h, w)`` velocity eps - x0: a
    FluxTransformer2DModel called as FluxPipeline calls it (packing, ids and t / 1000 inside).
    cond: {"prompt_embeds": (B, L_t5, joint_attention_dim), "pooled": (B, pooled_projection_dim),
    "guidance": (B,) (used when the transformer has guidance_embeds; :meth:`FluxFamily.run_conditions`)}."""

    family = "flux"

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        b, _, h, w = x.shape
        require_keys(cond, KEYS, b, self.family)
        self.check_latent_size(h, w)
        text = cond["prompt_embeds"]
        guidance = cond["guidance"].to(x.dtype) if self.model.config.guidance_embeds else None
        out = self.model(hidden_states=pack(x), timestep=t.expand(b).to(x.dtype) / 1000, guidance=guidance,
                         pooled_projections=cond["pooled"], encoder_hidden_states=text,
                         txt_ids=text.new_zeros(text.shape[1], 3), img_ids=image_ids(h, w, x.device, x.dtype),
                         return_dict=False)[0]
        return unpack(out, h, w)


class FluxPromptEncoder(PromptEncoder):
    """CLIP and T5 of a Flux folder, frozen: ``encode(captions, device) -> {"prompt_embeds": (B, t5_length,
    W_t5), "pooled": (B, W_clip)}`` as FluxPipeline.encode_prompt. The distilled guidance is not a text
    output: it is the run's (:meth:`FluxFamily.run_conditions`)."""

    parts = ("clip", "t5")

    def __init__(self, folder: Path, max_sequence_length: int = 0, deferred: bool = False):
        super().__init__()
        from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast  # optional ([text])

        self.source = str(folder)
        self.add_part("clip", folder / "text_encoder", frozen_part(folder, "text_encoder", CLIPTextModel,
                                                                   "CLIP text encoder"), deferred)
        self.add_part("t5", folder / "text_encoder_2", frozen_part(folder, "text_encoder_2", T5EncoderModel,
                                                                   "T5 text encoder"), deferred)
        self.tok_clip = load_part(folder, "tokenizer", CLIPTokenizer, "CLIP tokenizer")
        self.tok_t5 = load_part(folder, "tokenizer_2", T5TokenizerFast, "T5 tokenizer")
        self.t5_length = t5_length(max_sequence_length, DEFAULT_T5_LENGTH, self.tok_t5, folder)
        self.clip_length = int(self.tok_clip.model_max_length)
        self.width = int(read_json(folder / "text_encoder_2" / "config.json", f"base {folder}")["d_model"])
        self.digest = files_digest([folder / "text_encoder", folder / "text_encoder_2"],
                                   [folder / "tokenizer", folder / "tokenizer_2"], f"t5_length={self.t5_length}".encode())

    def legacy_extra(self) -> bytes:
        return vocab_bytes([self.tok_clip, self.tok_t5], pairs=True) + f"t5_length={self.t5_length}".encode()

    @property
    def dim(self) -> int:
        """The width of ``prompt_embeds`` (T5's d_model)."""
        return self.width

    def encode_part(self, name: str, captions: list[str]) -> dict[str, Tensor]:
        """CLIP's ``{"pooled": (B, W_clip)}`` pooled output or T5's ``{"prompt_embeds": (B, t5_length, W_t5)}``."""
        if name == "clip":
            return {"pooled": self.clip(token_ids(self.tok_clip, captions, self.clip_length, self.clip.device),
                                        output_hidden_states=False).pooler_output}
        return {"prompt_embeds": self.t5(token_ids(self.tok_t5, captions, self.t5_length, self.t5.device))[0]}

    def assemble(self, outputs: dict[str, dict[str, Tensor]], device: torch.device | str) -> dict[str, Tensor]:
        return {"prompt_embeds": outputs["t5"]["prompt_embeds"].float().to(device),
                "pooled": outputs["clip"]["pooled"].float().to(device)}


class FluxFamily(TransformerFamily):
    """Flux.1 (dev, schnell and their fine-tunes)."""

    name = "flux"
    pipeline_class = "FluxPipeline"
    transformer_class = "FluxTransformer2DModel"
    denoiser_class = FluxDenoiser
    # diffusers' Flux script's default LoRA targets: attention projections and feed-forwards.
    lora_targets = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                    "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                    "ff_context.net.2")
    foreign_modules = ("attn2", "pos_embed")  # SD3.5's second attention, SD3's position embedding
    default_sample_size = 128  # FluxPipeline's (its transformer's config has no sample_size): 1024 px with factor 8

    def training_defaults(self, folder: Path) -> dict[str, object]:
        """The base's parts, captions on, and rectified flow as diffusers' Flux script trains it:
        uniform, unshifted t; sampling with the scheduler's resolution-dependent shift."""
        sched = self.scheduler_config(folder)
        return {**self._defaults(folder), **self.unshifted_flow(sched)}

    def load_prompt_encoder(self, folder: Path, device: torch.device | str = "cpu",
                            max_sequence_length: int = 0, deferred: bool = False) -> FluxPromptEncoder:
        return FluxPromptEncoder(Path(folder), max_sequence_length, deferred).to(device)

    def run_conditions(self, section) -> dict[str, float]:
        """``{"guidance": ...}``: the distilled guidance input, ``model.distilled_guidance`` in training (3.5,
        diffusers' Flux script's --guidance_scale default), ``validation.distilled_guidance`` in sampling
        (3.5, FluxPipeline's guidance_scale default): ``section`` is the one of the two that applies."""
        return {"guidance": float(section.distilled_guidance)}

    def condition_shapes(self, config: dict, max_sequence_length: int = 0) -> dict[str, tuple[int, ...]]:
        """T5's tokens, ``joint_attention_dim`` wide, the pooled CLIP embedding and the guidance value
        (the run's: :meth:`run_conditions`)."""
        return {"prompt_embeds": (max_sequence_length or DEFAULT_T5_LENGTH, int(config["joint_attention_dim"])),
                "pooled": (int(config["pooled_projection_dim"]),), "guidance": ()}

    def latent_channels(self, config: dict) -> int:
        """The VAE's channels: the transformer takes 2x2 patches of them."""
        return int(config["in_channels"]) // 4

    def fsdp_units(self, denoiser: Denoiser) -> list[nn.Module]:
        return [*denoiser.model.transformer_blocks, *denoiser.model.single_transformer_blocks]

    def lora_state_options(self, config: dict) -> dict:
        """FluxPipeline.lora_state_dict returns the network alphas only when asked."""
        return {"return_alphas": True}


FLUX = register(FluxFamily())
