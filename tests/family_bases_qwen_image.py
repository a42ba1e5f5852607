"""A tiny random Qwen-Image base folder (QwenImagePipeline), in the real on-disk layout, built offline
from a seed with diffusers' and transformers' own classes (``QwenImagePipeline.from_pretrained(folder)``
loads it as it would the real base).

    write_tiny_qwen_image_folder(path)   transformer/ (QwenImageTransformer2DModel, 1 layer, 2 heads of 16),
                                         text_encoder/ (Qwen2_5_VLForConditionalGeneration: a 2-layer text
                                         model QWEN_WIDTH wide and a 1-block vision tower), tokenizer/ (a
                                         byte-level BPE Qwen2Tokenizer with the chat tokens), vae/
                                         (AutoencoderKLQwenImage, factor 4), scheduler/ (Qwen-Image's:
                                         dynamic shift, base/max shift 0.5/0.9 at 256/8192 tokens)

The tokenizer is trained offline with the ``tokenizers`` library on the pipeline's prompt template and the
test words, so that each of their words is one token: the template's system prefix is then 34 tokens, as
the real Qwen2 tokenizer makes it (QwenImagePipeline drops its first 34 hidden states). Sizes: 32 px
images -> 8 x 8 latents -> 16 tokens of 2 x 2 patches. The global RNG is left as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.family_bases import seeded
from tests.text_components import WORDS

QWEN_WIDTH = 32  # the Qwen2.5-VL text model's hidden size: the transformer's joint_attention_dim (3584 real)
QWEN_LENGTH = 16  # model.max_sequence_length the tests run (QwenImagePipeline's default 512, at most 1024)
CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen-Image's scheduler_config.json (published): shift 1 with dynamic shifting through these four values.
QWEN_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                      base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")


def tiny_qwen_tokenizer(words=WORDS):
    """A Qwen2Tokenizer (byte-level BPE, Qwen2's pre-tokenizer) that knows every word of the prompt template
    and of ``words`` as one token, every byte as a fallback, and the chat tokens as special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    text = TEMPLATE.replace("<|im_start|>", "\n").replace("<|im_end|>", "\n").format(" ".join(words))
    pieces = text.split() + [w.lower() for w in words] + list(words)
    corpus = [text, *pieces, " " + " ".join(pieces)]  # each word alone (a prompt's first) and after a space
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=5000, special_tokens=[CHAT_TOKENS[0]],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    model = bpe.get_vocab()
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(bpe.to_str())["model"]["merges"]]
    tok = Qwen2Tokenizer(vocab=model, merges=merges, model_max_length=32768)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True) for t in CHAT_TOKENS[1:]]})
    return tok


def tiny_qwen_vl(vocab_size: int, seed: int = 0):
    """A random Qwen2_5_VLForConditionalGeneration: the text model QWEN_WIDTH wide, 2 layers, 2 heads
    (1 key-value head) of 16 with mrope sections (2, 3, 3); a 1-block vision tower 16 wide."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=QWEN_WIDTH, intermediate_size=2 * QWEN_WIDTH,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0,
                         rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[2, 3, 3])),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=QWEN_WIDTH,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[0]),
        bos_token_id=0, eos_token_id=0, pad_token_id=0, image_token_id=vocab_size - 1, video_token_id=vocab_size - 1, vision_start_token_id=vocab_size - 1,
        vision_end_token_id=vocab_size - 1)
    return seeded(seed, lambda: Qwen2_5_VLForConditionalGeneration(config).eval())


def tiny_qwen_vae(seed: int = 0):
    """A random AutoencoderKLQwenImage: 16 latent channels, factor 4 (two downsamplings), base width 8, the
    real latents_mean / latents_std (its defaults)."""
    from diffusers import AutoencoderKLQwenImage

    return seeded(seed, lambda: AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1,
                                                       attn_scales=[], temperal_downsample=[False, True]))


def tiny_qwen_transformer(seed: int = 0, layers: int = 1):
    """A random QwenImageTransformer2DModel: 2 heads of 16, ``layers`` blocks, joint_attention_dim QWEN_WIDTH."""
    from diffusers import QwenImageTransformer2DModel

    return seeded(seed, lambda: QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=layers, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=QWEN_WIDTH, axes_dims_rope=(4, 6, 6)))


def write_tiny_qwen_image_folder(path: str | Path, seed: int = 0, layers: int = 1) -> Path:
    """Write a QwenImagePipeline folder into ``path`` (model_index.json, transformer/, text_encoder/,
    tokenizer/, vae/, scheduler/); ``QwenImagePipeline.from_pretrained`` loads it and samples 32 px images."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_qwen_tokenizer()
    pipe = QwenImagePipeline(
        transformer=tiny_qwen_transformer(seed, layers),
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER),
        vae=tiny_qwen_vae(seed + 1),
        text_encoder=tiny_qwen_vl(len(tokenizer), seed + 2),
        tokenizer=tokenizer,
    )
    pipe.save_pretrained(path)
    return path
