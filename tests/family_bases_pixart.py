"""A tiny random PixArt-Sigma base folder (``PixArtSigmaPipeline`` layout), built offline from a seed with
diffusers' and transformers' own classes (``PixArtSigmaPipeline.from_pretrained(folder)`` loads it).

    write_tiny_pixart_folder(path)   transformer/ (PixArtTransformer2DModel: 2 layers, 2 heads of 8, patch 2,
                                     out_channels 8 = 2 x 4 latent channels: the learned variance half,
                                     caption_channels = T5's width, use_additional_conditions False as
                                     PixArt-Sigma's config), text_encoder/ (T5EncoderModel), tokenizer/ (the offline
                                     T5 tokenizer of tests/family_bases.py), vae/ (a 4-channel AutoencoderKL, factor
                                     4: tests/text_components.tiny_vae with 3 levels), scheduler/
                                     (DPMSolverMultistepScheduler: PixArt-Sigma's settings, linear betas, epsilon)

32 px images -> 8 x 8 latents -> 16 tokens of 2 x 2 patches. The global RNG is left as it was.
"""

from __future__ import annotations

from pathlib import Path

from tests.family_bases import T5_LENGTH, T5_WIDTH, seeded, tiny_t5_encoder, tiny_t5_tokenizer
from tests.text_components import tiny_vae

__all__ = ["PIXART_SCHEDULER", "T5_LENGTH", "write_tiny_pixart_folder"]

# PixArt-Sigma-XL-2-1024-MS's scheduler/scheduler_config.json settings that matter (DPM-Solver++ 2M, the DDPM
# linear betas of 1000 steps, epsilon prediction).
PIXART_SCHEDULER = dict(num_train_timesteps=1000, beta_schedule="linear", beta_start=0.0001, beta_end=0.02,
                        prediction_type="epsilon", algorithm_type="dpmsolver++", solver_order=2,
                        solver_type="midpoint", lower_order_final=True, timestep_spacing="linspace", steps_offset=0)


def write_tiny_pixart_folder(path: str | Path, seed: int = 0, sample_size: int = 8) -> Path:
    """Write a PixArtSigmaPipeline folder into ``path`` (model_index.json, transformer/, text_encoder/,
    tokenizer/, vae/, scheduler/); the pipeline loads it and samples 32 px images (``sample_size`` 8 latent
    pixels; the pipeline's resolution binning takes only 32, 64, 128 or 256: call it with
    ``use_resolution_binning=False``)."""
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_t5_tokenizer()
    transformer = seeded(seed, lambda: PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=16, sample_size=sample_size, patch_size=2, caption_channels=T5_WIDTH,
        use_additional_conditions=False, norm_num_groups=4))
    pipe = PixArtSigmaPipeline(
        tokenizer=tokenizer, text_encoder=tiny_t5_encoder(len(tokenizer), T5_WIDTH, seed + 3),
        vae=tiny_vae(seed, scaling_factor=0.13025, levels=3), transformer=transformer,
        scheduler=DPMSolverMultistepScheduler(**PIXART_SCHEDULER))
    pipe.save_pretrained(path)
    return path
