"""Weights in and out: the .safetensors file, diffusers pipeline folders that sample what
difftrain samples, and runs that start from a diffusers UNet folder (model.init_from)."""

from __future__ import annotations

import pytest
import torch

from difftrain.config import load_config
from difftrain.diffusion.objective import build_objective
from difftrain.generation.inference import load_model
from difftrain.checkpoints.weights_file import load_weights_file, save_weights_file
from difftrain.diffusion.scheduler_configs import scheduler_config
from difftrain.generation.sampling import guided_network
from difftrain.checkpoints.checkpoint import state_dict_sha256
from difftrain.training.state import RunState
from tests.small_checkpoint import SMALL, make_checkpoint, one_thread  # noqa: F401 - one_thread: the module's autouse fixture



def test_weights_file_round_trip_and_loads_for_sampling(tmp_path):
    state = make_checkpoint(tmp_path, "diffusion.prediction=v", num_classes=3)
    out = save_weights_file(state, tmp_path / "model.safetensors")
    read = load_weights_file(out)
    assert read["num_classes"] == 3 and read["weights"] == "ema" and read["config"] == state["config"]
    assert state_dict_sha256(read["tensors"]) == state_dict_sha256(state["ema"]["model"])
    loaded = load_model(out)
    assert loaded.num_classes == 3 and loaded.ema and loaded.cfg.diffusion.prediction == "v"
    assert out.stat().st_size < (tmp_path / "checkpoints" / "step_00000000.pt").stat().st_size


@pytest.mark.parametrize("schedule", ["linear", "cosine", "scaled_linear", "sigmoid"])
@pytest.mark.parametrize("num_timesteps", [10, 1000])
def test_scheduler_config_reproduces_alpha_bar(schedule, num_timesteps):
    diffusers = pytest.importorskip("diffusers")
    cfg = load_config(None, [f"diffusion.schedule={schedule}", f"diffusion.num_timesteps={num_timesteps}",
                             "validation.steps=5", "evaluation.fid_steps=5"])
    scheduler = diffusers.DDPMScheduler(**scheduler_config(cfg.diffusion))
    ours = build_objective(cfg.diffusion).alpha_bar.float()
    torch.testing.assert_close(scheduler.alphas_cumprod, ours, rtol=1e-5, atol=1e-6)


def test_other_objectives_are_refused():
    class Diffusion:
        objective, num_timesteps, schedule, prediction = "edm", 1000, "cosine", "epsilon"

    with pytest.raises(ValueError, match="ddpm-family"):
        scheduler_config(Diffusion())


@pytest.mark.parametrize("prediction", ["epsilon", "v", "x0"])
@pytest.mark.parametrize("sampler", ["ddim", "ddpm"])
def test_exported_pipeline_samples_what_difftrain_samples(tmp_path, prediction, sampler):
    diffusers = pytest.importorskip("diffusers")
    from difftrain.api import export, generate, load
    from difftrain.interop.diffusers import pipeline_generator

    make_checkpoint(tmp_path, f"diffusion.prediction={prediction}", "diffusion.schedule=linear")
    folder = export(tmp_path, tmp_path / "pipe")
    loaded = load(tmp_path)
    steps, seed, n = 5, 3, 2  # 5 divides T = 100: diffusers' DDIM steps by T // steps
    if sampler == "ddim":  # deterministic: the same seed gives the images of `difftrain sample`
        pipe = diffusers.DDIMPipeline.from_pretrained(folder)
        theirs = pipe(batch_size=n, generator=pipeline_generator(seed), num_inference_steps=steps,
                      use_clipped_model_output=True, output_type="np").images
        ours = generate(loaded, n, sampler="ddim", steps=steps, seed=seed)
    else:  # the pipeline draws x_T and then each step's noise from one generator
        pipe = diffusers.DDPMPipeline.from_pretrained(folder)
        theirs = pipe(batch_size=n, generator=torch.Generator().manual_seed(seed), num_inference_steps=steps,
                      output_type="np").images
        gen = torch.Generator().manual_seed(seed)
        x_T = torch.randn((n, 3, 16, 16), generator=gen)
        with torch.no_grad():
            ours = loaded.objective.sample(guided_network(loaded.model), x_T, "ddpm", steps, gen)
    ours = ((ours + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    assert abs(ours - theirs).max() < 1e-4


def test_class_conditional_export_writes_a_working_snippet(tmp_path):
    pytest.importorskip("diffusers")
    from difftrain.api import export

    make_checkpoint(tmp_path, "data.class_conditional=true", num_classes=3)
    folder = export(tmp_path, tmp_path / "pipe")
    snippet = (folder / "README.md").read_text().split("```python\n")[1].split("```")[0]
    scope: dict = {}
    exec(snippet.replace("scheduler.set_timesteps(50)", "scheduler.set_timesteps(4)"), scope)  # noqa: S102
    assert scope["images"].shape == (4, 3, 16, 16)


def test_init_from_a_diffusers_folder_starts_from_its_weights(tmp_path):
    pytest.importorskip("diffusers")
    from difftrain.api import export

    state = make_checkpoint(tmp_path)
    folder = export(tmp_path, tmp_path / "pipe")
    cfg = load_config(None, SMALL + [f"model.init_from={folder / 'unet'}"])
    built = RunState.build(cfg, 0, torch.device("cpu"))
    assert state_dict_sha256(built.model.state_dict()) == state_dict_sha256(state["ema"]["model"])
    assert state_dict_sha256(built.ema.model.state_dict()) == state_dict_sha256(state["ema"]["model"])
    # the whole pipeline folder works too, and a resume ignores init_from
    cfg.model.init_from = str(folder)
    assert state_dict_sha256(RunState.build(cfg, 0, torch.device("cpu")).model.state_dict()) == \
        state_dict_sha256(state["ema"]["model"])
    fresh = RunState.build(cfg, 0, torch.device("cpu"), init_weights=False)
    assert state_dict_sha256(fresh.model.state_dict()) != state_dict_sha256(state["ema"]["model"])


def test_init_from_a_folder_saved_under_the_attention_names_diffusers_renames_reads_them_renamed(tmp_path):
    """A UNet2DModel folder whose weights hold the attention names of diffusers before 0.15 (``query``,
    ``key``, ``value``, ``proj_attn``, as google/ddpm-cifar10-32's ``.bin``): loaded whole, and recorded for a
    meta-built network (FSDP's sharded start) and read one tensor at a time, each under the name diffusers'
    own renaming gives it (run on the names): the folder's weights either way."""
    pytest.importorskip("diffusers")
    from safetensors.torch import load_file, save_file

    from difftrain.api import export
    from difftrain.networks.conditioning import Conditioning
    from difftrain.networks.init_from import defer_init_weights
    from difftrain.runtime import meta_init
    from difftrain.runtime.tensor_source import DeferredWeights
    from difftrain.networks.build import build_network

    state = make_checkpoint(tmp_path)
    weights = export(tmp_path, tmp_path / "pipe") / "unet" / "diffusion_pytorch_model.safetensors"
    old = {".to_q.": ".query.", ".to_k.": ".key.", ".to_v.": ".value.", ".to_out.0.": ".proj_attn."}
    tensors = {}
    for name, t in load_file(weights).items():
        for new, was in old.items():
            name = name.replace(new, was)
        tensors[name] = t
    assert any(".proj_attn." in k for k in tensors)
    save_file(tensors, weights)
    cfg = load_config(None, SMALL + [f"model.init_from={weights.parent}"])
    built = RunState.build(cfg, 0, torch.device("cpu"))
    assert state_dict_sha256(built.model.state_dict()) == state_dict_sha256(state["ema"]["model"])
    with meta_init.empty_build():
        model = build_network(cfg, Conditioning(0, channels=3, resolution=16), init_weights=False)
    deferred = DeferredWeights()
    assert defer_init_weights(model, weights.parent, deferred)
    read = {name: reader() for name, reader in deferred.bind(model).items()}
    assert state_dict_sha256(read) == state_dict_sha256(state["ema"]["model"])


def test_init_from_a_different_architecture_names_the_folder_and_key(tmp_path):
    pytest.importorskip("diffusers")
    from difftrain.api import export

    make_checkpoint(tmp_path)
    folder = export(tmp_path, tmp_path / "pipe")
    cfg = load_config(None, SMALL + ["model.base_channels=16", f"model.init_from={folder}"])
    with pytest.raises(ValueError, match=r"pipe/unet.*first mismatched key 'block_out_channels'"):
        RunState.build(cfg, 0, torch.device("cpu"))
    cfg = load_config(None, SMALL + ["model.num_res_blocks=2", f"model.init_from={tmp_path}"])
    with pytest.raises(ValueError, match=r"model\.init_from .*lacks"):
        RunState.build(cfg, 0, torch.device("cpu"))


def test_zero_terminal_snr_exports_a_scheduler_that_samples_what_difftrain_samples(tmp_path):
    # v prediction on the rescaled schedule: diffusers rescales the exported betas itself
    # (rescale_betas_zero_snr) and walks the trailing grid from alpha_bar = 0, as difftrain does.
    diffusers = pytest.importorskip("diffusers")
    from difftrain.api import export, generate, load
    from difftrain.interop.diffusers import pipeline_generator

    make_checkpoint(tmp_path, "diffusion.prediction=v", "diffusion.zero_terminal_snr=true")
    loaded = load(tmp_path)
    config = scheduler_config(loaded.cfg.diffusion)
    assert config["rescale_betas_zero_snr"] is True and config["prediction_type"] == "v_prediction"
    assert config["timestep_spacing"] == "trailing"
    scheduler = diffusers.DDPMScheduler(**config)
    assert scheduler.alphas_cumprod[-1].item() == 0.0 and loaded.objective.alpha_bar[-1].item() == 0.0
    torch.testing.assert_close(scheduler.alphas_cumprod, loaded.objective.alpha_bar.float(), rtol=1e-4, atol=1e-6)
    pipe = diffusers.DDIMPipeline.from_pretrained(export(tmp_path, tmp_path / "pipe"))
    theirs = pipe(batch_size=2, generator=pipeline_generator(3), num_inference_steps=5, use_clipped_model_output=True,
                  output_type="np").images
    ours = ((generate(loaded, 2, sampler="ddim", steps=5, seed=3) + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    assert abs(ours - theirs).max() < 1e-4


def test_init_source_training_reads_what_a_source_was_trained_with(tmp_path):
    import json

    from difftrain.networks.init_from import init_source_changes, init_source_training

    # a Stable Diffusion 2.x-like folder: v prediction, SD's scaled_linear betas; its unet/ reads the same
    sd = tmp_path / "sd"
    (sd / "scheduler").mkdir(parents=True)
    (sd / "unet").mkdir()
    (sd / "scheduler" / "scheduler_config.json").write_text(json.dumps({
        "_class_name": "PNDMScheduler", "num_train_timesteps": 1000, "beta_schedule": "scaled_linear",
        "beta_start": 0.00085, "beta_end": 0.012, "prediction_type": "v_prediction", "trained_betas": None}))
    want = {"objective": "ddpm", "prediction": "v", "schedule": "scaled_linear", "num_timesteps": 1000,
            "zero_terminal_snr": False}
    assert init_source_training(sd) == init_source_training(sd / "unet") == want
    # SD 1.x's scheduler config names no prediction_type: diffusers' default, epsilon
    (sd / "scheduler" / "scheduler_config.json").write_text(json.dumps({
        "beta_schedule": "squaredcos_cap_v2", "rescale_betas_zero_snr": True, "num_train_timesteps": 100}))
    assert init_source_training(sd) == {"objective": "ddpm", "prediction": "epsilon", "schedule": "cosine",
                                        "num_timesteps": 100, "zero_terminal_snr": True}
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    assert init_source_training(bare) == {} and init_source_training(tmp_path / "missing") == {}
    # difftrain's own checkpoints, run directories and weights files: their config
    state = make_checkpoint(tmp_path / "run", "diffusion.prediction=v", "diffusion.zero_terminal_snr=true")
    weights = save_weights_file(state, tmp_path / "w.safetensors")
    for source in (tmp_path / "run", state["path"], weights):
        assert init_source_training(source) == {"objective": "ddpm", "prediction": "v", "schedule": "cosine",
                                                "num_timesteps": 100, "zero_terminal_snr": True}, source
    # a new run from it that trains epsilon without the rescaling says so, one line per key
    new = load_config(None, SMALL + [f"model.init_from={weights}"])
    lines = init_source_changes(new.model, new.diffusion)
    assert [line.split(" was trained with ")[1].split(";")[0] for line in lines] == [
        "diffusion.prediction='v'", "diffusion.zero_terminal_snr=True"]
    assert "this run fine-tunes it with 'epsilon'" in lines[0] and "a resume refuses" in lines[0]
    same = load_config(None, SMALL + [f"model.init_from={weights}", "diffusion.prediction=v",
                                      "diffusion.zero_terminal_snr=true"])
    assert init_source_changes(same.model, same.diffusion) == []
