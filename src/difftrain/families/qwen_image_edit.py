"""Qwen-Image-Edit (QwenImageEditPipeline): Qwen-Image's transformer editing a reference image, which it sees
twice: through the Qwen2.5-VL encoder's vision tower (in the prompt) and as VAE latents packed after the
target's tokens. Everything not listed is Qwen-Image's (qwen_image.py: the VAE and its per-channel statistics,
2x2 packing, t / 1000, velocity eps - x0, uniform unshifted training t, the dynamic-shift sampling grid, true CFG
with the per-token norm rescale, the LoRA targets and file format).

Facts, checked in the installed diffusers 0.42 (pipeline_qwenimage_edit.py, transformer_qwenimage.py) and
transformers 5 (processing_qwen2_vl.py, image_processing_pil_qwen2_vl.py):

Reference size (``__call__``): the reference image is resized (VaeImageProcessor.resize: PIL, Lanczos) to
  ``calculate_dimensions(1024 * 1024, width / height)``: the 1024 x 1024 area at the image's aspect ratio, each
  side rounded to a multiple of 32 (:func:`reference_size`); that ONE resized image is what the vision tower
  sees and what the VAE encodes. The target's size defaults to the same.
Prompts -> conditioning (``_get_qwen_prompt_embeds``):
  text = EDIT_TEMPLATE.format(prompt): a system line asking to describe the input image and how the
         instruction alters it, then "<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>" + prompt +
         "<|im_end|>\\n<|im_start|>assistant\\n";
  processor = Qwen2VLProcessor(text, images, padding=True): its image processor (Qwen2VLImageProcessor) resizes
         the image once more to multiples of 28 within [min_pixels, max_pixels] (smart_resize), cuts 14 px patches
         and gives pixel_values (patches, 3 * 2 * 14 * 14) and image_grid_thw (1, h/14, w/14) per image; the
         processor then writes ``<|image_pad|>`` grid_t * grid_h * grid_w / merge_size ** 2 times (one token per
         2 x 2 merged patch); no truncation;
  hidden = Qwen2_5_VLForConditionalGeneration(input_ids, attention_mask, pixel_values, image_grid_thw,
           output_hidden_states=True).hidden_states[-1]: the image tokens' states come from the vision tower
           (its merged patch embeddings put in their places) and the language model's 3-D (mrope) positions;
  each row's states where the mask is 1, less the first DROP = 64 (prompt_template_encode_start_idx: the system
  part and "<|im_start|>user\\n", everything before <|vision_start|>): so the vision tokens' states (the
  vision_start, the image's tokens, vision_end), the prompt's and the 5 closing template tokens remain;
  right-padded with zeros to the batch's longest and a mask. max_sequence_length is NOT applied by this
  pipeline. Here (:class:`QwenEditPromptEncoder`) each row is padded to V + L: V the vision tokens of the
  batch's reference size (every row of a batch has one size), L = ``model.max_sequence_length`` (0: 512) for
  the prompt and closing tokens (a longer prompt is cut there); the transformer masks the padding and its
  text RoPE positions do not depend on the length (qwen_image.py), so the outputs are the pipeline's.
  The negative prompt (true CFG) is encoded WITH the same image (the pipeline's ``encode_prompt(image=
  prompt_image, prompt=negative_prompt)``): the null condition of this family is ``encode_edit([""], image)``.
  The processor's image class: transformers' Qwen2VLImageProcessorPil (PIL; the default Qwen2VLImageProcessor
  needs torchvision, and transformers' Qwen2VLProcessor class cannot even be built without it, its video
  processor's class being torchvision's). difftrain does the processor's two steps itself (the image processor
  of the base's ``processor/`` folder, then the image token written out and the tokenizer of ``processor/``),
  which the tests check against the pipeline's processor call.
Reference latents (``prepare_latents`` / ``_encode_vae_image``): the VAE's mode (argmax: the mean), (z -
  latents_mean) / latents_std as the targets, packed 2x2 (``flux.pack``) and appended after the target's tokens;
  ``img_shapes`` per sample is [(1, h/2, w/2), (1, h'/2, w'/2)]: the target's grid then the reference's (the
  transformer's RoPE gives each image its own centred grid, frame index 0 and 1); the output is cut to the
  target's tokens (``noise_pred[:, : latents.size(1)]``): no loss on the reference's.
Training: the pipeline's; no diffusers training script for the edit model (0.42). difftrain trains on
  (reference, target, instruction) pairs (``data.references``), each pair resized and cropped together to the
  target's bucket, so a training reference has the target's size (the pipeline's ~1 MP reference is the
  target's size too when the target is the default size). The prompt is encoded with its reference
  (``QwenImageEditFamily.edit_condition``, called by the step, validation and ``sample`` through
  ``Family.edit_condition``). In training, with ``text.cache`` on or auto (the default), once, before the first
  step, by the pair cache (``data/pair_cache.py``): each pair's caption and the empty prompt (caption dropout's
  row: the pipeline's negative is encoded with the image too), each with the reference file's pixels as the
  training item carries them (cropped to its target's bucket, mirrored with it: both views with
  ``data.random_flip``), keyed by the caption and the reference file's content; the encoder is then released
  and never loaded during training (``estimate`` counts it so: 15.06 GiB for the preset at 1024 px, against
  30.51 GiB with it resident). With ``text.cache = 'off'`` the encoder is loaded for the run and encodes each
  batch at its step; the training data then holds the references as cached VAE moments only, so the vision
  tower sees the reference's latent mean decoded by the VAE (an 8-bit image of it). Validation and ``sample``
  give it the reference file's pixels, as the pipeline does (with the cache: entries keyed by those pixels).
Guidance (true CFG, qwen_image.py's rescale): the negative is the empty prompt WITH the row's image, so it is
  per row: at sampling the condition carries both the prompt's states and the empty prompt's
  (``negative_embeds``, ``negative_mask``) and the null condition is ``{"null_prompt": 1}``, which selects them
  (:class:`QwenImageEditDenoiser`); ``generation.sampling.guided_network`` merges it into each row's condition.
Qwen-Image-Edit-2509 (QwenImageEditPlusPipeline), one reference or several (``qwen-image-edit-plus``): the template
  has no vision tokens, the pipeline writes "Picture 1: <|vision_start|><|image_pad|><|vision_end|>" before the prompt
  (the 64 dropped tokens are the same system part), and the image the vision tower sees is resized (Lanczos) to
  ``calculate_dimensions(384 * 384, ratio)`` (CONDITION_IMAGE_SIZE) while the VAE's is at 1024 x 1024 pixels'
  area (VAE_IMAGE_SIZE: difftrain's reference at the target's size); the transformer call is the same. The Plus
  pipeline takes several images and batch 1; difftrain R per sample (``data.reference_column`` naming a list, as
  many per image; at most MAX_REFERENCES) and any batch: "Picture i: <image i>" for each before the prompt, each
  image's latents packed after the target's in order (condition keys "reference", "reference_2", ...; img_shapes
  the target's then each reference's). Validation grids take one reference per row (several: not yet).
Known base (tools/bases/qwen-image-edit, for ``estimate --base qwen-image-edit``): Qwen-Image's files (the same
  20.4B transformer config, VAE, Qwen2.5-VL-7B and scheduler, as qwen_image.py remembers them) with
  model_index.json naming QwenImageEditPipeline and its processor.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor

from difftrain.families import register
from difftrain.families.base import Condition, load_part, read_json, require_keys
from difftrain.families.flux import pack, unpack
from difftrain.families.qwen_image import (
    KEYS,
    QwenImageDenoiser,
    QwenImageFamily,
    QwenPromptEncoder,
    chat_prompts,
    prompt_states,
)
from difftrain.models.text import files_digest, first_line
from difftrain.runtime.device import to_device_async

EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the "
                 "image. Generate a new image that meets the user's requirements while maintaining consistency with "
                 "the original input where appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|>"
                 "<|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n")  # QwenImageEditPipeline.prompt_template_encode
EDIT_DROP = 64  # prompt_template_encode_start_idx: the template's tokens before <|vision_start|>, dropped
IMAGE_PAD = "<|image_pad|>"
REFERENCE = "reference"  # the condition key of the reference latents (B, 16, h', w')
NULL_FLAG = "null_prompt"  # (B,) 1: the row's negative states (negative_embeds / negative_mask) in place of its prompt's
REFERENCE_AREA = 1024 * 1024  # the pipeline's calculate_dimensions target area
REFERENCE_MULTIPLE = 32  # ... and its rounding of each side
# QwenImageEditPlusPipeline's: the template without the vision tokens, each image's before the prompt as
# "Picture i: ...", and the image the vision tower sees resized to 384 x 384 pixels' area (the VAE's: 1024 x 1024)
PLUS_TEMPLATE = EDIT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
CONDITION_AREA = 384 * 384
MAX_REFERENCES = 8  # the Plus family's references per sample at most (the latent cache's bound on them)
# The vision tokens of a 1024 px reference in the prompt (smart_resize: 1036 x 1036, 37 x 37 merged 28 px patches)
# and <|vision_start|>, <|vision_end|>: what estimate counts
VISION_TOKENS_1024 = round(1024 / 28) ** 2 + 2


def reference_keys(count: int) -> list[str]:
    """The condition keys of ``count`` references' latents, in order: "reference", "reference_2", ..."""
    return [REFERENCE] + [f"{REFERENCE}_{i}" for i in range(2, count + 1)]


def reference_size(width: int, height: int, area: int = REFERENCE_AREA) -> tuple[int, int]:
    """(width, height) the pipeline resizes a ``width`` x ``height`` reference to: ``area`` pixels at its aspect
    ratio, each side rounded to a multiple of 32 (QwenImageEditPipeline's ``calculate_dimensions``)."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    h = w / ratio
    return round(w / REFERENCE_MULTIPLE) * REFERENCE_MULTIPLE, round(h / REFERENCE_MULTIPLE) * REFERENCE_MULTIPLE


def vision_inputs(image_processor, images: list) -> tuple[Tensor, Tensor]:
    """(pixel_values (patches, 3 * t * p * p), image_grid_thw (B, 3) long) of B PIL images, as the processor's
    image processor gives them (its smart resize to multiples of 28, 14 px patches)."""
    out = image_processor(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def image_prompts(captions: list[str], grid: Tensor, merge: int, template: str = EDIT_TEMPLATE, prefix: str = ""
                  ) -> list[str]:
    """Each caption after ``prefix`` in ``template`` with each ``<|image_pad|>`` written out once per merged patch
    of its image, in order: grid (B R, 3) (t, h, w) patches of the B rows' R images each, ``merge`` ** 2 of them
    per token (Qwen2VLProcessor's replace_image_token, image by image)."""
    counts = (grid.prod(dim=-1) // merge ** 2).tolist()  # a host read of B R small counts
    texts = chat_prompts([prefix + c for c in captions], template)
    per_row = len(counts) // max(1, len(texts))
    out = []
    for b, text in enumerate(texts):  # the row's pads, in order: its images' counts (the first ``per_row`` pads)
        head, *pads = text.split(IMAGE_PAD, per_row)
        out.append(head + "".join(IMAGE_PAD * n + rest for n, rest in zip(counts[b * per_row:(b + 1) * per_row], pads)))
    return out


def resized(images: list, area: int | None) -> list:
    """PIL images resized (Lanczos: VaeImageProcessor.resize) to :func:`reference_size` of ``area``; None: as
    they are."""
    if area is None:
        return images
    return [img.resize(reference_size(*img.size, area), resample=Image.LANCZOS) for img in images]


def image_processor(folder: Path, cls):
    """The image processor ``cls`` of ``folder/processor`` (its preprocessor_config.json: sizes, mean, std, patch
    and merge sizes); one ValueError naming the folder when it is missing or unreadable."""
    config = folder / "processor" / "preprocessor_config.json"
    read_json(config, f"base {folder}")  # one line when missing or not JSON
    try:
        return cls.from_pretrained(str(folder / "processor"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{folder}: cannot load the Qwen2-VL image processor in processor/: {first_line(e)}") from None


class QwenEditPromptEncoder(QwenPromptEncoder):
    """The Qwen2.5-VL encoder of a Qwen-Image-Edit folder, frozen, with its vision tower and the processor's
    image processor and tokenizer (``processor/``): ``encode_edit(captions, images, device) ->
    {"prompt_embeds": (B, V + L, 3584), "prompt_mask": (B, V + L)}`` as QwenImageEditPipeline's
    ``_get_qwen_prompt_embeds(captions, images)`` (V: the vision tokens of the batch's image size, L:
    ``model.max_sequence_length``, 0: 512). Captions alone cannot be encoded: :meth:`encode` refuses."""

    template = EDIT_TEMPLATE  # the pipeline's prompt_template_encode
    prefix = ""  # what the pipeline writes before each prompt (the Plus pipeline's "Picture 1: ..." and image)
    condition_area: int | None = None  # the Plus pipeline's area of the image the vision tower sees (None: as given)

    def __init__(self, folder: Path, max_sequence_length: int = 0, deferred: bool = False):
        super().__init__(folder, max_sequence_length, deferred)
        from transformers import (  # optional ([text])
            Qwen2Tokenizer,
            Qwen2VLImageProcessorPil,
        )

        # the pipeline tokenizes with its processor's tokenizer (processor/), which knows the vision tokens
        self.tokenizer = load_part(folder, "processor", Qwen2Tokenizer, "Qwen2-VL processor's tokenizer")
        self.image_processor = image_processor(folder, Qwen2VLImageProcessorPil)
        self.merge = int(self.image_processor.merge_size)
        self.digest = files_digest([folder / "text_encoder"], [folder / "processor"], self._extra().encode())

    def _extra(self) -> str:
        return f"qwen_edit_length={self.length}"

    def picture_prefix(self, count: int) -> str:
        """What the pipeline writes before each prompt for ``count`` images: the Plus pipeline's "Picture i: ..."
        each (:attr:`prefix` is the one image's), nothing else (the Edit template holds its one image's tokens)."""
        if count != 1 and not self.prefix:
            raise ValueError(f"the Qwen-Image-Edit prompt template takes one reference image, got {count} "
                             "(several: the qwen-image-edit-plus family)")
        return "".join(PICTURE.format(i + 1) for i in range(count)) if self.prefix else ""

    def vision_part(self, count: int = 1) -> str:
        """The text the pipeline keeps before each prompt (after the dropped template): the prefix of ``count``
        images and the template's vision tokens, ``<|image_pad|>`` once per image."""
        start = self.template.index("<|vision_start|>") if "<|vision_start|>" in self.template else None
        return self.picture_prefix(count) + (self.template[start:self.template.index("{}")] if start is not None else "")

    def encode_part(self, name: str, captions: list[str]) -> dict[str, Tensor]:
        raise ValueError(f"the Qwen-Image-Edit base {self.source} encodes a prompt with its reference image "
                         "(encode_edit): captions alone are not its condition")

    @torch.no_grad()
    def encode_edit(self, captions: list[str], images: list, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """``{"prompt_embeds": (B, V + L, D), "prompt_mask": (B, V + L)}`` float32 on ``device`` of B captions,
        each with its reference image (B PIL images of one size: V their vision tokens + 2), or with its R reference
        images (B lists of R PIL images, the i-th of every row of one size: the Plus family's "Picture i")."""
        if len(images) != len(captions):
            raise ValueError(f"Qwen-Image-Edit: {len(captions)} prompts and {len(images)} reference images")
        rows = [list(row) if isinstance(row, (list, tuple)) else [row] for row in images]
        count = len(rows[0])
        if any(len(row) != count for row in rows) or not count:
            raise ValueError("Qwen-Image-Edit: every prompt of one batch takes as many reference images")
        model = self.qwen
        pixels, grid = vision_inputs(self.image_processor, resized([img for row in rows for img in row],
                                                                   self.condition_area))
        if (grid.view(len(rows), count, 3) != grid.view(len(rows), count, 3)[:1]).any():
            raise ValueError("Qwen-Image-Edit: the reference images of one batch must have one size")
        tokens = self.tokenizer(image_prompts(captions, grid, self.merge, self.template, self.picture_prefix(count)),
                                padding=True, return_tensors="pt")
        ids, mask = to_device_async(tokens.input_ids, model.device), to_device_async(tokens.attention_mask, model.device)
        out = model(input_ids=ids, attention_mask=mask, pixel_values=pixels.to(model.device, model.dtype),
                    image_grid_thw=grid.to(model.device), output_hidden_states=True, logits_to_keep=1)
        # the tokens kept before the prompt's: <|vision_start|>, the image's, <|vision_end|> (and the Plus prefix's)
        vision = (int(grid[:count].prod(dim=-1).sum()) // self.merge ** 2
                  + len(self.tokenizer(self.vision_part(count)).input_ids) - count)
        states, kept = prompt_states(out.hidden_states[-1], mask, EDIT_DROP, vision + self.length)
        return {"prompt_embeds": states.float().to(device), "prompt_mask": kept.to(device)}

    def training_rows(self, captions, device: torch.device | str) -> None:
        """None: a live encoder has no cached rows (``data.pair_cache.CachedPairEncoder`` has): the family encodes
        each training row with its reference at each step."""
        return None


def pil_images(pixels: Tensor) -> list:
    """B PIL RGB images of (B, 3, H, W) pixels in [-1, 1] (8 bits: an image read from a file comes back as it was)."""
    values = ((pixels.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return [Image.fromarray(v.permute(1, 2, 0).numpy()) for v in values]


class QwenEditPlusPromptEncoder(QwenEditPromptEncoder):
    """QwenImageEditPlusPipeline's prompt encoder with one reference: PLUS_TEMPLATE, "Picture 1: " and the image's
    vision tokens before the prompt, the image the vision tower sees resized to CONDITION_AREA pixels at its aspect
    ratio (Lanczos) first."""

    template = PLUS_TEMPLATE
    prefix = PICTURE.format(1)
    condition_area = CONDITION_AREA


class QwenImageEditDenoiser(QwenImageDenoiser):
    """``net(x (B, 16, h, w), t (B,) = 1000 t, cond) -> (B, 16, h, w)``: QwenImageDenoiser with cond's
    ``"reference"`` (B, 16, h', w') latents packed after the target's tokens, img_shapes [(1, h/2, w/2),
    (1, h'/2, w'/2)] per sample and the output cut to the target's tokens, as QwenImageEditPipeline calls the
    transformer. Without a ``"reference"`` key: Qwen-Image's call."""

    family = "qwen-image-edit"

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        if not isinstance(cond, dict) or "prompt_embeds" not in cond:  # a prompt without its reference image
            raise ValueError(f"the {self.family} model edits a reference image: its prompts are encoded with it, and "
                             "this use gives none (evaluation on captions alone is not supported for an edit model; "
                             "DreamBooth's class images are made from the instance pairs' references)")
        if NULL_FLAG in cond:  # guidance's unconditional rows: each row's negative states (QwenImageEditFamily)
            use = (cond[NULL_FLAG] > 0.5).view(-1, 1)
            cond = cond | {"prompt_embeds": torch.where(use[..., None], cond["negative_embeds"], cond["prompt_embeds"]),
                           "prompt_mask": torch.where(use, cond["negative_mask"], cond["prompt_mask"])}
        if REFERENCE not in cond:
            return super().forward(x, t, cond)
        b, _, h, w = x.shape
        require_keys(cond, KEYS + (REFERENCE,), b, self.family)
        self.check_latent_size(h, w)
        refs = [cond[k] for k in reference_keys(MAX_REFERENCES) if k in cond]  # in order: "Picture 1", 2, ...
        for ref in refs:
            self.check_latent_size(*ref.shape[-2:])
        tokens = torch.cat([pack(x), *(pack(ref.to(x.dtype)) for ref in refs)], dim=1)
        shapes = [(1, h // 2, w // 2), *((1, ref.shape[-2] // 2, ref.shape[-1] // 2) for ref in refs)]
        out = self.model(hidden_states=tokens, timestep=t.expand(b).to(x.dtype) / 1000,
                         encoder_hidden_states=cond["prompt_embeds"].to(x.dtype),
                         encoder_hidden_states_mask=cond["prompt_mask"] > 0.5,
                         img_shapes=[shapes] * b, return_dict=False)[0]
        return unpack(out[:, : (h // 2) * (w // 2)], h, w)


class QwenImageEditFamily(QwenImageFamily):
    """Qwen-Image-Edit and its fine-tunes: Qwen-Image editing one reference image (an edit family)."""

    name = "qwen-image-edit"
    pipeline_class = "QwenImageEditPipeline"
    denoiser_class = QwenImageEditDenoiser
    references = 1  # one reference image per sample (data.references)
    max_references = 1  # QwenImageEditPipeline's prompt template holds one image
    # the run's prompts cached with their pairs' references (data/pair_cache.py): training never runs the encoder
    text_cache = "pairs"

    def load_prompt_encoder(self, folder: Path, device: torch.device | str = "cpu",
                            max_sequence_length: int = 0, deferred: bool = False) -> QwenEditPromptEncoder:
        return QwenEditPromptEncoder(Path(folder), max_sequence_length, deferred).to(device)

    def part_checks(self) -> dict:
        """The exported processor/ checked by loading its tokenizer and its image processor (transformers'
        Qwen2VLProcessor class cannot be built without torchvision; the pipeline's from_pretrained needs it)."""
        def processor(folder: Path):
            from transformers import (  # optional ([text])
                Qwen2Tokenizer,
                Qwen2VLImageProcessorPil,
            )

            load_part(folder.parent, folder.name, Qwen2Tokenizer, "Qwen2-VL processor's tokenizer")
            return image_processor(folder.parent, Qwen2VLImageProcessorPil)

        return {"processor": processor}

    def condition(self, c, captions, drop: Tensor | None, device: torch.device, geometry: Tensor | None = None,
                  size: tuple[int, int] | None = None) -> Condition:
        """Nothing without the reference: the prompt is encoded with it by :meth:`edit_condition`."""
        return {}

    def prompt_condition(self, c, prompts, device: torch.device | str = "cpu") -> Condition:
        """Nothing without the reference (:meth:`edit_condition` encodes the prompts with it)."""
        return {}

    def null_condition(self, c, n: int, device: torch.device | str = "cpu") -> Condition:
        """``{"null_prompt": ones (n,)}``: guidance's unconditional pass takes each row's own negative states
        (the empty prompt with the row's reference, :meth:`edit_condition`'s ``negative_embeds``)."""
        return {NULL_FLAG: torch.ones(n, device=device)}

    def edit_condition(self, c, references: list[Tensor], captions=None, drop: Tensor | None = None,
                       images: list[Tensor] | None = None, device: torch.device | str = "cpu") -> Condition:
        """The rows' prompt states encoded with their reference image, and the reference's latents.
        Training (``drop`` given): the dropped rows' captions "" (the empty prompt with the same image, the
        pipeline's negative): the pair cache's rows (``c.text.training_rows``: each caption's and ""'s states with
        the reference file's pixels, read in the loader's workers), or, without the cache, the rows encoded now
        with the reference's cached latent mean decoded by the VAE (training holds no pixels). Sampling (``images``, the references' pixels): the prompts' states and
        the empty prompt's (``negative_embeds``, ``negative_mask``) which :data:`NULL_FLAG` selects."""
        if captions is None:
            raise ValueError(f"the {self.name} family encodes each prompt with its reference image: give the prompts")
        rows = c.text.training_rows(captions, device) if drop is not None else None
        if rows is not None:  # the pair cache's: each row's caption and "" encoded with its reference file
            use = drop.to(rows["prompt_mask"].device).view(-1, 1)
            return {"prompt_embeds": torch.where(use[..., None], rows["empty_embeds"], rows["prompt_embeds"]),
                    "prompt_mask": torch.where(use, rows["empty_mask"], rows["prompt_mask"])} \
                | self.reference_condition(references)
        captions = list(captions)
        if drop is not None:  # a host read of B flags per step
            captions = ["" if d else text for text, d in zip(captions, drop.tolist())]
        self.reference_condition(references)  # the count checked before any encoding
        per_ref = [pil_images(images[k] if images else c.decode(ref)) for k, ref in enumerate(references)]
        pil = [row[0] if len(row) == 1 else row for row in zip(*per_ref)]  # each row's image(s)
        cond = c.text.encode_edit(captions, pil, device) | self.reference_condition(references)
        if drop is None:
            empty = c.text.encode_edit([""] * len(captions), pil, device)
            cond |= {"negative_embeds": empty["prompt_embeds"], "negative_mask": empty["prompt_mask"]}
        return cond

    def reference_condition(self, references: list[Tensor]) -> Condition:
        """``{"reference": (B, 16, h', w')}``: the reference's latents (model space), which
        :class:`QwenImageEditDenoiser` packs after the target's tokens; the Plus family's several
        (:attr:`max_references`): ``"reference_2"``, ... after it, in order."""
        if not self.references <= len(references) <= self.max_references:
            most = f"{self.references} to {self.max_references}" if self.max_references > self.references \
                else f"{self.references}"
            raise ValueError(f"the {self.name} family takes {most} reference image(s) per sample, got {len(references)}")
        return dict(zip(reference_keys(len(references)), references))

    def cache_fill_tokens(self) -> int:
        """The pair cache's fill (``data/pair_cache.py``): each prompt with a 1024 px reference's vision tokens."""
        return VISION_TOKENS_1024

    def condition_shapes(self, config: dict, max_sequence_length: int = 0) -> dict[str, tuple[int, ...]]:
        """Qwen-Image's, the prompt's states longer by the vision tokens of a 1024 px reference (smart_resize:
        1036 x 1036, 37 x 37 merged 28 px patches, + 2); the estimate adds the reference's latents itself."""
        shapes = super().condition_shapes(config, max_sequence_length)
        length, width = shapes["prompt_embeds"]
        return {"prompt_embeds": (length + VISION_TOKENS_1024, width), "prompt_mask": (length + VISION_TOKENS_1024,)}


class QwenImageEditPlusDenoiser(QwenImageEditDenoiser):
    """:class:`QwenImageEditDenoiser` of the Plus family (its checkpoints name it): the same transformer call."""

    family = "qwen-image-edit-plus"


class QwenImageEditPlusFamily(QwenImageEditFamily):
    """Qwen-Image-Edit-2509 (QwenImageEditPlusPipeline): Qwen-Image-Edit but for the prompt
    (:class:`QwenEditPlusPromptEncoder`) and its references: one or several per sample (``data.references``, or
    ``data.reference_column`` naming a list), any batch (the pipeline: a list of images, batch 1)."""

    name = "qwen-image-edit-plus"
    pipeline_class = "QwenImageEditPlusPipeline"
    denoiser_class = QwenImageEditPlusDenoiser
    max_references = MAX_REFERENCES  # the pipeline's list of images ("Picture 1: ...", "Picture 2: ...", ...)

    def load_prompt_encoder(self, folder: Path, device: torch.device | str = "cpu",
                            max_sequence_length: int = 0, deferred: bool = False) -> QwenEditPlusPromptEncoder:
        return QwenEditPlusPromptEncoder(Path(folder), max_sequence_length, deferred).to(device)


QWEN_IMAGE_EDIT = register(QwenImageEditFamily())
QWEN_IMAGE_EDIT_PLUS = register(QwenImageEditPlusFamily())
