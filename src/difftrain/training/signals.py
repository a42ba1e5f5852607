"""SIGTERM / SIGINT as a request to stop at the next step boundary, with a checkpoint.

The first signal sets a flag that the training loop reads after each optimizer step: it saves
a checkpoint and returns, and ``difftrain train`` exits with ``EXIT_STOPPED`` (75, EX_TEMPFAIL
in sysexits.h: "stopped early; run the same command again to continue"). A second signal
exits at once with 128 + the signal number (130 for SIGINT, 143 for SIGTERM), as a shell
reports a process killed by that signal; the newest complete checkpoint stays loadable because
every checkpoint write is atomic.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

EXIT_STOPPED = 75  # a signal stopped the run after saving a checkpoint
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Install handlers for SIGTERM and SIGINT while in a ``with`` block; restore them after.

    ``requested`` is the name of the first signal received, or None. Outside the main thread
    (where Python can't install handlers) it does nothing and ``requested`` stays None.
    """

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:  # the second signal: exit now, without saving
            print(f"difftrain: second signal ({name}); exiting without saving", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.requested = name
        print(
            f"difftrain: {name} received; saving a checkpoint at the end of this step, then "
            "exiting (send it again to exit at once)",
            file=sys.stderr,
            flush=True,
        )

    def install(self) -> "StopRequest":
        """Start catching the signals (also what ``with`` does)."""
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Put back the handlers that were there before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> "StopRequest":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()
