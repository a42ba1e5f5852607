"""What the base families' training tests check alike of a run's exports: the LoRA file loaded in the family's
diffusers pipeline computes difftrain's adapted network, and the exported folder of a full fine-tune samples what
difftrain samples (the comparison; each family calls its own pipeline)."""

from __future__ import annotations

import diffusers
import torch

from difftrain import api
from difftrain.cli import main
from difftrain.families import family_named
from difftrain.generation.inference import generate_images, load_model
from tests.family_bases import with_run_conditions
from tests.family_runs import TinyBase


def export_lora(tmp_path):
    """``difftrain export --format lora`` of the straight run, ``tmp_path/straight``, to ``tmp_path/lora``."""
    assert main(["export", str(tmp_path / "straight"), str(tmp_path / "lora"), "--format", "lora"]) == 0
    return tmp_path / "lora"


def prompt_condition(family, base: TinyBase) -> dict:
    """The condition of 'a red square' from the family's prompt encoder of ``base`` (at the runs' length, where
    they set one), with the family's per-run scalars at their defaults (``with_run_conditions``: Flux's guidance)."""
    length = {} if base.length is None else {"max_sequence_length": base.length}
    return with_run_conditions(family, family.load_prompt_encoder(base.folder, **length).encode(["a red square"]))


def assert_transformer_is_the_adapted_run(tmp_path, family, base: TinyBase, transformer, shape: tuple[int, ...],
                                          t: torch.Tensor | None = None) -> None:
    """A pipeline's ``transformer`` with the run's adapter loaded, behind difftrain's call (the family's
    denoiser_class), gives what difftrain's adapted network of ``tmp_path/straight`` gives (1e-4) on the same input
    (noise of ``shape``, seed 0; ``t``: 700.0), and not what the plain base gives (the adapter is in)."""
    ours = load_model(tmp_path / "straight", device="cpu").model.eval()
    cond = prompt_condition(family, base)
    x = torch.randn(1, *shape, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([700.0]) if t is None else t
    theirs = family.denoiser_class(transformer)  # the pipeline's transformer behind difftrain's call
    with torch.no_grad():
        assert (ours(x, t, cond) - theirs(x, t, cond)).abs().max() < 1e-4
        plain = family.load_denoiser(base.folder)
        assert (plain(x, t, cond) - theirs(x, t, cond)).abs().max() > 1e-6  # the adapter is in


def assert_lora_export_loads_in_the_pipeline(tmp_path, name: str, base: TinyBase, shape: tuple[int, ...]) -> None:
    """``export --format lora`` of the run -> the family's pipeline (``pipeline_class``) of ``base``,
    load_lora_weights: its transformer gives what difftrain's adapted network gives (1e-4) on the same input
    (latents of ``shape``)."""
    family = family_named(name)
    lora = export_lora(tmp_path)
    pipe = getattr(diffusers, family.pipeline_class).from_pretrained(str(base.folder))
    pipe.load_lora_weights(str(lora))
    assert_transformer_is_the_adapted_run(tmp_path, family, base, pipe.transformer, shape)


def exported_pipeline(tmp_path, pipeline_class: str):
    """``export`` of the full fine-tune in ``tmp_path/straight`` to ``tmp_path/pipe``, loaded in diffusers'
    ``pipeline_class`` (its progress bar off)."""
    out = api.export(tmp_path / "straight", tmp_path / "pipe")
    pipe = getattr(diffusers, pipeline_class).from_pretrained(str(out))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def difftrain_image(tmp_path, guidance_scale: float, sampler: str = "euler") -> torch.Tensor:
    """What difftrain samples of the run in ``tmp_path/straight`` for the pipeline to match: 1 image of 'a red
    square', ``sampler``, 3 steps, seed 5 (its initial noise: ``initial_noise(1, shape, 5)``), ``guidance_scale``."""
    ours = load_model(tmp_path / "straight", device="cpu")
    return generate_images(ours, 1, sampler=sampler, steps=3, seed=5, prompt="a red square",
                           guidance_scale=guidance_scale)


def assert_same_images(theirs: torch.Tensor, expected: torch.Tensor, *context) -> None:
    """The pipeline's images (in [-1, 1]) are difftrain's: the same shape, 1e-4 apart at most."""
    assert theirs.shape == expected.shape
    assert (theirs - expected).abs().max() < 1e-4, (*context, (theirs - expected).abs().max())
