"""FLUX.2 [dev] (Flux2Pipeline): a guidance-distilled MMDiT (double- and single-stream blocks) on the
batch-norm-normalised, 2x2-patchified latents of a 32-channel VAE, conditioned on three stacked hidden
layers of Mistral Small 3.1 (Mistral3ForConditionalGeneration), trained with rectified flow.

Facts, checked in the installed diffusers 0.42.1 (pipelines/flux2/pipeline_flux2.py, system_messages.py,
models/transformers/transformer_flux2.py, models/autoencoders/autoencoder_kl_flux2.py) and diffusers'
train_dreambooth_lora_flux2.py:

Prompts -> conditioning (``_get_mistral_3_small_prompt_embeds``):
  each prompt becomes a chat (``format_input``): a system message (system_messages.SYSTEM_MESSAGE, the
  pipeline's ``system_message``) and a user message with the prompt ("[IMG]" removed), both as content
  lists of one text part; the tokenizer's ``apply_chat_template`` (add_generation_prompt=False) tokenizes
  the batch, padded to max_sequence_length (default 512, the script's too) and truncated, with its
  attention mask; the text encoder runs on ids and mask (output_hidden_states, no cache) and
  hidden_states[10], [20], [30] (``text_encoder_out_layers``; hidden_states[0] is the embeddings) are
  stacked per token: prompt_embeds (B, L, 3 x 5120) = cat over the three layers of each token's states.
  Padded tokens' states are kept; the transformer takes no attention mask. text_ids (L, 4) = (0, 0, 0, l).
  The dropped prompt is ``encode([""])`` (the chat with an empty user message); the pipeline takes no
  negative prompt (its guidance is distilled into the ``guidance`` input). The pipeline's tokenizer is a
  PixtralProcessor; difftrain reads the tokenizer files of the same folder (AutoTokenizer) and applies the
  same chat template (the processor renders it and tokenizes without adding special tokens, as the
  tokenizer's own apply_chat_template does). The vision tower is loaded with the model (its weights are in
  the digest) but a text prompt never runs it; difftrain runs the encoder's base model (``.model``), whose
  hidden states are the pipeline's, without the language-model head.
Latents (AutoencoderKLFlux2, ``_encode_vae_image`` / the decode in ``__call__``): the VAE's 32 channels at
  factor 8, patchified 2x2 to (B, 128, h/2, w/2) (channel c*4 + dy*2 + dx), normalised by the VAE's batch
  norm running statistics, (p - running_mean) / sqrt(running_var + batch_norm_eps), then packed to
  (B, hw/4, 128). The config has no scaling_factor nor shift_factor. difftrain keeps latents 4-D at the
  VAE's resolution (B, 32, h, w): :class:`Flux2Codec` normalises through the patchify (the inverse after
  it), so the denoiser's packing is Flux.1's (flux.pack: the same channel order as
  _pack_latents(_patchify_latents(x))). h and w must be even (images a multiple of 16 px).
Transformer call: transformer(hidden_states=packed, timestep=sigma (t / 1000; x 1000 inside),
  guidance=(B,) guidance scale (x 1000 inside; config.guidance_embeds), encoder_hidden_states=prompt_embeds,
  txt_ids, img_ids (hw/4, 4) = (0, row, col, 0) of the packed grid (``_prepare_latent_ids``)); no pooled
  projection. The output is the velocity noise - x0 (the script's target), difftrain's v; unpacked back.
Training (the script): sigma = the scheduler's sigmas at floor(1000 u), u by weighting_scheme "none"
  (uniform); the scheduler has use_dynamic_shifting, so those sigmas are not shifted: uniform, unshifted t
  here too; loss weight 1 (velocity). guidance = --guidance_scale (default 3.5) for every sample:
  model.distilled_guidance (3.5). The script encodes latents with latent_dist.mode() (the mean); difftrain
  draws from the cached distribution (mean + std eps) as for every VAE.
Sampling (the pipeline): sigmas linspace(1, 1/N, N), shifted by e^mu (the scheduler's use_dynamic_shifting,
  time_shift_type "exponential") with mu = compute_empirical_mu(tokens, N): BFL's empirical fit of the packed
  token count and the step count (not Flux.1's calculate_shift: the scheduler's base/max shift are unused);
  here diffusion.flow_dynamic_shift with diffusion.flow_shift_rule = "empirical", the same grid; the export
  keeps use_dynamic_shifting, so the exported pipeline samples on it too. guidance_scale 4.0 by default:
  validation.distilled_guidance defaults to 4.0.
LoRA: the script's default targets: every double block's attention to_q/k/v/to_out.0 (image stream; not
  the context projections) and the single blocks' fused to_qkv_mlp_proj and attn.to_out (named per block,
  48 of them, as the script lists them); files in Flux2LoraLoaderMixin's format (``transformer.`` + peft
  names), written by Flux2Pipeline.save_lora_weights, read by its lora_state_dict.
Known base (tools/bases/flux2-dev/, for ``difftrain estimate --base``; no network here, so no published file
  was read): the transformer is Flux2Transformer2DModel's defaults (8 double and 48 single blocks, 48 heads of
  128, joint_attention_dim 15360 = 3 x 5120: 32.2B parameters, the published "32B"); the text encoder
  transformers' Mistral3Config defaults (Mistral Small 3.1: 40 layers of 5120, Pixtral vision tower of 24
  layers) with its untied language-model head: 24.0B, the published "24B"; the VAE AutoencoderKLFlux2's
  defaults; the scheduler FlowMatchEulerDiscreteScheduler with use_dynamic_shifting (the pipeline's mu is its
  own: only the dynamic flag matters).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from difftrain.families import register
from difftrain.families.base import (Denoiser, PromptEncoder, frozen_part, load_part, read_json, require_keys,
                                     token_ids_and_mask)
from difftrain.families.flux import pack, unpack
from difftrain.families.mmdit import TransformerDenoiser, TransformerFamily
from difftrain.models.text import files_digest, first_line, quiet_loading, vocab_bytes
from difftrain.models.vae import LatentCodec, config_factor, register_vae_class, vae_folder
from difftrain.runtime.tensor_source import check_weight_indexes

DEFAULT_LENGTH = 512  # Flux2Pipeline's max_sequence_length default and the script's
MISTRAL_LAYERS = (10, 20, 30)  # Flux2Pipeline's text_encoder_out_layers default (the script's too)
PIPELINE_GUIDANCE = 4.0  # Flux2Pipeline.__call__'s guidance_scale default
VAE_CLASS = "AutoencoderKLFlux2"
register_vae_class(VAE_CLASS, config_factor)  # a VAE folder of this class: its factor from block_out_channels


def system_message() -> str:
    """Flux2Pipeline's system message (diffusers' system_messages.SYSTEM_MESSAGE), read from diffusers."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE  # an optional package ([text])

    return SYSTEM_MESSAGE


# ---------------------------------------------------------------------------------------------
# The text encoder's steps (chat, tokenize, run, stack layers): small functions another family may share.


def chat(prompt: str, system: str | None) -> list[dict]:
    """One prompt as the messages the pipelines template: a system message (when given) and the user's,
    each content a list of one text part (Flux2Pipeline's format_input, "[IMG]" removed)."""
    text = [{"role": "user", "content": [{"type": "text", "text": prompt.replace("[IMG]", "")}]}]
    return ([{"role": "system", "content": [{"type": "text", "text": system}]}] if system is not None else []) + text


def chat_tokens(tokenizer, captions: list[str], length: int, system: str | None,
                device: torch.device | str) -> tuple[Tensor, Tensor]:
    """(ids (B, length) long, attention mask (B, length)) on ``device``: each caption's chat (:func:`chat`)
    through the tokenizer's chat template, then tokenized without adding special tokens (the template holds
    them: what ``apply_chat_template(tokenize=True)`` does, the pipeline's call), padded to ``length``, truncated."""
    texts = tokenizer.apply_chat_template([chat(c, system) for c in captions], add_generation_prompt=False,
                                          tokenize=False)
    return token_ids_and_mask(tokenizer, texts, length, device, add_special_tokens=False)


def stacked_layers(model: nn.Module, ids: Tensor, mask: Tensor, layers: tuple[int, ...]) -> Tensor:
    """(B, L, len(layers) x D): the hidden states ``layers`` of a decoder text model (its base model:
    ``model.model`` where it has one, so no language-model head runs), each token's concatenated in order."""
    base = getattr(model, "model", model)
    states = base(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
    if max(layers) >= len(states):
        raise ValueError(f"the text encoder has {len(states) - 1} layers; the pipeline takes its hidden states "
                         f"{', '.join(map(str, layers))}")
    out = torch.stack([states[k] for k in layers], dim=1)  # (B, n, L, D)
    b, n, length, d = out.shape
    return out.permute(0, 2, 1, 3).reshape(b, length, n * d)


def load_chat_tokenizer(folder: Path, sub: str = "tokenizer"):
    """The fast tokenizer of ``folder/sub`` (a tokenizer or a processor's folder: AutoTokenizer reads its
    tokenizer files) with its chat template (a processor's ``chat_template.json`` where the tokenizer has
    none); one ValueError naming the folder when it has neither."""
    from transformers import AutoTokenizer  # an optional package ([text])

    tokenizer = load_part(folder, sub, AutoTokenizer, "tokenizer")
    if not getattr(tokenizer, "chat_template", None):
        template = Path(folder) / sub / "chat_template.json"
        if template.is_file():
            tokenizer.chat_template = read_json(template, f"base {folder}").get("chat_template")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{folder}: the tokenizer in {sub}/ has no chat template (the pipeline applies one)")
    return tokenizer


def sequence_length(requested: int, folder, limit: int = DEFAULT_LENGTH) -> int:
    """``model.max_sequence_length`` (0: the pipeline's 512) if 1..512, else one ValueError."""
    length = limit if requested == 0 else requested
    if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= limit:
        raise ValueError(f"model.max_sequence_length={requested!r}: the base {folder} takes 1 to {limit} tokens")
    return length


def text_ids(length: int, device=None) -> Tensor:
    """(L, 4) float32: (0, 0, 0, l) of each text token (_prepare_text_ids)."""
    ids = torch.zeros(length, 4, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids


def latent_ids(h: int, w: int, device=None) -> Tensor:
    """((h/2)(w/2), 4) float32: (0, row, col, 0) of each packed patch of (h, w) latents (_prepare_latent_ids).
    float32 whatever the latents' dtype: bf16 would round positions past 256."""
    rows = torch.arange(h // 2, device=device, dtype=torch.float32)[:, None].expand(h // 2, w // 2)
    cols = torch.arange(w // 2, device=device, dtype=torch.float32)[None, :].expand(h // 2, w // 2)
    zeros = torch.zeros_like(rows)
    return torch.stack([zeros, rows, cols, zeros], dim=-1).reshape(-1, 4)


# ---------------------------------------------------------------------------------------------
# The VAE.


def patchify(z: Tensor) -> Tensor:
    """(B, C, h, w) -> (B, 4C, h/2, w/2), channel c*4 + dy*2 + dx (Flux2Pipeline._patchify_latents)."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatchify(p: Tensor) -> Tensor:
    """The inverse of :func:`patchify`."""
    b, c4, h, w = p.shape
    return p.view(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, h * 2, w * 2)


class Flux2Codec(LatentCodec):
    """A frozen AutoencoderKLFlux2: images <-> latents (B, 32, H/f, W/f) in model space, normalised as the
    pipelines normalise them: patchified 2x2, (p - running_mean) / sqrt(running_var + eps) by the VAE's batch
    norm statistics, unpatchified (so difftrain's latents keep the VAE's shape; the denoiser packs them)."""

    @classmethod
    def from_path(cls, path: str) -> Flux2Codec:
        """Load on the CPU, float32, from an AutoencoderKLFlux2 folder or a pipeline folder with ``vae/``."""
        from diffusers import AutoencoderKLFlux2  # an optional package ([text])
        from diffusers.utils import logging

        folder = vae_folder(path, VAE_CLASS)
        check_weight_indexes(folder)
        try:
            with quiet_loading(logging):
                vae = AutoencoderKLFlux2.from_pretrained(str(folder), torch_dtype=torch.float32, low_cpu_mem_usage=False)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ValueError(f"vae {path}: cannot load {folder}: {first_line(e)}") from None
        return cls(vae, path)

    def _stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(like.device, torch.float32)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1).to(like.device, torch.float32) + self.vae.config.batch_norm_eps)
        return mean, std

    def to_model(self, z: Tensor) -> Tensor:
        mean, std = self._stats(z)
        return unpatchify((patchify(z.float()) - mean) / std).to(z.dtype)

    def from_model(self, latents: Tensor) -> Tensor:
        mean, std = self._stats(latents)
        return unpatchify(patchify(latents.float()) * std + mean).to(latents.dtype)


# ---------------------------------------------------------------------------------------------
# The denoiser and the prompt encoder.


class Flux2Denoiser(TransformerDenoiser):
    """``net(x (B, 32, h, w), t (B,) = 1000 t, cond) -> (B, 32, h, w)`` velocity eps - x0: a
    Flux2Transformer2DModel called as the FLUX.2 pipelines call it (2x2 packing, 4-axis ids, t / 1000).
    cond: {"prompt_embeds": (B, L, joint_attention_dim), "guidance": (B,) (with guidance_embeds: [dev])}."""

    family = "flux2"

    def keys(self) -> tuple[str, ...]:
        return ("prompt_embeds", "guidance") if self.model.config.guidance_embeds else ("prompt_embeds",)

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        b, _, h, w = x.shape
        require_keys(cond, self.keys(), b, self.family)
        self.check_latent_size(h, w)
        text = cond["prompt_embeds"].to(x.dtype)
        guidance = cond["guidance"].to(x.dtype) if self.model.config.guidance_embeds else None
        out = self.model(hidden_states=pack(x), timestep=t.expand(b).to(x.dtype) / 1000, guidance=guidance,
                         encoder_hidden_states=text, txt_ids=text_ids(text.shape[1], x.device),
                         img_ids=latent_ids(h, w, x.device), return_dict=False)[0]
        return unpack(out, h, w)


class Flux2PromptEncoder(PromptEncoder):
    """The text encoder of a FLUX.2 folder, frozen: ``encode(captions, device) -> {"prompt_embeds": (B, L,
    len(layers) x D)}`` as the pipeline's encode_prompt. Subclasses (klein) set the encoder class, layers and
    how captions are tokenized."""

    parts = ("text",)
    encoder_class = "Mistral3ForConditionalGeneration"
    layers = MISTRAL_LAYERS

    def __init__(self, folder: Path, max_sequence_length: int = 0, deferred: bool = False):
        super().__init__()
        import transformers  # an optional package ([text])

        self.source = str(folder)
        self.add_part("text", folder / "text_encoder", frozen_part(
            folder, "text_encoder", getattr(transformers, self.encoder_class), f"{self.encoder_class} text encoder"),
            deferred)
        self.tokenizer = load_chat_tokenizer(folder)
        self.length = sequence_length(max_sequence_length, folder)
        config = read_json(folder / "text_encoder" / "config.json", f"base {folder}")
        self.width = len(self.layers) * int(config.get("text_config", config)["hidden_size"])
        self.digest = files_digest([folder / "text_encoder"], [folder / "tokenizer"], self.settings())

    def settings(self) -> bytes:
        """What enters the condition besides the files: the length, the layers, the system message."""
        return json.dumps({"length": self.length, "layers": list(self.layers), "system": self.system()}).encode()

    def system(self) -> str | None:
        return system_message()

    def legacy_extra(self) -> bytes:
        return vocab_bytes([self.tokenizer], pairs=True) + self.settings()

    @property
    def dim(self) -> int:
        """The width of ``prompt_embeds``: the stacked layers' (the transformer's joint_attention_dim)."""
        return self.width

    def tokens(self, captions: list[str], device) -> tuple[Tensor, Tensor]:
        return chat_tokens(self.tokenizer, captions, self.length, self.system(), device)

    def encode_part(self, name: str, captions: list[str]) -> dict[str, Tensor]:
        ids, mask = self.tokens(captions, self.text.device)
        return {"prompt_embeds": stacked_layers(self.text, ids, mask, self.layers)}

    def assemble(self, outputs: dict[str, dict[str, Tensor]], device: torch.device | str) -> dict[str, Tensor]:
        return {"prompt_embeds": outputs["text"]["prompt_embeds"].float().to(device)}


class Flux2Family(TransformerFamily):
    """FLUX.2 [dev] and its fine-tunes."""

    name = "flux2"
    pipeline_class = "Flux2Pipeline"
    transformer_class = "Flux2Transformer2DModel"
    denoiser_class = Flux2Denoiser
    prompt_encoder_class = Flux2PromptEncoder
    # train_dreambooth_lora_flux2.py's default targets (its list, the 48 single blocks' to_out by name)
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj",
                    *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(48)))
    foreign_modules = ("attn2", "proj_mlp", "net")  # SD3.5's second attention; Flux.1's single MLP, its ff.net
    default_sample_size = 128  # Flux2Pipeline's default_sample_size: 1024 px with the VAE's factor 8

    def training_defaults(self, folder: Path) -> dict[str, object]:
        """The base's parts, captions on, rectified flow as diffusers' script trains it (uniform, unshifted
        t), sampling on the pipelines' grid (the empirical mu of the tokens and steps), the pipeline's guidance."""
        sched = self.scheduler_config(folder)
        return {**self._defaults(folder), **self.unshifted_flow(sched), "diffusion.flow_shift_rule": "empirical",
                **self.guidance_defaults(folder)}

    def guidance_defaults(self, folder: Path) -> dict[str, object]:
        """The samples' guidance: the pipeline's distilled guidance_scale (4.0)."""
        return {"validation.distilled_guidance": PIPELINE_GUIDANCE}

    def load_prompt_encoder(self, folder: Path, device: torch.device | str = "cpu", max_sequence_length: int = 0,
                            deferred: bool = False) -> Flux2PromptEncoder:
        return self.prompt_encoder_class(Path(folder), max_sequence_length, deferred).to(device)

    def load_codec(self, folder: Path, device: torch.device | str = "cpu") -> Flux2Codec:
        return Flux2Codec.from_path(str(folder)).to(device)

    def run_conditions(self, section) -> dict[str, float]:
        """``{"guidance": ...}``: ``model.distilled_guidance`` in training (3.5, the script's --guidance_scale),
        ``validation.distilled_guidance`` in sampling (4.0 from the base's defaults, the pipeline's)."""
        return {"guidance": float(section.distilled_guidance)}

    def condition_shapes(self, config: dict, max_sequence_length: int = 0) -> dict[str, tuple[int, ...]]:
        """The stacked text states, ``joint_attention_dim`` wide, and the guidance value (with guidance_embeds)."""
        shapes = {"prompt_embeds": (max_sequence_length or DEFAULT_LENGTH, int(config["joint_attention_dim"]))}
        return shapes | ({"guidance": ()} if config.get("guidance_embeds", True) else {})

    def latent_channels(self, config: dict) -> int:
        """The VAE's channels: the transformer takes 2x2 patches of them."""
        return int(config["in_channels"]) // 4

    def fsdp_units(self, denoiser: Denoiser) -> list[nn.Module]:
        return [*denoiser.model.transformer_blocks, *denoiser.model.single_transformer_blocks]


FLUX2 = register(Flux2Family())
