"""Trackers: metrics.jsonl always, TensorBoard by default. A disabled tracker is a no-op."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import numpy as np


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def log_image(self, step: int, name: str, image: np.ndarray) -> None: ...
    def close(self) -> None: ...


class JSONLTracker:
    """One JSON object per logged step in ``metrics.jsonl`` (line-buffered, append-only)."""

    def __init__(self, path: Path):
        self._file = open(path, "a", buffering=1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")

    def log_image(self, step: int, name: str, image: np.ndarray) -> None:
        pass  # images live in samples/

    def close(self) -> None:
        self._file.close()


class TensorBoardTracker:
    """TensorBoard event files under ``run_dir/tensorboard``."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def log_image(self, step: int, name: str, image: np.ndarray) -> None:
        """``image``: (H, W, C) uint8."""
        self._writer.add_image(name, image, step, dataformats="HWC")

    def close(self) -> None:
        self._writer.close()


class Trackers:
    """Fans every call out to the enabled trackers."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for t in self.trackers:
            t.log(step, metrics)

    def log_image(self, step: int, name: str, image: np.ndarray) -> None:
        for t in self.trackers:
            t.log_image(step, name, image)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


def build_trackers(run_dir: Path, tensorboard: bool = True) -> Trackers:
    trackers: list[Tracker] = [JSONLTracker(run_dir / "metrics.jsonl")]
    if tensorboard:
        trackers.append(TensorBoardTracker(run_dir / "tensorboard"))
    return Trackers(trackers)
