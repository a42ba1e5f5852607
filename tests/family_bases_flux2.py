"""Tiny random FLUX.2 base folders, in the on-disk layouts Flux2Pipeline and Flux2KleinPipeline load,
built offline from a seed with diffusers' and transformers' own classes.

    write_tiny_flux2_folder(path)         Flux2Pipeline: Flux2Transformer2DModel (guidance_embeds),
                                          Mistral3ForConditionalGeneration (text model of MISTRAL_LAYERS
                                          layers, a 1-layer Pixtral vision tower), a fast tokenizer with a
                                          chat template (the real base's tokenizer/ is a PixtralProcessor,
                                          which transformers builds only with torchvision, not installed
                                          here; the pipeline calls the same apply_chat_template on either),
                                          AutoencoderKLFlux2 (32 channels,
                                          factor 4, its batch norm's running statistics set), the scheduler
    write_tiny_flux2_klein_folder(path)   Flux2KleinPipeline: the same transformer without guidance_embeds,
                                          Qwen3ForCausalLM (QWEN_LAYERS layers), a Qwen2 tokenizer with a
                                          chat template, the same VAE and scheduler

Sizes: 32 px images -> 8 x 8 latents of 32 channels (the VAE's factor 4) -> 16 tokens of 2 x 2 patches
(128 channels). The text models are 16 wide and have enough layers for the pipelines' default hidden-state
layers ((10, 20, 30) for Mistral, (9, 18, 27) for Qwen3): 30 and 27 layers of width 16, still tiny. The
tokenizers are word-level ``tokenizers`` models (every word of tests' captions, every letter as a fallback)
with the special tokens and an approximation of each model's chat template (the real templates are not
available offline): what matters here is that difftrain and the pipeline apply the same one.
Each builder takes a seed and leaves the global RNG as it was.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.family_bases import seeded
from tests.text_components import WORDS

LATENT_CHANNELS = 32  # AutoencoderKLFlux2's latent_channels (the real VAE's 32)
TEXT_WIDTH = 16  # the text models' hidden size (Mistral Small 3.1: 5120; Qwen3 4B/8B: 2560/4096)
MISTRAL_LAYERS = 30  # Flux2Pipeline stacks hidden_states[10], [20], [30]
QWEN_LAYERS = 27  # Flux2KleinPipeline stacks hidden_states[9], [18], [27]
TEXT_LENGTH = 32  # the tests' max_sequence_length (the pipelines' default: 512)
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")

MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                    "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
# Mistral's template, reduced to what format_input gives (a system message and a user text, content lists).
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set text = message['content'] if message['content'] is string else "
    "(message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(' ')) %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}")
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# Qwen3's template, reduced: ChatML turns; enable_thinking=False adds an empty think block after the prompt.
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
FILLER = ("you", "are", "an", "ai", "that", "reasons", "about", "image", "descriptions", "give", "structured",
          "responses", "focusing", "on", "object", "relationships", "attribution", "and", "actions", "without",
          "speculation", "system", "user", "assistant", "a", "the", "red", "blue", "circle", "square", "dark",
          "background", "photo", "of", "dog", "sks")


def word_tokenizer(specials: list[str], pad: str, bos: str | None, eos: str, unk: str, template: str,
                   max_length: int = 512):
    """A PreTrainedTokenizerFast: a WordLevel model over ``specials``, the tests' words, letters, digits
    and punctuation (whitespace and punctuation split the text), with ``template`` as its chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [*specials, *dict.fromkeys(w.lower() for w in (*WORDS, *FILLER)),
             *"abcdefghijklmnopqrstuvwxyz0123456789.,:;!?'\"-_()[]/<>|\n"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, bos_token=bos, eos_token=eos, unk_token=unk,
                                   model_max_length=max_length, chat_template=template)


def tiny_flux2_vae(seed: int):
    """A random AutoencoderKLFlux2: RGB, 32 latent channels, factor 4, its batch norm's running mean and
    variance random (as a trained VAE's: the pipelines normalise the patchified latents by them)."""
    from diffusers import AutoencoderKLFlux2

    def build():
        vae = AutoencoderKLFlux2(in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, layers_per_block=1,
                                 norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 3,
                                 up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 16, 16),
                                 sample_size=32)
        vae.bn.running_mean.copy_(torch.randn(4 * LATENT_CHANNELS) * 0.3)
        vae.bn.running_var.copy_(torch.rand(4 * LATENT_CHANNELS) + 0.5)
        return vae

    return seeded(seed, build)


def tiny_flux2_transformer(seed: int, text_width: int, guidance: bool, head_dim: int = 8):
    """A random Flux2Transformer2DModel: 1 double and 1 single block, 2 heads of ``head_dim``, taking the
    text model's three stacked layers (3 x ``text_width``)."""
    from diffusers import Flux2Transformer2DModel

    return seeded(seed, lambda: Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=1, num_single_layers=1, attention_head_dim=head_dim,
        num_attention_heads=2, joint_attention_dim=3 * text_width, timestep_guidance_channels=16,
        axes_dims_rope=(head_dim // 4,) * 4, guidance_embeds=guidance))


def write_tiny_flux2_folder(path: str | Path, seed: int = 0) -> Path:
    """Write a Flux2Pipeline folder into ``path`` (model_index.json, transformer/, vae/, text_encoder/ (a
    Mistral3ForConditionalGeneration), tokenizer/ (a fast tokenizer with the chat template), scheduler/);
    ``Flux2Pipeline.from_pretrained`` loads it and samples 32 px images."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(MISTRAL_SPECIALS, "<pad>", "<s>", "</s>", "<unk>", MISTRAL_TEMPLATE)
    text = MistralConfig(vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH,
                         num_hidden_layers=MISTRAL_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=4 * TEXT_LENGTH, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = PixtralVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=4, image_size=16, patch_size=4)
    config = Mistral3Config(vision_config=vision, text_config=text, image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
                            spatial_merge_size=2)
    pipe = Flux2Pipeline(
        transformer=tiny_flux2_transformer(seed, TEXT_WIDTH, guidance=True),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=tiny_flux2_vae(seed),
        text_encoder=seeded(seed + 1, lambda: Mistral3ForConditionalGeneration(config)),
        tokenizer=tokenizer,
    )
    pipe.save_pretrained(path)
    return path


def write_tiny_flux2_klein_folder(path: str | Path, seed: int = 0) -> Path:
    """Write a Flux2KleinPipeline folder into ``path`` (transformer/ without guidance_embeds, vae/,
    text_encoder/ (a Qwen3ForCausalLM), tokenizer/ (a fast tokenizer with a Qwen3-like chat template),
    scheduler/); ``Flux2KleinPipeline.from_pretrained`` loads it and samples 32 px images."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(QWEN_SPECIALS, "<|endoftext|>", None, "<|im_end|>", "<|endoftext|>", QWEN_TEMPLATE)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH,
                         num_hidden_layers=QWEN_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=4 * TEXT_LENGTH, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    pipe = Flux2KleinPipeline(
        transformer=tiny_flux2_transformer(seed, TEXT_WIDTH, guidance=False),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=tiny_flux2_vae(seed),
        text_encoder=seeded(seed + 1, lambda: Qwen3ForCausalLM(config)),
        tokenizer=tokenizer,
    )
    pipe.save_pretrained(path)
    return path
