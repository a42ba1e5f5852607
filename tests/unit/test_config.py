"""Config: presets load, overrides are typed, bad keys and values are named."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from difftrain import config as C
from difftrain.config import ConfigError, config_from_dict, config_to_dict, config_to_toml, load_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.toml"))


def test_defaults_follow_practice():
    cfg = load_config()
    assert cfg.optim.lr == 2e-4 and cfg.optim.betas == (0.9, 0.999)
    assert cfg.train.batch_size == 128 and cfg.diffusion.num_timesteps == 1000
    assert cfg.diffusion.schedule == "cosine" and cfg.ema.decay == 0.9999 and cfg.ema.warmup
    assert cfg.optim.grad_clip == 1.0 and cfg.optim.warmup_steps == 5000


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_presets_load_and_round_trip(path, tmp_path):
    # a fine-tuning preset (configs/*-lora.toml) names its base on the command line
    cfg = load_config(path, ["model.init_from=base-folder/"] if path.stem.endswith("-lora") else [])
    out = tmp_path / "resolved.toml"
    out.write_text(config_to_toml(cfg))
    assert load_config(out) == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_overrides_are_parsed_against_the_field_type():
    cfg = load_config(
        None,
        ["optim.lr=3e-4", "train.total_steps=10", "data.random_flip=false", "model.channel_mult=[1, 2]",
         "optim.betas=[0.9, 0.99]", "data.path=/some/folder", "diffusion.prediction=v", "model.base_channels=none"],
    )
    assert cfg.optim.lr == 3e-4 and cfg.train.total_steps == 10 and cfg.data.random_flip is False
    assert cfg.model.channel_mult == (1, 2) and cfg.optim.betas == (0.9, 0.99)
    assert cfg.data.path == "/some/folder" and cfg.diffusion.prediction == "v" and cfg.model.base_channels is None


@pytest.mark.parametrize(
    "override, named",
    [
        ("optim.lrr=1e-4", "optim.lrr"),
        ("optimizer.lr=1e-4", "optimizer"),
        ("optim.lr=-1", "optim.lr"),
        ("optim.lr=fast", "optim.lr"),
        ("train.total_steps=1.5", "train.total_steps"),
        ("diffusion.schedule=cosin", "diffusion.schedule"),
        ("model.preset=huge", "model.preset"),
        ("data.channels=2", "data.channels"),
        ("optim.betas=[0.9]", "optim.betas"),
        ("validation.steps=5000", "validation.steps"),
    ],
)
def test_bad_keys_and_values_name_the_key(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(None, [override])


def test_typo_in_a_file_names_the_key_and_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\ntotal_stepz = 10\n")
    with pytest.raises(ConfigError, match=r"train\.total_stepz.*bad\.toml"):
        load_config(path)


def test_literal_choices_match_the_registries():
    from difftrain.diffusion.losses import LOSS_WEIGHTINGS
    from difftrain.diffusion.objective import OBJECTIVE_SAMPLERS, OBJECTIVES
    from difftrain.diffusion.process import PREDICTIONS
    from difftrain.diffusion.samplers import SAMPLERS
    from difftrain.diffusion.schedules import SCHEDULES

    assert set(typing.get_args(C.Schedule)) == set(SCHEDULES)
    assert set(typing.get_args(C.Prediction)) == set(PREDICTIONS)
    assert set(typing.get_args(C.LossWeighting)) == set(LOSS_WEIGHTINGS)
    # Sampler is the union of every objective's samplers; DDPM's are the SAMPLERS registry.
    assert set(typing.get_args(C.Sampler)) == {n for names in OBJECTIVE_SAMPLERS.values() for n in names}
    assert set(OBJECTIVE_SAMPLERS["ddpm"]) == set(SAMPLERS)
    assert set(OBJECTIVE_SAMPLERS) == set(OBJECTIVES)
    assert set(typing.get_args(C.ObjectiveName)) == set(OBJECTIVES)
    from difftrain.diffusion.flow import FLOW_LOSSES, T_SAMPLINGS

    assert set(typing.get_args(C.FlowLoss)) == set(FLOW_LOSSES)
    assert set(typing.get_args(C.FlowTSampling)) == set(T_SAMPLINGS)


def test_config_holds_the_registries_choices_without_importing_them():
    """config sits below the registries (it imports none of them): the schema it holds of their
    names (each objective's samplers and default, the UNet presets, the quantized base's
    libraries) is the registries', in their order, since error messages list them."""
    import ast

    from difftrain.diffusion.objective import DEFAULT_SAMPLERS, OBJECTIVE_SAMPLERS
    from difftrain.models import MODEL_PRESETS
    from difftrain.networks.quantize import QUANTIZE_KINDS

    assert C.OBJECTIVE_SAMPLER_NAMES == OBJECTIVE_SAMPLERS
    assert C.DEFAULT_SAMPLERS == DEFAULT_SAMPLERS
    assert C.MODEL_PRESET_NAMES == tuple(MODEL_PRESETS)
    assert C.QUANTIZE_PACKAGES == {kind: k.library for kind, k in QUANTIZE_KINDS.items()}
    assert set(typing.get_args(C.QuantizeBase)) == {"off", *QUANTIZE_KINDS}
    tree = ast.parse(Path(C.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    # difftrain.families: _follow_base's, which the unet-family work takes out (issue 40)
    assert {m for m in imported if m.startswith("difftrain")} <= {"difftrain.families"}


def test_incompatible_keys_are_the_architecture_ones():
    old = config_to_dict(load_config())
    new = config_to_dict(load_config(None, ["model.base_channels=64", "train.total_steps=7", "data.resolution=64"]))
    changes = C.config_changes(old, new)
    assert set(changes) == {"model.base_channels", "train.total_steps", "data.resolution"}
    assert set(C.incompatible_keys(old, new)) == {"model.base_channels", "data.resolution"}


def test_zero_terminal_snr_refuses_epsilon_and_other_objectives_in_one_line():
    with pytest.raises(ConfigError, match=r"diffusion\.zero_terminal_snr needs diffusion\.prediction='v'") as e:
        load_config(None, ["diffusion.zero_terminal_snr=true"])
    assert "\n" not in str(e.value)
    assert load_config(None, ["diffusion.zero_terminal_snr=true", "diffusion.prediction=v"]).diffusion.zero_terminal_snr
    for key in ("diffusion.zero_terminal_snr=true", "diffusion.input_perturbation=0.1"):
        with pytest.raises(ConfigError, match=r"diffusion\.(zero_terminal_snr|input_perturbation) is for .*'ddpm'"):
            load_config(None, ["diffusion.objective=flow", "diffusion.prediction=v", key])
    for key in ("diffusion.noise_offset=-0.1", "diffusion.input_perturbation=-0.1"):
        with pytest.raises(ConfigError, match=key.split("=")[0].replace(".", r"\.")):
            load_config(None, [key])


def test_a_resume_refuses_a_changed_zero_terminal_snr_but_not_the_training_noise_knobs():
    old = config_to_dict(load_config(None, ["diffusion.prediction=v"]))
    new = config_to_dict(load_config(None, ["diffusion.prediction=v", "diffusion.zero_terminal_snr=true",
                                            "diffusion.noise_offset=0.1", "diffusion.input_perturbation=0.1"]))
    assert set(C.incompatible_keys(old, new)) == {"diffusion.zero_terminal_snr"}
    assert set(C.allowed_changes(old, new)) == {"diffusion.noise_offset", "diffusion.input_perturbation"}


def test_a_checkpoint_written_before_a_key_existed_reads_as_its_default():
    # A run saved by an older difftrain lacks the newer keys: resuming it is no change.
    old = config_to_dict(load_config())
    for key in ("zero_terminal_snr", "noise_offset", "input_perturbation"):
        del old["diffusion"][key]
    assert C.config_changes(old, config_to_dict(load_config())) == {}
    assert set(C.incompatible_keys(old, config_to_dict(load_config(None, ["diffusion.prediction=v",
                                                                          "diffusion.zero_terminal_snr=true"])))) \
        == {"diffusion.prediction", "diffusion.zero_terminal_snr"}


def test_a_run_saved_before_buckets_existed_does_not_resume_with_buckets_on():
    # A base-folder run saved before data.buckets existed trained square crops; the key now defaults to
    # "aspect" for a base folder, which would change the data order: the resume names the key instead.
    old = config_to_dict(load_config())
    del old["data"]["buckets"]
    new = config_to_dict(load_config(None, ["data.buckets=aspect"]))
    assert set(C.incompatible_keys(old, new)) == {"data.buckets"}
    masked = config_to_dict(load_config(None, ["data.masks=true"]))
    mp = config_to_dict(load_config(None, ["model.magnitude_preserving=true"]))
    assert set(C.incompatible_keys(old, masked)) == {"data.masks"}
    assert set(C.incompatible_keys(old, mp)) == {"model.magnitude_preserving"}


def test_switching_the_objective_takes_one_option_and_only_chosen_samplers_can_conflict(tmp_path):
    tiny = Path(__file__).parents[2] / "configs" / "tiny.toml"
    for objective, sampler in (("ddpm", "ddim"), ("edm", "heun"), ("flow", "heun")):
        cfg = load_config(tiny, [f"diffusion.objective={objective}"])
        assert (cfg.validation.sampler, cfg.evaluation.fid_sampler) == (sampler, sampler), objective
        resolved = tmp_path / f"{objective}.toml"  # config.toml names the samplers: a resume reads the same
        resolved.write_text(config_to_toml(cfg))
        assert load_config(resolved) == cfg
    cfg = load_config(tiny, ["diffusion.objective=edm", "validation.sampler=euler"])  # a choice is kept
    assert (cfg.validation.sampler, cfg.evaluation.fid_sampler) == ("euler", "heun")
    # Every conflicting choice in one message; a key the user left alone is not one.
    with pytest.raises(ConfigError) as e:
        load_config(tiny, ["diffusion.objective=flow", "validation.sampler=ddim", "evaluation.fid_sampler=dpmpp_2m"])
    assert "validation.sampler='ddim' and evaluation.fid_sampler='dpmpp_2m'" in str(e.value)
    assert "euler, heun, midpoint" in str(e.value)
    preset = tmp_path / "preset.toml"  # a preset that names the key chose it too
    preset.write_text('[diffusion]\nobjective = "edm"\n[validation]\nsampler = "ddim"\n')
    with pytest.raises(ConfigError) as e:
        load_config(preset)
    assert "validation.sampler='ddim'" in str(e.value) and "fid_sampler" not in str(e.value)
