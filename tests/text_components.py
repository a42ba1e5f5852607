"""Builders of tiny, randomly initialised frozen components in their real on-disk layouts, for
tests: a CLIP BPE tokenizer, a CLIP text model, an AutoencoderKL, a Stable Diffusion folder.

Everything is made offline in well under a second or two each, from a seed (the global torch
RNG is left as it was). Sizes are the smallest that keep the real code paths.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from difftrain.models.text import BOS, EOS, TINY_CLIP_WORDS, word_vocabulary

# Words of the built-in captions, and a few more; any other word is spelled out by character.
WORDS = tuple(TINY_CLIP_WORDS)
TEXT_HIDDEN = 32  # hidden size D of the tiny text encoder (the UNet's cross_attention_dim)
TEXT_LENGTH = 16  # max_position_embeddings: tokens per caption


def write_tiny_tokenizer(path: str | Path, words=WORDS, max_length: int = TEXT_LENGTH) -> Path:
    """Write a CLIP BPE tokenizer (vocab.json, merges.txt, tokenizer_config.json) into ``path``
    that knows each of ``words`` as one token and every byte as a fallback."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab, merges = word_vocabulary(list(words))
    (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    config = {"tokenizer_class": "CLIPTokenizer", "model_max_length": max_length, "bos_token": BOS,
              "eos_token": EOS, "unk_token": EOS, "pad_token": EOS}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def tiny_text_model(vocab_size: int, hidden: int = TEXT_HIDDEN, seed: int = 0, bos: int = 0, eos: int = 1):
    """A random CLIPTextModel: ``hidden`` wide, 2 layers, 2 heads, ``TEXT_LENGTH`` positions."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=TEXT_LENGTH,
                            bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return CLIPTextModel(config)


def write_tiny_text_encoder(path: str | Path, seed: int = 0, hidden: int = TEXT_HIDDEN) -> Path:
    """Write a random CLIP text model (config.json, model.safetensors) and its tokenizer into
    ``path``: the layout ``TextEncoder.from_path`` reads."""
    path = write_tiny_tokenizer(path)
    vocab = json.loads((path / "vocab.json").read_text())
    tiny_text_model(len(vocab), hidden, seed, vocab[BOS], vocab[EOS]).save_pretrained(path)
    return path


def tiny_vae(seed: int = 0, scaling_factor: float = 0.5, levels: int = 2):
    """A random AutoencoderKL: RGB, 4 latent channels, factor ``2 ** (levels - 1)``, 8/16 channels."""
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=4,
            down_block_types=("DownEncoderBlock2D",) * levels, up_block_types=("UpDecoderBlock2D",) * levels,
            block_out_channels=tuple(8 * 2 ** min(i, 1) for i in range(levels)), sample_size=16,
            scaling_factor=scaling_factor,
        )


def write_tiny_vae(path: str | Path, seed: int = 0, scaling_factor: float = 0.5, levels: int = 2) -> Path:
    """Write a random AutoencoderKL (config.json with its scaling_factor, weights) into ``path``."""
    path = Path(path)
    tiny_vae(seed, scaling_factor, levels).save_pretrained(path)
    return path


def tiny_condition_unet(cross_attention_dim: int = TEXT_HIDDEN, seed: int = 0, sample_size: int = 8,
                        channels: tuple[int, int] = (8, 16)):
    """A random UNet2DConditionModel on 4-channel latents with cross-attention of that width."""
    from diffusers import UNet2DConditionModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return UNet2DConditionModel(
            sample_size=sample_size, in_channels=4, out_channels=4, layers_per_block=1,
            block_out_channels=channels, norm_num_groups=4, attention_head_dim=4,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=cross_attention_dim,
        )


def write_tiny_sd_folder(path: str | Path, seed: int = 0, unet_channels: tuple[int, int] = (8, 16)) -> Path:
    """Write a Stable-Diffusion-style pipeline folder into ``path``: model_index.json, vae/,
    text_encoder/, tokenizer/, scheduler/ (DDPMScheduler), unet/ (cross_attention_dim = the
    text encoder's width, ``unet_channels`` its blocks' widths); ``StableDiffusionPipeline.from_pretrained(path)``
    loads it."""
    from diffusers import DDPMScheduler, StableDiffusionPipeline
    from transformers import CLIPTokenizer

    path = Path(path)
    tokenizer_dir = write_tiny_tokenizer(path / "tokenizer")
    vocab = json.loads((tokenizer_dir / "vocab.json").read_text())
    pipe = StableDiffusionPipeline(
        vae=tiny_vae(seed),
        text_encoder=tiny_text_model(len(vocab), TEXT_HIDDEN, seed, vocab[BOS], vocab[EOS]),
        tokenizer=CLIPTokenizer.from_pretrained(str(tokenizer_dir)),
        unet=tiny_condition_unet(TEXT_HIDDEN, seed, channels=unet_channels),
        scheduler=DDPMScheduler(num_train_timesteps=1000, steps_offset=1, clip_sample=False),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(path)
    for f in (path / "tokenizer").iterdir():  # Stable Diffusion's own layout: vocab.json and merges.txt
        f.unlink()
    write_tiny_tokenizer(path / "tokenizer")
    return path


def write_tiny_clip_model(path: str | Path, seed: int = 0, image_size: int = 32) -> Path:
    """Write a random CLIPModel (text and vision towers, 32 wide, 2 layers) with the tokenizer of
    :func:`write_tiny_tokenizer` into ``path``: what ``evaluation.clip_model`` names."""
    from transformers import CLIPConfig, CLIPModel

    path = write_tiny_tokenizer(path)
    vocab = json.loads((path / "vocab.json").read_text())
    text = dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=TEXT_LENGTH, bos_token_id=vocab[BOS], eos_token_id=vocab[EOS],
                pad_token_id=vocab[EOS])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=image_size, patch_size=8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(path)
    return path


def assert_one_line_error(load, path: str, *needles: str) -> None:
    """``load(path)`` raises a ValueError of one line that names ``path`` and holds each of ``needles``."""
    import pytest

    with pytest.raises(ValueError) as info:
        load(path)
    message = str(info.value)
    assert "\n" not in message and path in message, message
    for needle in needles:
        assert needle in message, message
