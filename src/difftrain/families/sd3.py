"""Stable Diffusion 3 / 3.5 (StableDiffusion3Pipeline): an MMDiT trained with rectified flow.

Facts, checked in the installed diffusers (pipeline_stable_diffusion_3.py, transformer_sd3.py,
scheduling_flow_match_euler_discrete.py) and diffusers' train_dreambooth_lora_sd3.py:

Prompts -> conditioning (``encode_prompt``). Three text encoders read the same caption:
  CLIP-L (text_encoder, CLIPTextModelWithProjection) and CLIP-G (text_encoder_2, the same class),
  each with its tokenizer padded to model_max_length (77; the tiny bases 16); their penultimate
  hidden states (hidden_states[-2], clip_skip None) are concatenated on the feature axis
  (768 + 1280 = 2048 wide), zero-padded on the right to T5's width (4096) and then concatenated
  with T5's sequence along the token axis:
      prompt_embeds = cat([pad(cat([h_L, h_G], -1), T5 width), t5], dim=1)    (B, 77 + L_t5, 4096)
  T5 (text_encoder_3, T5EncoderModel, tokenizer_3) reads max_sequence_length tokens (the
  pipeline's default 256, at most 512); its last hidden state. Without T5 (the pipeline loaded with
  text_encoder_3=None; here a folder without text_encoder_3/ and tokenizer_3/), _get_t5_prompt_embeds
  returns zeros (B, max_sequence_length, transformer.config.joint_attention_dim) and the CLIP states
  are padded to that width: SD3PromptEncoder does the same.
      pooled = cat([text_embeds_L, text_embeds_G], -1)                       (B, 768 + 1280 = 2048)
  (``text_embeds``: the projected pooler output, ``output[0]`` of CLIPTextModelWithProjection.)
  The negative / dropped prompt is ``encode([""])``: the pipeline encodes "" through all three
  encoders (SD3 has no force_zeros_for_empty_prompt), so our null condition is what its CFG uses.
VAE: 16 latent channels; latents = (z - shift_factor) * scaling_factor (1.5305, 0.0609 in SD3's
  config); decode z = latents / scaling_factor + shift_factor. Factor 8 (the tiny bases: 4).
Transformer call: transformer(hidden_states=x (B, 16, h, w), timestep=1000 sigma (B,),
  encoder_hidden_states=prompt_embeds, pooled_projections=pooled); h and w must be multiples of
  patch_size (2) and h / 2, w / 2 at most pos_embed_max_size. The output is the velocity
  noise - x0 (the scheduler steps x += (sigma_next - sigma) out), difftrain's v = eps - x0
  exactly: no sign flip. difftrain's flow objective conditions the network on 1000 t, which is
  SD3's timestep as it is.
Training (the script): x_t = (1 - sigma) x0 + sigma eps; sigma = the scheduler's sigmas at
  floor(1000 u) with u from compute_density_for_timestep_sampling (logit_normal by default, mean 0,
  std 1; or mode with scale 1.29); those sigmas are already shifted by the scheduler's shift (3.0):
  here diffusion.flow_train_shift = shift. Its loss, by default (--precondition_outputs 1): the
  output is made x0_hat = model_pred * (-sigma) + x_t and regressed onto x0 (weighting "none"), i.e.
  the velocity error weighted by sigma^2; with --precondition_outputs 0, target eps - x0, weight 1.
  difftrain trains the latter by default (diffusion.flow_loss = "velocity"): the velocity loss of
  rectified flow and of the SD3 paper (Esser et al. 2024, sec. 2), the target the transformer
  outputs, which keeps the loss of the low-noise samples instead of shrinking it by sigma^2; the
  script's is diffusion.flow_loss = "x0" (the same loss: tests/unit/test_objectives.py). Their
  logged losses differ (each sample's x0 loss is its velocity loss times sigma^2).
Sampling (the pipeline): set_timesteps(N) makes linspace(1, sigma_min, N) (sigma_min = the
  shifted 1/1000), shifted again, then 0: here diffusion.flow_shift = shift and
  diffusion.flow_grid_end = sigma_min; CFG with guidance_scale 7.0 by default.
LoRA: peft on the transformer's attention projections (the script's default targets); files in
  SD3LoraLoaderMixin's format (``transformer.`` + peft names), written by
  StableDiffusion3Pipeline.save_lora_weights, read by its lora_state_dict.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from difftrain.families import register
from difftrain.families.base import (CLIP_TOKENS, PromptEncoder, frozen_part, load_part, read_json, require_keys,
                                     token_ids)
from difftrain.families.mmdit import TransformerDenoiser, TransformerFamily, t5_length
from difftrain.models.text import files_digest, vocab_bytes

DEFAULT_T5_LENGTH = 256  # StableDiffusion3Pipeline's max_sequence_length default (diffusers' SD3 script: 77)
KEYS = ("prompt_embeds", "pooled")


class SD3Denoiser(TransformerDenoiser):
    """``net(x (B, 16, h, w), t (B,) = 1000 t, cond) -> (B, 16, h, w)`` velocity eps - x0: an
    SD3Transformer2DModel called as StableDiffusion3Pipeline calls it.
    cond: {"prompt_embeds": (B, L_clip + L_t5, joint_attention_dim), "pooled": (B, pooled_projection_dim)}."""

    family = "sd3"

    @property
    def patch(self) -> int:
        """The transformer's own ``patch_size`` (2 in every released SD3 and SD3.5)."""
        return int(self.model.config.patch_size)

    def check_latent_size(self, h: int, w: int) -> None:
        super().check_latent_size(h, w)
        p, most = self.patch, self.model.config.pos_embed_max_size
        if most is not None and max(h, w) // p > most:
            raise ValueError(f"latents of {h}x{w} are larger than the SD3 transformer's position embedding "
                             f"takes ({most} patches of {p}: at most {most * p} latent pixels a side)")

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        require_keys(cond, KEYS, x.shape[0], self.family)
        self.check_latent_size(x.shape[-2], x.shape[-1])
        return self.model(hidden_states=x, timestep=t.expand(x.shape[0]), encoder_hidden_states=cond["prompt_embeds"],
                          pooled_projections=cond["pooled"], return_dict=False)[0]


class SD3PromptEncoder(PromptEncoder):
    """CLIP-L, CLIP-G and T5 of an SD3 folder, frozen: ``encode(captions, device) -> {"prompt_embeds":
    (B, L_clip + t5_length, W_t5), "pooled": (B, P_L + P_G)}`` as StableDiffusion3Pipeline.encode_prompt
    (clip_skip None). Its null condition encode([""]) is the pipeline's negative prompt. A folder with
    neither ``text_encoder_3/`` nor ``tokenizer_3/`` is SD3 without T5: the T5 part is zeros
    (t5_length tokens, the transformer's ``joint_attention_dim`` wide), as the pipeline makes them when
    its text_encoder_3 is None; ``t5`` is then None."""

    def __init__(self, folder: Path, max_sequence_length: int = 0, deferred: bool = False):
        super().__init__()
        from transformers import (CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel,  # optional ([text])
                                  T5TokenizerFast)

        self.source = str(folder)
        self.add_part("clip_l", folder / "text_encoder", frozen_part(
            folder, "text_encoder", CLIPTextModelWithProjection, "CLIP-L text encoder"), deferred)
        self.add_part("clip_g", folder / "text_encoder_2", frozen_part(
            folder, "text_encoder_2", CLIPTextModelWithProjection, "CLIP-G text encoder"), deferred)
        self.tok_l = load_part(folder, "tokenizer", CLIPTokenizer, "CLIP-L tokenizer")
        self.tok_g = load_part(folder, "tokenizer_2", CLIPTokenizer, "CLIP-G tokenizer")
        self.t5 = self.tok_t5 = None
        self.parts = ("clip_l", "clip_g")
        if (folder / "text_encoder_3").is_dir() or (folder / "tokenizer_3").is_dir():  # one without the other: one line
            self.add_part("t5", folder / "text_encoder_3", frozen_part(
                folder, "text_encoder_3", T5EncoderModel, "T5 text encoder"), deferred)
            self.tok_t5 = load_part(folder, "tokenizer_3", T5TokenizerFast, "T5 tokenizer")
            self.width = int(read_json(folder / "text_encoder_3" / "config.json", f"base {folder}")["d_model"])
            self.parts = ("clip_l", "clip_g", "t5")
        else:
            width = read_json(folder / "transformer" / "config.json", f"base {folder}").get("joint_attention_dim")
            if isinstance(width, bool) or not isinstance(width, int) or width <= 0:
                raise ValueError(f"{folder}: transformer/config.json gives no joint_attention_dim, the width of the "
                                 "zeros that stand for T5 in a base without text_encoder_3/")
            self.width = width
        self.t5_length = t5_length(max_sequence_length, DEFAULT_T5_LENGTH, self.tok_t5, folder)
        self.clip_length = int(self.tok_l.model_max_length)
        subs = [folder / "text_encoder", folder / "text_encoder_2"] + ([folder / "text_encoder_3"] if len(self.parts) == 3 else [])
        toks = [folder / "tokenizer", folder / "tokenizer_2"] + ([folder / "tokenizer_3"] if len(self.parts) == 3 else [])
        self.digest = files_digest(subs, toks, self._extra().encode())

    def _extra(self) -> str:
        return f"t5_length={self.t5_length}" + ("" if len(self.parts) == 3 else f",t5=zeros({self.width})")

    def legacy_extra(self) -> bytes:
        t5 = [self.tok_t5] if len(self.parts) == 3 else []
        return vocab_bytes([self.tok_l, self.tok_g, *t5], pairs=True) + self._extra().encode()

    @property
    def dim(self) -> int:
        """The width of ``prompt_embeds`` (T5's d_model; without T5 the transformer's joint_attention_dim)."""
        return self.width

    def encode_part(self, name: str, captions: list[str]) -> dict[str, Tensor]:
        """CLIP-L's or CLIP-G's ``{"hidden": (B, 77, W) penultimate states, "pooled": (B, P) text_embeds}``,
        or T5's ``{"t5": (B, t5_length, width)}`` last hidden state."""
        model = getattr(self, name)
        if name == "t5":
            return {"t5": model(token_ids(self.tok_t5, captions, self.t5_length, model.device))[0]}
        tok = self.tok_l if name == "clip_l" else self.tok_g
        out = model(token_ids(tok, captions, self.clip_length, model.device), output_hidden_states=True)
        return {"hidden": out.hidden_states[-2], "pooled": out.text_embeds}

    def assemble(self, outputs: dict[str, dict[str, Tensor]], device: torch.device | str) -> dict[str, Tensor]:
        """The pipeline's condition; without T5, zeros (t5_length, width) in its place (the pipeline's)."""
        clip = torch.cat([outputs["clip_l"]["hidden"], outputs["clip_g"]["hidden"]], dim=-1)
        t5 = outputs["t5"]["t5"].to(clip.device) if "t5" in outputs else \
            torch.zeros(clip.shape[0], self.t5_length, self.width, device=clip.device)
        clip = nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        pooled = torch.cat([outputs["clip_l"]["pooled"], outputs["clip_g"]["pooled"]], dim=-1)
        return {"prompt_embeds": torch.cat([clip.to(t5.dtype), t5], dim=-2).float().to(device),
                "pooled": pooled.float().to(device)}


class SD3Family(TransformerFamily):
    """Stable Diffusion 3 / 3.5."""

    name = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"
    transformer_class = "SD3Transformer2DModel"
    denoiser_class = SD3Denoiser
    # diffusers' SD3 script's default LoRA targets: the joint attention's projections of both streams.
    lora_targets = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                    "attn.to_out.0", "attn.to_q", "attn.to_v")
    foreign_modules = ("single_transformer_blocks", "x_embedder", "guidance_embedder")  # Flux's

    def training_defaults(self, folder: Path) -> dict[str, object]:
        """The base's parts, captions on, and rectified flow as diffusers' SD3 script trains it:
        logit-normal t (0, 1) shifted by the scheduler's shift, sampled on the scheduler's grid."""
        sched = self.scheduler_config(folder)
        shift, steps = float(sched.get("shift", 1.0)), int(sched.get("num_train_timesteps", 1000))
        grid_end = shift * (1 / steps) / (1 + (shift - 1) * (1 / steps))  # the scheduler's sigma_min
        return {**self._defaults(folder), "diffusion.flow_t_sampling": "logit_normal",
                "diffusion.flow_logit_mean": 0.0, "diffusion.flow_logit_std": 1.0,
                "diffusion.flow_train_shift": shift, "diffusion.flow_shift": shift,
                "diffusion.flow_grid_end": grid_end, "diffusion.flow_dynamic_shift": False}

    def condition_shapes(self, config: dict, max_sequence_length: int = 0) -> dict[str, tuple[int, ...]]:
        """CLIP's 77 tokens then T5's, ``joint_attention_dim`` wide, and the pooled CLIP embeddings."""
        tokens = CLIP_TOKENS + (max_sequence_length or DEFAULT_T5_LENGTH)
        return {"prompt_embeds": (tokens, int(config["joint_attention_dim"])),
                "pooled": (int(config["pooled_projection_dim"]),)}

    def load_prompt_encoder(self, folder: Path, device: torch.device | str = "cpu",
                            max_sequence_length: int = 0, deferred: bool = False) -> SD3PromptEncoder:
        return SD3PromptEncoder(Path(folder), max_sequence_length, deferred).to(device)


SD3 = register(SD3Family())
