"""Bad input to the CLI ends in one line naming the file or option and a documented exit code.

Issue 11's edges: config values, run folders, memory, a closed stdout, disks that refuse a
write, data that changes or disappears under a run, hostile ``latest`` pointers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from difftrain.cli import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, main
from difftrain.config import load_config
from difftrain.checkpoints import checkpoint as ckpt
from difftrain.training.loop import train

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "difftrain", *args], capture_output=True, text=True, env=ENV,
                          errors="replace", timeout=300)


def _folder(root: Path, count: int = 16) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(root / f"{i:02d}.png")
    return root


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A tiny run trained to its last step (2), checkpoint and all."""
    from tests.conftest import TINY_OVERRIDES

    run = tmp_path_factory.mktemp("finished") / "run"
    cfg = load_config(None, TINY_OVERRIDES + ["train.total_steps=2", "validation.every_steps=0",
                                              "tracking.tensorboard=false"])
    train(cfg, run)
    return run


def test_input_errors_are_one_line_and_exit_2(tmp_path):
    data = _folder(tmp_path / "d", 2)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    (tmp_path / "latin1.toml").write_bytes(b"[optim]\nlr = 1e-4  # caf\xe9\n")
    oom = ["--set", "data.resolution=65536", "--set", "model.attention_resolutions=[]", "--set", "train.batch_size=1",
           "--set", "data.num_workers=0", "--set", "train.progress_bar=false", "--set", "tracking.tensorboard=false"]
    cases = [
        (["train", "--set", "optim.lr=inf"], "optim.lr must be a finite number"),
        (["train", "--set", f"data.path={data}", "--set", f"data.heldout_path={tmp_path / 'nope'}"],
         "data.heldout_path"),
        (["train", "--run-dir", str(a_file)], "--run-dir"),
        (["train", "--run-dir", str(a_file / "sub"), "--set", f"data.path={data}"], "cannot create the folder"),
        (["train", "--config", str(tmp_path / "latin1.toml")], "latin1.toml is not UTF-8"),
        (["train", "--run-dir", str(tmp_path / "oom"), *oom], "out of memory"),
    ]
    if not torch.cuda.is_available():
        cases.append((["train", "--set", "train.device=cuda"], "train.device is 'cuda'"))
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda case: _cli(*case[0]), cases))
    for (args, needle), r in zip(cases, results):
        assert r.returncode == EXIT_BAD_INPUT, (args, r.stderr)
        assert needle in _one_error_line(r.stderr), (args, r.stderr)
    assert "train.batch_size" in results[5].stderr and "difftrain estimate" in results[5].stderr


def test_stop_at_step_0_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--stop-at-step", "0"])
    assert e.value.code == 2 and "--stop-at-step: must be >= 1" in capsys.readouterr().err


def test_inspect_json_into_a_closed_pipe_exits_quietly(finished_run):
    proc = subprocess.Popen([sys.executable, "-m", "difftrain", "inspect", str(finished_run), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    proc.stdout.close()  # `| head` that has already gone away
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == EXIT_BROKEN_PIPE, err
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_sample_out_on_a_full_disk_names_the_folder(finished_run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    os.symlink("/dev/full", out / "000000.png")  # the first image's write: ENOSPC
    code = main(["sample", "--checkpoint", str(finished_run), "--num", "2", "--steps", "2", "--out", str(out)])
    line = _one_error_line(capsys.readouterr().err)
    assert code == EXIT_BAD_INPUT and str(out) in line and "No space left on device" in line


def test_a_hostile_latest_pointer_resumes_from_the_runs_own_newest_checkpoint(finished_run, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(finished_run, other)
    (other / "checkpoints" / "latest").write_text("../../../etc/passwd\n")
    assert main(["inspect", str(other)]) == 0
    out, err = capsys.readouterr()
    assert str(other / "checkpoints" / "step_00000002.pt") in out and "latest names" in err


def test_metrics_on_a_full_disk_stop_the_run_naming_the_file(tmp_path, tiny_overrides, capsys):
    run = tmp_path / "run"
    run.mkdir()
    os.symlink("/dev/full", run / "metrics.jsonl")
    args = ["train", "--run-dir", str(run)] + [x for o in tiny_overrides + ["tracking.tensorboard=false",
                                               "validation.every_steps=0"] for x in ("--set", o)]
    code = main(args)
    line = _one_error_line(capsys.readouterr().err)
    assert code == EXIT_BAD_INPUT and "metrics.jsonl: No space left on device (ENOSPC)" in line


def test_every_image_disappearing_mid_run_is_one_line(tmp_path, tiny_overrides, monkeypatch, capsys):
    from difftrain.data import check, prepare

    data = _folder(tmp_path / "d")
    real = check.prepare_dataset

    def prepare_then_delete_all(*args):
        dataset = real(*args)
        for f in data.iterdir():
            f.unlink()
        return dataset

    monkeypatch.setattr(prepare, "prepare_dataset", prepare_then_delete_all)
    overrides = tiny_overrides + [f"data.path={data}", "validation.every_steps=0", "tracking.tensorboard=false",
                                  "data.num_workers=1"]
    code = main(["train", "--run-dir", str(tmp_path / "run")] + [x for o in overrides for x in ("--set", o)])
    line = _one_error_line(capsys.readouterr().err)
    assert code == EXIT_BAD_INPUT and "none of its 16 images can be read any more" in line


@pytest.mark.parametrize("change, cache", [("delete", False), ("corrupt", True)])
def test_resume_stays_exact_when_an_image_changes_while_the_run_is_stopped(tmp_path, tiny_overrides, change, cache):
    """Stop at step 2, break one image, resume to 4 == the same break at step 2 of a run that never stopped."""
    from difftrain.training import trackers

    def break_one(root: Path) -> None:
        victim = root / "05.png"
        if change == "delete":
            victim.unlink()
        else:  # in place: same name, new content and time
            victim.write_bytes(b"corrupted in place")

    base = tiny_overrides + ["validation.every_steps=0", "tracking.tensorboard=false", "train.total_steps=4",
                             f"data.cache={str(cache).lower()}", f"data.cache_dir={tmp_path / 'cache'}"]
    # Stopped and resumed.
    a = _folder(tmp_path / "a")
    cfg_a = load_config(None, base + [f"data.path={a}"])
    train(cfg_a, tmp_path / "run_a", stop_at_step=2)
    break_one(a)
    train(cfg_a, tmp_path / "run_a")
    # Never stopped: the same change right after step 2 is logged (batches are fetched on demand).
    b = _folder(tmp_path / "b")
    real_log = trackers.JSONLTracker.log

    def log_then_break(self, step, metrics):
        real_log(self, step, metrics)
        if step == 2:
            break_one(b)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trackers.JSONLTracker, "log", log_then_break)
        train(load_config(None, base + [f"data.path={b}"]), tmp_path / "run_b")
    sa, sb = ckpt.load_checkpoint(tmp_path / "run_a"), ckpt.load_checkpoint(tmp_path / "run_b")
    assert sa["step"] == sb["step"] == 4
    assert ckpt.state_dict_sha256(sa["model"]) == ckpt.state_dict_sha256(sb["model"])


def test_resuming_a_finished_run_into_a_new_folder_is_not_an_error(finished_run, tmp_path, capsys):
    source = ckpt.find_checkpoint(finished_run)
    overrides = _tiny() + ["train.total_steps=2"]
    assert main(["train", "--run-dir", str(tmp_path / "new"), "--resume", str(source)]
                + [x for o in overrides for x in ("--set", o)]) == 0


def test_config_toml_on_a_full_disk_names_the_file(tmp_path, tiny_overrides, capsys):
    run = tmp_path / "run"
    run.mkdir()
    os.symlink("/dev/full", run / ".config.toml.tmp")
    args = ["train", "--run-dir", str(run)] + [x for o in tiny_overrides for x in ("--set", o)]
    assert main(args) == EXIT_BAD_INPUT
    assert "config.toml" in _one_error_line(capsys.readouterr().err)


def _tiny() -> list[str]:
    from tests.conftest import TINY_OVERRIDES

    return TINY_OVERRIDES + ["validation.every_steps=0", "tracking.tensorboard=false"]


@pytest.mark.parametrize("overrides, key", [
    (["validation.num_images=1000000000", "validation.every_steps=3"], "validation.num_images=1000000000"),
    (["diffusion.num_timesteps=2000000000"], "diffusion.num_timesteps"),
    (["data.heldout_fraction=0.9999"], "data.heldout_fraction=0.9999"),
    (["data.cache=true", "data.cache_dir=/proc/nope", "data.path=FOLDER"], "data.cache_dir=/proc/nope"),
], ids=["num_images", "num_timesteps", "heldout_fraction", "cache_dir"])
def test_an_error_caused_by_an_option_names_it(tmp_path, tiny_overrides, capsys, overrides, key):
    """Each of these ended in a message without the key: out of memory, fewer images (2 of the
    built-in 20,000) than the batch, ENOENT of a folder."""
    data = _folder(tmp_path / "d", 16)
    args = ["train", "--run-dir", str(tmp_path / "run")]
    for o in tiny_overrides + ["tracking.tensorboard=false"] + [o.replace("FOLDER", str(data)) for o in overrides]:
        args += ["--set", o]
    assert main(args) == EXIT_BAD_INPUT
    assert key in _one_error_line(capsys.readouterr().err)
