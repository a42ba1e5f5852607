"""A tiny random FLUX.1 Kontext base, offline: tests/family_bases.write_tiny_flux_folder's FluxPipeline folder
(its transformer, VAE, CLIP, T5, tokenizers and scheduler, built with diffusers' and transformers' own classes)
saved as a FluxKontextPipeline folder, which ``FluxKontextPipeline.from_pretrained`` loads and samples
(32 px images, latents 8 x 8)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.family_bases import write_tiny_flux_folder


def write_tiny_flux_kontext_folder(path: str | Path, seed: int = 0, head_dim: int = 8) -> Path:
    """A FluxKontextPipeline folder in ``path``: write_tiny_flux_folder's parts (the same classes and sizes as
    FLUX.1 Kontext's, tiny), its model_index.json naming FluxKontextPipeline (the real Kontext folder's parts
    are FLUX.1-dev's classes, with an image_encoder / feature_extractor pair that the pipeline takes as
    optional: left out here, as in the released FLUX.1-Kontext-dev folder, whose entries are [null, null])."""
    path = write_tiny_flux_folder(path, seed, head_dim)
    index = json.loads((path / "model_index.json").read_text())
    index["_class_name"] = "FluxKontextPipeline"
    (path / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return path
