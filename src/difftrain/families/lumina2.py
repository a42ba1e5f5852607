"""Lumina-Image 2.0 (Lumina2Pipeline): a unified single-stream DiT (Lumina2Transformer2DModel, caption
and image tokens in one sequence) on the 16 channels of Flux's VAE, conditioned on Gemma 2, trained with
rectified flow in the REVERSED time convention.

Facts, checked in the installed diffusers (pipeline_lumina2.py, transformer_lumina2.py,
scheduling_flow_match_euler_discrete.py) and diffusers' train_dreambooth_lora_lumina2.py:

Prompts -> conditioning (``encode_prompt``; the Gemma steps: families/gemma.py): the prompt becomes
  ``system_prompt + " <Prompt Start> " + prompt`` (the pipeline's system prompt, :data:`SYSTEM_PROMPT`;
  the script's --system_prompt defaults to None, which is the pipeline's); tokens (GemmaTokenizer, its own
  padding side) padded to max_sequence_length (256 by default, the script's too), truncated; Gemma2Model's
  SECOND TO LAST hidden state (``hidden_states[-2]``) (B, L, 2304) and the attention mask. The negative
  prompt "" is encoded without the system prompt: the null condition here.
Latents: the 16-channel AutoencoderKL of Flux, latents = (z - shift_factor) * scaling_factor (the script),
  decoded latents / scaling + shift (the pipeline). The pipeline's vae_scale_factor is fixed at 8 and
  its image sides are multiples of 16 (2x2 patches); the transformer patchifies inside (patch_size 2).
Transformer call: transformer(hidden_states=x (B, 16, h, w), timestep=1 - t/1000,
  encoder_hidden_states=prompt_embeds, encoder_attention_mask=mask (the transformer counts each row's
  tokens from it: it takes integers, and right padding)). Lumina 2's time runs the other way: its
  timestep is 1 at the data and 0 at the noise (the pipeline gives ``1 - t / num_train_timesteps``), and
  its output is x0 - noise, the velocity from noise to data (the script's target ``model_input - noise``;
  the pipeline negates it, ``noise_pred = -noise_pred``, before the scheduler's step). difftrain's flow
  objective conditions on 1000 t and predicts eps - x0: forward() passes 1 - t / 1000 and returns the
  output negated.
Training (the script): sigma = the base scheduler's (FlowMatchEulerDiscreteScheduler's) sigmas at
  floor(1000 u), u uniform (weighting_scheme "none", weight 1); x = (1 - sigma) noise + sigma x0, i.e.
  difftrain's t = 1 - sigma: with the scheduler's shift s that is 1 - shift_s(u) = shift_{1/s}(1 - u),
  uniform t shifted by 1 / s toward the data (diffusion.flow_t_sampling "uniform",
  flow_train_shift = 1 / s; s = 1 gives uniform t).
Sampling (the pipeline): sigmas linspace(1, 1/N, N), shifted by the scheduler (its shift, or mu when it
  has use_dynamic_shifting: the pipeline computes mu from latents.shape[1], the channels), then 0: here
  diffusion.flow_shift = shift on difftrain's grid linspace(1, 0, N + 1) (the same points).
  CFG with guidance_scale 4.0 by default, on two transformer calls, with ``cfg_normalization`` (True by
  default: the guided prediction uncond + g (cond - uncond), a (B, 16, h, w) tensor, rescaled so that each
  vector along its LAST axis, one latent row of w values per sample and channel, has the norm of the
  conditional prediction's same row; not the whole prediction, not per token) and ``cfg_trunc_ratio``
  (1.0 by default: guidance on every step). difftrain's validation guidance is the same normalised CFG
  (:meth:`Lumina2Denoiser.guide_outputs`, the hook ``generation.sampling.guided_network`` takes), so the
  exported pipeline samples as difftrain does with its defaults; cfg_trunc_ratio < 1 is not reproduced. The
  pipeline guides only when guidance_scale > 1 (difftrain's sampler at any scale but 1: below 1 they differ).
LoRA: peft on to_k, to_q, to_v, to_out.0 (the script's default targets, every attention: the refiners'
  and the joint layers'); files in Lumina2LoraLoaderMixin's format (``transformer.`` + peft names),
  written by Lumina2Pipeline.save_lora_weights, read by its lora_state_dict.
FSDP and block swap: the context refiner, the noise refiner and the joint layers, in forward order.
Known base (tools/bases/lumina2, config files only, for ``estimate --base``): Lumina2Transformer2DModel's
  defaults in the installed diffusers (26 joint layers and 2 + 2 refiner layers 2304 wide, 24 heads, 8 KV heads)
  with cap_feat_dim 2304, the width of the Gemma 2 2B states the pipeline gives it (the class's default, 1024,
  would not take them): 2,609,769,152 parameters on meta, the published 2.6B; Gemma 2 2B as Sana's (2.6B);
  Flux's VAE (16 channels, factor 8, scaling 0.3611, shift 0.1159). Its scheduler_config.json (shift 6.0) is
  recalled, not read from the published file here: estimate does not read it; a real base's own file decides.
  Activations are counted on meta (:meth:`Lumina2Denoiser.counted_on_meta`): the transformer reads its mask's
  token counts on the host (tolist), so the count takes every caption at the full max_sequence_length.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn

from difftrain.families import register
from difftrain.families.base import Denoiser, require_keys
from difftrain.families.gemma import KEYS, GemmaPromptEncoder
from difftrain.families.mmdit import TransformerDenoiser, TransformerFamily

DEFAULT_LENGTH = 256  # Lumina2Pipeline's max_sequence_length default (and the script's)
# Lumina2Pipeline's self.system_prompt (set in its __init__), the text before " <Prompt Start> ".
SYSTEM_PROMPT = ("You are an assistant designed to generate superior images with the superior degree of image-text "
                 "alignment based on textual prompts or user prompts.")
PROMPT_START = " <Prompt Start> "


class Lumina2Denoiser(TransformerDenoiser):
    """``net(x (B, 16, h, w), t (B,) = 1000 t, cond) -> (B, 16, h, w)`` velocity eps - x0: a
    Lumina2Transformer2DModel called as Lumina2Pipeline calls it (timestep 1 - t / 1000, the mask as
    integers), its output (x0 - eps) negated. cond: {"prompt_embeds": (B, L, cap_feat_dim),
    "prompt_attention_mask": (B, L)}."""

    family = "lumina2"

    @property
    def patch(self) -> int:
        return int(self.model.config.patch_size)

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        b = x.shape[0]
        require_keys(cond, KEYS, b, self.family)
        self.check_latent_size(x.shape[-2], x.shape[-1])
        out = self.model(hidden_states=x, timestep=1 - t.expand(b).to(x.dtype) / 1000,
                         encoder_hidden_states=cond["prompt_embeds"].to(x.dtype),
                         encoder_attention_mask=cond["prompt_attention_mask"].long(), return_dict=False)[0]
        return -out

    @contextmanager
    def counted_on_meta(self) -> Iterator[None]:
        """The transformer's rotary embedder counting each row's caption tokens from a mask of ones of the meta
        mask's shape (every row at the full ``max_sequence_length``: the longest sequence, what the count plans
        for): its ``attention_mask.sum(dim=1).tolist()`` is a host read, which meta tensors cannot give."""
        rope = self.model.rope_embedder
        plain = rope.forward

        def forward(hidden_states: Tensor, attention_mask: Tensor):
            if attention_mask.is_meta:
                attention_mask = torch.ones(attention_mask.shape, dtype=attention_mask.dtype)
            return plain(hidden_states, attention_mask)

        rope.forward = forward
        try:
            yield
        finally:
            del rope.forward  # the class's again

    def guide_outputs(self, cond: Tensor, uncond: Tensor, scale: float) -> Tensor:
        """Lumina2Pipeline's guidance of outputs (B, 16, h, w) with its default ``cfg_normalization=True``:
        uncond + scale (cond - uncond), each vector along the LAST axis (one latent row: the w values of a
        sample's channel and row) rescaled to the norm of the conditional output's same row
        (``generation.sampling.guided_network`` asks for it instead of plain CFG). The pipeline computes it on
        the transformer's output (x0 - eps), difftrain on its negation: the same norms, the negated result."""
        combined = uncond + scale * (cond - uncond)
        return combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


class Lumina2PromptEncoder(GemmaPromptEncoder):
    """Gemma 2 of a Lumina 2 folder: the system prompt and " <Prompt Start> " before each caption, the
    second to last hidden state (Lumina2Pipeline.encode_prompt)."""

    default_length = DEFAULT_LENGTH
    layer = -2

    def template(self, captions: list[str]) -> tuple[list[str], int]:
        return [SYSTEM_PROMPT + PROMPT_START + c for c in captions], self.length


# kohya sd-scripts' Lumina 2 LoRA names (the NextDiT's, after "lora_unet_"): the diffusers modules of
# Lumina2Transformer2DModel each names, as diffusers' single-file converter maps the weights (convert_lumina2_to_diffusers;
# its attention.qkv is split into to_q, to_k, to_v by rows): of each block (BLOCKS) and of the model (KOHYA_TOP).
KOHYA = "lora_unet_"
BLOCKS = ("noise_refiner", "context_refiner", "layers")
KOHYA_NAMES = {"attention.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"), "attention.out": ("attn.to_out.0",),
               "feed_forward.w1": ("feed_forward.linear_1",), "feed_forward.w2": ("feed_forward.linear_2",),
               "feed_forward.w3": ("feed_forward.linear_3",), "adaLN_modulation.1": ("norm1.linear",)}
KOHYA_TOP = {"final_layer.linear": ("norm_out.linear_2",), "final_layer.adaLN_modulation.1": ("norm_out.linear_1",),
             "x_embedder": ("x_embedder",), "cap_embedder.1": ("time_caption_embed.caption_embedder.1",),
             "t_embedder.mlp.0": ("time_caption_embed.timestep_embedder.linear_1",),
             "t_embedder.mlp.2": ("time_caption_embed.timestep_embedder.linear_2",)}


class Lumina2Family(TransformerFamily):
    """Lumina-Image 2.0 and its fine-tunes."""

    name = "lumina2"
    pipeline_class = "Lumina2Pipeline"
    transformer_class = "Lumina2Transformer2DModel"
    denoiser_class = Lumina2Denoiser
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")  # diffusers' Lumina 2 script's default
    comfyui_layouts = ()  # ComfyUI's Lumina2 maps its fused attention.qkv and Z-Image's names, not diffusers' attn.
    # Sana's, SD3's and Flux's blocks: a LoRA file naming them is not Lumina 2's
    foreign_modules = ("transformer_blocks", "single_transformer_blocks", "attn1", "attn2")
    default_sample_size = 128  # Lumina2Pipeline's when the transformer's config has none

    def training_defaults(self, folder: Path) -> dict[str, object]:
        """The base's parts, captions on, rectified flow as diffusers' Lumina 2 script trains it (uniform t
        shifted by 1 / the scheduler's shift: the reversed time), sampled on the scheduler's grid."""
        sched = self.scheduler_config(folder)
        shift = float(sched.get("shift", 1.0))
        out = {**self._defaults(folder), "diffusion.flow_t_sampling": "uniform", "diffusion.flow_train_shift": 1 / shift,
               "diffusion.flow_shift": shift, "diffusion.flow_grid_end": None,
               "diffusion.flow_dynamic_shift": bool(sched.get("use_dynamic_shifting", False))}
        if out["diffusion.flow_dynamic_shift"]:
            out |= self.shift_range(sched)
        return out

    def load_prompt_encoder(self, folder: Path, device: torch.device | str = "cpu",
                            max_sequence_length: int = 0, deferred: bool = False) -> Lumina2PromptEncoder:
        return Lumina2PromptEncoder(Path(folder), max_sequence_length, deferred).to(device)

    def condition_shapes(self, config: dict, max_sequence_length: int = 0) -> dict[str, tuple[int, ...]]:
        """L Gemma states, ``cap_feat_dim`` wide, and their mask."""
        length = max_sequence_length or DEFAULT_LENGTH
        return {"prompt_embeds": (length, int(config["cap_feat_dim"])), "prompt_attention_mask": (length,)}

    def fsdp_units(self, denoiser: Denoiser) -> list[nn.Module]:
        model = denoiser.model
        return [*model.context_refiner, *model.noise_refiner, *model.layers]

    def renamed_lora(self, tensors: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor] | None:
        """kohya sd-scripts' Lumina 2 files (``networks/lora_lumina.py``: ``lora_unet_`` + the original NextDiT's
        module path with "_", ``.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``), which Lumina2Pipeline's
        lora_state_dict does not convert (its converter takes ``diffusion_model.`` names with peft's factors, at
        the 2.6B's q/k/v widths, without the final layer), in diffusers' names: each module named after
        :data:`KOHYA_NAMES` (diffusers' single-file converter's map, ``convert_lumina2_to_diffusers``), the fused
        ``attention.qkv``'s up factor split by the rows of ``to_q``, ``to_k``, ``to_v`` (its down factor is theirs),
        alpha / rank folded into the up factor (the mixin reads no alpha). A name of no module of ``model`` keeps
        its underscores, for the check that names it; tensors of the text encoder (``lora_te_``) stay as they
        are. None for any other layout."""
        if not any(k.startswith(KOHYA) for k in tensors) or not all(k.startswith((KOHYA, "lora_te_")) for k in tensors):
            return None
        modules = dict(model.named_modules())
        names = {}  # kohya's name -> the diffusers modules whose rows its up factor holds, in order
        for block in (n for n in modules if n.count(".") == 1 and n.split(".")[0] in BLOCKS):
            names |= {KOHYA + f"{block}.{theirs}".replace(".", "_"): [f"{block}.{m}" for m in ours]
                      for theirs, ours in KOHYA_NAMES.items()}
        names |= {KOHYA + theirs.replace(".", "_"): list(ours) for theirs, ours in KOHYA_TOP.items()}
        out = {k: v for k, v in tensors.items() if k.startswith("lora_te_")}
        for key in (k for k in tensors if k.endswith(".lora_down.weight") and k.startswith(KOHYA)):
            name = key.split(".")[0]
            down, up = tensors[key], tensors.get(f"{name}.lora_up.weight")
            ours = names.get(name, [name[len(KOHYA):]])
            rows = [modules[m].weight.shape[0] for m in ours if m in modules]
            if up is None or len(rows) != len(ours) or sum(rows) != up.shape[0]:  # as one module, for the checks
                out |= {f"transformer.{ours[0]}.lora_A.weight": down} | ({} if up is None else
                                                                       {f"transformer.{ours[0]}.lora_B.weight": up})
                continue
            alpha = tensors.get(f"{name}.alpha")
            up = up * (float(alpha) / down.shape[0]) if alpha is not None else up
            for module, part in zip(ours, up.split(rows)):
                out[f"transformer.{module}.lora_A.weight"], out[f"transformer.{module}.lora_B.weight"] = down, part
        return out


LUMINA2 = register(Lumina2Family())
