"""AuraFlow (AuraFlowPipeline): an MMDiT (a few joint blocks, then single DiT blocks, 8 register tokens,
learned position embeddings) on an SDXL-style 4-channel VAE's latents, conditioned on a UMT5 encoder
(EleutherAI's pile-t5-xl), trained with rectified flow; sampled with classifier-free guidance.

Facts, checked in the installed diffusers 0.42.1 (pipelines/aura_flow/pipeline_aura_flow.py,
models/transformers/auraflow_transformer_2d.py, scheduling_flow_match_euler_discrete.py). diffusers has
no AuraFlow training script (none in ../shared/peers): the objective is taken from the pipeline's
scheduler, as said below.

Prompts -> conditioning (``AuraFlowPipeline.encode_prompt``):
  tokens = tokenizer(prompt, truncation, max_length=max_sequence_length (default 256), padded to max_length)
           -> input_ids (B, L), attention_mask m (B, L); the tokenizer is the class model_index.json names
           (the released bases: LlamaTokenizerFast, pile-t5's vocabulary; the pipeline's signature says a
           T5 tokenizer), loaded by that class (``families.base.part_class``)
  prompt_embeds = UMT5EncoderModel(input_ids, attention_mask=m)[0] * m[..., None]   (B, L, 2048): the last
           hidden state run with the mask, padding rows zeroed (``mmdit.T5PromptEncoder``: ``base.token_ids_and_mask``,
           ``masked_t5``, then :func:`zero_padding`)
  The transformer takes no mask: the zeroed rows are all it gets of it. The negative prompt defaults to ""
  through the same steps: ``encode([""])``, difftrain's null condition, is what the pipeline's CFG uses.
Latents: the 4-channel VAE (SDXL's, scaling_factor 0.13025, no shift_factor); the pipeline decodes
  latents / scaling_factor (``applies_shift_factor`` False).
Transformer call: transformer(latents (B, 4, h, w), encoder_hidden_states=prompt_embeds, timestep=t/1000
  (B,)) (its Timesteps embedding scales by 1000 inside); patches of patch_size (2) made inside, h/2 and w/2
  each at most sqrt(pos_embed_max_size) (the learned position grid, centre-cropped). difftrain's flow objective
  conditions on 1000 t: forward() passes t / 1000. The output is the velocity noise - x0 (the scheduler steps
  x += (sigma_next - sigma) out), difftrain's v = eps - x0: no sign flip.
Training (no diffusers script): rectified flow, x_t = (1 - t) x0 + t eps, velocity loss weight 1; t drawn
  as diffusers' flow scripts draw it with weighting_scheme "none" (u uniform, sigma = the scheduler's sigmas
  at floor(1000 u)) on AuraFlow's scheduler, whose sigmas are shifted by its static ``shift`` (no dynamic
  shifting): diffusion.flow_t_sampling "uniform", flow_train_shift = the scheduler's shift.
Sampling (the pipeline): set_timesteps(N) without sigmas: linspace(1, sigma_min, N) of the shifted grid
  (sigma_min the shifted 1/1000), then 0; 50 steps, CFG guidance_scale 3.5 by default, 1024 px (the
  pipeline's fixed default height and width, not sample_size x 8): here diffusion.flow_shift = shift,
  flow_grid_end = sigma_min, validation.guidance_scale (the preset: 3.5), data.resolution 1024.
LoRA: AuraFlowLoraLoaderMixin (``transformer.`` + peft names: save_lora_weights / lora_state_dict);
  targets: the attention projections of both streams and the feed-forwards (AuraFlowFeedForward's
  linear_1, linear_2, out_projection), by the transformer's module names (there is no script to take
  defaults from).
FSDP and block swap: the joint blocks then the single blocks (``joint_transformer_blocks``,
  ``single_transformer_blocks``), in forward order.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor, nn

from difftrain.families import register
from difftrain.families.base import Denoiser, part_class, read_json, require_keys
from difftrain.families.mmdit import T5PromptEncoder, TransformerDenoiser, TransformerFamily

DEFAULT_T5_LENGTH = 256  # AuraFlowPipeline's max_sequence_length default
DEFAULT_SIZE = 1024  # AuraFlowPipeline.__call__'s default height and width (px)
KEYS = ("prompt_embeds",)


def zero_padding(embeds: Tensor, mask: Tensor) -> Tensor:
    """(B, L, W) ``embeds`` with the rows where ``mask`` (B, L) is 0 set to zero (AuraFlowPipeline's product)."""
    return embeds * mask[..., None].to(embeds.dtype)


class AuraFlowDenoiser(TransformerDenoiser):
    """``net(x (B, 4, h, w), t (B,) = 1000 t, cond) -> (B, 4, h, w)`` velocity eps - x0: an
    AuraFlowTransformer2DModel called as AuraFlowPipeline calls it (t / 1000).
    cond: {"prompt_embeds": (B, L, joint_attention_dim), padding rows zero}."""

    family = "auraflow"

    @property
    def patch(self) -> int:
        """The transformer's own ``patch_size`` (2 in the released bases)."""
        return int(self.model.config.patch_size)

    def check_latent_size(self, h: int, w: int) -> None:
        super().check_latent_size(h, w)
        p, side = self.patch, math.isqrt(int(self.model.config.pos_embed_max_size))
        if max(h, w) // p > side:
            raise ValueError(f"latents of {h}x{w} are larger than the AuraFlow transformer's position embedding "
                             f"takes ({side} patches of {p}: at most {side * p} latent pixels a side)")

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        b = x.shape[0]
        require_keys(cond, KEYS, b, self.family)
        self.check_latent_size(x.shape[-2], x.shape[-1])
        return self.model(x, encoder_hidden_states=cond["prompt_embeds"], timestep=t.expand(b).to(x.dtype) / 1000,
                          return_dict=False)[0]


class AuraFlowPromptEncoder(T5PromptEncoder):
    """UMT5 of an AuraFlow folder, frozen: ``encode(captions, device) -> {"prompt_embeds": (B, t5_length, W)}``
    (padding rows zero) as AuraFlowPipeline.encode_prompt."""

    encoder_class = "UMT5EncoderModel"
    encoder_what, tokenizer_what = "UMT5 text encoder", "text tokenizer"
    default_length = DEFAULT_T5_LENGTH
    digest_extra = "padding=zero"

    def tokenizer_type(self, folder: Path) -> type:
        """The class model_index.json names (the released bases: LlamaTokenizerFast)."""
        index = read_json(folder / "model_index.json", f"base {folder}")
        return part_class(index.get("tokenizer"), f"base {folder}: model_index.json's tokenizer")

    def outputs(self, states: Tensor, mask: Tensor) -> dict[str, Tensor]:
        return {"prompt_embeds": zero_padding(states, mask)}


class AuraFlowFamily(TransformerFamily):
    """AuraFlow (v0.1 to v0.3 and their fine-tunes)."""

    name = "auraflow"
    pipeline_class = "AuraFlowPipeline"
    transformer_class = "AuraFlowTransformer2DModel"
    denoiser_class = AuraFlowDenoiser
    applies_shift_factor = False  # the pipeline decodes latents / scaling_factor
    lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                    "attn.add_v_proj", "attn.to_add_out", "ff.linear_1", "ff.linear_2", "ff.out_projection",
                    "ff_context.linear_1", "ff_context.linear_2", "ff_context.out_projection")
    comfyui_layouts = ("diffusers",)  # ComfyUI maps its transformer.<module> names alone
    # Flux's / Chroma's double-block list and single-block MLP, SD3.5's second attention: not AuraFlow's.
    foreign_modules = ("attn2", "transformer_blocks", "proj_mlp", "x_embedder")

    def training_defaults(self, folder: Path) -> dict[str, object]:
        """The base's parts, captions on, rectified flow: uniform t shifted by the scheduler's shift, sampled on
        the scheduler's grid (its shift, its shifted sigma_min)."""
        sched = self.scheduler_config(folder)
        shift, steps = float(sched.get("shift", 1.0)), int(sched.get("num_train_timesteps", 1000))
        grid_end = shift * (1 / steps) / (1 + (shift - 1) * (1 / steps))  # the scheduler's sigma_min
        return {**self._defaults(folder), "diffusion.flow_t_sampling": "uniform",
                "diffusion.flow_train_shift": shift, "diffusion.flow_shift": shift,
                "diffusion.flow_grid_end": grid_end, "diffusion.flow_dynamic_shift": False}

    def native_resolution(self, folder: Path) -> int | None:
        """AuraFlowPipeline's default height and width, 1024 (fixed in its signature), for a pipeline folder."""
        return DEFAULT_SIZE if (Path(folder) / "vae" / "config.json").is_file() else None

    def load_prompt_encoder(self, folder: Path, device: torch.device | str = "cpu",
                            max_sequence_length: int = 0, deferred: bool = False) -> AuraFlowPromptEncoder:
        return AuraFlowPromptEncoder(Path(folder), max_sequence_length, deferred).to(device)

    def condition_shapes(self, config: dict, max_sequence_length: int = 0) -> dict[str, tuple[int, ...]]:
        """UMT5's tokens, ``joint_attention_dim`` wide."""
        return {"prompt_embeds": (max_sequence_length or DEFAULT_T5_LENGTH, int(config["joint_attention_dim"]))}

    def image_side_multiple(self, codec) -> int:
        """The VAE's factor times the transformer's patches (2)."""
        return int(codec.factor) * 2

    def fsdp_units(self, denoiser: Denoiser) -> list[nn.Module]:
        return [*denoiser.model.joint_transformer_blocks, *denoiser.model.single_transformer_blocks]


AURAFLOW = register(AuraFlowFamily())
