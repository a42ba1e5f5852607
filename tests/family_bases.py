"""Tiny random base folders of the families (difftrain.families), in the real on-disk layouts their
diffusers pipelines load, built offline from a seed with diffusers' and transformers' own classes
(``<Pipeline>.from_pretrained(folder)`` loads each as it would a real base).

    write_tiny_sdxl_folder(path)   StableDiffusionXLPipeline (see its docstring)
    write_tiny_sd3_folder(path)    StableDiffusion3Pipeline: SD3Transformer2DModel, CLIP-L and
                                   CLIP-G (CLIPTextModelWithProjection), T5EncoderModel, a
                                   16-channel AutoencoderKL, FlowMatchEulerDiscreteScheduler(shift=3)
    write_tiny_flux_folder(path)   FluxPipeline: FluxTransformer2DModel (guidance_embeds), CLIPTextModel,
                                   T5EncoderModel, 16-channel AutoencoderKL, the scheduler with
                                   use_dynamic_shifting (base/max shift 0.5/1.15 at 256/4096 tokens)

SD3 and Flux sizes: the VAE has a factor of 4 (32 px images -> 8 x 8 latents -> 16 tokens of 2 x 2
patches); text encoders are 2 layers, a few channels wide; the CLIP tokenizers are the BPE tokenizer
of tests/text_components.py (16 tokens), the T5 tokenizer is a Unigram tokenizer made offline with
the ``tokenizers`` library (transformers' T5Tokenizer built from a vocabulary: no sentencepiece),
``T5_LENGTH`` tokens long. Each builder takes a seed and leaves the global RNG as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from difftrain.models.text import BOS, EOS
from tests.text_components import TEXT_HIDDEN, TEXT_LENGTH, WORDS, tiny_vae, write_tiny_tokenizer

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


# ---------------------------------------------------------------------------------------------
# SD3 and Flux.

T5_LENGTH = 24  # the T5 tokenizer's model_max_length (the real ones: 256 for SD3's pipeline default, 512)
T5_WIDTH = 32  # T5's d_model: the transformers' joint_attention_dim (4096 in the real bases)
CLIP_L_WIDTH, CLIP_G_WIDTH = 8, 16  # SD3's two CLIP widths (768, 1280 real); L + G <= T5_WIDTH
FLUX_CLIP_WIDTH = 16  # Flux's CLIP-L width (768 real): the pooled projection width
LATENT_CHANNELS = 16
SD3_VAE = dict(scaling_factor=1.5305, shift_factor=0.0609)  # the real SD3 VAE's config values
FLUX_VAE = dict(scaling_factor=0.3611, shift_factor=0.1159)  # the real Flux VAE's config values
SD3_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)
FLUX_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                      max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)


def seeded(seed: int, build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def tiny_t5_tokenizer(words=WORDS, max_length: int = T5_LENGTH):
    """A T5 tokenizer (transformers' tokenizers-backed T5Tokenizer, Unigram) that knows each of
    ``words`` as one piece and every lower-case letter and digit as a fallback; no extra ids."""
    from transformers import T5Tokenizer

    pieces = ["<pad>", "</s>", "<unk>"] + [f"\u2581{w.lower()}" for w in dict.fromkeys(words)]
    pieces += ["\u2581"] + list("abcdefghijklmnopqrstuvwxyz0123456789")
    vocab = [(p, 0.0 if i < 3 else -1.0 - 0.01 * i) for i, p in enumerate(dict.fromkeys(pieces))]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)


def tiny_t5_encoder(vocab_size: int, width: int = T5_WIDTH, seed: int = 0):
    """A random T5EncoderModel, ``width`` wide, 2 layers, 2 heads."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=vocab_size, d_model=width, d_kv=width // 2, d_ff=2 * width, num_layers=2,
                      num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=32,
                      pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return seeded(seed, lambda: T5EncoderModel(config))


def tiny_clip(vocab: dict[str, int], width: int, seed: int, projection: bool):
    """A random CLIPTextModel (``projection``: CLIPTextModelWithProjection, projection_dim = width)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(vocab_size=len(vocab), hidden_size=width, intermediate_size=2 * width,
                            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=TEXT_LENGTH,
                            projection_dim=width, bos_token_id=vocab[BOS], eos_token_id=vocab[EOS],
                            pad_token_id=vocab[EOS])
    return seeded(seed, lambda: (CLIPTextModelWithProjection if projection else CLIPTextModel)(config))


def tiny_vae16(seed: int, scaling_factor: float, shift_factor: float):
    """A random AutoencoderKL: RGB, 16 latent channels, factor 4, with both factors in its config."""
    from diffusers import AutoencoderKL

    return seeded(seed, lambda: AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, layers_per_block=1, norm_num_groups=4,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16), sample_size=32, scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv=False, use_post_quant_conv=False))


def clip_tokenizer(folder: Path):
    from transformers import CLIPTokenizer

    write_tiny_tokenizer(folder)
    return CLIPTokenizer.from_pretrained(str(folder)), json.loads((folder / "vocab.json").read_text())


def restore_clip_tokenizers(path: Path, *names: str) -> None:
    """Stable Diffusion's own tokenizer layout (vocab.json and merges.txt), as the real bases ship it."""
    for name in names:
        for f in (path / name).iterdir():
            f.unlink()
        write_tiny_tokenizer(path / name)


def write_tiny_sd3_folder(path: str | Path, seed: int = 0, t5: bool = True) -> Path:
    """Write a StableDiffusion3Pipeline folder into ``path`` (model_index.json, transformer/, vae/,
    text_encoder{,_2,_3}/, tokenizer{,_2,_3}/, scheduler/); ``StableDiffusion3Pipeline.from_pretrained``
    loads it and samples 32 px images. ``t5=False``: without text_encoder_3/ and tokenizer_3/ (SD3 without
    T5: ``from_pretrained(path, text_encoder_3=None, tokenizer_3=None)`` loads it)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab = clip_tokenizer(path / "tokenizer")
    t5_tokenizer = tiny_t5_tokenizer()
    transformer = seeded(seed, lambda: SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=LATENT_CHANNELS, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=T5_WIDTH, caption_projection_dim=16,
        pooled_projection_dim=CLIP_L_WIDTH + CLIP_G_WIDTH, out_channels=LATENT_CHANNELS, pos_embed_max_size=16))
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER),
        vae=tiny_vae16(seed, **SD3_VAE),
        text_encoder=tiny_clip(vocab, CLIP_L_WIDTH, seed + 1, projection=True),
        tokenizer=tokenizer,
        text_encoder_2=tiny_clip(vocab, CLIP_G_WIDTH, seed + 2, projection=True),
        tokenizer_2=tokenizer,
        text_encoder_3=tiny_t5_encoder(len(t5_tokenizer), T5_WIDTH, seed + 3) if t5 else None,
        tokenizer_3=t5_tokenizer if t5 else None,
    )
    pipe.save_pretrained(path)
    restore_clip_tokenizers(path, "tokenizer", "tokenizer_2")
    return path


def write_tiny_flux_folder(path: str | Path, seed: int = 0, head_dim: int = 8) -> Path:
    """Write a FluxPipeline folder into ``path`` (model_index.json, transformer/ with guidance_embeds,
    vae/, text_encoder{,_2}/, tokenizer{,_2}/, scheduler/ with use_dynamic_shifting);
    ``FluxPipeline.from_pretrained`` loads it and samples 32 px images. ``head_dim`` (a multiple of 8) sets
    the transformer's width, 2 heads of it (32: a width of 64, which nf4's kernels take)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab = clip_tokenizer(path / "tokenizer")
    t5_tokenizer = tiny_t5_tokenizer()
    transformer = seeded(seed, lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=1, num_single_layers=1,
        attention_head_dim=head_dim, num_attention_heads=2, joint_attention_dim=T5_WIDTH,
        pooled_projection_dim=FLUX_CLIP_WIDTH, guidance_embeds=True,
        axes_dims_rope=(head_dim // 4, head_dim // 4, head_dim // 2)))
    pipe = FluxPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
        vae=tiny_vae16(seed, **FLUX_VAE),
        text_encoder=tiny_clip(vocab, FLUX_CLIP_WIDTH, seed + 1, projection=False),
        tokenizer=tokenizer,
        text_encoder_2=tiny_t5_encoder(len(t5_tokenizer), T5_WIDTH, seed + 3),
        tokenizer_2=t5_tokenizer,
    )
    pipe.save_pretrained(path)
    restore_clip_tokenizers(path, "tokenizer")
    return path


def with_run_conditions(family, cond: dict) -> dict:
    """``cond`` (a family's prompt-encoder output, batch-first) with the family's per-run scalars at their
    defaults (``Family.run_conditions``: Flux's distilled guidance 3.5), as ``Conditioning`` adds them."""
    from difftrain.config import Config

    n = next(iter(cond.values())).shape[0]
    return cond | {k: torch.full((n,), v) for k, v in family.run_conditions(Config().model).items()}
