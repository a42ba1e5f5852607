"""The Python API and export / import end to end: the README's example runs, a config error
comes before any folder is made, and a run started from an exported diffusers folder trains
and resumes exactly."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import difftrain
from conftest import TINY_OVERRIDES
from difftrain.cli import main
from difftrain.config import ConfigError, parse_override
from difftrain.checkpoints.checkpoint import load_checkpoint, state_dict_sha256

ROOT = Path(__file__).parents[2]
FAST = {"train.progress_bar": False, "tracking.tensorboard": False, "validation.every_steps": 0,
        "data.num_workers": 0}


def overrides(*extra: str) -> dict:
    """The tiny run's ``--set`` overrides as keyword overrides of the API."""
    parsed = [parse_override(o) for o in TINY_OVERRIDES + list(extra)]
    return {**{f"{section}.{key}": value for section, key, value in parsed}, **FAST}


def test_import_difftrain_is_lazy():
    import subprocess
    import sys

    code = "import sys, difftrain; assert 'torch' not in sys.modules; print(*dir(difftrain))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert {"train", "load", "generate", "export", "Config"} <= set(out.stdout.split())
    assert difftrain.train.__module__ == "difftrain.api"


def test_readme_python_example_runs(tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Python API\n.*?```python\n(.*?)```", text, re.S).group(1)
    code = code.replace("train__total_steps=300", "train__total_steps=2, data__num_workers=0, "
                        "train__progress_bar=False, tracking__tensorboard=False, validation__every_steps=0")
    code = code.replace("steps=20", "steps=3")
    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "tiny.toml", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102
    assert scope["result"].step == 2 and (tmp_path / "runs" / "notebook.safetensors").is_file()
    # generate gives what `difftrain sample` writes for the same seed
    images = difftrain.generate(difftrain.load(tmp_path / "runs" / "notebook.safetensors"), 16, steps=3, seed=0)
    assert torch.equal(images, scope["images"])


def test_bad_config_in_python_fails_before_any_folder(tmp_path):
    cfg = difftrain.make_config(None, **overrides())
    with pytest.raises(ConfigError, match=r"train\.precision"):
        cfg.train.precision = "fp8"
    assert cfg.train.precision == "fp32"
    with pytest.raises(ConfigError, match=r"train\.precision"):
        difftrain.train(cfg, tmp_path / "run", train__precision="fp8")
    with pytest.raises(ConfigError, match=r"optim\.lrr"):
        difftrain.train(None, tmp_path / "run", optim__lrr=1.0)
    assert not (tmp_path / "run").exists()


def test_train_from_an_exported_diffusers_folder_resumes_exactly(tmp_path, capsys):
    pytest.importorskip("diffusers")
    base = difftrain.train(None, tmp_path / "base", **overrides("train.total_steps=2"))
    assert main(["export", str(tmp_path / "base"), str(tmp_path / "pipe")]) == 0
    assert main(["export", str(tmp_path / "base"), str(tmp_path / "w.safetensors"), "--format", "safetensors"]) == 0
    assert "exported as diffusers" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "w.safetensors")]) == 0

    start = load_checkpoint(base.checkpoint)["ema"]["model"]
    tuned = overrides("train.total_steps=4", f"model.init_from={tmp_path / 'pipe'}", "train.seed=7")
    straight = difftrain.train(None, tmp_path / "straight", **tuned)
    difftrain.train(None, tmp_path / "stopped", stop_at_step=2, **tuned)
    shutil.rmtree(tmp_path / "pipe")  # a resume reads its checkpoint, not init_from
    resumed = difftrain.train(None, tmp_path / "stopped", **tuned)
    a, b = load_checkpoint(straight.checkpoint), load_checkpoint(resumed.checkpoint)
    assert a["step"] == b["step"] == 4
    assert state_dict_sha256(a["model"]) == state_dict_sha256(b["model"])
    assert state_dict_sha256(a["ema"]["model"]) == state_dict_sha256(b["ema"]["model"])
    assert state_dict_sha256(a["model"]) != state_dict_sha256(start)
    # A run from the .safetensors file starts at its weights: one step (lr 5e-4) away from them.
    first = difftrain.train(None, tmp_path / "first", **overrides(
        "train.total_steps=1", "train.seed=7", f"model.init_from={tmp_path / 'w.safetensors'}"))
    after = load_checkpoint(first.checkpoint)["model"]
    assert 0 < (after["conv_in.weight"] - start["conv_in.weight"]).abs().max() < 2e-3


def test_switching_the_objective_in_python_takes_one_keyword():
    """As with --set: samplers that neither the preset nor a keyword names follow the objective."""
    from pathlib import Path

    from difftrain.api import make_config

    preset = Path(__file__).parents[2] / "configs" / "tiny.toml"
    cfg = make_config(preset, diffusion__objective="edm")
    assert (cfg.validation.sampler, cfg.evaluation.fid_sampler) == ("heun", "heun")
    assert make_config(None, diffusion__objective="flow").validation.sampler == "heun"
    kept = make_config(preset, diffusion__objective="edm", validation__sampler="euler")
    assert (kept.validation.sampler, kept.evaluation.fid_sampler) == ("euler", "heun")
    with pytest.raises(ConfigError, match="validation.sampler='ddim'"):
        make_config(preset, diffusion__objective="edm", validation__sampler="ddim")
