"""CLIP score of images against their prompts, with a local transformers CLIPModel folder.

CLIP score (Hessel et al. 2021, "CLIPScore"), as torchmetrics defines it:
  score(image, prompt) = 100 * max(cos(E_img(image), E_txt(prompt)), 0)
where E_img / E_txt are CLIP's projected image and text embeddings. Higher is better; the
mean over a set of (image, prompt) pairs is what papers report (about 30 for SD on COCO with
ViT-L/14). Numbers from different CLIP models are not comparable.

Preprocessing follows CLIPImageProcessor without torchvision: resize the short side to
`size` with Pillow's bicubic filter (long side int(size * long / short)), center crop to
`crop_size`, scale to [0, 1], normalise by the model's mean and std. The values come from
the folder's preprocessor_config.json when it exists, else CLIP's standard mean/std and the
vision config's image_size.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from difftrain.runtime.optional import require

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's RGB normalisation
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
TOKENIZER_FILES = ("vocab.json", "merges.txt")  # CLIP's byte-level BPE files


@dataclass(frozen=True)
class ClipPreprocessing:
    """How images become CLIP's input: short side -> size, center crop, normalise."""

    size: int  # pixels, the short side after the resize
    crop_height: int  # pixels
    crop_width: int  # pixels
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def _side(value, key: str, folder: Path) -> tuple[int, int]:
    """(height, width) from an int or a {"height", "width"} / {"shortest_edge"} dict."""
    if isinstance(value, int):
        return value, value
    if isinstance(value, dict):
        if "shortest_edge" in value:
            return int(value["shortest_edge"]), int(value["shortest_edge"])
        if "height" in value and "width" in value:
            return int(value["height"]), int(value["width"])
    raise ValueError(f"{folder}/preprocessor_config.json: cannot read {key}={value!r}")


def read_preprocessing(folder: Path, image_size: int) -> ClipPreprocessing:
    """Preprocessing from folder/preprocessor_config.json, or CLIP's defaults at image_size."""
    path = folder / "preprocessor_config.json"
    if not path.is_file():
        return ClipPreprocessing(image_size, image_size, image_size, CLIP_MEAN, CLIP_STD)
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable JSON file ({e})") from e
    size = _side(config.get("size", image_size), "size", folder)[0]
    crop_h, crop_w = _side(config.get("crop_size", size), "crop_size", folder)
    if not config.get("do_resize", True) or not config.get("do_center_crop", True):
        raise ValueError(f"{path}: do_resize=false or do_center_crop=false is not supported")
    mean = tuple(float(v) for v in config.get("image_mean", CLIP_MEAN))
    std = tuple(float(v) for v in config.get("image_std", CLIP_STD))
    if len(mean) != 3 or len(std) != 3:
        raise ValueError(f"{path}: image_mean and image_std must have 3 values")
    return ClipPreprocessing(size, crop_h, crop_w, mean, std)


def _as_uint8_nhwc(images) -> np.ndarray:
    """(N, H, W, C) uint8 array from a tensor or array; C of 1 becomes 3."""
    array = images.detach().cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    if array.ndim != 4 or array.shape[-1] not in (1, 3):
        raise ValueError(f"images must be (N, H, W, 1 or 3), got shape {array.shape}")
    if array.dtype != np.uint8:
        raise TypeError(f"images must be uint8, got {array.dtype}")
    return np.repeat(array, 3, axis=-1) if array.shape[-1] == 1 else array


def preprocess_clip(images, prep: ClipPreprocessing) -> torch.Tensor:
    """images: (N, H, W, 3 or 1) uint8 -> (N, 3, crop_height, crop_width) float32, normalised."""
    out = []
    for image in _as_uint8_nhwc(images):
        h, w = image.shape[:2]
        new_h = prep.size if h <= w else int(prep.size * h / w)
        new_w = prep.size if w <= h else int(prep.size * w / h)
        pil = Image.fromarray(image)
        if (new_h, new_w) != (h, w):
            pil = pil.resize((new_w, new_h), Image.Resampling.BICUBIC)
        array = np.asarray(pil)
        top = max((new_h - prep.crop_height) // 2, 0)
        left = max((new_w - prep.crop_width) // 2, 0)
        array = array[top:top + prep.crop_height, left:left + prep.crop_width]
        if array.shape[:2] != (prep.crop_height, prep.crop_width):
            raise ValueError(f"crop {prep.crop_height}x{prep.crop_width} is larger than the "
                             f"resized image {new_h}x{new_w}")
        out.append(torch.from_numpy(array.copy()))
    x = torch.stack(out).permute(0, 3, 1, 2).float() / 255  # (N, 3, h, w) in [0, 1]
    mean = torch.tensor(prep.mean).view(1, 3, 1, 1)
    std = torch.tensor(prep.std).view(1, 3, 1, 1)
    return (x - mean) / std


class CLIPScorer(nn.Module):
    """A frozen CLIP model that scores (image, prompt) pairs; moves with `.to(device)`.

    Usage: `scorer = CLIPScorer.from_path("clip-vit-base-patch32").to(device);
    scores = scorer.score(images_uint8_nhwc, prompts)`.
    """

    def __init__(self, model: nn.Module, tokenizer, preprocessing: ClipPreprocessing,
                 source: str = ""):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.preprocessing = preprocessing
        self.source = source
        self.max_length = int(model.config.text_config.max_position_embeddings)  # tokens

    @classmethod
    def from_path(cls, folder: str | os.PathLike) -> CLIPScorer:
        """Load a transformers CLIPModel folder (config.json, weights, vocab.json, merges.txt)."""
        require("transformers", "text", f"evaluation.clip_model={folder}")
        # Imported here: transformers is an optional package (the text extra).
        from transformers import CLIPModel, CLIPTokenizer

        root = Path(folder).expanduser()
        if not root.is_dir():
            raise ValueError(f"evaluation.clip_model: {root} is not a folder")
        config_path = root / "config.json"
        try:
            model_type = json.loads(config_path.read_text()).get("model_type")
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{root} is not a CLIP model folder: cannot read {config_path} "
                             f"({e})") from e
        if model_type != "clip":
            raise ValueError(f"{root} is not a CLIP model folder: config.json has model_type "
                             f"{model_type!r}, expected 'clip' (a transformers CLIPModel)")
        missing = [name for name in TOKENIZER_FILES if not (root / name).is_file()]
        if missing:
            raise ValueError(f"{root} has no CLIP tokenizer: missing {', '.join(missing)}")
        try:
            model = CLIPModel.from_pretrained(root, local_files_only=True)
            tokenizer = CLIPTokenizer.from_pretrained(root, local_files_only=True)
        except (OSError, ValueError, RuntimeError) as e:
            raise ValueError(f"{root}: cannot load the CLIP model or tokenizer ({e})") from e
        image_size = int(model.config.vision_config.image_size)
        return cls(model.float(), tokenizer, read_preprocessing(root, image_size), str(root))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def image_embeddings(self, images) -> torch.Tensor:
        """images: (B, H, W, 3 or 1) uint8 -> (B, E) unit-norm float32 on the model's device."""
        pixels = preprocess_clip(images, self.preprocessing).to(self.device)
        pooled = self.model.vision_model(pixel_values=pixels).pooler_output
        return nn.functional.normalize(self.model.visual_projection(pooled).float(), dim=-1)

    @torch.no_grad()
    def text_embeddings(self, prompts: list[str]) -> torch.Tensor:
        """prompts: B strings (truncated to max_length tokens) -> (B, E) unit-norm float32."""
        tokens = self.tokenizer(list(prompts), padding=True, truncation=True,
                                max_length=self.max_length, return_tensors="pt")
        out = self.model.text_model(input_ids=tokens["input_ids"].to(self.device),
                                    attention_mask=tokens["attention_mask"].to(self.device))
        return nn.functional.normalize(self.model.text_projection(out.pooler_output).float(),
                                       dim=-1)

    @torch.no_grad()
    def score(self, images, prompts: list[str], batch_size: int = 32) -> torch.Tensor:
        """CLIP score per pair: images (N, H, W, 3 or 1) uint8, N prompts -> (N,) float32 CPU.

        100 * max(cos(image_embedding, text_embedding), 0), in [0, 100].
        """
        n = len(images)
        if len(prompts) != n:
            raise ValueError(f"got {n} images and {len(prompts)} prompts; need one prompt "
                             "per image")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        scores = []
        for start in range(0, n, batch_size):
            img = self.image_embeddings(images[start:start + batch_size])
            txt = self.text_embeddings(prompts[start:start + batch_size])
            scores.append((100 * (img * txt).sum(-1).clamp(min=0)).cpu())
        return torch.cat(scores) if scores else torch.zeros(0)

    def mean_score(self, images, prompts: list[str], batch_size: int = 32
                   ) -> tuple[float, int]:
        """(mean CLIP score, number of pairs) over images (N, H, W, C) uint8 and N prompts."""
        scores = self.score(images, prompts, batch_size)
        if len(scores) == 0:
            raise ValueError("CLIP score of no images")
        return float(scores.double().mean()), len(scores)
