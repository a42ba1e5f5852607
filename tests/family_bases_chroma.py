"""A tiny random Chroma base (ChromaPipeline's folder layout), built offline from a seed with diffusers' and
transformers' own classes; ``ChromaPipeline.from_pretrained(folder)`` loads it and samples 32 px images.

    write_tiny_chroma_folder(path)   ChromaTransformer2DModel (1 double + 1 single block, 2 heads of 8,
                                     a 1-layer approximator), T5EncoderModel + the tiny T5 tokenizer of
                                     tests/family_bases.py, Flux's 16-channel VAE kind (factor 4), the
                                     scheduler with use_dynamic_shifting (Flux's values)
"""

from __future__ import annotations

from pathlib import Path

from tests.family_bases import (FLUX_SCHEDULER, FLUX_VAE, LATENT_CHANNELS, T5_WIDTH, seeded, tiny_t5_encoder,
                                tiny_t5_tokenizer, tiny_vae16)


def write_tiny_chroma_folder(path: str | Path, seed: int = 0, head_dim: int = 8) -> Path:
    """Write a ChromaPipeline folder into ``path`` (model_index.json, transformer/, vae/, text_encoder/,
    tokenizer/, scheduler/); ``head_dim`` (a multiple of 8): the transformer's width is 2 heads of it."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_t5_tokenizer()
    transformer = seeded(seed, lambda: ChromaTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=1, num_single_layers=1,
        attention_head_dim=head_dim, num_attention_heads=2, joint_attention_dim=T5_WIDTH,
        axes_dims_rope=(head_dim // 4, head_dim // 4, head_dim // 2), approximator_num_channels=16,
        approximator_hidden_dim=32, approximator_layers=1))
    pipe = ChromaPipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
                          vae=tiny_vae16(seed, **FLUX_VAE), text_encoder=tiny_t5_encoder(len(tokenizer), T5_WIDTH,
                                                                                          seed + 3),
                          tokenizer=tokenizer)
    pipe.save_pretrained(path)
    return path
