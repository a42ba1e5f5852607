"""A tiny random AuraFlow base (AuraFlowPipeline's folder layout), built offline from a seed with diffusers'
and transformers' own classes; ``AuraFlowPipeline.from_pretrained(folder)`` loads it and samples 32 px images.

    write_tiny_auraflow_folder(path)   AuraFlowTransformer2DModel (1 joint + 1 single block, 2 heads of 8,
                                       a position grid of 8 x 8 patches), UMT5EncoderModel + the tiny T5
                                       tokenizer of tests/family_bases.py, a 4-channel AutoencoderKL (factor 4,
                                       SDXL's scaling_factor, no shift), FlowMatchEulerDiscreteScheduler(shift=1.73)
"""

from __future__ import annotations

from pathlib import Path

from tests.family_bases import T5_WIDTH, seeded, tiny_t5_tokenizer

AURAFLOW_SCHEDULER = dict(num_train_timesteps=1000, shift=1.73)  # AuraFlow v0.3's scheduler shift
AURAFLOW_SCALING = 0.13025  # SDXL's VAE, AuraFlow's


def tiny_umt5_encoder(vocab_size: int, width: int = T5_WIDTH, seed: int = 0):
    """A random UMT5EncoderModel, ``width`` wide, 2 layers, 2 heads."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=vocab_size, d_model=width, d_kv=width // 2, d_ff=2 * width, num_layers=2,
                        num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=32,
                        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return seeded(seed, lambda: UMT5EncoderModel(config))


def write_tiny_auraflow_folder(path: str | Path, seed: int = 0) -> Path:
    """Write an AuraFlowPipeline folder into ``path`` (model_index.json, transformer/, vae/, text_encoder/,
    tokenizer/, scheduler/)."""
    from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel, AutoencoderKL, FlowMatchEulerDiscreteScheduler

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_t5_tokenizer()
    transformer = seeded(seed, lambda: AuraFlowTransformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=T5_WIDTH, caption_projection_dim=16,
        out_channels=4, pos_embed_max_size=64))
    vae = seeded(seed, lambda: AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=4,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16), sample_size=32, scaling_factor=AURAFLOW_SCALING))
    pipe = AuraFlowPipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**AURAFLOW_SCHEDULER),
                            vae=vae, text_encoder=tiny_umt5_encoder(len(tokenizer), T5_WIDTH, seed + 3),
                            tokenizer=tokenizer)
    pipe.save_pretrained(path)
    return path
