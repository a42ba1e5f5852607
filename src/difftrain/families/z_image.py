"""Z-Image (ZImagePipeline: Z-Image-Turbo, Z-Image Base): a single-stream DiT over image and caption
tokens, its captions read by a Qwen3 language model, trained with rectified flow.

Facts, checked in the installed diffusers 0.42.1 (pipeline_z_image.py, transformer_z_image.py,
scheduling_flow_match_euler_discrete.py, loaders/lora_pipeline.py ZImageLoraLoaderMixin) and diffusers'
train_dreambooth_lora_z_image.py:

Prompts -> conditioning (``ZImagePipeline._encode_prompt``): each caption is put in the tokenizer's chat
  template as one user message, ``apply_chat_template([{"role": "user", "content": caption}],
  tokenize=False, add_generation_prompt=True, enable_thinking=True)`` (Qwen3's template then ends with
  ``<|im_start|>assistant\\n`` and no empty think block), tokenized padded to ``max_sequence_length``
  (the pipeline's default 512, the script's too) and truncated; the text encoder (model_index.json's
  ``text_encoder``: Qwen3Model in Z-Image-Turbo, Qwen3-4B's 2560 wide) runs with the attention mask and
  ``output_hidden_states=True``; the condition is ``hidden_states[-2]`` (the second-to-last layer's
  output, before the final norm), each caption's rows where the mask is set: a LIST of (L_i, 2560), one
  length per caption. difftrain keeps the batch-first dict every family has: ``prompt_embeds`` (B, L, D)
  padded to max_sequence_length and ``prompt_mask`` (B, L) (1.0 on the caption's tokens, 0.0 on the
  padding), and the denoiser takes each row's masked tokens (:func:`caption_list`), which is the
  pipeline's list. The negative prompt is "" (``encode_prompt``'s default), so the null condition
  ``encode([""])`` is what its CFG uses.
Latents: the Flux VAE (16 channels), latents = (z - shift_factor) * scaling_factor (0.1159, 0.3611);
  decode z = latents / scaling_factor + shift_factor. The image side a multiple of 2 x the VAE factor.
Transformer call: transformer(x = list of (C, 1, h, w) latents (a frame axis of 1 added, one tensor per
  sample), t = (1000 - timestep) / 1000 = 1 - sigma (B,) (it multiplies by t_scale 1000 inside),
  cap_feats = the list of (L_i, D) caption states) -> list of (C, 1, h, w); 2x2 patches, the caption and
  the image each padded to a multiple of 32 tokens inside. The pipeline then NEGATES the output
  (``noise_pred = -noise_pred``) and steps x += (sigma_next - sigma) noise_pred: the transformer predicts
  x0 - eps and the velocity is its negation eps - x0, difftrain's v. difftrain's flow objective conditions on
  1000 t, so forward() passes (1000 - t) / 1000 and returns minus the stacked output.
Training (the script): x_t = (1 - sigma) x0 + sigma eps; sigma = the scheduler's sigmas at floor(1000 u),
  u by --weighting_scheme "none" (uniform) by default; Z-Image-Turbo's scheduler has shift 3.0 and no
  dynamic shifting, so those sigmas are shifted by 3: here diffusion.flow_t_sampling "uniform",
  flow_train_shift = the scheduler's shift (1 when it has use_dynamic_shifting: its sigmas are then
  unshifted); target noise - x0 with weight 1 (difftrain's flow_loss "velocity"). The script's
  --guidance_scale is unused (a leftover of Flux's). Prior preservation: the class prompt's embeddings
  concatenated, the prior loss weighted by --prior_loss_weight (difftrain's dreambooth section).
Sampling (the pipeline): sigmas linspace(1, 1/N, N) (``get_default_z_image_sigmas``), shifted by the
  scheduler (shift 3, or with use_dynamic_shifting by e^mu from the (h/2)(w/2) tokens), then 0: here
  diffusion.flow_grid_end None (linspace(1, 0, N + 1)), flow_shift = shift. CFG: ZImagePipeline computes
  ``pos + g (pos - neg)`` with guidance_scale g and guides when g > 0 (default g = 5.0, Z-Image Base's;
  Z-Image-Turbo is distilled and is sampled with g = 0, 8-9 steps); difftrain's validation.guidance_scale w
  is ``neg + w (pos - neg)``, so the pipeline's g is difftrain's w = g + 1 (Turbo: w = 1, no guidance, the
  default). The pipeline's cfg_truncation (1.0) and cfg_normalization (off) defaults change nothing.
  Which of Turbo and Base a folder holds is not in its configs (the same classes and sizes): set
  validation.guidance_scale and validation.steps for the one you train.
LoRA: peft on the attention projections to_q, to_k, to_v, to_out.0 of every block (noise_refiner,
  context_refiner, layers: the script's default --lora_layers); files in ZImageLoraLoaderMixin's format
  (``transformer.`` + peft names), written by ZImagePipeline.save_lora_weights, read by its lora_state_dict.
FSDP and block swap units: noise_refiner, context_refiner, then the main layers, in forward order (block
  swap swaps the last N: main layers).

The Qwen3 steps (:func:`chat_prompts`, :func:`qwen_tokens`, :func:`qwen_hidden_states`,
:func:`qwen_length`) are small functions of their own: FLUX.2 klein reads Qwen3 the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from difftrain.families import register
from difftrain.families.base import (Denoiser, PromptEncoder, frozen_part, load_part, part_class, read_json,
                                     require_keys, token_ids_and_mask)
from difftrain.families.mmdit import TransformerDenoiser, TransformerFamily, canonical_lora_renamed
from difftrain.models.text import files_digest, vocab_bytes

DEFAULT_LENGTH = 512  # ZImagePipeline's max_sequence_length default (the script's too)
HIDDEN_LAYER = -2  # ZImagePipeline takes hidden_states[-2]
KEYS = ("prompt_embeds", "prompt_mask")
# The text encoder classes difftrain runs for Z-Image (model_index.json's text_encoder): Qwen3's.
QWEN3_CLASSES = ("Qwen3Model", "Qwen3ForCausalLM")


# ---------------------------------------------------------------------------------------------
# Qwen3 as a text encoder: template, tokens, hidden states.


def chat_prompts(tokenizer, captions: list[str], enable_thinking: bool = True) -> list[str]:
    """Each caption as one user message in the tokenizer's chat template, with the generation prompt and
    ``enable_thinking`` (ZImagePipeline: True), as text (``tokenize=False``)."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                          add_generation_prompt=True, enable_thinking=enable_thinking)
            for c in captions]


def qwen_tokens(tokenizer, prompts: list[str], length: int, device: torch.device | str) -> tuple[Tensor, Tensor]:
    """(ids (B, length) long, mask (B, length) long: 1 on the tokens) on ``device``: ``prompts`` padded to ``length`` and
    truncated (on the tokenizer's own padding side), as ZImagePipeline tokenizes (``base.token_ids_and_mask``)."""
    return token_ids_and_mask(tokenizer, prompts, length, device)


def qwen_hidden_states(model: nn.Module, ids: Tensor, mask: Tensor, layer: int = HIDDEN_LAYER) -> Tensor:
    """(B, L, D): what ``model(ids, attention_mask=mask, output_hidden_states=True).hidden_states[layer]`` gives
    (``layer`` <= -2: the output of decoder layer ``layers[layer]``, before the final norm), taken from that
    layer's output by a forward hook: ``output_hidden_states`` would keep every layer's states until the call
    returns (37 x (B, L, 2560) for Qwen3-4B: 9.7 GB in bf16 for a text-cache fill batch of 100 captions of 512
    tokens). ``model``: a Qwen3Model or a Qwen3ForCausalLM (its ``model``)."""
    body = getattr(model, "model", model) if not hasattr(model, "layers") else model
    if layer > -2 or -layer > len(body.layers):
        raise ValueError(f"hidden layer {layer}: a Qwen3 text encoder's states are taken from layers -2 to "
                         f"-{len(body.layers)}")
    taken: list[Tensor] = []
    hook = body.layers[layer].register_forward_hook(
        lambda module, args, out: taken.append(out[0] if isinstance(out, tuple) else out))
    try:
        body(input_ids=ids, attention_mask=mask)
    finally:
        hook.remove()
    return taken[0]


def qwen_length(requested: int, default: int, tokenizer, folder) -> int:
    """The tokens per prompt: ``requested`` (0 = ``default`` capped by the tokenizer's model_max_length) if
    the tokenizer takes it; else one ValueError naming ``model.max_sequence_length`` and the folder."""
    most = int(getattr(tokenizer, "model_max_length", default) or default)
    length = min(default, most) if requested == 0 else requested
    if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= most:
        raise ValueError(f"model.max_sequence_length={requested!r}: the base {folder} cannot take it: its Qwen "
                         f"tokenizer takes 1 to {most} tokens")
    return length


def caption_list(embeds: Tensor, mask: Tensor) -> list[Tensor]:
    """The pipeline's list of (L_i, D) caption states from (B, L, D) padded states and their (B, L) mask
    (> 0.5: a token). On the meta device (``estimate``), every row whole (the longest captions).

    Each caption's tokens are one run of the row (the tokenizer pads on one side), so each entry is a slice, a
    view of ``embeds``: the mask is read on the host once (one sync on CUDA), where a boolean index per caption
    would sync once per caption and copy its states. A row whose mask is not one run is indexed by it."""
    if embeds.is_meta:
        return list(embeds.unbind(0))
    keep = (mask > 0.5).cpu()  # (B, L) on the host
    lengths = keep.sum(dim=1)
    starts = keep.int().argmax(dim=1)  # the first token (0 for an empty row)
    positions = torch.arange(keep.shape[1])
    runs = (positions >= starts[:, None]) & (positions < (starts + lengths)[:, None])
    if torch.equal(runs, keep):
        return [e[s: s + n] for e, s, n in zip(embeds.unbind(0), starts.tolist(), lengths.tolist(), strict=True)]
    return [e[k.to(e.device)] for e, k in zip(embeds.unbind(0), keep.unbind(0), strict=True)]


# ---------------------------------------------------------------------------------------------
# The family.


class ZImageDenoiser(TransformerDenoiser):
    """``net(x (B, 16, h, w), t (B,) = 1000 t, cond) -> (B, 16, h, w)`` velocity eps - x0: a
    ZImageTransformer2DModel called as ZImagePipeline calls it (a list of (16, 1, h, w) latents, the timestep
    (1000 - t) / 1000, the list of each caption's masked states; its output negated).
    cond: {"prompt_embeds": (B, L, cap_feat_dim), "prompt_mask": (B, L) 1.0 on tokens, 0.0 on padding}."""

    family = "z-image"

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        b, _, h, w = x.shape
        require_keys(cond, KEYS, b, self.family)
        self.check_latent_size(h, w)
        timestep = (1000 - t.expand(b).to(x.dtype)) / 1000
        out = self.model(list(x.unsqueeze(2).unbind(0)), timestep,
                         caption_list(cond["prompt_embeds"], cond["prompt_mask"]), return_dict=False)[0]
        return -torch.stack(out, dim=0).squeeze(2)


class ZImagePromptEncoder(PromptEncoder):
    """The Qwen3 text encoder and tokenizer of a Z-Image folder, frozen: ``encode(captions, device) ->
    {"prompt_embeds": (B, length, D), "prompt_mask": (B, length)}`` as ZImagePipeline.encode_prompt (its
    list: each row's masked tokens). Its null condition encode([""]) is the pipeline's negative prompt."""

    parts = ("qwen",)

    def __init__(self, folder: Path, max_sequence_length: int = 0, deferred: bool = False):
        super().__init__()
        index = read_json(folder / "model_index.json", f"base {folder}")
        cls = part_class(index.get("text_encoder", ["transformers", "Qwen3Model"]),
                         f"base {folder}: model_index.json's text_encoder")
        if cls.__name__ not in QWEN3_CLASSES:
            raise ValueError(f"base {folder}: model_index.json's text_encoder is {cls.__name__}; difftrain runs "
                             f"Z-Image's Qwen3 text encoder ({', '.join(QWEN3_CLASSES)})")
        tok_cls = part_class(index.get("tokenizer", ["transformers", "AutoTokenizer"]),
                             f"base {folder}: model_index.json's tokenizer")
        self.source = str(folder)
        self.add_part("qwen", folder / "text_encoder", frozen_part(folder, "text_encoder", cls, "Qwen3 text encoder"),
                      deferred)
        self.tokenizer = load_part(folder, "tokenizer", tok_cls, "Qwen tokenizer")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"base {folder}: the tokenizer in tokenizer/ has no chat template (ZImagePipeline puts "
                             "every prompt in it)")
        self.length = qwen_length(max_sequence_length, DEFAULT_LENGTH, self.tokenizer, folder)
        self.width = int(read_json(folder / "text_encoder" / "config.json", f"base {folder}")["hidden_size"])
        self.digest = files_digest([folder / "text_encoder"], [folder / "tokenizer"], self._extra().encode())

    def _extra(self) -> str:
        return f"qwen_length={self.length},layer={HIDDEN_LAYER},chat_template,enable_thinking"

    def legacy_extra(self) -> bytes:
        return vocab_bytes([self.tokenizer]) + self._extra().encode()

    @property
    def dim(self) -> int:
        """The width of ``prompt_embeds`` (the Qwen3 hidden size)."""
        return self.width

    def encode_part(self, name: str, captions: list[str]) -> dict[str, Tensor]:
        """``{"prompt_embeds": (B, length, D) hidden_states[-2], "prompt_mask": (B, length) 1 / 0}``."""
        ids, mask = qwen_tokens(self.tokenizer, chat_prompts(self.tokenizer, captions), self.length, self.qwen.device)
        return {"prompt_embeds": qwen_hidden_states(self.qwen, ids, mask), "prompt_mask": mask}

    def assemble(self, outputs: dict[str, dict[str, Tensor]], device: torch.device | str) -> dict[str, Tensor]:
        """The padded states, zero where the mask is not set (the pipeline never reads them), and the mask as
        1.0 / 0.0, float32 on ``device``."""
        out = outputs["qwen"]
        mask = out["prompt_mask"].bool()
        embeds = torch.where(mask[..., None], out["prompt_embeds"], 0)
        return {"prompt_embeds": embeds.float().to(device), "prompt_mask": mask.float().to(device)}


class ZImageFamily(TransformerFamily):
    """Z-Image (Turbo, Base and their fine-tunes)."""

    name = "z-image"
    pipeline_class = "ZImagePipeline"
    transformer_class = "ZImageTransformer2DModel"
    denoiser_class = ZImageDenoiser
    # diffusers' Z-Image script's default --lora_layers: the attention projections of every block.
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")
    kohya_prefix = "lycoris_"  # what ComfyUI maps for Z-Image (SimpleTuner's LyCORIS names)
    # Other transformers' module names: a LoRA file naming them is not Z-Image's.
    foreign_modules = ("transformer_blocks", "single_transformer_blocks", "attn", "pos_embed")
    default_sample_size = 128  # ZImagePipeline's default 1024 px (its transformer's config has no sample_size)

    def training_defaults(self, folder: Path) -> dict[str, object]:
        """The base's parts, captions on, and rectified flow as diffusers' Z-Image script trains it: uniform t
        shifted by the scheduler's shift (unshifted with use_dynamic_shifting); sampling on the pipeline's grid
        linspace(1, 1/N, N) with the same shift."""
        sched = self.scheduler_config(folder)
        dynamic = bool(sched.get("use_dynamic_shifting", False))
        shift = float(sched.get("shift", 1.0))
        return {**self._defaults(folder), "diffusion.flow_t_sampling": "uniform",
                "diffusion.flow_train_shift": 1.0 if dynamic else shift, "diffusion.flow_shift": shift,
                "diffusion.flow_grid_end": None, "diffusion.flow_dynamic_shift": dynamic, **self.shift_range(sched)}

    def load_prompt_encoder(self, folder: Path, device: torch.device | str = "cpu",
                            max_sequence_length: int = 0, deferred: bool = False) -> ZImagePromptEncoder:
        return ZImagePromptEncoder(Path(folder), max_sequence_length, deferred).to(device)

    def condition_shapes(self, config: dict, max_sequence_length: int = 0) -> dict[str, tuple[int, ...]]:
        """The Qwen3 states padded to max_sequence_length, ``cap_feat_dim`` wide, and their mask (``estimate``
        takes every token: the longest captions)."""
        length = max_sequence_length or DEFAULT_LENGTH
        return {"prompt_embeds": (length, int(config["cap_feat_dim"])), "prompt_mask": (length,)}

    def fsdp_units(self, denoiser: Denoiser) -> list[nn.Module]:
        m = denoiser.model
        return [*m.noise_refiner, *m.context_refiner, *m.layers]

    def renamed_lora(self, tensors: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor] | None:
        """OneTrainer's canonical layout, renamed to one the pipeline's lora_state_dict converts
        (:func:`~difftrain.families.mmdit.canonical_lora_renamed`)."""
        return canonical_lora_renamed(tensors)


Z_IMAGE = register(ZImageFamily())
