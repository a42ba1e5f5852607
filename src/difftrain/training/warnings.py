"""Warnings of a run going wrong, read from the metrics it logs: samples that copy training images,
samples that lose their variety, FID that keeps rising, held-out loss rising while the training
loss falls. Each fires once when its condition starts (again only after it has cleared), as one
line on stderr and a ``warning`` text in the trackers, naming the step it started and what to try.

:class:`WatchedTrackers` wraps the run's trackers, so every metric the loop logs is also seen by
:class:`RunWarnings`: the loop needs no extra call.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from difftrain.config import ValidationConfig

NEAR_COPY_HINT = ("fewer steps (the best or an earlier checkpoint), a lower optim.lr, more data or augmentation "
                  "(data.random_flip), prior preservation for a fine-tune")
DIVERSITY_HINT = "a lower optim.lr, fewer steps, more data; check the guidance scale (validation.guidance_scale)"
FID_HINT = "use the best checkpoint (RUN/best), a lower optim.lr or fewer steps; more data or augmentation"
HELDOUT_HINT = "fewer steps (the best or an earlier checkpoint), a lower optim.lr, more data or augmentation"


class RunWarnings:
    """Watches logged metrics; ``observe(step, metrics)`` returns the warnings that start there."""

    def __init__(self, v: ValidationConfig):
        """``v``: the run's validation section (its ``warn_*`` thresholds)."""
        self.near_copy_share = v.warn_near_copy_share
        self.diversity_ratio = v.warn_diversity_ratio
        self.fid_rises = v.warn_fid_rises
        self.heldout_rises = v.warn_heldout_rises
        self.fids: list[tuple[int, float]] = []
        self.heldout: list[tuple[int, float, float]] = []  # (step, held-out loss, mean training loss since last)
        self._train_losses: list[float] = []
        self.active: dict[str, int] = {}  # condition -> the step it started

    @classmethod
    def resumed(cls, v: ValidationConfig, metrics_file: Path, step: int) -> RunWarnings:
        """Watching a resumed run: the metrics it logged up to ``step`` (metrics.jsonl) are replayed
        silently, so a rise that began before the stop still counts and a warning given is not repeated."""
        warnings = cls(v)
        try:
            lines = Path(metrics_file).read_text().splitlines() if step else []
        except OSError:
            lines = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                warnings.observe(row["step"], row)
        return warnings

    def observe(self, step: int, metrics: dict) -> list[str]:
        out: list[str] = []
        if "loss" in metrics:
            self._train_losses.append(float(metrics["loss"]))
        share = metrics.get("memorization/near_copy_share")
        if share is not None:
            ratio = metrics.get("memorization/median_ratio", float("nan"))
            out += self._update("near_copy", step, share > self.near_copy_share,
                                lambda s: f"{share:.0%} of the validation samples are near-copies of training "
                                          f"images (above {self.near_copy_share:.0%}; median ratio {ratio:.2f}) "
                                          f"since step {s}: the model is memorizing. Try {NEAR_COPY_HINT}")
        div = metrics.get("diversity/ratio")
        if div is not None:
            out += self._update("diversity", step, div < self.diversity_ratio,
                                lambda s: f"the validation samples' diversity is {div:.0%} of the training data's "
                                          f"(Vendi score; below {self.diversity_ratio:.0%}) since step {s}: the "
                                          f"samples are losing variety (mode collapse). Try {DIVERSITY_HINT}")
        if "fid" in metrics:
            self.fids.append((step, float(metrics["fid"])))
            rises, start = _rises([f for _, f in self.fids])
            since = self.fids[start][0] if rises else step
            out += self._update("fid", step, rises >= self.fid_rises,
                                lambda s: f"FID has risen for {rises} evaluations in a row since step {since} "
                                          f"({self.fids[start][1]:.2f} -> {self.fids[-1][1]:.2f}): quality is "
                                          f"turning down. Try {FID_HINT}")
        if "heldout/loss" in metrics:
            train = float(np.mean(self._train_losses)) if self._train_losses else float("nan")
            self._train_losses = []
            self.heldout.append((step, float(metrics["heldout/loss"]), train))
            rises, start = _rises([h for _, h, _ in self.heldout])
            trains = [t for _, _, t in self.heldout[start:]]
            falling = rises > 0 and len(trains) > 1 and trains[-1] < trains[0]
            since = self.heldout[start][0]
            out += self._update("heldout", step, rises >= self.heldout_rises and falling,
                                lambda s: f"the held-out loss has risen for {rises} validations in a row since step "
                                          f"{since} ({self.heldout[start][1]:.4f} -> {self.heldout[-1][1]:.4f}) "
                                          f"while the training loss fell ({trains[0]:.4f} -> {trains[-1]:.4f}): "
                                          f"the model is over-fitting. Try {HELDOUT_HINT}")
        return out

    def _update(self, name: str, step: int, on: bool, message) -> list[str]:
        """Start (once) or clear the condition ``name``; the message of a start."""
        if not on:
            self.active.pop(name, None)
            return []
        if name in self.active:
            return []
        self.active[name] = step
        return [f"step {step}: {message(step)}"]


def _rises(values: list[float]) -> tuple[int, int]:
    """(how many rises in a row end the list, the index where that run of rises starts)."""
    n = 0
    while n + 1 < len(values) and values[-1 - n] > values[-2 - n]:
        n += 1
    return n, len(values) - 1 - n


class WatchedTrackers:
    """The run's trackers, with every logged metric shown to :class:`RunWarnings`; a warning is
    printed to stderr and logged as the text ``warning`` (metrics.jsonl, TensorBoard text)."""

    def __init__(self, trackers, warnings: RunWarnings):
        self.trackers, self.warnings = trackers, warnings
        self.fired: list[tuple[int, str]] = []

    def log(self, step: int, metrics: dict) -> None:
        self.trackers.log(step, metrics)
        if not metrics:
            return
        for line in self.warnings.observe(step, metrics):
            self.fired.append((step, line))
            print(f"difftrain: warning: {line}", file=sys.stderr, flush=True)
            self.trackers.log(step, {"warning": line})
            self.trackers.log_text(step, "warning", line)

    def log_image(self, step: int, name: str, image) -> None:
        self.trackers.log_image(step, name, image)

    def close(self) -> None:
        self.trackers.close()
