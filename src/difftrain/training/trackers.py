"""Trackers: metrics.jsonl always, TensorBoard by default, W&B and MLflow when chosen.

A disabled tracker is simply absent from the fan-out. No tracker is given or stores a
credential: W&B and MLflow read theirs from their own environment variables or files.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from difftrain.runtime.optional import require


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def log_image(self, step: int, name: str, image: np.ndarray) -> None: ...
    def close(self) -> None: ...


class JSONLTracker:
    """One JSON object per logged step in ``metrics.jsonl`` (append-only, one write per line),
    with the wall-clock ``time`` (Unix seconds) it was logged at.

    A failed write (disk full, read-only file system) raises an OSError naming the file; the
    line is written whole or not at all, so the file never ends in half a record that the
    next resume would append to.
    """

    def __init__(self, path: Path):
        self.path = path
        try:
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(path)) from None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        line = (json.dumps({"step": step, "time": round(time.time(), 3), **metrics}) + "\n").encode()
        try:
            written = os.write(self._fd, line)
            if written != len(line):  # a short write: the disk filled up inside this line
                os.ftruncate(self._fd, os.lseek(self._fd, 0, os.SEEK_END) - written)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def log_image(self, step: int, name: str, image: np.ndarray) -> None:
        pass  # images live in samples/

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


class TensorBoardTracker:
    """TensorBoard event files under ``run_dir/tensorboard``."""

    def __init__(self, log_dir: Path):
        # Imported here: tensorboard (a dependency) takes 0.1 s to import after training/loop.py's own imports,
        # paid only with tracking.tensorboard on.
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def log_image(self, step: int, name: str, image: np.ndarray) -> None:
        """``image``: (H, W, C) uint8."""
        self._writer.add_image(name, image, step, dataformats="HWC")

    def log_text(self, step: int, name: str, text: str) -> None:
        self._writer.add_text(name, text, step)

    def close(self) -> None:
        self._writer.close()


class Trackers:
    """Fans every call out to the enabled trackers. Text values (what an FID's samples were
    conditioned on) go to metrics.jsonl only; the others get the numbers."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log(self, step: int, metrics: dict[str, float | str]) -> None:
        if not metrics:
            return
        numbers = {k: v for k, v in metrics.items() if not isinstance(v, str)}
        for t in self.trackers:
            if isinstance(t, JSONLTracker):
                t.log(step, metrics)
            elif numbers:
                t.log(step, numbers)

    def log_image(self, step: int, name: str, image: np.ndarray) -> None:
        for t in self.trackers:
            t.log_image(step, name, image)

    def log_text(self, step: int, name: str, text: str) -> None:
        """Text to the trackers that show it (TensorBoard); the others keep it as a metric."""
        for t in self.trackers:
            if hasattr(t, "log_text"):
                t.log_text(step, name, text)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


class WandbTracker:
    """Weights & Biases, offline by default (``wandb sync run_dir/wandb/offline-run-*`` uploads)."""

    def __init__(self, run_dir: Path, project: str, mode: str, config: dict[str, Any]):
        wandb = require("wandb", "tracking", "tracking.wandb=true")

        os.environ.setdefault("WANDB_SILENT", "true")
        self._wandb = wandb
        self._run = wandb.init(
            project=project, dir=str(run_dir), mode=mode, config=config, name=run_dir.name, reinit="create_new"
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def log_image(self, step: int, name: str, image: np.ndarray) -> None:
        self._run.log({name: self._wandb.Image(image)}, step=step)

    def close(self) -> None:
        self._run.finish()


class MLflowTracker:
    """MLflow through its client API (no global active run); a local store by default."""

    def __init__(self, run_dir: Path, tracking_uri: str | None, experiment: str, config: dict[str, Any]):
        require("mlflow", "tracking", "tracking.mlflow=true")
        # Imported here: mlflow is an optional package (the tracking extra).
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param  # as above

        self._Metric = Metric
        if tracking_uri is None:
            # A plain folder store needs no database package; MLflow 3 asks for this opt-in.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        uri = tracking_uri or (run_dir / "mlruns").resolve().as_uri()
        self._client = MlflowClient(tracking_uri=uri)
        found = self._client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self._client.create_experiment(experiment)
        self._run_id = self._client.create_run(exp_id, run_name=run_dir.name).info.run_id
        params = [Param(f"{s}.{k}", str(v)) for s, section in config.items() for k, v in section.items()]
        self._client.log_batch(self._run_id, params=params)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [self._Metric(k, float(v), now, step) for k, v in metrics.items()]
        self._client.log_batch(self._run_id, metrics=batch)

    def log_image(self, step: int, name: str, image: np.ndarray) -> None:
        self._client.log_image(self._run_id, image, key=name.replace("/", "_"), step=step)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def build_trackers(run_dir: Path, tracking=None, config: dict[str, Any] | None = None) -> Trackers:
    """metrics.jsonl, plus the trackers ``tracking`` (a TrackingConfig) turns on."""
    trackers: list[Tracker] = [JSONLTracker(run_dir / "metrics.jsonl")]
    if tracking is None or tracking.tensorboard:
        trackers.append(TensorBoardTracker(run_dir / "tensorboard"))
    if tracking is not None and tracking.wandb:
        trackers.append(WandbTracker(run_dir, tracking.wandb_project, tracking.wandb_mode, config or {}))
    if tracking is not None and tracking.mlflow:
        trackers.append(MLflowTracker(run_dir, tracking.mlflow_tracking_uri, tracking.mlflow_experiment, config or {}))
    return Trackers(trackers)
