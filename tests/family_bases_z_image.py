"""A tiny random Z-Image base folder (ZImagePipeline's on-disk layout), built offline from a seed with
diffusers' and transformers' own classes: ``ZImagePipeline.from_pretrained(folder)`` loads it as it would
Z-Image-Turbo.

    write_tiny_z_image_folder(path)   ZImageTransformer2DModel (2 layers, 1 refiner layer each, 32 wide),
                                      Qwen3Model (2 layers, 32 wide), a Qwen-style byte-level BPE tokenizer
                                      with a chat template (made with the ``tokenizers`` library), the
                                      16-channel AutoencoderKL of tests/family_bases.py (factor 4),
                                      FlowMatchEulerDiscreteScheduler(shift=3) as Z-Image-Turbo's

The tokenizer knows the words of the built-in captions (tests/text_components.WORDS) as single tokens and
every byte as a fallback, the special tokens Qwen's chat template uses (``<|im_start|>``, ``<|im_end|>``,
``<|endoftext|>`` the pad token, ``<think>``, ``</think>``), and ``model_max_length`` ``QWEN_LENGTH``.
Its chat template is Qwen3's for one user message: ``<|im_start|>user\\n{content}<|im_end|>\\n``, then with
``add_generation_prompt`` ``<|im_start|>assistant\\n``, followed by an empty think block
``<think>\\n\\n</think>\\n\\n`` only when ``enable_thinking`` is false (ZImagePipeline passes true: none).
"""

from __future__ import annotations

from pathlib import Path

from tests.family_bases import LATENT_CHANNELS, seeded, tiny_vae16
from tests.text_components import WORDS

QWEN_LENGTH = 48  # the tiny tokenizer's model_max_length: max_sequence_length's default min(512, 48)
QWEN_WIDTH = 32  # the Qwen3 hidden size: the transformer's cap_feat_dim (2560 in Z-Image-Turbo)
Z_IMAGE_VAE = dict(scaling_factor=0.3611, shift_factor=0.1159)  # Z-Image uses the Flux VAE (its config values)
Z_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


def write_qwen_tokenizer(path: str | Path, words=WORDS, max_length: int = QWEN_LENGTH) -> Path:
    """A Qwen2Tokenizer folder (tokenizer.json, tokenizer_config.json with the chat template): byte-level BPE
    that knows each of ``words`` (with and without a leading space) as one token, every byte as a fallback,
    and :data:`SPECIALS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2Tokenizer

    from difftrain.models.text import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    space = bytes_to_unicode()[ord(" ")]
    vocab = {c: i for i, c in enumerate(byte_chars)}
    merges: list[tuple[str, str]] = []
    for word in dict.fromkeys(p for w in words for p in (w.lower(), space + w.lower())):
        for i in range(2, len(word) + 1):  # merged left to right: the word's prefixes, then the word
            if word[:i] not in vocab:
                merges.append((word[:i - 1], word[i - 1]))
                vocab[word[:i]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    qwen = Qwen2Tokenizer(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                          unk_token=None, bos_token=None, model_max_length=max_length,
                          additional_special_tokens=list(SPECIALS[1:]))
    qwen.chat_template = CHAT_TEMPLATE
    path = Path(path)
    qwen.save_pretrained(str(path))
    return path


def write_tiny_z_image_folder(path: str | Path, seed: int = 0) -> Path:
    """Write a ZImagePipeline folder into ``path`` (model_index.json, transformer/, vae/, text_encoder/
    (Qwen3Model), tokenizer/, scheduler/); ``ZImagePipeline.from_pretrained`` loads it and samples 32 px
    images (8 x 8 latents: 16 tokens of 2 x 2 patches)."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(write_qwen_tokenizer(path / "_tokenizer")))
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=QWEN_WIDTH, intermediate_size=2 * QWEN_WIDTH,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    text_encoder = seeded(seed + 1, lambda: Qwen3Model(config))
    transformer = seeded(seed, lambda: ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=LATENT_CHANNELS, dim=32, n_layers=2,
        n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=QWEN_WIDTH, axes_dims=[4, 6, 6],
        axes_lens=[256, 32, 32]))
    pipe = ZImagePipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**Z_IMAGE_SCHEDULER),
                          vae=tiny_vae16(seed, **Z_IMAGE_VAE), text_encoder=text_encoder, tokenizer=tokenizer)
    pipe.save_pretrained(path)
    for f in (path / "_tokenizer").iterdir():
        f.unlink()
    (path / "_tokenizer").rmdir()
    return path
