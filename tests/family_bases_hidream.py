"""A tiny random HiDream-I1 base folder (HiDreamImagePipeline's on-disk layout), built offline from a seed
with diffusers' and transformers' own classes: ``HiDreamImagePipeline.from_pretrained(folder)`` loads it.

    write_tiny_hidream_folder(path)   HiDreamImageTransformer2DModel (1 double-stream and 1 single-stream
                                      block, 4 routed experts, 2 active), CLIP-L and CLIP-G
                                      (CLIPTextModelWithProjection), T5EncoderModel, LlamaForCausalLM (2 layers),
                                      the Flux-style 16-channel AutoencoderKL (factor 4 here),
                                      FlowMatchEulerDiscreteScheduler(shift=3)

Sizes: the CLIPs are 8 and 16 wide (pooled: 24 = the transformer's text_emb_dim) with 128 positions (the
pipeline pads CLIP to min(max_sequence_length, 218) tokens, 128 by default: the real bases' CLIPs are long
ones); T5 is ``T5_WIDTH`` wide and Llama ``LLAMA_WIDTH`` (different, so that swapping them fails); the
transformer's llama_layers [0, 1] take Llama's two layers, one per block. Tokenizers: the CLIP BPE tokenizer
of tests/text_components.py, the T5 Unigram tokenizer of tests/family_bases.py and a byte-level BPE tokenizer
in Llama 3's form (``<|begin_of_text|>`` prepended by its post-processor, ``<|end_of_text|>`` also the pad,
as the pipeline sets it) made with the ``tokenizers`` library; T5's and Llama's take ``TOKENS`` tokens at most
(their model_max_length), so the pipeline's default 128 is their length. Tests pass ``LENGTH`` (24) as
max_sequence_length to keep the runs short.
"""

from __future__ import annotations

from pathlib import Path

from tests.family_bases import (FLUX_VAE, LATENT_CHANNELS, T5_WIDTH, clip_tokenizer, restore_clip_tokenizers, seeded,
                                tiny_t5_encoder, tiny_t5_tokenizer, tiny_vae16)
from tests.text_components import WORDS

LENGTH = 24  # max_sequence_length the tests pass (the pipeline's default is 128)
TOKENS = 128  # T5's and Llama's tokenizers' model_max_length; the CLIPs' positions
CLIP_L_WIDTH, CLIP_G_WIDTH = 8, 16
LLAMA_WIDTH = 24
LLAMA_LAYERS = 2
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
MAX_RESOLUTION = (16, 16)  # latent pixels: 64 tokens of 2 x 2 patches, what non-square latents are padded to


def tiny_llama_tokenizer(max_length: int = TOKENS):
    """A byte-level BPE tokenizer in Llama 3's form (no merges: one token a byte), as transformers'
    PreTrainedTokenizerFast: BOS prepended, EOS, model_max_length ``max_length``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from difftrain.models.text import bytes_to_unicode

    chars = list(dict.fromkeys(bytes_to_unicode().values()))
    vocab = {c: i for i, c in enumerate(chars)} | {BOS: len(chars), EOS: len(chars) + 1}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, vocab[BOS])])
    tok.add_special_tokens([BOS, EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS,
                                   model_max_length=max_length)


def tiny_llama(tokenizer, seed: int):
    """A random LlamaForCausalLM, ``LLAMA_WIDTH`` wide, ``LLAMA_LAYERS`` layers, 2 heads (1 key/value head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=LLAMA_WIDTH, intermediate_size=2 * LLAMA_WIDTH,
                         num_hidden_layers=LLAMA_LAYERS, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=2 * TOKENS, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return seeded(seed, lambda: LlamaForCausalLM(config))


def tiny_long_clip(vocab: dict[str, int], width: int, seed: int):
    """A random CLIPTextModelWithProjection with ``TOKENS`` positions (projection_dim = width)."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from difftrain.models.text import BOS as CLIP_BOS, EOS as CLIP_EOS

    config = CLIPTextConfig(vocab_size=len(vocab), hidden_size=width, intermediate_size=2 * width,
                            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=TOKENS,
                            projection_dim=width, bos_token_id=vocab[CLIP_BOS], eos_token_id=vocab[CLIP_EOS],
                            pad_token_id=vocab[CLIP_EOS])
    return seeded(seed, lambda: CLIPTextModelWithProjection(config))


def tiny_hidream_transformer(seed: int = 0):
    from diffusers import HiDreamImageTransformer2DModel

    return seeded(seed, lambda: HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, caption_channels=[T5_WIDTH, LLAMA_WIDTH],
        text_emb_dim=CLIP_L_WIDTH + CLIP_G_WIDTH, num_routed_experts=4, num_activated_experts=2,
        axes_dims_rope=(8, 4, 4), max_resolution=MAX_RESOLUTION, llama_layers=list(range(LLAMA_LAYERS))))


def write_tiny_hidream_folder(path: str | Path, seed: int = 0) -> Path:
    """Write a HiDreamImagePipeline folder into ``path`` (model_index.json, transformer/, vae/,
    text_encoder{,_2,_3,_4}/, tokenizer{,_2,_3,_4}/, scheduler/); ``HiDreamImagePipeline.from_pretrained`` loads
    it (its default_sample_size, 128 latent pixels, rescales every request to that area: tests set it to 8)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab = clip_tokenizer(path / "tokenizer")
    t5_tokenizer = tiny_t5_tokenizer(WORDS, TOKENS)
    llama_tokenizer = tiny_llama_tokenizer()
    pipe = HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=tiny_vae16(seed, **FLUX_VAE),
        text_encoder=tiny_long_clip(vocab, CLIP_L_WIDTH, seed + 1),
        tokenizer=tokenizer,
        text_encoder_2=tiny_long_clip(vocab, CLIP_G_WIDTH, seed + 2),
        tokenizer_2=tokenizer,
        text_encoder_3=tiny_t5_encoder(len(t5_tokenizer), T5_WIDTH, seed + 3),
        tokenizer_3=t5_tokenizer,
        text_encoder_4=tiny_llama(llama_tokenizer, seed + 4),
        tokenizer_4=llama_tokenizer,
        transformer=tiny_hidream_transformer(seed),
    )
    pipe.save_pretrained(path)
    restore_clip_tokenizers(path, "tokenizer", "tokenizer_2")
    return path
