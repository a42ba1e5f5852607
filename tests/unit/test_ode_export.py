"""EDM and flow-matching models exported to diffusers: the folder's README loop, with diffusers'
own EDMEulerScheduler / FlowMatchEulerDiscreteScheduler, samples the images difftrain samples."""

from __future__ import annotations

import pytest
import torch

from tests.small_checkpoint import make_checkpoint, one_thread  # noqa: F401 - one_thread: the module's autouse fixture

STEPS, SEED = 6, 3


def run_readme_loop(folder, seed: int, steps: int):
    """Run the README's snippet with ``steps`` steps and difftrain's initial noise for ``seed``."""
    snippet = (folder / "README.md").read_text().split("```python\n")[1].split("```")[0]
    assert "steps = 32\n" in snippet and "torch.Generator().manual_seed(0)" in snippet
    snippet = snippet.replace("steps = 32\n", f"steps = {steps}\n").replace(
        "torch.Generator().manual_seed(0)", f"pipeline_generator({seed})")
    from difftrain.interop.diffusers import pipeline_generator

    scope: dict = {"pipeline_generator": pipeline_generator}
    exec(snippet, scope)  # noqa: S102 - our own README
    return scope["images"]


@pytest.mark.parametrize("objective,options", [
    ("edm", ["diffusion.edm_sigma_data=0.6", "diffusion.sigma_max=40", "diffusion.rho=5"]),
    ("flow", ["diffusion.flow_shift=2.5"]),
])
@pytest.mark.parametrize("num_classes", [0, 3])
def test_exported_ode_folder_samples_what_difftrain_samples(tmp_path, objective, options, num_classes):
    diffusers = pytest.importorskip("diffusers")
    from difftrain.api import export, generate, load

    extra = ["data.class_conditional=true"] if num_classes else []
    make_checkpoint(tmp_path, f"diffusion.objective={objective}", *options, *extra, num_classes=num_classes)
    folder = export(tmp_path, tmp_path / "pipe")
    scheduler_class = {"edm": diffusers.EDMEulerScheduler, "flow": diffusers.FlowMatchEulerDiscreteScheduler}
    assert isinstance(scheduler_class[objective].from_pretrained(folder, subfolder="scheduler"),
                      scheduler_class[objective])
    theirs = run_readme_loop(folder, SEED, STEPS)
    loaded = load(tmp_path)
    labels = [k % num_classes for k in range(4)] if num_classes else None
    ours = generate(loaded, 4, sampler="euler", steps=STEPS, seed=SEED, class_label=labels)
    ours = ((ours + 1) / 2).clamp(0, 1)
    assert ours.shape == theirs.shape == (4, 3, 16, 16)
    assert (ours - theirs).abs().max() < 1e-4  # float32 sigmas in diffusers, float64 in difftrain
    assert (ours - theirs).abs().max() < (ours - ours.flip(0)).abs().max() / 100  # the images differ among them


def test_flow_folder_loads_as_a_ddpm_pipeline(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    from difftrain.api import export

    make_checkpoint(tmp_path, "diffusion.objective=flow")
    pipe = diffusers.DDPMPipeline.from_pretrained(export(tmp_path, tmp_path / "pipe"))
    assert isinstance(pipe.scheduler, diffusers.FlowMatchEulerDiscreteScheduler)
    images = pipe(batch_size=2, generator=torch.Generator().manual_seed(0), num_inference_steps=3,
                  output_type="np").images
    assert images.shape == (2, 16, 16, 3)


def test_edm_timestep_map_is_difftrains_conditioning():
    from difftrain.diffusion.edm import EDMObjective
    from difftrain.interop.ode_export import edm_timestep_map

    objective = EDMObjective()
    scale, offset = edm_timestep_map(objective)
    sigma = torch.tensor([0.002, 0.3, 1.0, 7.0, 80.0], dtype=torch.float64)
    torch.testing.assert_close(scale * sigma.log() / 4 + offset, objective.cond(sigma).double(), rtol=0, atol=1e-4)


def test_the_export_command_points_an_unconditional_edm_model_to_its_readme(tmp_path, capsys):
    pytest.importorskip("diffusers")
    from difftrain.cli import main

    make_checkpoint(tmp_path, "diffusion.objective=edm")
    assert main(["export", str(tmp_path), str(tmp_path / "out"), "--format", "diffusers"]) == 0
    note = capsys.readouterr().out.splitlines()[-1]
    assert str(tmp_path / "out" / "README.md") in note and "class-conditional" not in note, note
