"""Small random SDXL, SD3 and Flux base folders that keep the real families' proportions of work:
text encoders against denoiser by parameters (SDXL about 0.3: CLIP-L + CLIP-bigG against the UNet;
SD3 about 2.8: CLIP-L + CLIP-G + T5-XXL against the MMDiT; Flux about 0.4: CLIP-L + T5-XXL against
the transformer), built offline like tests/family_bases.py (the same tokenizers, the same classes,
wider and deeper), tiny ones of about the tests' size, and a "large" Flux: the proportioned one's text
encoders and VAE with a transformer of about 130M parameters (the host-memory comparison of
``bench/family_peer_speed.py --memory``: with and without it, the difference is the frozen base's). Their CLIP encoders take 77 tokens, as
the real ones do: diffusers' SD3 and Flux scripts tokenize CLIP prompts to 77 whatever the
tokenizer says. ``bench/family_peer_speed.py`` trains on them.

    write_base(family, size, path)     -> path; family in ("sdxl", "sd3", "flux"), size "tiny" or "proportioned"
                                          (or "large": flux only)
    parameter_counts(path)             -> {"denoiser": n, "text encoders": n, "vae": n, "ratio": text / denoiser}
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import family_bases as fb  # noqa: E402
from tests.text_components import tiny_vae, write_tiny_tokenizer  # noqa: E402

CLIP_TOKENS = 77  # the real CLIP encoders' positions; the peers' SD3 and Flux scripts pad CLIP prompts to it

# The real families' text-encoder / denoiser parameter ratios these folders aim at.
TARGET_RATIO = {"sdxl": 0.3, "sd3": 2.8, "flux": 0.4}


def _clip(vocab, width: int, layers: int, seed: int, projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from difftrain.models.text import BOS, EOS

    config = CLIPTextConfig(vocab_size=len(vocab), hidden_size=width, intermediate_size=4 * width,
                            num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=CLIP_TOKENS,
                            projection_dim=width, bos_token_id=vocab[BOS], eos_token_id=vocab[EOS],
                            pad_token_id=vocab[EOS])
    return fb.seeded(seed, lambda: (CLIPTextModelWithProjection if projection else CLIPTextModel)(config))


def _t5(vocab_size: int, width: int, layers: int, seed: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=vocab_size, d_model=width, d_kv=width // 4, d_ff=4 * width, num_layers=layers,
                      num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
                      pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return fb.seeded(seed, lambda: T5EncoderModel(config))


def write_sdxl(path: Path, tiny: bool = False, seed: int = 0) -> Path:
    """UNet (64, 128) channels, 2 blocks per level; CLIP-L 64 wide and CLIP-bigG 128 wide, 5 layers each
    (tiny: the tests' UNet, (8, 16) channels, 1 block; CLIPs 16 and 32 wide, 2 layers)."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    path.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab = fb.clip_tokenizer(path / "tokenizer")
    w1, w2, time_dim, layers = (16, 32, 8, 2) if tiny else (64, 128, 16, 5)
    unet = fb.seeded(seed, lambda: UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1 if tiny else 2,
        block_out_channels=(8, 16) if tiny else (64, 128), norm_num_groups=4 if tiny else 16, attention_head_dim=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=w1 + w2,
        addition_embed_type="text_time", addition_time_embed_dim=time_dim,
        projection_class_embeddings_input_dim=6 * time_dim + w2, use_linear_projection=True,
        transformer_layers_per_block=(1, 1)))
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       num_train_timesteps=1000, steps_offset=1, timestep_spacing="leading")
    pipe = StableDiffusionXLPipeline(
        vae=tiny_vae(seed), text_encoder=_clip(vocab, w1, layers, seed + 1, projection=False),
        text_encoder_2=_clip(vocab, w2, layers, seed + 2, projection=True), tokenizer=tokenizer, tokenizer_2=tokenizer,
        unet=unet, scheduler=scheduler)
    pipe.save_pretrained(path)
    fb.restore_clip_tokenizers(path, "tokenizer", "tokenizer_2")
    return path


def write_sd3(path: Path, tiny: bool = False, seed: int = 0) -> Path:
    """MMDiT 4 layers, 4 heads of 16; CLIP-L 32 and CLIP-G 64 wide; a T5 192 wide, 4 layers (the T5 is
    most of the text work, as T5-XXL is in SD3). Tiny: the tests' sizes (2 layers, 2 heads of 8; 8, 16, 32)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    path.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab = fb.clip_tokenizer(path / "tokenizer")
    t5_tokenizer = fb.tiny_t5_tokenizer()
    l_width, g_width, t5_width, t5_layers = (8, 16, 32, 2) if tiny else (32, 64, 192, 4)
    transformer = fb.seeded(seed, lambda: SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=fb.LATENT_CHANNELS, num_layers=2 if tiny else 4,
        attention_head_dim=8 if tiny else 16, num_attention_heads=2 if tiny else 4, joint_attention_dim=t5_width,
        caption_projection_dim=16 if tiny else 64,
        pooled_projection_dim=l_width + g_width, out_channels=fb.LATENT_CHANNELS, pos_embed_max_size=32))
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**fb.SD3_SCHEDULER),
        vae=fb.tiny_vae16(seed, **fb.SD3_VAE),
        text_encoder=_clip(vocab, l_width, 2, seed + 1, projection=True), tokenizer=tokenizer,
        text_encoder_2=_clip(vocab, g_width, 2, seed + 2, projection=True), tokenizer_2=tokenizer,
        text_encoder_3=_t5(len(t5_tokenizer), t5_width, t5_layers, seed + 3), tokenizer_3=t5_tokenizer)
    pipe.save_pretrained(path)
    fb.restore_clip_tokenizers(path, "tokenizer", "tokenizer_2")
    return path


# The large Flux transformer: 4 double + 11 single blocks, 10 heads of 64 (640 wide): 129M parameters.
LARGE_FLUX = {"num_layers": 4, "num_single_layers": 11, "attention_head_dim": 64, "num_attention_heads": 10,
              "axes_dims_rope": (16, 24, 24)}


def write_flux(path: Path, tiny: bool = False, seed: int = 0, large: bool = False) -> Path:
    """Flux transformer 2 double + 4 single blocks, 4 heads of 16; CLIP-L 32 wide; a T5 96 wide, 2 layers.
    Tiny: the tests' sizes (1 + 1 blocks, 2 heads of 8; CLIP 16, T5 32). Large: the same encoders and VAE,
    the transformer :data:`LARGE_FLUX`."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    path.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab = fb.clip_tokenizer(path / "tokenizer")
    t5_tokenizer = fb.tiny_t5_tokenizer()
    clip_width, t5_width = (16, 32) if tiny else (32, 96)
    shape = LARGE_FLUX if large else {
        "num_layers": 1 if tiny else 2, "num_single_layers": 1 if tiny else 4, "attention_head_dim": 8 if tiny else 16,
        "num_attention_heads": 2 if tiny else 4, "axes_dims_rope": (2, 2, 4) if tiny else (4, 6, 6)}
    transformer = fb.seeded(seed, lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=4 * fb.LATENT_CHANNELS, joint_attention_dim=t5_width,
        pooled_projection_dim=clip_width, guidance_embeds=True, **shape))
    pipe = FluxPipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**fb.FLUX_SCHEDULER),
        vae=fb.tiny_vae16(seed, **fb.FLUX_VAE),
        text_encoder=_clip(vocab, clip_width, 2, seed + 1, projection=False), tokenizer=tokenizer,
        text_encoder_2=_t5(len(t5_tokenizer), t5_width, 2, seed + 3), tokenizer_2=t5_tokenizer)
    pipe.save_pretrained(path)
    fb.restore_clip_tokenizers(path, "tokenizer")
    return path


WRITERS = {"sdxl": write_sdxl, "sd3": write_sd3, "flux": write_flux}


def write_base(family: str, size: str, path: Path) -> Path:
    """The ``size`` ("tiny", "proportioned", or for flux "large") base of ``family``, CLIP tokenizers 77
    tokens long."""
    if size == "large" and family != "flux":
        raise ValueError(f"size 'large' is a Flux base only, not {family}")
    if not (path / "model_index.json").is_file():
        WRITERS[family](path, tiny=size == "tiny", **({"large": True} if size == "large" else {}))
        for folder in path.glob("tokenizer*"):
            if (folder / "merges.txt").is_file():  # a CLIP tokenizer (T5's has no merges)
                write_tiny_tokenizer(folder, max_length=CLIP_TOKENS)
    return path


def parameter_counts(path: Path) -> dict:
    """Parameters of the folder's denoiser, text encoders (together) and VAE, from its safetensors headers."""
    from safetensors import safe_open

    def count(sub: str) -> int:
        n = 0
        for f in sorted((path / sub).glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                for key in st.keys():
                    n += _numel(st.get_slice(key).get_shape())  # a scalar (shape []) counts 1
        return n

    denoiser = count("unet") + count("transformer")
    text = sum(count(d.name) for d in path.iterdir() if d.is_dir() and d.name.startswith("text_encoder"))
    return {"denoiser": denoiser, "text encoders": text, "vae": count("vae"), "ratio": text / denoiser}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    import tempfile

    for family in WRITERS:
        with tempfile.TemporaryDirectory() as tmp:
            for size in ("tiny", "proportioned"):
                counts = parameter_counts(write_base(family, size, Path(tmp) / size))
                print(family, size, counts, "target", TARGET_RATIO[family])
