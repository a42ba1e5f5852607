"""Fault injection: kill real training processes at random moments, resume, compare digests.

    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/fault_injection.py --kills 30

Trains a small run once without interruption (the reference), then trains the same config
in a fresh run directory while killing the process again and again with SIGKILL or SIGTERM:
some kills at a random moment (start-up, a step, validation, a save), some aimed inside a
checkpoint write (the test hook ``DIFFTRAIN_TEST_SAVE_PAUSE_S`` holds the written temporary
file open for a moment before its rename, and the kill lands when the file appears). After
each kill it checks that the exit code is an expected one and that the checkpoint the next run
resumes from (``latest``, or the newest complete one where the kill came between a checkpoint's
rename and its ``latest`` update) loads, then runs the same command again. When a run completes, its final model
and EMA digests must equal the reference's; then a new run starts, until ``--kills`` kills are
done. Prints the kills, how many the runs survived, and anything lost; exits 1 on any loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

OVERRIDES = [
    "data.resolution=16",
    "data.num_workers=0",
    "model.preset=tiny",
    "model.attention_resolutions=[8]",
    "model.dropout=0.1",
    "diffusion.num_timesteps=100",
    "optim.lr=1e-3",
    "optim.warmup_steps=4",
    "train.batch_size=4",
    "train.log_every_steps=3",
    "train.progress_bar=false",
    "ema.decay=0.9",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=2",
    "validation.every_steps=6",
    "validation.num_images=2",
    "validation.steps=2",
    "tracking.tensorboard=false",
]
PAUSE_ENV = "DIFFTRAIN_TEST_SAVE_PAUSE_S"
EXIT_STOPPED = 75
EXPECTED = {
    signal.SIGKILL: {0, -signal.SIGKILL},
    # 75: saved and stopped; -15: the signal came before the handler was installed (start-up)
    signal.SIGTERM: {0, EXIT_STOPPED, -signal.SIGTERM},
}


@dataclasses.dataclass
class Outcome:
    kills: int = 0
    sigkill: int = 0
    sigterm: int = 0
    in_write: int = 0
    survived: int = 0
    runs: int = 0
    lost: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        return (
            f"kills: {self.kills} (SIGKILL {self.sigkill}, SIGTERM {self.sigterm}; "
            f"{self.in_write} aimed inside checkpoint writes) over {self.runs} runs\n"
            f"survived: {self.survived}\n"
            f"lost: {len(self.lost)}" + "".join(f"\n  {x}" for x in self.lost)
        )


def train_cmd(run_dir: Path, total_steps: int) -> list[str]:
    cmd = [sys.executable, "-m", "difftrain", "train", "--run-dir", str(run_dir)]
    return cmd + [x for o in OVERRIDES + [f"train.total_steps={total_steps}"] for x in ("--set", o)]


def digests(run_dir: Path) -> tuple[int, str, str]:
    """(step, model SHA-256, EMA SHA-256) of the newest checkpoint, via ``difftrain inspect``."""
    out = subprocess.run(
        [sys.executable, "-m", "difftrain", "inspect", str(run_dir), "--json"], capture_output=True, text=True, check=True
    ).stdout
    info = json.loads(out)
    return info["step"], info["model_sha256"], info["ema_sha256"]


def check_resumable(run_dir: Path) -> str | None:
    """None when the checkpoint the next run resumes from is complete and loads (or no checkpoint
    was completed yet); else the problem.

    The next run resumes from what ``find_checkpoint`` picks: the checkpoint ``latest`` names, or
    the newest complete one when ``latest`` is missing or names none of the folder's. So a kill
    between a checkpoint's rename and the ``latest`` update loses nothing: the first checkpoint
    has no pointer yet and resume takes it; a later one leaves the pointer at the previous
    checkpoint, and resume redoes the steps since (the final digests, compared with the
    reference's, show that the redone steps are the same).
    """
    from difftrain.checkpoints.checkpoint import LATEST, find_checkpoint, list_checkpoints, load_checkpoint

    ckpt_dir = run_dir / "checkpoints"
    if not list_checkpoints(ckpt_dir):
        return f"{LATEST} names a checkpoint, but none is complete" if (ckpt_dir / LATEST).exists() else None
    chosen = find_checkpoint(run_dir)
    try:
        load_checkpoint(chosen)
    except Exception as e:  # noqa: BLE001 - any failure to load is a loss
        return f"resume would read {chosen.name}, which does not load: {e}"
    return None


def resume_point(run_dir: Path) -> str:
    """The checkpoint the next run resumes from, or "-" when there is none yet."""
    from difftrain.checkpoints.checkpoint import find_checkpoint

    try:
        return find_checkpoint(run_dir).name
    except FileNotFoundError:
        return "-"


def _wait_for_tmp(proc: subprocess.Popen, ckpt_dir: Path, timeout_s: float) -> bool:
    """Wait until ``proc`` writes a checkpoint's temporary file (not one left by an earlier kill)."""
    deadline = time.monotonic() + timeout_s
    old = set(ckpt_dir.glob(".step_*.tmp")) if ckpt_dir.is_dir() else set()
    while time.monotonic() < deadline and proc.poll() is None:
        if ckpt_dir.is_dir() and set(ckpt_dir.glob(".step_*.tmp")) - old:
            return True
        time.sleep(0.01)
    return False


def campaign(kills: int, workdir: Path, total_steps: int = 12, seed: int = 0, log=print) -> Outcome:
    """Run the campaign described in the module docstring; return what happened."""
    rng = random.Random(seed)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    workdir.mkdir(parents=True, exist_ok=True)
    ref_dir = workdir / "reference"
    start = time.monotonic()
    subprocess.run(train_cmd(ref_dir, total_steps), env=env, check=True, capture_output=True)
    run_time = time.monotonic() - start
    reference = digests(ref_dir)
    log(f"reference: {total_steps} steps in {run_time:.1f} s; model {reference[1][:12]}, ema {reference[2][:12]}")

    out = Outcome()
    pending = 0  # kills of the current run, judged when it completes
    run_dir = workdir / f"run_{out.runs:03d}"
    while True:
        done = out.kills >= kills
        sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
        in_write = rng.random() < 0.4
        proc_env = {**env, PAUSE_ENV: "0.3"} if in_write and not done else env
        proc = subprocess.Popen(train_cmd(run_dir, total_steps), env=proc_env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        killed = False
        if not done:
            if in_write:
                killed = _wait_for_tmp(proc, run_dir / "checkpoints", timeout_s=3 * run_time)
                if killed:
                    time.sleep(rng.uniform(0.0, 0.25))
            else:
                time.sleep(rng.uniform(0.0, 0.9 * run_time))
                killed = proc.poll() is None
            if killed and proc.poll() is None:
                os.kill(proc.pid, sig)
                if sig == signal.SIGTERM and rng.random() < 0.25:  # sometimes a second SIGTERM
                    time.sleep(rng.uniform(0.0, 0.2))
                    if proc.poll() is None:
                        os.kill(proc.pid, sig)
            else:
                killed = False
        _, err = proc.communicate()
        rc = proc.returncode
        if killed:
            out.kills += 1
            pending += 1
            out.sigkill += sig == signal.SIGKILL
            out.sigterm += sig == signal.SIGTERM
            out.in_write += in_write
            allowed = EXPECTED[sig] | ({128 + signal.SIGTERM} if sig == signal.SIGTERM else set())
            if rc not in allowed:
                out.lost.append(f"{run_dir.name}: {sig.name} gave exit code {rc}: {err.strip()[-300:]}")
        elif rc != 0:
            out.lost.append(f"{run_dir.name}: unkilled process exited {rc}: {err.strip()[-300:]}")
        problem = check_resumable(run_dir)
        if problem:
            out.lost.append(f"{run_dir.name} after {sig.name if killed else 'exit'}: {problem}")
        if killed:
            log(f"kill {out.kills}: {sig.name}{' in a write' if in_write else ''}, exit {rc}, "
                f"resumes from {resume_point(run_dir)}")
        if rc == 0 and not killed:  # this run is complete: judge it
            got = digests(run_dir)
            out.runs += 1
            if got == reference:
                out.survived += pending
            else:
                out.lost.append(f"{run_dir.name}: final digests differ from the reference ({got} vs {reference})")
            pending = 0
            if done:
                return out
            run_dir = workdir / f"run_{out.runs:03d}"
        if len(out.lost) > 20:
            return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--total-steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--workdir", default="/tmp/difftrain-fault-injection")
    args = parser.parse_args()
    import shutil

    shutil.rmtree(args.workdir, ignore_errors=True)
    start = time.monotonic()
    out = campaign(args.kills, Path(args.workdir), args.total_steps, args.seed)
    print(out.summary())
    print(f"({time.monotonic() - start:.0f} s)")
    return 0 if not out.lost and out.survived == out.kills else 1


if __name__ == "__main__":
    sys.exit(main())
