"""PixArt-Sigma (PixArtSigmaPipeline): a DiT cross-attending to T5's masked hidden states, trained as a
DDPM epsilon model on the SDXL VAE's 4-channel latents; its output has a second, learned-variance half.

    family = FAMILIES["pixart-sigma"]                  # or families.detect("pixart-folder")
    net = family.load_denoiser("pixart-folder")        # PixArtDenoiser
    cond = family.load_prompt_encoder("pixart-folder").encode(["a photo of a dog"])
    out = net(x, t, cond)    # x (B, 4, h, w), t (B,) integer timesteps -> epsilon (B, 4, h, w)

Facts, checked in the installed diffusers 0.42.1 (pipelines/pixart_alpha/pipeline_pixart_sigma.py,
models/transformers/pixart_transformer_2d.py, schedulers/scheduling_dpmsolver_multistep.py); there is no
diffusers training script for PixArt in ../shared/peers, so the training facts are the scheduler config's and
the PixArt-Sigma paper's (Chen et al. 2024, which trains as PixArt-alpha: DDPM, uniform timesteps):

Prompts -> conditioning (``encode_prompt``): each caption preprocessed by ``_text_preprocessing``: with
  ``clean_caption`` (the __call__ default True) diffusers' caption cleaner runs only when BeautifulSoup and ftfy
  are installed, else it warns and falls back to ``text.lower().strip()``; difftrain does the latter always
  (:func:`pixart_text`: compare with ``clean_caption=False``; captions are not cleaned of URLs, HTML...).
  T5Tokenizer, padding "max_length" to ``max_sequence_length`` (the pipeline's default 300), truncation,
  special tokens (</s>); the attention mask is the tokenizer's (``base.token_ids_and_mask``). T5EncoderModel(ids, attention_mask=mask)[0]:
      prompt_embeds (B, L, 4096)   (T5 v1.1 XXL's d_model; the tiny bases 32)
      prompt_mask   (B, L)         1 for the caption's tokens and </s>, 0 for padding (float here: a condition
                                   tensor; the transformer turns it into a -10000 bias of the padded keys)
  The negative prompt is "" (the pipeline's default), tokenized to the same length with its own mask:
  difftrain's null condition ``encode([""])`` is the same.
Latents: AutoencoderKL (SDXL's VAE: 4 channels, factor 8, scaling_factor 0.13025, no shift factor); the pipeline
  decodes latents / scaling_factor (no shift: ``applies_shift_factor`` False).
Transformer call (__call__): transformer(latents (B, 4, h, w), encoder_hidden_states=prompt_embeds,
  encoder_attention_mask=prompt_mask, timestep=t (B,) the scheduler's integer timestep as it is,
  added_cond_kwargs={"resolution": None, "aspect_ratio": None}) (Sigma's config has
  use_additional_conditions False; Alpha's size conditions are not used); h and w multiples of patch_size (2).
  The output has out_channels = 8 = 2 x 4 channels: the epsilon, then the learned variance (IDDPM's
  "learned_range" interpolation); the pipeline keeps the first half when out_channels // 2 == in_channels.
Training: the scheduler config (PixArt-Sigma-XL-2-1024-MS: DPMSolverMultistepScheduler, 1000 steps, linear betas
  0.0001 to 0.02, prediction_type epsilon) mapped to difftrain's DDPM objective as SD's is
  (``sd.scheduler_training``): objective ddpm, schedule linear, T 1000, prediction epsilon; timesteps uniform,
  loss weight 1 (difftrain's defaults). The learned-variance half: PixArt's own training adds IDDPM's
  variational-bound term for it; difftrain's epsilon objective has no such term, so :class:`PixArtDenoiser`
  returns the epsilon half only (what the pipeline samples with) and the variance half gets no loss and no
  gradient: its weights (``proj_out``'s second half of rows) stay the base's (LoRA does not target
  ``proj_out``; a full fine-tune gives them zero gradients, which Adam leaves unchanged with the default weight
  decay 0). The exported pipeline's DPM-Solver ignores that half as the pipeline does.
Sampling: the pipeline's DPMSolverMultistepScheduler (DPM-Solver++ 2M, 20 steps, CFG guidance_scale 4.5 on the
  "" prompt): difftrain's ``dpmpp_2m`` sampler on the same timesteps is the same solver (tests/unit/
  test_fast_samplers.py); validation CFG is the pipeline's convention (``uncond + s (text - uncond)``).
  ``export`` writes that scheduler's class with difftrain's betas, prediction and "trailing" timesteps.
LoRA: peft on the attention projections of both attentions (``attn1`` self, ``attn2`` cross) and the
  feed-forwards of every ``BasicTransformerBlock`` (the brief's targets; there is no diffusers script to take
  defaults from). PixArtSigmaPipeline has no ``load_lora_weights`` / ``save_lora_weights`` in diffusers 0.42.1,
  and PixArtTransformer2DModel no ``load_lora_adapter`` (it is no PeftAdapterMixin). The file is diffusers'
  transformer-only LoRA layout all the same (``transformer.`` + peft's names, peft's LoraConfig as
  ``lora_adapter_metadata``), written and read by diffusers' SanaLoraLoaderMixin (:meth:`lora_io_class`: the
  same layout, no converter); it loads with peft on the pipeline's transformer:
  ``inject_adapter_in_model(LoraConfig(**config), pipe.transformer)`` then ``set_peft_model_state_dict(
  pipe.transformer, {k.removeprefix("transformer."): v})``. ComfyUI's PixArt LoRA loader maps the same
  ``transformer.<diffusers module>`` names (not checked here: no ComfyUI). Another program's PixArt LoRA file
  cannot be read (``networks.lora_import.adopt`` needs ``load_lora_adapter``): not done.
FSDP and block swap: the ``transformer_blocks`` (28 BasicTransformerBlocks in the 0.6B base).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from difftrain.diffusion.scheduler_configs import scheduler_config
from difftrain.families import register
from difftrain.families.base import Denoiser, ExportParts, require_keys
from difftrain.families.mmdit import T5PromptEncoder, TransformerDenoiser, TransformerFamily
from difftrain.families.sd import scheduler_training

DEFAULT_T5_LENGTH = 300  # PixArtSigmaPipeline's max_sequence_length default ("See Section 3.1 of the paper")
KEYS = ("prompt_embeds", "prompt_mask")
TRANSFORMER_CLASS = "PixArtTransformer2DModel"


# ---------------------------------------------------------------------------------------------
# PixArt-Sigma's text preprocessing (the T5-with-mask steps are mmdit.T5PromptEncoder's).


def pixart_text(captions: list[str]) -> list[str]:
    """PixArtSigmaPipeline._text_preprocessing without the caption cleaner: each caption lower-cased and stripped."""
    return [str(c).lower().strip() for c in captions]


# ---------------------------------------------------------------------------------------------
# The denoiser.


class PixArtDenoiser(TransformerDenoiser):
    """``net(x (B, 4, h, w), t (B,) integer timesteps, cond) -> epsilon (B, 4, h, w)``: a PixArtTransformer2DModel
    called as PixArtSigmaPipeline calls it, its learned-variance half dropped (the pipeline's split).
    cond: {"prompt_embeds": (B, L, caption_channels), "prompt_mask": (B, L) 1 = token, 0 = padding}."""

    family = "pixart-sigma"

    @property
    def patch(self) -> int:
        return int(self.model.config.patch_size)

    @property
    def out_channels(self) -> int:
        """The epsilon's channels (the latent's): the variance half is not difftrain's output."""
        return self.in_channels

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        require_keys(cond, KEYS, x.shape[0], self.family)
        self.check_latent_size(x.shape[-2], x.shape[-1])
        out = self.model(x, encoder_hidden_states=cond["prompt_embeds"], encoder_attention_mask=cond["prompt_mask"],
                         timestep=t.expand(x.shape[0]), added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                         return_dict=False)[0]
        if int(self.model.config.out_channels) // 2 == x.shape[1]:  # learned sigma: the pipeline keeps the first half
            out = out.chunk(2, dim=1)[0]
        return out


# ---------------------------------------------------------------------------------------------
# The prompt encoder.


class PixArtPromptEncoder(T5PromptEncoder):
    """T5 of a PixArt-Sigma folder, frozen: ``encode(captions, device) -> {"prompt_embeds": (B, t5_length, W_t5),
    "prompt_mask": (B, t5_length)}`` as PixArtSigmaPipeline.encode_prompt (clean_caption False); the null
    condition encode([""]) is the pipeline's negative prompt."""

    tokenizer_class = "T5Tokenizer"
    default_length = DEFAULT_T5_LENGTH
    digest_extra = "text=lower-strip,mask"

    def texts(self, captions: list[str]) -> list[str]:
        return pixart_text(captions)

    def outputs(self, states: Tensor, mask: Tensor) -> dict[str, Tensor]:
        return {"prompt_embeds": states, "prompt_mask": mask}


# ---------------------------------------------------------------------------------------------
# The family.


class PixArtSigmaFamily(TransformerFamily):
    """PixArt-Sigma (and fine-tunes in its pipeline layout)."""

    name = "pixart-sigma"
    pipeline_class = "PixArtSigmaPipeline"
    transformer_class = TRANSFORMER_CLASS
    denoiser_class = PixArtDenoiser
    lora_targets = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                    "attn2.to_v", "attn2.to_out.0", "ff.net.0.proj", "ff.net.2")
    comfyui_layouts = ("diffusers",)  # ComfyUI maps its transformer.<module> names alone
    # SD3's and Flux's joint attention ("attn") and blocks: a LoRA file naming them is theirs.
    foreign_modules = ("attn", "single_transformer_blocks", "ff_context", "context_embedder")
    applies_shift_factor = False  # the pipeline decodes latents / scaling_factor

    def training_defaults(self, folder: Path) -> dict[str, object]:
        """The base's T5 and VAE, captions on, and the DDPM its scheduler config describes (SD's mapping:
        objective ddpm, schedule, T, prediction, zero terminal SNR)."""
        sched = self.scheduler_config(folder)
        return {"model.text_encoder": str(folder), "model.vae": str(folder), "data.captions": True,
                **scheduler_training(sched)}

    def export_scheduler(self, diffusion) -> dict:
        """The base's scheduler class (DPMSolverMultistepScheduler) with difftrain's DDPM: its betas (named or
        trained), prediction and "trailing" timesteps, steps_offset 0; the DDPM-only keys (variance_type,
        clip_sample) left out: DPM-Solver's variance_type means a learned variance it would split off."""
        ours = scheduler_config(diffusion)
        return {k: v for k, v in ours.items() if k not in ("variance_type", "clip_sample", "clip_sample_range")}

    def condition_shapes(self, config: dict, max_sequence_length: int = 0) -> dict[str, tuple[int, ...]]:
        """T5's tokens, ``caption_channels`` wide, and their mask."""
        tokens = max_sequence_length or DEFAULT_T5_LENGTH
        return {"prompt_embeds": (tokens, int(config["caption_channels"])), "prompt_mask": (tokens,)}

    def load_prompt_encoder(self, folder: Path, device: torch.device | str = "cpu",
                            max_sequence_length: int = 0, deferred: bool = False) -> PixArtPromptEncoder:
        return PixArtPromptEncoder(Path(folder), max_sequence_length, deferred).to(device)

    def image_side_multiple(self, codec) -> int:
        return int(codec.factor) * 2  # the 2x2 patches of every released PixArt base

    def fsdp_units(self, denoiser: Denoiser) -> list[nn.Module]:
        return list(denoiser.model.transformer_blocks)

    def export_parts(self, denoiser: Denoiser, base: Path, scheduler: dict | None, vae: Path | None) -> ExportParts:
        """The base's parts; the transformer named by its own class (the released bases' model_index.json names
        the legacy Transformer2DModel, which diffusers maps to this class on load)."""
        parts = super().export_parts(denoiser, base, scheduler, vae)
        parts.index[self.denoiser_subfolder] = ["diffusers", TRANSFORMER_CLASS]
        return parts

    def lora_io_class(self) -> type:
        """diffusers' SanaLoraLoaderMixin: PixArtSigmaPipeline has no save_lora_weights / lora_state_dict; Sana's
        mixin writes and reads the same transformer-only layout (``transformer.`` + peft's names, peft's LoraConfig
        as ``lora_adapter_metadata``; no layout converter, DoRA's kohya ``dora_scale`` dropped on reading)."""
        from diffusers.loaders import SanaLoraLoaderMixin  # diffusers: an optional package ([text])

        return SanaLoraLoaderMixin


PIXART_SIGMA = register(PixArtSigmaFamily())
