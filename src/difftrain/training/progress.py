"""A one-line progress display (step, loss, lr, images/s, ETA) and memory readings."""

from __future__ import annotations

import resource
import sys
import time

import torch

from difftrain.runtime.progress import duration as _duration


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak resident memory of this process and, on CUDA, peak allocated GPU memory, in MiB."""
    stats = {"cpu_max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.type == "cuda":
        stats["gpu_max_allocated_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return stats


class Progress:
    """Prints ``step N/total | loss | lr | img/s | ETA`` to stderr at each log step."""

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True):
        self.total_steps = total_steps
        self.enabled = enabled
        self._tty = sys.stderr.isatty()
        self._start = time.perf_counter()
        self._start_step = start_step

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        rate = metrics["images_per_s"]
        steps_per_s = (step - self._start_step) / max(now - self._start, 1e-9)
        eta = (self.total_steps - step) / max(steps_per_s, 1e-9)
        pct = 100 * step / self.total_steps
        line = (
            f"step {step}/{self.total_steps} ({pct:3.0f}%) | loss {metrics['loss']:.4f} | "
            f"lr {metrics['lr']:.2e} | {rate:,.0f} img/s | ETA {_duration(eta)}"
        )
        if metrics.get("skipped_steps"):
            line += f" | skipped {int(metrics['skipped_steps'])}"
        sys.stderr.write(("\r" + line + "\033[K") if self._tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self._tty:
            sys.stderr.write("\n")
