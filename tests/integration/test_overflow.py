"""Numbers that overflow (issue 39): finite weights whose outputs are not. A kohya-layout LoRA file whose
``alpha`` tensors are 1e30 passes the finite-weights check; difftrain refuses it at start (``sample --lora``,
``difftrain.load(lora=)``, ``model.init_lora_from``: one forward on a fixed input must be finite). Samples that
come out NaN or infinite stop ``sample``, ``eval`` and validation during training with one line naming the
checkpoint; a run whose every step was skipped as non-finite does not end with exit 0. Each case exited 0
(a black image, a run that trained nothing) before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.cli import EXIT_BAD_INPUT, main  # noqa: E402
from difftrain.config import load_config  # noqa: E402
from difftrain.checkpoints import checkpoint as ckpt  # noqa: E402
from tests.integration.test_hostile_cli import _one_error_line  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.conftest import TINY_OVERRIDES  # noqa: E402
from tests.integration.test_lora import PROMPT, _sd_overrides  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # a LoRA run's default lora.target_modules


def _kohya_file(sd: Path, path: Path, alpha: float) -> Path:
    """A kohya sd-scripts file (``lora_unet_<module path with _>.lora_down / lora_up / alpha``, rank 4) for
    every attention projection of the tiny base's UNet, small random factors, each module's ``alpha`` =
    ``alpha`` (a 0-d float32 tensor, as kohya writes it)."""
    from diffusers import UNet2DConditionModel
    from safetensors.torch import save_file

    unet = UNet2DConditionModel.from_pretrained(sd / "unet")
    g, tensors = torch.Generator().manual_seed(0), {}
    for name, module in unet.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(TARGETS):
            key = "lora_unet_" + name.replace(".", "_")
            tensors[f"{key}.lora_down.weight"] = torch.randn(4, module.in_features, generator=g) * 0.1
            tensors[f"{key}.lora_up.weight"] = torch.randn(module.out_features, 4, generator=g) * 0.1
            tensors[f"{key}.alpha"] = torch.tensor(alpha)
    save_file(tensors, path, metadata={"ss_network_module": "networks.lora", "ss_network_dim": "4"})
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The tiny Stable Diffusion folder (``sd/``), captioned squares (``data/``), and two kohya files of its
    UNet: ``overflowing.safetensors`` (alpha 1e30: every weight finite) and ``fine.safetensors`` (alpha 8)."""
    root = tmp_path_factory.mktemp("overflow")
    _sd_overrides(root, list(TINY_OVERRIDES))  # writes sd/ and data/
    _kohya_file(root / "sd", root / "overflowing.safetensors", 1e30)
    _kohya_file(root / "sd", root / "fine.safetensors", 8.0)
    return root


# ---------------------------------------------------------------------------------------------
# An adapter that makes the first forward non-finite: refused at start.


def test_sample_refuses_an_overflowing_kohya_file_in_one_line(base, tmp_path):
    file, out = base / "overflowing.safetensors", tmp_path / "samples"
    proc = subprocess.run([sys.executable, "-m", "difftrain", "sample", "--lora", str(file), "--base", str(base / "sd"),
                           "--num", "2", "--steps", "2", "--prompt", PROMPT, "--out", str(out), "--device", "cpu"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"})
    line = _one_error_line(proc.stderr)
    assert proc.returncode == EXIT_BAD_INPUT, (proc.returncode, proc.stderr)  # was 0, with a black image
    assert str(file) in line and "non-finite outputs" in line and "overflow" in line, line
    assert not list(out.glob("*.png"))


def test_the_python_api_refuses_an_overflowing_file_and_takes_a_fine_one(base):
    import difftrain

    with pytest.raises(ValueError, match="non-finite outputs") as info:
        difftrain.load(lora=base / "overflowing.safetensors", base=base / "sd", device="cpu")
    assert str(base / "overflowing.safetensors") in str(info.value) and "\n" not in str(info.value)
    model = difftrain.load(lora=base / "fine.safetensors", base=base / "sd", device="cpu")  # the check passes it
    assert torch.isfinite(difftrain.generate(model, 1, steps=2, prompt=PROMPT)).all()


def test_init_lora_from_an_overflowing_file_is_refused_before_any_step(base, tmp_path, capsys):
    file, run_dir = base / "overflowing.safetensors", tmp_path / "run"
    args = ["train", "--run-dir", str(run_dir)]
    for s in _sd_overrides(base, list(TINY_OVERRIDES), f"model.init_lora_from={file}", "train.total_steps=2"):
        args += ["--set", s]
    assert main(args) == EXIT_BAD_INPUT  # was 0: every step skipped as non-finite
    line = _one_error_line(capsys.readouterr().err)
    assert f"model.init_lora_from {file}" in line and "non-finite outputs" in line, line
    assert not (run_dir / "checkpoints").exists()


def _start_on_rank(ctx, run_dir: str, overrides: list[str]) -> str:
    """A rank's ``train`` of ``overrides`` (for ``run_ranks``): "" when it ran to its end, else its ValueError."""
    try:
        train(load_config(None, overrides), run_dir)
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.slow  # about 50 s on the shared 2-core machine: two 2-rank starts
def test_init_lora_from_is_checked_on_every_rank_of_a_sharded_start(base, tmp_path):
    """Under FSDP (2 gloo processes, the network built sharded from the files): each rank runs the sharded
    network's forward in lockstep; the overflowing file is refused by both, a fine one trains."""
    from tests.multiproc import run_ranks

    fsdp = ["train.device=cpu", "train.channels_last=off", "train.parallel=fsdp", "train.batch_size=4",
            "train.total_steps=1", "tracking.tensorboard=false"]
    for name, says in (("overflowing", "non-finite outputs"), ("fine", "")):
        overrides = _sd_overrides(base, list(TINY_OVERRIDES), *fsdp, f"model.init_lora_from={base / name}.safetensors")
        lines = run_ranks(_start_on_rank, 2, str(tmp_path / name), overrides)
        assert all(says in line if says else line == "" for line in lines), lines


# ---------------------------------------------------------------------------------------------
# A run whose every step is skipped (non-finite) does not exit 0.


def _nan_loss(monkeypatch, every: int = 1) -> None:
    """Every ``every``-th micro-batch's loss NaN (1: all of them)."""
    from difftrain.diffusion import objective

    real, calls = objective.diffusion_loss, [0]

    def loss(*args):
        calls[0] += 1
        return real(*args) * (float("nan") if calls[0] % every == 0 else 1.0)

    monkeypatch.setattr(objective, "diffusion_loss", loss)


def _train_args(run_dir: Path, *extra: str) -> list[str]:
    sets = TINY_OVERRIDES + ["validation.every_steps=0", "train.max_nonfinite_in_row=100", *extra]
    return ["train", "--run-dir", str(run_dir)] + [a for s in sets for a in ("--set", s)]


def test_a_run_whose_every_step_is_skipped_exits_2(tmp_path, monkeypatch, capsys):
    _nan_loss(monkeypatch)
    assert main(_train_args(tmp_path / "run")) == EXIT_BAD_INPUT  # 6 steps, fewer than max_nonfinite_in_row
    line = _one_error_line(capsys.readouterr().err)
    assert "no step of this run was applied: all 6 were skipped for a non-finite loss or gradient" in line, line
    state = ckpt.load_checkpoint(tmp_path / "run")  # the weights it started from, finite, saved
    assert state["step"] == state["skipped_steps"] == 6


def test_skipped_steps_are_counted_over_the_run_and_per_optimizer_step(tmp_path, monkeypatch, capsys):
    # A start stopped early (--stop-at-step) with every step skipped is not a success either; its resume,
    # still skipping every step, counts the whole run's steps.
    with monkeypatch.context() as m:
        _nan_loss(m)
        assert main(_train_args(tmp_path / "all") + ["--stop-at-step", "2"]) == EXIT_BAD_INPUT
        assert "all 2 were skipped" in _one_error_line(capsys.readouterr().err)
        assert main(_train_args(tmp_path / "all")) == EXIT_BAD_INPUT
        assert "all 6 were skipped" in _one_error_line(capsys.readouterr().err)
    # A run that applied steps before (its first start) and skips every step of this start is judged by
    # train.max_nonfinite_in_row, not by this rule: exit 0.
    assert main(_train_args(tmp_path / "some") + ["--stop-at-step", "2"]) == 0
    with monkeypatch.context() as m:
        _nan_loss(m)
        assert main(_train_args(tmp_path / "some")) == 0
    assert ckpt.load_checkpoint(tmp_path / "some")["skipped_steps"] == 4
    # Gradient accumulation: a step is skipped whole when one of its micro-batches is non-finite.
    with monkeypatch.context() as m:
        _nan_loss(m, every=2)  # the second micro-batch of each step
        assert main(_train_args(tmp_path / "accum", "train.grad_accum_steps=2", "train.batch_size=4")) == EXIT_BAD_INPUT
        assert "all 6 were skipped" in _one_error_line(capsys.readouterr().err)


# ---------------------------------------------------------------------------------------------
# Samples that come out non-finite stop sample, eval and validation with one line.


@pytest.fixture(scope="module")
def overflowing_checkpoint(tmp_path_factory) -> Path:
    """A tiny pixel run at step 2 whose checkpoint's weights (raw and EMA) are scaled by 1e20: every one
    finite (the checkpoint loads), its outputs not."""
    root = tmp_path_factory.mktemp("overflowing_checkpoint")
    train(load_config(None, TINY_OVERRIDES + ["train.total_steps=2", "validation.every_steps=0"]), root / "run")
    path = root / "run" / "checkpoints" / "step_00000002.pt"
    state = torch.load(path, weights_only=True)
    for weights in (state["model"], state["ema"]["model"]):
        for name, value in weights.items():
            if value.is_floating_point():
                weights[name] = value * 1e20
    assert all(torch.isfinite(v).all() for v in state["ema"]["model"].values())
    torch.save(state, path)
    return path


def test_non_finite_samples_of_a_checkpoint_stop_sample_in_one_line(overflowing_checkpoint, tmp_path, capsys):
    out = tmp_path / "samples"
    code = main(["sample", "--checkpoint", str(overflowing_checkpoint), "--num", "2", "--steps", "2", "--out", str(out)])
    line = _one_error_line(capsys.readouterr().err)
    assert code == EXIT_BAD_INPUT, line  # was 0, with black images
    assert str(overflowing_checkpoint) in line and "came out not finite (NaN or inf)" in line, line
    assert not list(out.glob("*.png"))


def test_non_finite_samples_of_a_checkpoint_stop_eval_in_one_line(overflowing_checkpoint, tmp_path, monkeypatch,
                                                                  capsys):
    from tests.fid_standin import use_standin, write_standin

    use_standin(monkeypatch, write_standin(tmp_path / "standin.pt", 16), 16, tmp_path / "cache")
    code = main(["eval", "--checkpoint", str(overflowing_checkpoint), "--num", "4", "--steps", "2", "--no-kid",
                 "--ref-num", "8"])
    line = _one_error_line(capsys.readouterr().err)
    assert code == EXIT_BAD_INPUT, line  # was 0, an FID of black images
    assert str(overflowing_checkpoint) in line and "came out not finite" in line, line


def test_non_finite_validation_samples_stop_the_run_in_one_line(overflowing_checkpoint, tmp_path, capsys):
    run_dir = tmp_path / "run"
    sets = TINY_OVERRIDES + [f"model.init_from={overflowing_checkpoint}", "validation.every_steps=2"]
    assert main(["train", "--run-dir", str(run_dir)] + [a for s in sets for a in ("--set", s)]) == EXIT_BAD_INPUT
    line = _one_error_line(capsys.readouterr().err)
    assert "step 2: the validation grid of the EMA weights: samples 0-" in line and "came out not finite" in line, line
    assert f"the newest checkpoint in {run_dir / 'checkpoints'} is untouched" in line, line
    assert f"model.init_from {overflowing_checkpoint}" in line, line
    assert not list((run_dir / "samples").glob("*.png"))  # no black grid written
