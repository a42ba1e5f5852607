"""SIGTERM / SIGINT as a request to stop at the next step boundary, with a checkpoint.

The first signal sets a flag that the training loop reads after each optimizer step: it saves
a checkpoint and returns, and ``difftrain train`` exits with ``EXIT_STOPPED`` (75, EX_TEMPFAIL
in sysexits.h: "stopped early; run the same command again to continue"). A second signal
exits at once with 128 + the signal number (130 for SIGINT, 143 for SIGTERM), as a shell
reports a process killed by that signal; the newest complete checkpoint stays loadable because
every checkpoint write is atomic.

Under torchrun the ranks agree at every step boundary (see the training loop's "Agree on
stopping"): each contributes :attr:`StopRequest.signum` and all of them stop after the same step
if any one was signalled, so a signal that reaches one rank only (or the ranks at different
steps) stops the whole run with one checkpoint instead of leaving the others waiting.

DataLoader workers leave the run's process group as they start (:func:`leave_process_group`),
so a SIGTERM to the whole group (a scheduler's, or torchrun's agent's when a peer failed) reaches
the main process only, which saves and then shuts the workers down.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

EXIT_STOPPED = 75  # a signal stopped the run after saving a checkpoint
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def signal_name(signum: int) -> str | None:
    """``"SIGTERM"`` for 15 and so on; None for 0 (no signal)."""
    return signal.Signals(signum).name if signum else None


class StopRequest:
    """Install handlers for SIGTERM and SIGINT while in a ``with`` block; restore them after.

    ``requested`` is the name of the first signal received, or None. Outside the main thread
    (where Python can't install handlers) it does nothing and ``requested`` stays None.
    """

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, object] = {}
        self._pid = os.getpid()

    def _handle(self, signum: int, frame: object) -> None:
        if os.getpid() != self._pid:
            # A forked child (a DataLoader worker) inherits the handler so that a Ctrl-C to the
            # process group does not kill it; stopping is the main process's, which shuts the
            # workers down. (A worker that exited on the second signal made the main process
            # raise "DataLoader worker exited unexpectedly" instead of exiting 130.)
            return
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

    @property
    def signum(self) -> int:
        """The number of the signal received, 0 if none."""
        return signal.Signals[self.requested].value if self.requested else 0

    def install(self) -> "StopRequest":
        """Start catching the signals (also what ``with`` does)."""
        if threading.current_thread() is threading.main_thread():
            self._pid = os.getpid()
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


def leave_process_group(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: put this worker in a process group of its own.

    PyTorch's worker handler obeys a SIGTERM from its parent only and dies of any other, so a
    SIGTERM to the group used to kill the workers, and the main process then stopped with
    "DataLoader worker ... killed by signal: Terminated" (exit 70, no save) instead of saving.
    Outside the group, the workers never see it. Ignoring SIGTERM in them instead would let a
    worker stuck in I/O hang the exit, as the loader's shutdown and Python's exit both end a
    worker that does not finish with SIGTERM and then wait for it; here that SIGTERM still ends
    it at once. What this costs: a signal to the group (SIGKILL too) no longer reaches the
    workers; each ends itself within 5 s of its parent's death (PyTorch's worker watchdog), or,
    if stuck in I/O, when that I/O returns. Until then it holds its copies of the parent's
    sockets, so under torchrun the other ranks learn of a SIGKILLed rank within those 5 s
    rather than at once.
    """
    try:
        os.setpgid(0, 0)
    except OSError:  # not permitted here (a session leader): the worker stays in the run's group, as before
        pass
