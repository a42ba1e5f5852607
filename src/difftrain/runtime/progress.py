"""Progress lines on stderr for long commands: count, rate and ETA."""

from __future__ import annotations

import sys
import time


def duration(seconds: float) -> str:
    """``1h02m`` or ``3m07s``."""
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class CountProgress:
    """``label: done/total (pct) | rate unit/s | ETA`` on stderr for the commands that work
    through a count (sampling, features, an LR sweep): at most once a second and at the end; on
    a terminal one line rewritten in place."""

    def __init__(self, label: str, total: int, unit: str = "images", enabled: bool = True, every_s: float = 1.0):
        self.label, self.total, self.unit, self.every_s = label, total, unit, every_s
        self.enabled = enabled and total > 0
        self._tty = sys.stderr.isatty()
        self._start = self._last = time.perf_counter()
        self.done = 0

    def advance(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and (now - self._last >= self.every_s or self.done >= self.total):
            self._last = now
            rate = self.done / max(now - self._start, 1e-9)
            eta = (self.total - self.done) / max(rate, 1e-9)
            line = (f"{self.label}: {self.done:,}/{self.total:,} ({100 * self.done / self.total:3.0f}%) | "
                    f"{rate:,.1f} {self.unit}/s | ETA {duration(eta)}")
            sys.stderr.write(("\r" + line + "\033[K") if self._tty else line + "\n")
            if self._tty and self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
