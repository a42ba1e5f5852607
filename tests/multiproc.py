"""Run a function on W real processes joined by gloo, set up the way torchrun sets them up."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from difftrain.runtime import distributed


def free_port() -> int:
    """A TCP port free at the time of the call, for MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun gives rank ``rank`` of a one-machine run."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }


# The ranks start from a fork server that has imported these once (per test process), not each from a
# fresh interpreter ("spawn", about 2 CPU seconds of imports per rank on a 2-core machine). A rank forked
# from it is as a spawned one: its own process, modules as imported (no monkeypatch of the caller's), and
# the caller's environment, working folder and sys.path as they are at the call (passed along below, not
# the server's).
_PRELOAD = ["torch", "torch.distributed", "difftrain.config", "difftrain.runtime.distributed",
            "difftrain.training.loop", "difftrain.training.state"]
mp.set_forkserver_preload(_PRELOAD)
# Variables a process reads as it starts (glibc's malloc, the loader, Python, OpenMP): a caller that
# changes one (test_fsdp_lockstep_eval.py sets MALLOC_MMAP_THRESHOLD_) gets ranks spawned afresh.
_AT_START = ("MALLOC_", "GLIBC_TUNABLES", "LD_", "PYTHON", "OMP_", "KMP_", "MKL_")


def _start_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_AT_START)}


_SERVER_START = _start_variables()  # the server is started later by this process, with these


def _worker(rank: int, world_size: int, port: int, fn, args: tuple, out_dir: str, timeout_s: float,
            caller: tuple[dict[str, str], str, list[str]]) -> None:
    environ, cwd, path = caller
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ.update(rank_env(rank, world_size, port))
    torch.set_num_threads(1)
    ctx = distributed.setup(torch.device("cpu"), timeout_s)
    try:
        result = fn(ctx, *args)
    finally:
        distributed.teardown(ctx)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def run_ranks(fn, world_size: int, *args, timeout_s: float = 600.0, collective_timeout_s: float = 600.0) -> list:
    """``fn(ctx, *args)`` on ``world_size`` new processes (from the fork server above); their results in rank order.

    ``fn`` must be a module-level function and its result something ``torch.save`` can write.
    A process that raises fails the call with its traceback; a hang is killed after
    ``timeout_s``. ``collective_timeout_s`` is the process groups' (``train.collective_timeout_s``).
    """
    with tempfile.TemporaryDirectory() as out_dir:
        procs = mp.start_processes(
            _worker, (world_size, free_port(), fn, args, out_dir, collective_timeout_s,
                      (dict(os.environ), os.getcwd(), list(sys.path))),
            nprocs=world_size, join=False,
            start_method="forkserver" if _start_variables() == _SERVER_START else "spawn",
        )
        deadline = time.monotonic() + timeout_s
        while not procs.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in procs.processes:
                    p.kill()
                raise TimeoutError(f"{world_size} processes still running after {timeout_s:.0f} s: a hang")
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def train_on_rank(ctx, run_dir: str, overrides: list[str], stop_at_step: int | None) -> int:
    """A rank's part of ``difftrain train`` on the config of ``overrides`` (for :func:`run_ranks`)."""
    from difftrain.config import load_config
    from difftrain.training.loop import train

    return train(load_config(None, overrides), run_dir, stop_at_step=stop_at_step).step


def assert_close_dicts(a: dict, b: dict, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Two state dicts with the same keys and tensors equal to float tolerance."""
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


def status_bytes(field: str) -> int:
    """A byte count of /proc/self/status, e.g. "VmRSS" (resident now) or "VmHWM" (peak resident)."""
    for line in open("/proc/self/status").read().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


def reset_peak(give_back: bool = False) -> int:
    """Reset this process's peak RSS (VmHWM) to its RSS now, and return that; with ``give_back``,
    collect garbage and hand freed heap memory back to the OS (``malloc_trim``) first."""
    if give_back:
        import ctypes
        import gc

        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")
