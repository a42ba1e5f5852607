"""Qwen-Image (QwenImagePipeline): a 60-block dual-stream MMDiT conditioned on the last hidden states of a
Qwen2.5-VL language model, trained with rectified flow on 2x2-packed latents of a video-style VAE.

Facts, checked in the installed diffusers 0.42 (pipeline_qwenimage.py, transformer_qwenimage.py,
autoencoder_kl_qwenimage.py, scheduling_flow_match_euler_discrete.py) and diffusers'
train_dreambooth_lora_qwen_image.py:

Prompts -> conditioning (``_get_qwen_prompt_embeds`` / ``encode_prompt``):
  text = TEMPLATE.format(prompt): a chat with the system line "Describe the image by detailing the color,
         shape, size, texture, quantity, text, spatial relationships of the objects and background:" and the
         prompt as the user's turn, ending with "<|im_start|>assistant\\n";
  tokens = Qwen2Tokenizer(text, padding=True, truncation at 1024 + 34);
  hidden = Qwen2_5_VLForConditionalGeneration(tokens, attention_mask, output_hidden_states=True)
           .hidden_states[-1]  (B, T, 3584): the language model's last (normed) states; text only, the vision
           tower unused;
  each prompt's states where its attention mask is 1, less the first DROP = 34 (the template's system part
  and "<|im_start|>user\\n": prompt_template_encode_start_idx), so its own tokens and the 5 closing template
  tokens remain; right-padded with zeros to the batch's longest, a mask (B, L) of 1s over each prompt's own
  states; then cut to max_sequence_length (the pipeline's __call__ default 512, the script's 512, at most
  1024). Here every prompt is padded to max_sequence_length (``model.max_sequence_length``, 0: 512) with
  its mask: a fixed shape the caches, caption dropout and batches take. The transformer's attention masks the
  padding and its text RoPE positions of token i do not depend on the length (pos_freqs[max_vid_index + i]),
  so the image outputs are those of the pipeline's shorter padding. The null / negative prompt is
  ``encode([""])`` (the pipeline encodes the negative prompt the same way; the script's empty prompt too).
  Since the language model is causal, the first L + 34 tokens give the same states as the pipeline's
  1024 + 34: the prompt is tokenised at most to L + 34 tokens here.
VAE: AutoencoderKLQwenImage (Wan's causal 3-D VAE): images take a frame axis (B, 3, 1, H, W) and latents
  (B, 16, 1, h, w); factor 2 ** len(temperal_downsample) = 8 (the tiny test VAE: 4); no scaling / shift
  factor but per-channel statistics: latents = (z - latents_mean) / latents_std, decode z = latents *
  latents_std + latents_mean (the pipeline multiplies by 1 / (1 / std)). difftrain holds latents 4-D,
  the frame axis dropped (:class:`QwenImageCodec`).
Latents -> transformer: 2x2 packing as Flux's (flux.pack: (B, 16, h, w) -> (B, hw/4, 64)); img_shapes =
  [(1, h/2, w/2)] per sample (the RoPE grid, centred: scale_rope); no txt_ids / img_ids.
Transformer call: transformer(hidden_states=packed, timestep=sigma in [0, 1] (x 1000 inside),
  encoder_hidden_states=prompt_embeds, encoder_hidden_states_mask=mask, img_shapes, guidance=None
  (guidance_embeds False in Qwen-Image). difftrain's flow conditions on 1000 t: forward() passes t / 1000.
  The output is the velocity noise - x0 (the script's target; the scheduler steps x += (sigma_next -
  sigma) out): difftrain's v = eps - x0, no sign flip.
Training (the script): u by --weighting_scheme "none" (uniform), sigma = the scheduler's sigmas at
  floor(1000 u); its scheduler is loaded with shift=3.0 but use_dynamic_shifting=True, so those sigmas are
  NOT shifted: uniform, unshifted t here (diffusion.flow_t_sampling "uniform", flow_train_shift 1); loss:
  the velocity error, weight 1 (flow_loss "velocity"); max_sequence_length 512.
Sampling (the pipeline): sigmas linspace(1, 1/N, N) shifted by e^mu, mu linear in the packed token count
  through (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift): diffusion.flow_dynamic_shift
  with the scheduler's four values. The published scheduler also stretches the grid to end at
  shift_terminal (0.02), which difftrain's flow grid does not: the export writes shift_terminal = None so
  that the exported pipeline samples on difftrain's grid. Guidance: "true CFG" with a negative prompt,
  true_cfg_scale 4.0 by default (no guidance-distilled input): neg + s (cond - neg), then each token's
  output rescaled to the conditional output's norm over its 64 packed channels: difftrain's validation and
  ``sample`` guide so with validation.guidance_scale / --guidance-scale (the family sets 4.0) and the empty
  prompt as the negative (QwenImageDenoiser.guide_outputs, which generation.sampling.guided_network uses in
  place of plain CFG).
LoRA: the script's default targets ["to_k", "to_q", "to_v", "to_out.0"] (the image stream's attention
  projections of every block); files in QwenImageLoraLoaderMixin's format (``transformer.`` + peft names).
Known base (tools/bases/qwen-image, for ``estimate --base qwen-image``): the transformer's config is
QwenImageTransformer2DModel's defaults in diffusers 0.42 (60 blocks, 24 heads of 128, joint_attention_dim 3584):
20,430,401,088 parameters on meta, the published "20B"; the VAE's is AutoencoderKLQwenImage's defaults (base_dim 96,
dim_mult 1 2 4 4, its latents_mean / latents_std); the text encoder's is Qwen2.5-VL-7B-Instruct's published config
as written from memory (28 layers of 3584, 28 heads, 4 key-value heads, feed-forward 18944, vocabulary 152064; a
32-block vision tower 1280 wide), which counts 8,292,166,656 parameters on meta, Qwen2.5-VL-7B's published 8.29B;
the scheduler's (base / max shift 0.5 / 0.9 at 256 / 8192 tokens, shift_terminal 0.02, exponential time shift) is
the published Qwen-Image scheduler_config.json as remembered, NOT checked against the file here (no network).
Edit variants (QwenImageEditPipeline: a reference image through the vision tower and the VAE) are not here;
the encoder keeps its steps (:func:`chat_prompts`, :func:`chat_tokens`, :func:`prompt_states`) separate so
that a vision input can be added.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from difftrain.families import register
from difftrain.families.base import Denoiser, PromptEncoder, frozen_part, load_part, read_json, require_keys
from difftrain.families.flux import pack, unpack
from difftrain.families.mmdit import TransformerDenoiser, TransformerFamily, canonical_lora_renamed
from difftrain.models.text import files_digest, vocab_bytes, weights_digest
from difftrain.models.vae import LatentCodec, register_vae_class
from difftrain.runtime.device import to_device_async

TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")  # QwenImagePipeline.prompt_template_encode
DROP = 34  # prompt_template_encode_start_idx: the template's tokens before the prompt, dropped
DEFAULT_LENGTH = 512  # QwenImagePipeline.__call__'s max_sequence_length default (the script's too)
MOST_LENGTH = 1024  # the most the pipeline takes (check_inputs; tokenizer_max_length)
KEYS = ("prompt_embeds", "prompt_mask")
VAE_CLASS = "AutoencoderKLQwenImage"


def vae_factor(config: dict) -> int:
    """AutoencoderKLQwenImage's spatial downsampling: 2 ** len(temperal_downsample) (the pipeline's)."""
    return 2 ** len(config["temperal_downsample"])


register_vae_class(VAE_CLASS, vae_factor)


# ---------------------------------------------------------------------------------------------
# The text encoder's steps (a Qwen2.5-VL language model under a chat template).


def chat_prompts(captions: list[str], template: str = TEMPLATE) -> list[str]:
    """Each caption inside the chat ``template`` (the pipeline's ``template.format(prompt)``)."""
    return [template.format(c) for c in captions]


def sequence_length(requested: int, folder) -> int:
    """The prompt tokens kept: ``requested`` (0 = the pipeline's 512) if 1 to 1024; else one ValueError."""
    length = DEFAULT_LENGTH if requested == 0 else requested
    if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= MOST_LENGTH:
        raise ValueError(f"model.max_sequence_length={requested!r}: the Qwen-Image base {folder} takes 1 to "
                         f"{MOST_LENGTH} prompt tokens (0: {DEFAULT_LENGTH})")
    return length


def chat_tokens(tokenizer, texts: list[str], length: int, device) -> tuple[Tensor, Tensor]:
    """(input_ids (B, T), attention_mask (B, T)) long on ``device``: ``texts`` tokenised as the pipeline does
    (padded to the longest, truncated), at most ``length`` tokens."""
    out = tokenizer(texts, max_length=length, padding=True, truncation=True, return_tensors="pt")
    return to_device_async(out.input_ids, device), to_device_async(out.attention_mask, device)


def prompt_states(hidden: Tensor, mask: Tensor, drop: int, length: int) -> tuple[Tensor, Tensor]:
    """(states (B, length, D), mask (B, length) float): each row's states where ``mask`` (B, T) is 1, less its
    first ``drop``, cut to ``length`` and right-padded with zeros (mask 0), as the pipeline's
    ``_extract_masked_hidden`` and ``encode_prompt`` take them (padded to ``length``, not the batch's longest)."""
    b, _, d = hidden.shape
    states = hidden.new_zeros(b, length, d)
    kept = torch.zeros(b, length, dtype=torch.float32, device=hidden.device)
    for i in range(b):  # a few rows, each its own length (a host read of the mask per row)
        row = hidden[i][mask[i].bool()][drop:drop + length]
        states[i, :row.shape[0]] = row
        kept[i, :row.shape[0]] = 1.0
    return states, kept


class QwenPromptEncoder(PromptEncoder):
    """The Qwen2.5-VL text encoder and tokenizer of a Qwen-Image folder, frozen: ``encode(captions, device) ->
    {"prompt_embeds": (B, L, 3584), "prompt_mask": (B, L) float 1/0}`` as QwenImagePipeline.encode_prompt (L =
    ``model.max_sequence_length``, the pipeline's padding to the batch's longest replaced by padding to L)."""

    parts = ("qwen",)

    def __init__(self, folder: Path, max_sequence_length: int = 0, deferred: bool = False):
        super().__init__()
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer  # optional ([text])

        self.source = str(folder)
        self.add_part("qwen", folder / "text_encoder", frozen_part(
            folder, "text_encoder", Qwen2_5_VLForConditionalGeneration, "Qwen2.5-VL text encoder"), deferred)
        self.tokenizer = load_part(folder, "tokenizer", Qwen2Tokenizer, "Qwen2 tokenizer")
        self.length = sequence_length(max_sequence_length, folder)
        config = read_json(folder / "text_encoder" / "config.json", f"base {folder}")
        self.width = int(config.get("text_config", config).get("hidden_size", config.get("hidden_size", 0)))
        self.digest = files_digest([folder / "text_encoder"], [folder / "tokenizer"], self._extra().encode())

    def _extra(self) -> str:
        return f"qwen_length={self.length}"

    def legacy_extra(self) -> bytes:
        return vocab_bytes([self.tokenizer], pairs=True) + self._extra().encode()

    @property
    def dim(self) -> int:
        """The width of ``prompt_embeds`` (the language model's hidden size)."""
        return self.width

    def encode_part(self, name: str, captions: list[str]) -> dict[str, Tensor]:
        """``{"prompt_embeds": (B, L, D), "prompt_mask": (B, L)}`` on the encoder's device."""
        model = self.qwen
        ids, mask = chat_tokens(self.tokenizer, chat_prompts(captions), self.length + DROP, model.device)
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1)
        states, kept = prompt_states(out.hidden_states[-1], mask, DROP, self.length)
        return {"prompt_embeds": states, "prompt_mask": kept}

    def assemble(self, outputs: dict[str, dict[str, Tensor]], device: torch.device | str) -> dict[str, Tensor]:
        return {k: v.float().to(device) for k, v in outputs["qwen"].items()}


# ---------------------------------------------------------------------------------------------
# The VAE.


class QwenImageCodec(LatentCodec):
    """A frozen AutoencoderKLQwenImage behind :class:`~difftrain.models.vae.LatentCodec`'s interface: images
    (B, 3, H, W) <-> latents (B, 16, H/f, W/f), the VAE's frame axis (of 1) added and dropped inside; model
    space (z - latents_mean) / latents_std per channel (``scaling_factor`` 1, ``shift_factor`` 0: unused)."""

    def __init__(self, vae: nn.Module, source: str):
        nn.Module.__init__(self)
        self.vae = vae.eval().requires_grad_(False)
        config = vae.config
        self.source = source
        self.in_channels = int(config.input_channels)
        self.latent_channels = int(config.z_dim)
        self.factor = vae_factor(dict(config))
        self.scaling_factor, self.shift_factor = 1.0, 0.0
        shape = (1, self.latent_channels, 1, 1)
        self.register_buffer("mean", torch.tensor(config.latents_mean, dtype=torch.float32).view(shape), persistent=False)
        self.register_buffer("std", torch.tensor(config.latents_std, dtype=torch.float32).view(shape), persistent=False)
        self.digest = weights_digest(vae)

    @torch.no_grad()
    def encode_moments(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """(mean, std) (B, 16, H/f, W/f) float32, unscaled, of images (B, 3, H, W) in [-1, 1]."""
        if images.ndim != 4 or images.shape[1] != self.in_channels:
            raise ValueError(f"vae {self.source}: encodes (B, {self.in_channels}, H, W) images, got {tuple(images.shape)}")
        if images.shape[2] % self.factor or images.shape[3] % self.factor:
            raise ValueError(f"vae {self.source}: image sides must be multiples of {self.factor}, got "
                             f"{tuple(images.shape[2:])}")
        dist = self.vae.encode(images.to(self.device, self.dtype)[:, :, None]).latent_dist
        return dist.mean[:, :, 0].float(), dist.std[:, :, 0].float()

    def to_model(self, z: Tensor) -> Tensor:
        """(z - latents_mean) / latents_std, per channel."""
        return (z - self.mean.to(z.device, z.dtype)) / self.std.to(z.device, z.dtype)

    def from_model(self, latents: Tensor) -> Tensor:
        """latents * latents_std + latents_mean (the inverse of :meth:`to_model`)."""
        return latents * self.std.to(latents.device, latents.dtype) + self.mean.to(latents.device, latents.dtype)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Images (B, 3, H, W) float32 in [-1, 1] of latents (B, 16, h, w) in model space."""
        z = self.from_model(latents.to(self.device, torch.float32))
        return self.vae.decode(z.to(self.dtype)[:, :, None]).sample[:, :, 0].float().clamp_(-1.0, 1.0)


# ---------------------------------------------------------------------------------------------
# The denoiser and the family.


class QwenImageDenoiser(TransformerDenoiser):
    """``net(x (B, 16, h, w), t (B,) = 1000 t, cond) -> (B, 16, h, w)`` velocity eps - x0: a
    QwenImageTransformer2DModel called as QwenImagePipeline calls it (2x2 packing, img_shapes, t / 1000).
    cond: {"prompt_embeds": (B, L, joint_attention_dim), "prompt_mask": (B, L) 1 / 0}."""

    family = "qwen-image"

    @property
    def patch(self) -> int:
        return int(self.model.config.patch_size)

    def guide_outputs(self, cond: Tensor, uncond: Tensor, scale: float) -> Tensor:
        """QwenImagePipeline's true CFG of outputs (B, 16, h, w): uncond + scale (cond - uncond), each 2x2 patch
        (a packed token's 64 values) rescaled to the norm of the conditional output's
        (``generation.sampling.guided_network`` asks for it instead of plain CFG)."""
        combined = uncond + scale * (cond - uncond)
        norm = lambda v: pack(v).norm(dim=-1, keepdim=True)  # (B, hw/4, 1)
        h, w = cond.shape[-2:]
        ratio = norm(cond) / norm(combined)
        return unpack(pack(combined) * ratio, h, w)

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        b, _, h, w = x.shape
        require_keys(cond, KEYS, b, self.family)
        self.check_latent_size(h, w)
        out = self.model(hidden_states=pack(x), timestep=t.expand(b).to(x.dtype) / 1000,
                         encoder_hidden_states=cond["prompt_embeds"].to(x.dtype),
                         encoder_hidden_states_mask=cond["prompt_mask"] > 0.5,
                         img_shapes=[(1, h // 2, w // 2)] * b, return_dict=False)[0]
        return unpack(out, h, w)


class QwenImageFamily(TransformerFamily):
    """Qwen-Image (20B) and its fine-tunes."""

    name = "qwen-image"
    pipeline_class = "QwenImagePipeline"
    transformer_class = "QwenImageTransformer2DModel"
    denoiser_class = QwenImageDenoiser
    # diffusers' Qwen-Image script's default LoRA targets (--lora_layers unset).
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")
    kohya_prefix = "lycoris_"  # what ComfyUI maps for Qwen-Image (SimpleTuner's LyCORIS names)
    foreign_modules = ("single_transformer_blocks", "context_embedder", "x_embedder")  # Flux's and SD3's
    default_sample_size = 128  # QwenImagePipeline's (1024 px with its VAE's factor 8)

    def native_resolution(self, folder: Path) -> int | None:
        """QwenImagePipeline's default side: default_sample_size (128) x the VAE's factor."""
        try:
            return self.default_sample_size * vae_factor(read_json(Path(folder) / "vae" / "config.json", f"base {folder}"))
        except (ValueError, KeyError, TypeError):
            return None

    def training_defaults(self, folder: Path) -> dict[str, object]:
        """The base's parts, captions on, rectified flow as diffusers' script trains it (uniform, unshifted
        t), sampling with the scheduler's resolution-dependent shift and true CFG 4.0."""
        sched = self.scheduler_config(folder)
        return {**self._defaults(folder), **self.unshifted_flow(sched, max_shift=0.9, max_seq_len=8192),
                "validation.guidance_scale": 4.0}

    def export_scheduler(self, diffusion) -> dict:
        """The flow settings (:meth:`TransformerFamily.flow_scheduler`) and no shift_terminal: difftrain's grid."""
        return {**self.flow_scheduler(diffusion), "shift_terminal": None}

    def load_prompt_encoder(self, folder: Path, device: torch.device | str = "cpu",
                            max_sequence_length: int = 0, deferred: bool = False) -> QwenPromptEncoder:
        return QwenPromptEncoder(Path(folder), max_sequence_length, deferred).to(device)

    def load_codec(self, folder: Path, device: torch.device | str = "cpu") -> QwenImageCodec:
        """The AutoencoderKLQwenImage of a Qwen-Image folder (``vae/``) or of a VAE folder."""
        from diffusers import AutoencoderKLQwenImage  # an optional package ([text])

        root = Path(folder).expanduser()
        parent, sub = (root, "vae") if (root / "vae").is_dir() else (root.parent, root.name)
        config = read_json(parent / sub / "config.json", f"vae {folder}")
        if config.get("_class_name") != VAE_CLASS:
            raise ValueError(f"vae {folder}: {parent / sub / 'config.json'} describes a {config.get('_class_name')!r}, "
                             f"not the {VAE_CLASS} a Qwen-Image base decodes with")
        vae = load_part(parent, sub, AutoencoderKLQwenImage, "Qwen-Image VAE")
        return QwenImageCodec(vae, str(folder)).to(device)

    def condition_shapes(self, config: dict, max_sequence_length: int = 0) -> dict[str, tuple[int, ...]]:
        """The prompt's states, ``joint_attention_dim`` wide, and their mask."""
        length = max_sequence_length or DEFAULT_LENGTH
        return {"prompt_embeds": (length, int(config["joint_attention_dim"])), "prompt_mask": (length,)}

    def latent_channels(self, config: dict) -> int:
        """The VAE's channels: the transformer takes 2x2 patches of them."""
        return int(config["in_channels"]) // 4

    def fsdp_units(self, denoiser: Denoiser) -> list[nn.Module]:
        return list(denoiser.model.transformer_blocks)

    def renamed_lora(self, tensors: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor] | None:
        """OneTrainer's canonical layout, renamed to one the pipeline's lora_state_dict converts
        (:func:`~difftrain.families.mmdit.canonical_lora_renamed`)."""
        return canonical_lora_renamed(tensors)


QWEN_IMAGE = register(QwenImageFamily())
