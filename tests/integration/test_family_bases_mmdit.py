"""The tiny SD3 and Flux base folders of tests/family_bases.py are what diffusers' own
pipelines load and sample from (32 px, 2 steps)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.family_bases import T5_LENGTH, write_tiny_flux_folder, write_tiny_sd3_folder

diffusers = pytest.importorskip("diffusers")


@pytest.mark.parametrize("name,write,pipeline", [
    ("sd3", write_tiny_sd3_folder, "StableDiffusion3Pipeline"),
    ("flux", write_tiny_flux_folder, "FluxPipeline"),
])
def test_pipeline_loads_the_tiny_base_and_samples(tmp_path, name, write, pipeline):
    folder = write(tmp_path / name)
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == pipeline
    pipe = getattr(diffusers, pipeline).from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    assert pipe.vae.config.shift_factor is not None and pipe.vae.config.latent_channels == 16
    out = pipe("a red ring", height=32, width=32, num_inference_steps=2, max_sequence_length=T5_LENGTH,
               generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert out.shape == (1, 3, 32, 32) and torch.isfinite(out).all()
    again = getattr(diffusers, pipeline).from_pretrained(str(write(tmp_path / f"{name}-again")))
    again.set_progress_bar_config(disable=True)
    same = again("a red ring", height=32, width=32, num_inference_steps=2, max_sequence_length=T5_LENGTH,
                 generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert torch.equal(out, same)  # the same seed writes the same base
