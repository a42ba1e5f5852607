"""Tiny random base folders of the families (difftrain.families), in the real on-disk layouts their
diffusers pipelines load, built offline from a seed with diffusers' and transformers' own classes."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from difftrain.models.text import BOS, EOS
from tests.text_components import TEXT_HIDDEN, TEXT_LENGTH, tiny_vae, write_tiny_tokenizer

SDXL_TIME_DIM = 8  # addition_time_embed_dim: each of the six size numbers' embedding width


def write_tiny_sdxl_folder(path: str | Path, seed: int = 0) -> Path:
    """A StableDiffusionXLPipeline folder: two CLIP text encoders (the second with a projection) of
    width ``TEXT_HIDDEN``, their tokenizers, a 4-channel VAE, an EulerDiscreteScheduler (SDXL's:
    scaled_linear betas, epsilon) and a "text_time" UNet2DConditionModel cross-attending to width
    2 * TEXT_HIDDEN; ``StableDiffusionXLPipeline.from_pretrained(path)`` loads it."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    path = Path(path)
    tokenizer_dir = write_tiny_tokenizer(path / "_tokenizer")
    vocab = json.loads((tokenizer_dir / "vocab.json").read_text())
    config = CLIPTextConfig(vocab_size=len(vocab), hidden_size=TEXT_HIDDEN, intermediate_size=2 * TEXT_HIDDEN,
                            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=TEXT_LENGTH,
                            bos_token_id=vocab[BOS], eos_token_id=vocab[EOS], pad_token_id=vocab[EOS],
                            projection_dim=TEXT_HIDDEN)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder, text_encoder_2 = CLIPTextModel(config), CLIPTextModelWithProjection(config)
        unet = UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
            norm_num_groups=4, attention_head_dim=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=2 * TEXT_HIDDEN,
            addition_embed_type="text_time", addition_time_embed_dim=SDXL_TIME_DIM,
            projection_class_embeddings_input_dim=6 * SDXL_TIME_DIM + TEXT_HIDDEN, use_linear_projection=True,
        )
    tokenizer = CLIPTokenizer.from_pretrained(str(tokenizer_dir))
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       num_train_timesteps=1000, steps_offset=1, timestep_spacing="leading")
    pipe = StableDiffusionXLPipeline(vae=tiny_vae(seed), text_encoder=text_encoder, text_encoder_2=text_encoder_2,
                                     tokenizer=tokenizer, tokenizer_2=tokenizer, unet=unet, scheduler=scheduler)
    pipe.save_pretrained(path)
    for f in tokenizer_dir.iterdir():
        f.unlink()
    tokenizer_dir.rmdir()
    return path
