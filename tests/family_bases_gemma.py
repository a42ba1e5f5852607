"""Tiny random base folders of the Gemma families (difftrain.families.sana, .lumina2), in the on-disk
layouts their diffusers pipelines load, built offline from a seed with diffusers' and transformers' own
classes (``SanaPipeline.from_pretrained(folder)`` / ``Lumina2Pipeline.from_pretrained(folder)`` load them).

    write_tiny_sana_folder(path)     SanaPipeline: SanaTransformer2DModel (2 layers, 16 wide), Gemma2Model
                                     (2 layers, 32 wide), a character-level GemmaTokenizer, an AutoencoderDC
                                     (32 latent channels, factor 4), DPMSolverMultistepScheduler with the
                                     published base's flow settings (flow_prediction, use_flow_sigmas,
                                     flow_shift 3)
    write_tiny_lumina2_folder(path)  Lumina2Pipeline: Lumina2Transformer2DModel (1 joint layer, 1 refiner
                                     layer each, 32 wide), the same Gemma2Model and tokenizer, a 16-channel
                                     AutoencoderKL of factor 8 (the pipeline's fixed vae_scale_factor) with
                                     Flux's scaling and shift factors, FlowMatchEulerDiscreteScheduler(shift=3)

The Gemma tokenizer is transformers' GemmaTokenizer (tokenizers' BPE with byte fallback) over single
characters (no merges: a token per character), made offline; 32 px images -> 8 x 8 latents (Sana) or
4 x 4 latents, 2 x 2 tokens of 2 x 2 patches (Lumina 2). Each builder takes a seed and leaves the global
RNG as it was.
"""

from __future__ import annotations

import string
from pathlib import Path

from tests.family_bases import FLUX_VAE, LATENT_CHANNELS, seeded

GEMMA_WIDTH = 32  # Gemma 2's hidden_size (2304 in Gemma 2 2B): the transformers' caption width
SANA_LATENTS = 32  # AutoencoderDC's latent channels (the published 32)
SANA_VAE_SCALING = 0.41407  # the published Sana DC-AE's scaling_factor
SANA_SCHEDULER = dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
                      flow_shift=3.0, beta_schedule="linear", beta_start=0.0001, beta_end=0.02, solver_order=2,
                      algorithm_type="dpmsolver++")
LUMINA2_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)


def tiny_gemma_tokenizer(padding_side: str = "right"):
    """A GemmaTokenizer of single characters (printable ASCII, "▁" for the space) and the 256 byte
    fallbacks, Gemma's special tokens first (<pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> 4); BOS added."""
    from transformers import GemmaTokenizer

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in ["\u2581", *string.ascii_letters, *string.digits, *string.punctuation]:
        vocab.setdefault(c, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[], padding_side=padding_side, add_bos_token=True, add_eos_token=False)


def tiny_gemma(vocab_size: int, seed: int = 0):
    """A random Gemma2Model: ``GEMMA_WIDTH`` wide, 2 layers (a sliding and a global one), 2 heads, 1 KV head."""
    from transformers import Gemma2Config, Gemma2Model

    config = Gemma2Config(vocab_size=vocab_size, hidden_size=GEMMA_WIDTH, intermediate_size=2 * GEMMA_WIDTH,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                          max_position_embeddings=2048, sliding_window=64, pad_token_id=0, eos_token_id=1,
                          bos_token_id=2)
    return seeded(seed, lambda: Gemma2Model(config))


def tiny_dc_ae(seed: int):
    """A random AutoencoderDC: RGB, 32 latent channels, 3 levels (factor 4), 8/16/32 wide (the last a multiple of the latent channels), no attention."""
    from diffusers import AutoencoderDC

    return seeded(seed, lambda: AutoencoderDC(
        in_channels=3, latent_channels=SANA_LATENTS, attention_head_dim=8, encoder_block_types="ResBlock",
        decoder_block_types="ResBlock", encoder_block_out_channels=(8, 16, 32), decoder_block_out_channels=(8, 16, 32),
        encoder_layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1), encoder_qkv_multiscales=((), (), ()),
        decoder_qkv_multiscales=((), (), ()), decoder_norm_types="rms_norm", decoder_act_fns="silu",
        scaling_factor=SANA_VAE_SCALING))


def tiny_vae16_factor8(seed: int):
    """A random AutoencoderKL: RGB, 16 latent channels, factor 8 (4 levels), Flux's scaling and shift."""
    from diffusers import AutoencoderKL

    return seeded(seed, lambda: AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, layers_per_block=1, norm_num_groups=4,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16), sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
        **FLUX_VAE))


def write_tiny_sana_folder(path: str | Path, seed: int = 0) -> Path:
    """Write a SanaPipeline folder into ``path`` (model_index.json, transformer/, vae/, text_encoder/,
    tokenizer/, scheduler/); ``SanaPipeline.from_pretrained`` loads it and samples 32 px images
    (``use_resolution_binning=False``: its bins know the published sample sizes only)."""
    from diffusers import DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel

    path = Path(path)
    tokenizer = tiny_gemma_tokenizer()
    transformer = seeded(seed, lambda: SanaTransformer2DModel(
        in_channels=SANA_LATENTS, out_channels=SANA_LATENTS, num_attention_heads=2, attention_head_dim=8,
        num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16,
        caption_channels=GEMMA_WIDTH, mlp_ratio=2.5, sample_size=8, patch_size=1))
    pipe = SanaPipeline(tokenizer=tokenizer, text_encoder=tiny_gemma(len(tokenizer), seed + 1), vae=tiny_dc_ae(seed),
                        transformer=transformer, scheduler=DPMSolverMultistepScheduler(**SANA_SCHEDULER))
    pipe.save_pretrained(path)
    return path


def write_tiny_lumina2_folder(path: str | Path, seed: int = 0) -> Path:
    """Write a Lumina2Pipeline folder into ``path`` (model_index.json, transformer/, vae/, text_encoder/,
    tokenizer/, scheduler/); ``Lumina2Pipeline.from_pretrained`` loads it and samples 32 px images."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel

    path = Path(path)
    tokenizer = tiny_gemma_tokenizer()
    transformer = seeded(seed, lambda: Lumina2Transformer2DModel(
        sample_size=4, patch_size=2, in_channels=LATENT_CHANNELS, hidden_size=32, num_layers=1, num_refiner_layers=1,
        num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(2048, 64, 64),
        cap_feat_dim=GEMMA_WIDTH))
    pipe = Lumina2Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**LUMINA2_SCHEDULER),
                           vae=tiny_vae16_factor8(seed), text_encoder=tiny_gemma(len(tokenizer), seed + 1),
                           tokenizer=tokenizer)
    pipe.save_pretrained(path)
    return path
