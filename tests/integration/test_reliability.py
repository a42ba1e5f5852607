"""Faults made real: signals to real processes, failing disks, bad numbers, changed configs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from difftrain.config import load_config
from difftrain.checkpoints import checkpoint as ckpt
from difftrain.training.loop import TrainingDiverged, train
from difftrain.training.signals import EXIT_STOPPED

ROOT = Path(__file__).resolve().parents[2]


def _train_proc(run_dir, overrides, env_extra=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "difftrain", "train", "--run-dir", str(run_dir)]
    cmd += [x for o in overrides for x in ("--set", o)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env_extra or {})}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, proc, timeout_s=300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# 1. Kills ------------------------------------------------------------------------------------


def test_sigterm_saves_at_the_step_boundary_and_the_run_resumes_exactly(tmp_path, tiny_overrides):
    overrides = tiny_overrides + ["train.total_steps=10000", "train.log_every_steps=1", "validation.every_steps=0",
                                  "checkpoint.every_steps=10000", "tracking.tensorboard=false"]
    run = tmp_path / "run"
    proc = _train_proc(run, overrides)
    _wait_for(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 2, proc)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, err
    assert "SIGTERM" in err
    state = ckpt.load_checkpoint(run)
    stopped_at = int(state["step"])
    assert stopped_at >= 2 and (run / "checkpoints" / "latest").read_text().strip() == ckpt.checkpoint_name(stopped_at)

    # The same schedule straight through to one step past the stop, and resumed: equal weights.
    cfg = load_config(None, overrides)
    train(cfg, tmp_path / "straight", stop_at_step=stopped_at + 1)
    train(cfg, run, stop_at_step=stopped_at + 1)
    a, b = ckpt.load_checkpoint(tmp_path / "straight"), ckpt.load_checkpoint(run)
    assert ckpt.state_dict_sha256(a["model"]) == ckpt.state_dict_sha256(b["model"])
    assert ckpt.state_dict_sha256(a["ema"]["model"]) == ckpt.state_dict_sha256(b["ema"]["model"])


def test_a_stopping_run_saves_before_it_would_validate(tmp_path, tiny_overrides):
    # A preemption gives seconds: the step at which the stop is seen is saved without its grid.
    overrides = tiny_overrides + ["train.total_steps=10000", "train.log_every_steps=1", "validation.every_steps=1",
                                  "checkpoint.every_steps=10000", "tracking.tensorboard=false"]
    run = tmp_path / "run"
    proc = _train_proc(run, overrides)
    _wait_for(lambda: len(list((run / "samples").glob("step_*.png"))) >= 2, proc)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, err
    stopped_at = int(ckpt.load_checkpoint(run)["step"])
    grids = sorted(int(p.stem.split("_")[1]) for p in (run / "samples").glob("step_*.png"))
    assert grids == list(range(1, stopped_at)), (grids, stopped_at)  # every step's grid but the last


def test_ctrl_c_to_the_process_group_with_loader_workers_stops_cleanly(tmp_path, tiny_overrides):
    overrides = tiny_overrides + ["train.total_steps=10000", "train.log_every_steps=1", "validation.every_steps=0",
                                  "checkpoint.every_steps=10000", "tracking.tensorboard=false", "data.num_workers=1"]
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "difftrain", "train", "--run-dir", str(run)] + [x for o in overrides for x in ("--set", o)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    # A logged step: the handler is installed (a Ctrl-C during start-up is a plain KeyboardInterrupt).
    _wait_for(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 1, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C: main process and workers
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, err
    assert ckpt.load_checkpoint(run)["step"] >= 1


def test_a_second_signal_inside_a_checkpoint_write_exits_at_once_and_keeps_the_old_one(tmp_path, tiny_overrides):
    overrides = tiny_overrides + ["train.total_steps=10000", "validation.every_steps=0", "tracking.tensorboard=false"]
    run = tmp_path / "run"
    # The first save (step 2) pauses between write and rename long enough to aim at it.
    proc = _train_proc(run, overrides, {ckpt.PAUSE_ENV: "3"})
    ckpt_dir = run / "checkpoints"
    _wait_for(lambda: (ckpt_dir / "latest").exists(), proc)  # step 2 is complete
    _wait_for(lambda: any(ckpt_dir.glob(".step_*.tmp")), proc)  # step 4 is being written
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert (ckpt_dir / "latest").read_text().strip() == ckpt.checkpoint_name(2)
    assert ckpt.load_checkpoint(run)["step"] == 2


def test_a_double_ctrl_c_to_the_process_group_with_loader_workers_exits_130_with_one_line(tmp_path, tiny_overrides):
    """The second Ctrl-C reaches the workers too: they leave stopping to the main process (they
    used to exit on it, and the main process then raised "DataLoader worker exited unexpectedly",
    exit 70 with a traceback)."""
    overrides = tiny_overrides + ["train.total_steps=10000", "validation.every_steps=0", "tracking.tensorboard=false",
                                  "data.num_workers=2"]
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "difftrain", "train", "--run-dir", str(run)] + [x for o in overrides for x in ("--set", o)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), ckpt.PAUSE_ENV: "2"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    ckpt_dir = run / "checkpoints"
    _wait_for(lambda: (ckpt_dir / "latest").exists(), proc)  # step 2 is complete
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the save of the stop pauses inside its write
    _wait_for(lambda: any(ckpt_dir.glob(".step_*.tmp")), proc)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C again: stop now
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.count("second signal") == 1 and err.count("SIGINT received") == 1, err
    assert "Traceback" not in err and "internal error" not in err
    assert ckpt.load_checkpoint(run)["step"] >= 2  # the newest complete checkpoint is intact


def test_sigterm_to_the_process_group_with_loader_workers_saves_and_exits_75_with_one_line(tmp_path, tiny_overrides):
    """What a scheduler, or torchrun's agent when a peer fails, does: SIGTERM to the whole group.
    The workers used to die of it (PyTorch's worker handler obeys only its parent) and the main
    process then raised "DataLoader worker ... killed by signal: Terminated", exit 70, no save."""
    overrides = tiny_overrides + ["train.total_steps=10000", "train.log_every_steps=1", "validation.every_steps=0",
                                  "checkpoint.every_steps=10000", "tracking.tensorboard=false", "data.num_workers=2"]
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "difftrain", "train", "--run-dir", str(run)] + [x for o in overrides for x in ("--set", o)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    _wait_for(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 2, proc)
    os.killpg(proc.pid, signal.SIGTERM)  # `kill -TERM -PGID`: the main process and its two workers
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, err
    assert err.count("SIGTERM received") == 1 and "Traceback" not in err and "internal error" not in err, err
    step = ckpt.load_checkpoint(run)["step"]
    assert f"SIGTERM stopped the run at step {step}" in out and step >= 2


def test_sigkill_campaign_short(tmp_path):
    """A short run of scripts/fault_injection.py (the full one: pytest -m slow, or the script)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import fault_injection
    finally:
        sys.path.pop(0)
    out = fault_injection.campaign(kills=2, workdir=tmp_path, total_steps=6, seed=1, log=lambda s: None)
    assert out.kills == 2 and out.survived == 2 and not out.lost, out.summary()


def test_a_kill_between_a_checkpoints_rename_and_its_latest_pointer_loses_nothing(tmp_path, tiny_overrides):
    """The two states such a kill leaves, made by hand: the first checkpoint without a ``latest``
    (resume takes the newest complete checkpoint), and a later one with ``latest`` still naming
    the previous checkpoint (resume redoes the steps since). The fault-injection campaign's check
    agrees with resume, and the run ends with the uninterrupted run's weights."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import fault_injection
    finally:
        sys.path.pop(0)
    cfg = load_config(None, tiny_overrides + ["validation.every_steps=0", "checkpoint.keep_last=3"])
    train(cfg, tmp_path / "straight")
    run = tmp_path / "run"
    pointer = run / "checkpoints" / ckpt.LATEST
    train(cfg, run, stop_at_step=2)
    pointer.unlink()  # killed after step 2's rename, before its first pointer
    assert fault_injection.check_resumable(run) is None and ckpt.find_checkpoint(run).name == ckpt.checkpoint_name(2)
    train(cfg, run, stop_at_step=4)
    pointer.write_text(ckpt.checkpoint_name(2) + "\n")  # killed after step 4's rename, before the pointer moved
    assert fault_injection.check_resumable(run) is None and ckpt.find_checkpoint(run).name == ckpt.checkpoint_name(2)
    assert train(cfg, run).step == 6
    a, b = ckpt.load_checkpoint(tmp_path / "straight"), ckpt.load_checkpoint(run)
    assert ckpt.state_dict_sha256(a["model"]) == ckpt.state_dict_sha256(b["model"])
    assert ckpt.state_dict_sha256(a["ema"]["model"]) == ckpt.state_dict_sha256(b["ema"]["model"])
    pointer.unlink()
    for _, path in ckpt.list_checkpoints(run / "checkpoints"):
        path.unlink()
    pointer.write_text(ckpt.checkpoint_name(6) + "\n")
    assert "none is complete" in fault_injection.check_resumable(run)  # a pointer to nothing is a loss


@pytest.mark.slow
def test_fault_injection_full(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(ROOT / "scripts" / "fault_injection.py"), "--kills", "30", "--workdir", str(tmp_path)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "lost: 0" in result.stdout


# 3. Disk errors ------------------------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a small tmpfs; yields a function (path, size) -> path. Skips where mounting is refused."""
    mounted = []

    def mount(path: Path, size: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.decode().strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_disk_full_keeps_the_previous_checkpoint(tmp_path, tiny_overrides, tmpfs, capsys):
    # One checkpoint of this model is ~13 MB: the first fits, the second fills the disk.
    run = tmp_path / "run"
    ckpt_dir = tmpfs(run / "checkpoints", "20m")
    cfg = load_config(None, tiny_overrides + ["checkpoint.on_write_error=continue", "validation.every_steps=0"])
    with pytest.raises(ckpt.CheckpointWriteError, match=r"last step, 6,.*/step_00000002.pt \(step 2\), 4 steps unsaved"):
        train(cfg, run)  # went on, but the last save failed too: not a success
    err = capsys.readouterr().err
    assert "ENOSPC" in err and str(ckpt_dir) in err
    assert ckpt.load_checkpoint(run)["step"] == 2
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["latest", "step_00000002.pt"]  # no temp file left

    stop = load_config(None, tiny_overrides + ["checkpoint.on_write_error=stop", "validation.every_steps=0"])
    with pytest.raises(ckpt.CheckpointWriteError, match=r"step 4 .*No space left on device"):
        train(stop, run)
    assert ckpt.load_checkpoint(run)["step"] == 2


def test_a_run_whose_last_save_fails_too_exits_2_naming_the_newest_checkpoint_and_the_unsaved_steps(
        tmp_path, tiny_overrides, monkeypatch, capsys):
    """checkpoint.on_write_error=continue goes on past failed saves, but a run that ends without
    its last checkpoint is no success for a job scheduler: exit 2, and the last line says what is lost."""
    from difftrain import cli

    real = ckpt.save_checkpoint

    def disk_full_after_step_2(state, ckpt_dir, step, *args):
        if step > 2:
            raise OSError(28, "No space left on device", str(ckpt_dir / ckpt.checkpoint_name(step)))
        return real(state, ckpt_dir, step, *args)

    monkeypatch.setattr(ckpt, "save_checkpoint", disk_full_after_step_2)
    args = ["train", "--run-dir", str(tmp_path / "run")]
    for o in tiny_overrides + ["checkpoint.on_write_error=continue", "validation.every_steps=0"]:
        args += ["--set", o]
    assert cli.main(args) == cli.EXIT_BAD_INPUT
    captured = capsys.readouterr()
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("difftrain train: error: ") and "trained to step" not in captured.out
    assert f"{tmp_path / 'run' / 'checkpoints' / 'step_00000002.pt'} (step 2), 4 steps unsaved" in last, last
    assert ckpt.load_checkpoint(tmp_path / "run")["step"] == 2


def test_read_only_checkpoint_folder_stops_cleanly(tmp_path, tiny_overrides, tmpfs):
    run = tmp_path / "run"
    ckpt_dir = tmpfs(run / "checkpoints", "40m")
    cfg = load_config(None, tiny_overrides + ["validation.every_steps=0"])
    train(cfg, run, stop_at_step=2)
    subprocess.run(["mount", "-o", "remount,ro", str(ckpt_dir)], check=True)
    with pytest.raises(ckpt.CheckpointWriteError, match=r"EROFS.*Read-only file system.*intact") as e:
        train(cfg, run)
    assert str(ckpt_dir) in str(e.value)
    assert ckpt.load_checkpoint(run)["step"] == 2


# 4. Data -------------------------------------------------------------------------------------


def test_training_skips_bad_images_including_one_that_goes_bad_mid_run(tmp_path, tiny_overrides, monkeypatch):
    from tests.unit.test_data_check import BAD, make_messy_folder
    from difftrain.data import check, prepare

    root = make_messy_folder(tmp_path / "d", good=6)
    real = check.prepare_dataset

    def prepare_then_break_one(*args):
        dataset = real(*args)
        (root / "good_0.png").write_bytes(b"not a png any more")  # breaks after the scan
        return dataset

    monkeypatch.setattr(prepare, "prepare_dataset", prepare_then_break_one)
    cfg = load_config(None, tiny_overrides + [f"data.path={root}", "validation.every_steps=0", "train.total_steps=4"])
    assert train(cfg, tmp_path / "run").step == 4
    log = (tmp_path / "run" / "bad_images.log").read_text()
    assert all(f"start\t{name}" in log for name in BAD)
    assert "mid-run\tgood_0.png" in log


@pytest.mark.parametrize("count", [0, 3])
def test_empty_or_too_small_folder_fails_before_the_model_is_built(tmp_path, tiny_overrides, monkeypatch, count):
    from difftrain.networks import build

    root = tmp_path / "d"
    root.mkdir()
    for i in range(count):
        torch.zeros(1)  # noqa: B018 - keep torch imported for the monkeypatch below
        from PIL import Image

        Image.new("RGB", (20, 20), (i, 0, 0)).save(root / f"{i}.png")
    monkeypatch.setattr(build, "build_model", lambda *a: pytest.fail("the model was built"))
    cfg = load_config(None, tiny_overrides + [f"data.path={root}"])
    with pytest.raises(ValueError, match=r"holds 0 images|fewer than train.batch_size"):
        train(cfg, tmp_path / "run")


def test_small_images_are_skipped_unless_min_image_size_accepts_and_upscales_them(tmp_path, tiny_overrides):
    from PIL import Image

    from difftrain.data import build_dataset

    root = tmp_path / "small"  # 12x12 images (like MNIST's 28x28 against a resolution of 32)
    root.mkdir()
    for i in range(10):
        Image.new("RGB", (12, 12), (20 * i, 0, 0)).save(root / f"{i}.png")
    Image.new("RGB", (8, 8)).save(root / "tiny.png")
    run = ["train.total_steps=2", "validation.every_steps=0", f"data.path={root}"]
    with pytest.raises(ValueError, match="holds 0 usable images .*11 too small: lower data.min_image_size"):
        train(load_config(None, tiny_overrides + run), tmp_path / "skipped")
    assert "min_image_size" in (tmp_path / "skipped" / "bad_images.log").read_text()  # says how to accept them

    train(load_config(None, tiny_overrides + run + ["data.min_image_size=12"]), tmp_path / "upscaled")
    log = (tmp_path / "upscaled" / "bad_images.log").read_text()
    assert "tiny.png" in log and "0.png" not in log  # still too small: 8 < 12
    assert ckpt.load_checkpoint(tmp_path / "upscaled")["step"] == 2
    x, *_ = build_dataset(str(root), resolution=16, channels=3, random_flip=False, color_jitter=0.0, class_conditional=False)[(0, 0)]
    assert x.shape == (3, 16, 16)  # upscaled to the resolution
    with pytest.raises(Exception, match="data.min_image_size must be in"):
        load_config(None, tiny_overrides + ["data.min_image_size=17"])


# 5. Numbers ----------------------------------------------------------------------------------


def test_divergence_stops_with_a_diagnostic(tmp_path, tiny_overrides, monkeypatch):
    from difftrain.diffusion import objective

    cfg = load_config(None, tiny_overrides + ["train.max_nonfinite_in_row=2", "validation.every_steps=0"])
    train(cfg, tmp_path, stop_at_step=2)
    before = (tmp_path / "checkpoints" / "step_00000002.pt").read_bytes()
    real = objective.diffusion_loss
    monkeypatch.setattr(objective, "diffusion_loss", lambda *args: real(*args) * float("inf"))
    with pytest.raises(TrainingDiverged) as e:
        train(cfg, tmp_path)
    text = str(e.value)
    assert "noise levels: [" in text and "x0: shape (8, 3, 16, 16)" in text and "gradient norms:" in text
    assert "conv_in" in text or "weight" in text  # per-layer names
    assert (tmp_path / "checkpoints" / "step_00000002.pt").read_bytes() == before


def test_a_checkpoint_with_non_finite_weights_is_never_written(tmp_path):
    state = {"model": {"w": torch.tensor([1.0, float("nan")])}, "ema": {"model": {"w": torch.ones(2)}}}
    with pytest.raises(ckpt.NonFiniteWeights, match="model weight w"):
        ckpt.save_checkpoint(state, tmp_path, 1)
    assert not list(tmp_path.iterdir())


# 6. Mismatch on resume -----------------------------------------------------------------------


def test_resume_lists_each_incompatible_key_and_each_allowed_change(tmp_path, tiny_overrides, capsys):
    train(load_config(None, tiny_overrides + ["validation.every_steps=0"]), tmp_path, stop_at_step=2)
    changed = load_config(None, tiny_overrides + [
        "data.resolution=32", "data.channels=1", "diffusion.schedule=linear", "model.channel_mult=[1,2,2]"])
    with pytest.raises(ValueError) as e:
        train(changed, tmp_path)
    for line in ("data.resolution: checkpoint 16, now 32", "data.channels: checkpoint 3, now 1",
                 "diffusion.schedule: checkpoint 'cosine', now 'linear'", "model.channel_mult:"):
        assert line in str(e.value)
    harmless = load_config(None, tiny_overrides + ["validation.every_steps=0", "train.total_steps=8",
                                                   "train.log_every_steps=4", "data.num_workers=1"])
    capsys.readouterr()
    assert train(harmless, tmp_path, stop_at_step=4).step == 4
    out = capsys.readouterr().out
    for key in ("train.total_steps: checkpoint 6, now 8", "train.log_every_steps: checkpoint 2, now 4",
                "data.num_workers: checkpoint 0, now 1"):
        assert f"resuming with a changed {key}" in out


@pytest.mark.parametrize("extra", [{"augment": {}}, {"augment": {"mixup": 0.2}}, {"train": {"mixup": 0.2}}],
                         ids=["empty section", "section", "key"])
def test_a_checkpoint_whose_config_has_an_unknown_section_or_key_is_refused_naming_it(tmp_path, tiny_overrides, extra):
    cfg = load_config(None, tiny_overrides + ["validation.every_steps=0"])
    train(cfg, tmp_path, stop_at_step=2)
    path = ckpt.find_checkpoint(tmp_path)
    state = torch.load(path, weights_only=True)
    for section, keys in extra.items():
        state["config"].setdefault(section, {}).update(keys)
    torch.save(state, path)
    (name, keys), = extra.items()
    named = f"{name}.{next(iter(keys))}" if keys else name
    with pytest.raises(ValueError, match=rf"cannot resume from {path}: .*unknown .*{named}"):
        train(cfg, tmp_path)


# 7. Security ---------------------------------------------------------------------------------


def test_a_crafted_checkpoint_in_the_run_directory_is_refused_on_resume(tmp_path, tiny_cfg):
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    (tmp_path / "checkpoints").mkdir()
    torch.save({"format": ckpt.FORMAT, "x": Payload()}, tmp_path / "checkpoints" / "step_00000004.pt")
    with pytest.raises(ValueError, match="cannot load checkpoint"):
        train(tiny_cfg, tmp_path)
    assert not (tmp_path / "pwned").exists()


def test_config_is_data_and_credentials_stay_out_of_the_run(tmp_path, tiny_overrides, monkeypatch):
    from difftrain.config import ConfigError

    code = tmp_path / "evil.toml"
    code.write_text(f"import os; os.system('touch {tmp_path / 'pwned'}')\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(code)
    assert not (tmp_path / "pwned").exists()

    secret = "sk-difftrain-test-0123456789abcdef"
    for var in ("WANDB_API_KEY", "HF_TOKEN", "MLFLOW_TRACKING_PASSWORD", "COMET_API_KEY"):
        monkeypatch.setenv(var, secret)
    run = tmp_path / "run"
    train(load_config(None, tiny_overrides + ["train.total_steps=2"]), run)
    for path in run.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


# 8. Memory -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_soak_shows_no_memory_growth(tmp_path):
    """5,000 steps of the tiny preset on the CPU (tens of minutes on 2 shared cores)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "scripts" / "soak.py"), "--steps", "5000", "--run-dir", str(tmp_path / "soak")]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0 and "soak: PASS" in result.stdout, result.stdout + result.stderr
