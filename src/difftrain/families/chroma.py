"""Chroma (ChromaPipeline): a Flux.1-schnell derivative (double- and single-stream blocks, 2x2-packed
latents) conditioned on T5 alone, with an attention mask, no CLIP and no guidance input (its modulation
comes from a small "approximator" network of the timestep); sampled with true classifier-free guidance.

Facts, checked in the installed diffusers 0.42.1 (pipelines/chroma/pipeline_chroma.py,
models/transformers/transformer_chroma.py, scheduling_flow_match_euler_discrete.py). diffusers has no
Chroma training script (none in ../shared/peers): the objective is taken from the pipeline's scheduler
and the Flux script's defaults, as said below.

Prompts -> conditioning (``ChromaPipeline._get_t5_prompt_embeds``):
  tokens = T5TokenizerFast(prompt, padded to max_length, max_length=max_sequence_length (default 512,
           also the most), truncation) -> input_ids (B, L), attention_mask m (B, L) (1 on the caption's
           tokens and its EOS, 0 on padding)
  prompt_embeds = T5EncoderModel(input_ids, attention_mask=m)[0]      (B, L, 4096): unlike Flux, the
           encoder runs WITH the tokenizer's mask (``base.token_ids_and_mask``, ``mmdit.masked_t5``)
  attention_mask = (arange(L) <= m.sum(1))                            (B, L) float: the transformer's
           text mask keeps the caption's tokens AND the first padding token unmasked, all other padding
           masked (:func:`chroma_text_mask`; lodestones' "keep one pad token" rule)
  txt_ids = zeros (L, 3). The negative prompt defaults to "" through the same steps: ``encode([""])``,
  difftrain's null condition, is what the pipeline's CFG uses (its mask included).
Latents: FLUX.1's 16-channel VAE; latents = (z - shift_factor) * scaling_factor, decoded
  z = latents / scaling + shift (``applies_shift_factor``); packed into 2x2 patches as Flux's
  (flux.pack / unpack / image_ids, ChromaPipeline._pack_latents is Flux's); h, w even.
Transformer call: transformer(hidden_states=packed, timestep=sigma in [0, 1] (x 1000 inside),
  encoder_hidden_states=prompt_embeds, txt_ids, img_ids, attention_mask=cat([text mask, ones(image
  tokens)], 1) (``_prepare_attention_mask``: a float 0/1 mask; each block makes it
  mask[:, None, None, :] * mask[:, None, :, None], and scaled_dot_product_attention takes a float mask as an
  additive bias: +1 on the pairs of kept tokens, 0 elsewhere, not a hard mask; difftrain passes the same
  tensor, so that what it trains is what the pipeline samples). No pooled input, no guidance input. difftrain's flow
  objective conditions on 1000 t: forward() passes t / 1000. The output is the velocity noise - x0
  (the scheduler steps x += (sigma_next - sigma) out), difftrain's v = eps - x0: no sign flip.
  NB diffusers' own forward drops the mask in the single-stream blocks when gradient checkpointing is on
  (its _gradient_checkpointing_func call passes no attention_mask): ChromaDenoiser checkpoints with a
  function of its own (torch.utils.checkpoint, non-reentrant, as diffusers' default) that gives those
  blocks the mask back, so model.gradient_checkpointing trains the pipeline's function.
Training (no diffusers script): rectified flow, x_t = (1 - t) x0 + t eps, velocity loss weight 1; t
  uniform and unshifted, as diffusers' Flux script trains its sibling on the same kind of scheduler
  (use_dynamic_shifting: the script's sigmas are not shifted): diffusion.flow_t_sampling "uniform",
  flow_train_shift 1.
Sampling (the pipeline): sigmas linspace(1, 1/N, N), shifted by the scheduler's resolution-dependent
  mu (calculate_shift of the packed token count through base/max_image_seq_len and base/max_shift),
  35 steps, CFG guidance_scale 5.0 by default: here diffusion.flow_dynamic_shift with the scheduler's four
  values and validation.guidance_scale (the preset: 5.0).
LoRA: ChromaPipeline loads LoRA files with FluxLoraLoaderMixin (``transformer.`` + peft names,
  save_lora_weights / lora_state_dict, ``return_alphas``); targets: the attention projections of both
  streams and the double blocks' feed-forwards (Flux's script's defaults, the same module names:
  ChromaTransformerBlock / ChromaSingleTransformerBlock use FluxAttention).
FSDP and block swap: the 19 double then 38 single blocks, in forward order.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from difftrain.families import register
from difftrain.families.base import Denoiser, require_keys
from difftrain.families.flux import image_ids, pack, unpack
from difftrain.families.mmdit import T5PromptEncoder, TransformerDenoiser, TransformerFamily, flux_lora_renamed

DEFAULT_T5_LENGTH = 512  # ChromaPipeline's max_sequence_length default (and the most its check_inputs takes)
KEYS = ("prompt_embeds", "attention_mask")


# ---------------------------------------------------------------------------------------------
# Chroma's text mask (the T5-with-mask steps are mmdit.T5PromptEncoder's, shared with PixArt and AuraFlow).


def chroma_text_mask(mask: Tensor) -> Tensor:
    """(B, L) float32 0/1 of the tokenizer's mask (B, L): 1 on the caption's tokens and on the first padding
    token after them (position <= the count of real tokens), 0 on the rest: ChromaPipeline's text mask."""
    positions = torch.arange(mask.shape[1], device=mask.device)[None, :]
    return (positions <= mask.sum(dim=1, keepdim=True)).float()


# ---------------------------------------------------------------------------------------------


class ChromaDenoiser(TransformerDenoiser):
    """``net(x (B, 16, h, w), t (B,) = 1000 t, cond) -> (B, 16, h, w)`` velocity eps - x0: a
    ChromaTransformer2DModel called as ChromaPipeline calls it (Flux's packing and ids, t / 1000, the text
    mask extended by ones over the image tokens).
    cond: {"prompt_embeds": (B, L, joint_attention_dim), "attention_mask": (B, L) 0/1}."""

    family = "chroma"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._mask: Tensor | None = None  # the running forward's full mask, for :meth:`_checkpoint`

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """diffusers' activation checkpointing of the blocks, by :meth:`_checkpoint`."""
        if enabled:
            self.model.enable_gradient_checkpointing(gradient_checkpointing_func=self._checkpoint)
        else:
            self.model.disable_gradient_checkpointing()

    def _checkpoint(self, block: nn.Module, *args):
        """``torch.utils.checkpoint`` (non-reentrant: diffusers' default) of one block; a single-stream block,
        which ChromaTransformer2DModel.forward calls here with (hidden_states, temb, rotary embedding) only,
        gets the running forward's attention mask back, as it gets it without checkpointing."""
        extra = {"attention_mask": self._mask} if len(args) == 3 and hasattr(block, "proj_mlp") else {}
        return torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False, **extra)

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        b, _, h, w = x.shape
        require_keys(cond, KEYS, b, self.family)
        self.check_latent_size(h, w)
        text = cond["prompt_embeds"]
        mask = torch.cat([cond["attention_mask"].to(x.dtype), x.new_ones(b, (h // 2) * (w // 2))], dim=1)
        self._mask = mask
        try:
            out = self.model(hidden_states=pack(x), timestep=t.expand(b).to(x.dtype) / 1000,
                             encoder_hidden_states=text, txt_ids=text.new_zeros(text.shape[1], 3),
                             img_ids=image_ids(h, w, x.device, x.dtype), attention_mask=mask, return_dict=False)[0]
        finally:
            self._mask = None
        return unpack(out, h, w)


class ChromaPromptEncoder(T5PromptEncoder):
    """T5 of a Chroma folder, frozen: ``encode(captions, device) -> {"prompt_embeds": (B, t5_length, W),
    "attention_mask": (B, t5_length) 0/1}`` as ChromaPipeline.encode_prompt."""

    default_length = DEFAULT_T5_LENGTH
    digest_extra = "mask=chroma"

    def outputs(self, states: Tensor, mask: Tensor) -> dict[str, Tensor]:
        return {"prompt_embeds": states, "attention_mask": chroma_text_mask(mask)}


class ChromaFamily(TransformerFamily):
    """Chroma (Chroma1-HD, Chroma1-Base and their fine-tunes)."""

    name = "chroma"
    pipeline_class = "ChromaPipeline"
    transformer_class = "ChromaTransformer2DModel"
    denoiser_class = ChromaDenoiser
    # Flux's script's default targets (the same module names in Chroma's blocks).
    lora_targets = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                    "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                    "ff_context.net.2")
    # FLUX.1's pooled-text and guidance embedders, SD3.5's second attention, AuraFlow's blocks: not Chroma's.
    foreign_modules = ("attn2", "guidance_embedder", "text_embedder", "joint_transformer_blocks")
    default_sample_size = 128  # ChromaPipeline's (its transformer's config has no sample_size)

    def training_defaults(self, folder: Path) -> dict[str, object]:
        """The base's parts, captions on, rectified flow: uniform, unshifted training t (the Flux script's
        default on this kind of scheduler), sampling with the scheduler's resolution-dependent shift."""
        sched = self.scheduler_config(folder)
        return {**self._defaults(folder), **self.unshifted_flow(sched)}

    def load_prompt_encoder(self, folder: Path, device: torch.device | str = "cpu",
                            max_sequence_length: int = 0, deferred: bool = False) -> ChromaPromptEncoder:
        return ChromaPromptEncoder(Path(folder), max_sequence_length, deferred).to(device)

    def condition_shapes(self, config: dict, max_sequence_length: int = 0) -> dict[str, tuple[int, ...]]:
        """T5's tokens, ``joint_attention_dim`` wide, and their mask."""
        tokens = max_sequence_length or DEFAULT_T5_LENGTH
        return {"prompt_embeds": (tokens, int(config["joint_attention_dim"])), "attention_mask": (tokens,)}

    def latent_channels(self, config: dict) -> int:
        """The VAE's channels: the transformer takes 2x2 patches of them."""
        return int(config["in_channels"]) // 4

    def fsdp_units(self, denoiser: Denoiser) -> list[nn.Module]:
        return [*denoiser.model.transformer_blocks, *denoiser.model.single_transformer_blocks]

    def lora_state_options(self, config: dict) -> dict:
        """FluxLoraLoaderMixin.lora_state_dict (ChromaPipeline's) returns the network alphas only when asked."""
        return {"return_alphas": True}

    def renamed_lora(self, tensors: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor] | None:
        """ai-toolkit's and OneTrainer's layouts, renamed to ones FluxLoraLoaderMixin reads (:func:`flux_lora_renamed`)."""
        return flux_lora_renamed(tensors, model)


CHROMA = register(ChromaFamily())
