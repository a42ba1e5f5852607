"""A tiny random Qwen-Image-Edit base folder (QwenImageEditPipeline), in the real on-disk layout, built offline
from a seed with diffusers' and transformers' own classes (``QwenImageEditPipeline.from_pretrained(folder)``
loads it as it would the real base).

    write_tiny_qwen_image_edit_folder(path)   tests/family_bases_qwen_image's transformer/, vae/ and scheduler/,
                                              a tokenizer/ that also knows the vision tokens (<|vision_start|>,
                                              <|image_pad|>, <|vision_end|>, <|video_pad|>), a text_encoder/ whose config names
                                              their ids (its 1-block vision tower sees the reference image) and
                                              a processor/ (Qwen2VLProcessor: that tokenizer and transformers'
                                              PIL image processor Qwen2VLImageProcessorPil: the default
                                              Qwen2VLImageProcessor needs torchvision, not installed here)

The tokenizer is trained offline (``tiny_qwen_tokenizer``) on the edit pipeline's prompt template so that each
of its words is one token: the template's system prefix is then 64 tokens, as the real Qwen2 tokenizer makes it
(QwenImageEditPipeline drops its first 64 hidden states). The vision tower: patches of 14 px merged 2 x 2, so a
56 px reference image is 16 patches -> 4 image tokens. The global RNG is left as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.family_bases import seeded
from tests.family_bases_qwen_image import (
    QWEN_SCHEDULER,
    QWEN_WIDTH,
    tiny_qwen_tokenizer,
    tiny_qwen_transformer,
    tiny_qwen_vae,
)
from tests.text_components import WORDS

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")  # the real tokenizer's
EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the "
                 "image. Generate a new image that meets the user's requirements while maintaining consistency with "
                 "the original input where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                 "<|im_start|>assistant\n")  # QwenImageEditPipeline's, less the vision tokens (added ones)
VISION_PIXELS = (56 * 56, 112 * 112)  # the tiny processor's min_pixels, max_pixels: 4 to 16 image tokens


def tiny_qwen_edit_tokenizer(words=WORDS):
    """tiny_qwen_tokenizer trained on the edit template too, with the vision tokens as special tokens."""
    from tokenizers import AddedToken

    tok = tiny_qwen_tokenizer(tuple(words) + tuple(EDIT_TEMPLATE.replace("<|im_start|>", " ")
                                                   .replace("<|im_end|>", " ").format("").split()))
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True) for t in VISION_TOKENS]},
                           replace_extra_special_tokens=False)
    return tok


def tiny_qwen_edit_vl(tokenizer, seed: int = 0):
    """A random Qwen2_5_VLForConditionalGeneration as tests/family_bases_qwen_image's tiny_qwen_vl, its image and
    vision ids those of ``tokenizer``'s vision tokens."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    start, pad, end, video = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=QWEN_WIDTH, intermediate_size=2 * QWEN_WIDTH,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0,
                         rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[2, 3, 3])),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=QWEN_WIDTH,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[0]),
        bos_token_id=0, eos_token_id=0, pad_token_id=0, image_token_id=pad, video_token_id=video,
        vision_start_token_id=start, vision_end_token_id=end)
    return seeded(seed, lambda: Qwen2_5_VLForConditionalGeneration(config).eval())


def tiny_qwen_image_processor():
    """transformers' PIL Qwen2VLImageProcessorPil (14 px patches, merge 2, VISION_PIXELS)."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=VISION_PIXELS[0], max_pixels=VISION_PIXELS[1])


def tiny_qwen_processor(tokenizer, images=None):
    """A Qwen2VLProcessor of ``tokenizer`` and ``images`` (default tiny_qwen_image_processor()), without a video
    processor. transformers' ProcessorMixin checks every part's class, and the video processor's base class
    (VideoProcessorMixin) is only defined with torchvision, which is not installed here: its check of the absent
    video processor is skipped (the class check alone; the processor's text and image work is transformers')."""
    from transformers import Qwen2VLProcessor

    class NoVideoQwen2VLProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

        def save_pretrained(self, save_directory, **kwargs):  # its parts' files (ProcessorMixin's saves the video's)
            self.tokenizer.save_pretrained(save_directory)
            self.image_processor.save_pretrained(save_directory)

    return NoVideoQwen2VLProcessor(image_processor=images or tiny_qwen_image_processor(), tokenizer=tokenizer)


def write_tiny_qwen_image_edit_folder(path: str | Path, seed: int = 0, layers: int = 1) -> Path:
    """Write a QwenImageEditPipeline folder into ``path`` (model_index.json, transformer/, text_encoder/,
    tokenizer/, processor/, vae/, scheduler/); ``QwenImageEditPipeline.from_pretrained`` loads it."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_qwen_edit_tokenizer()
    pipe = QwenImageEditPipeline(
        transformer=tiny_qwen_transformer(seed, layers),
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER),
        vae=tiny_qwen_vae(seed + 1),
        text_encoder=tiny_qwen_edit_vl(tokenizer, seed + 2),
        tokenizer=tokenizer,
        processor=tiny_qwen_processor(tokenizer),
    )
    pipe.save_pretrained(path)
    index = json.loads((path / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]  # the real folder's entry (not the test subclass)
    (path / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return path


def write_tiny_qwen_image_edit_plus_folder(path: str | Path, seed: int = 0, layers: int = 1) -> Path:
    """write_tiny_qwen_image_edit_folder's folder with model_index.json naming QwenImageEditPlusPipeline (the same
    parts: Qwen-Image-Edit-2509's folder has the same classes)."""
    path = write_tiny_qwen_image_edit_folder(path, seed, layers)
    index = json.loads((path / "model_index.json").read_text())
    index["_class_name"] = "QwenImageEditPlusPipeline"
    (path / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return path


def load_tiny_qwen_image_edit_pipeline(path: str | Path, **parts):
    """The folder's pipeline (QwenImageEditPipeline or QwenImageEditPlusPipeline).from_pretrained(path) with its
    processor built from the folder's processor/ (tiny_qwen_processor: transformers' Qwen2VLProcessor
    .from_pretrained needs torchvision, not installed)."""
    import diffusers
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessorPil

    path = Path(path)
    processor = tiny_qwen_processor(Qwen2Tokenizer.from_pretrained(path / "processor"),
                                    Qwen2VLImageProcessorPil.from_pretrained(path / "processor"))
    cls = getattr(diffusers, json.loads((path / "model_index.json").read_text())["_class_name"])
    return cls.from_pretrained(path, processor=processor, **parts)
