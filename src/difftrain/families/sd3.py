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
  pipeline's default 256, at most 512); its last hidden state. A folder without T5 makes zeros.
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
Training (the script): x_t = (1 - sigma) x0 + sigma eps, target eps - x0, weighting "none" (1);
  sigma = the scheduler's sigmas at floor(1000 u) with u from compute_density_for_timestep_sampling
  (logit_normal by default, mean 0, std 1; or mode with scale 1.29); those sigmas are already
  shifted by the scheduler's shift (3.0): here diffusion.flow_train_shift = shift.
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

from difftrain.families import mmdit

PIPELINE_CLASS = "StableDiffusion3Pipeline"
TRANSFORMER_CLASS = "SD3Transformer2DModel"
DEFAULT_T5_LENGTH = 256  # StableDiffusion3Pipeline's max_sequence_length default
# The peer script's default LoRA targets: the joint attention's projections of both streams.
LORA_TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"]
# Module names only Flux's transformer has: a file naming them is a Flux LoRA.
FOREIGN_MODULES = ("single_transformer_blocks", "x_embedder", "guidance_embedder")


class SD3Denoiser(mmdit.TransformerDenoiser):
    """``net(x (B, 16, h, w), t (B,) = 1000 t, cond) -> (B, 16, h, w)`` velocity eps - x0:
    an SD3Transformer2DModel called as StableDiffusion3Pipeline calls it.
    cond: {"prompt_embeds": (B, L_clip + L_t5, joint_attention_dim), "pooled": (B, pooled_projection_dim)}."""

    family = "sd3"

    @property
    def patch_size(self) -> int:
        return int(self.transformer.config.patch_size)

    def check_latent_size(self, h: int, w: int) -> None:
        """A ValueError unless (h, w) latents divide into patches the position embedding covers."""
        p, most = self.patch_size, self.transformer.config.pos_embed_max_size
        if h % p or w % p:
            raise ValueError(f"latents of {h}x{w} do not divide into the SD3 transformer's {p}x{p} patches")
        if most is not None and max(h, w) // p > most:
            raise ValueError(f"latents of {h}x{w} are larger than the SD3 transformer's position embedding "
                             f"({most} patches of {p}: at most {most * p} latent pixels a side)")

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        self.check_latent_size(x.shape[-2], x.shape[-1])
        return self.transformer(hidden_states=x, timestep=t.expand(x.shape[0]),
                                encoder_hidden_states=cond["prompt_embeds"], pooled_projections=cond["pooled"],
                                return_dict=False)[0]


class SD3PromptEncoder:
    """CLIP-L, CLIP-G and T5 of an SD3 folder, frozen: ``encode(captions) -> {"prompt_embeds":
    (B, L_clip + t5_length, W_t5), "pooled": (B, P_L + P_G)}`` as StableDiffusion3Pipeline.encode_prompt."""

    def __init__(self, folder: str | Path, device=None, t5_length: int | None = None):
        self.source = str(folder)
        self.clip_l = mmdit.frozen(mmdit.load_part("transformers", "CLIPTextModelWithProjection", folder,
                                                   "text_encoder", "CLIP-L text encoder"), device)
        self.clip_g = mmdit.frozen(mmdit.load_part("transformers", "CLIPTextModelWithProjection", folder,
                                                   "text_encoder_2", "CLIP-G text encoder"), device)
        self.t5 = mmdit.frozen(mmdit.load_part("transformers", "T5EncoderModel", folder, "text_encoder_3",
                                               "T5 text encoder"), device)
        self.tok_l = mmdit.load_part("transformers", "CLIPTokenizer", folder, "tokenizer", "CLIP-L tokenizer")
        self.tok_g = mmdit.load_part("transformers", "CLIPTokenizer", folder, "tokenizer_2", "CLIP-G tokenizer")
        self.tok_t5 = mmdit.load_part("transformers", "T5TokenizerFast", folder, "tokenizer_3", "T5 tokenizer")
        length = min(DEFAULT_T5_LENGTH, int(self.tok_t5.model_max_length)) if t5_length is None else t5_length
        self.t5_length = mmdit.check_t5_length(length, self.tok_t5, folder)
        self.clip_length = int(self.tok_l.model_max_length)
        self.digest = mmdit.parts_digest([self.clip_l, self.clip_g, self.t5],
                                         [self.tok_l, self.tok_g, self.tok_t5]) + f":t5={self.t5_length}"

    @torch.no_grad()
    def encode(self, captions: list[str], device=None) -> dict[str, Tensor]:
        device = device if device is not None else self.t5.device
        embeds, pooled = [], []
        for model, tok in ((self.clip_l, self.tok_l), (self.clip_g, self.tok_g)):
            out = model(mmdit.token_ids(tok, captions, self.clip_length, model.device), output_hidden_states=True)
            embeds.append(out.hidden_states[-2])
            pooled.append(out.text_embeds)
        t5 = self.t5(mmdit.token_ids(self.tok_t5, captions, self.t5_length, self.t5.device))[0]
        clip = torch.cat(embeds, dim=-1)
        clip = nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {"prompt_embeds": torch.cat([clip, t5], dim=-2).float().to(device),
                "pooled": torch.cat(pooled, dim=-1).float().to(device)}


def scheduler_config(folder: str | Path) -> dict:
    """The base's FlowMatchEulerDiscreteScheduler config (scheduler/scheduler_config.json)."""
    import json

    path = Path(folder).expanduser() / "scheduler" / "scheduler_config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the base's scheduler config ({mmdit.first_line(e)})") from None


class SD3Family:
    """Stable Diffusion 3 / 3.5."""

    name = "sd3"
    pipeline_class = PIPELINE_CLASS
    lora_targets = LORA_TARGETS

    def training_defaults(self, folder) -> dict[str, object]:
        """Rectified flow as the base was trained and diffusers' SD3 script trains it: logit-normal
        t (0, 1), shifted by the scheduler's shift, sampled on the scheduler's grid; captions on."""
        sched = scheduler_config(folder)
        shift, steps = float(sched.get("shift", 1.0)), int(sched.get("num_train_timesteps", 1000))
        grid_end = shift * (1 / steps) / (1 + (shift - 1) * (1 / steps))  # the scheduler's sigma_min
        return {"diffusion.objective": "flow", "diffusion.flow_t_sampling": "logit_normal",
                "diffusion.flow_logit_mean": 0.0, "diffusion.flow_logit_std": 1.0,
                "diffusion.flow_train_shift": shift, "diffusion.flow_shift": shift,
                "diffusion.flow_grid_end": grid_end, "diffusion.flow_dynamic_shift": False,
                "data.captions": True}

    def load_codec(self, folder):
        """The VAE with its scaling_factor and shift_factor."""
        return mmdit.load_codec(folder)

    def check_resolution(self, folder, resolution: int) -> None:
        """A ValueError of one line for a resolution the VAE and the 2x2 patches cannot divide."""
        cfg = mmdit.part_config(folder, "transformer")
        mmdit.check_resolution(folder, self.name, resolution, int(cfg.get("patch_size", 2)), cfg.get("pos_embed_max_size"))

    def load_denoiser(self, folder) -> SD3Denoiser:
        return SD3Denoiser(mmdit.load_part("diffusers", TRANSFORMER_CLASS, folder, "transformer",
                                           "transformer", torch_dtype=torch.float32).float())

    def denoiser_from_record(self, record: dict) -> SD3Denoiser:
        from diffusers import SD3Transformer2DModel

        return SD3Denoiser(SD3Transformer2DModel.from_config(dict(record["config"])).float())

    def load_prompt_encoder(self, folder, device=None, t5_length: int | None = None) -> SD3PromptEncoder:
        return SD3PromptEncoder(folder, device, t5_length)

    def fsdp_units(self, denoiser: SD3Denoiser) -> list[nn.Module]:
        return list(denoiser.transformer.transformer_blocks)

    def export_pipeline(self, denoiser: SD3Denoiser, folder_of_base, out) -> Path:
        return mmdit.export_folder(denoiser.transformer, folder_of_base, out)

    def save_lora(self, adapter_state_dict: dict, out) -> Path:
        return mmdit.save_lora(PIPELINE_CLASS, adapter_state_dict, out)

    def read_lora(self, path, denoiser: SD3Denoiser | None = None) -> dict:
        return mmdit.read_lora(PIPELINE_CLASS, self.name, path, FOREIGN_MODULES, denoiser)
