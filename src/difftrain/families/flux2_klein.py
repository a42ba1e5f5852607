"""FLUX.2 [klein] (Flux2KleinPipeline): FLUX.2's transformer (without the guidance embedding) and VAE,
conditioned on three stacked hidden layers of Qwen3 (Qwen3ForCausalLM, 4B or 8B), guided by classifier-free
guidance. What it shares with FLUX.2 [dev] (latents, packing, ids, objective, LoRA files) is flux2.py's.

Facts, checked in the installed diffusers 0.42.1 (pipelines/flux2/pipeline_flux2_klein.py) and diffusers'
train_dreambooth_lora_flux2_klein.py:

Prompts -> conditioning (``_get_qwen3_prompt_embeds``): each prompt alone as one user message (content a
  plain string, no system message), through the tokenizer's chat template with add_generation_prompt=True and
  enable_thinking=False (tokenize=False), then the tokenizer on that text, padded to max_sequence_length
  (512) and truncated, with its attention mask; Qwen3 runs on ids and mask (output_hidden_states, no cache)
  and hidden_states[9], [18], [27] (``text_encoder_out_layers``) are stacked per token: (B, L, 3 x D)
  (D = 2560 for the 4B, 4096 for the 9B: joint_attention_dim 7680 / 12288). difftrain tokenizes the batch
  at once: the same ids, every row padded to the same length. NOTE: the script passes its own
  --text_encoder_out_layers default (10, 20, 30) to this pipeline's encode_prompt, so it trains on other
  layers than the pipeline samples with; difftrain takes the pipeline's (9, 18, 27).
Transformer call: flux2.py's, with guidance=None (guidance_embeds False; the script passes guidance only
  when the transformer has it).
Guidance: real classifier-free guidance, the negative prompt "" (``encode([""])``, difftrain's null
  condition), guidance_scale 4.0 by default; none for a step-distilled folder (model_index.json
  "is_distilled": true: the pipeline ignores guidance_scale). validation.guidance_scale defaults to the
  pipeline's: 4.0, or 1.0 for a distilled base.
Training (the script): flux2.py's (uniform, unshifted t; velocity; weight 1); its --caption_dropout defaults
  to 0 (difftrain keeps data.class_dropout, the null condition being the pipeline's negative prompt).
LoRA: the script's default targets, flux2.py's list with the single blocks named up to 24; difftrain keeps
  the 48 names (the names past a base's blocks match nothing), so one list serves both.
Known bases (tools/bases/flux2-klein-4b, -9b; no published file could be read here): the transformers' split,
  4B: 5 double + 20 single blocks, 24 heads of 128, joint_attention_dim 7680; 9B: 8 + 24 blocks, 32 heads,
  12288 (as public reimplementations quote the released transformer/config.json; the script's 24 single-block
  targets agree with the 9B), 3.88B and 9.08B parameters; Qwen3-4B and -8B at their published sizes (36
  layers, 2560 / 4096 wide, FFN 9728 / 12288, 32 heads, 8 KV heads, the 4B's embeddings tied): 4.02B and
  8.19B. The folders say is_distilled (the released klein 4B / 9B are step-distilled; the "base" ones are not).
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from difftrain.families import register
from difftrain.families.base import read_json
from difftrain.families.flux2 import Flux2Denoiser, Flux2Family, Flux2PromptEncoder
from difftrain.families.z_image import chat_prompts, qwen_tokens

QWEN_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers default
PIPELINE_GUIDANCE = 4.0  # Flux2KleinPipeline.__call__'s guidance_scale default (CFG)


class Flux2KleinPromptEncoder(Flux2PromptEncoder):
    """Qwen3 of a FLUX.2 [klein] folder, frozen: ``encode(captions) -> {"prompt_embeds": (B, L, 3 x D)}``."""

    encoder_class = "Qwen3ForCausalLM"
    layers = QWEN_LAYERS

    def system(self) -> str | None:
        return None

    def tokens(self, captions: list[str], device) -> tuple[Tensor, Tensor]:
        """Each caption as one user message through Qwen3's chat template, the generation prompt added, thinking
        off (``enable_thinking=False``), tokenized with its mask: Z-Image's Qwen3 steps (z_image.chat_prompts,
        qwen_tokens)."""
        return qwen_tokens(self.tokenizer, chat_prompts(self.tokenizer, captions, enable_thinking=False), self.length,
                           device)


class Flux2KleinDenoiser(Flux2Denoiser):
    """flux2.py's denoiser, registered under klein's name (its records name this family)."""

    family = "flux2-klein"


class Flux2KleinFamily(Flux2Family):
    """FLUX.2 [klein] 4B and 9B (base and step-distilled)."""

    name = "flux2-klein"
    pipeline_class = "Flux2KleinPipeline"
    prompt_encoder_class = Flux2KleinPromptEncoder
    denoiser_class = Flux2KleinDenoiser

    def guidance_defaults(self, folder: Path) -> dict[str, object]:
        """The samples' classifier-free guidance: the pipeline's 4.0, 1.0 for a distilled base."""
        distilled = bool(read_json(Path(folder) / "model_index.json", f"base {folder}").get("is_distilled", False))
        return {"validation.guidance_scale": 1.0 if distilled else PIPELINE_GUIDANCE}

    def run_conditions(self, section) -> dict[str, float]:
        """None: klein's transformer has no guidance input."""
        return {}



FLUX2_KLEIN = register(Flux2KleinFamily())
