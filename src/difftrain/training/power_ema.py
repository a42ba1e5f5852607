"""Power-function EMAs and their snapshots, for post-hoc EMA (Karras et al. 2024, "Analyzing and
Improving the Training Dynamics of Diffusion Models", EDM2, sec. 3 and appendix C).

A power-function EMA of exponent gamma averages the weights theta_1 .. theta_t of the first t
optimizer steps with the profile ``p_t(tau) = (gamma + 1) / t ** (gamma + 1) * tau ** gamma`` on
[0, t] (eq. 3). Updated each step with ``beta(t) = (1 - 1 / t) ** (gamma + 1)`` (eq. 2), the
discrete average puts on theta_tau exactly the integral of p_t over (tau - 1, tau], so the
closed-form inner products of the profiles (appendix C.3) hold for the discrete averages too.
Its length is named by the relative standard deviation ``sigma_rel`` of the profile (eq. 4).

During training :class:`PowerEMA` keeps one average per tracked ``sigma_rel``
(``ema.posthoc_std``) and writes snapshots of them every ``ema.posthoc_every_steps`` to
``RUN/ema_snapshots/``; ``difftrain posthoc-ema`` (``difftrain/training/posthoc.py``) combines them into
the average of any other length with :func:`solve_coefficients`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import nn

from difftrain.runtime import distributed
from difftrain.runtime.distributed import DistContext
from difftrain.runtime.files import atomic_write
from difftrain.runtime.fsdp import full_tensor
from difftrain.checkpoints.checkpoint import load_weights
from difftrain.training.ema import Reader, averaged_copy, foreach_lerp_, trainable

SIGMA_REL_MAX = 0.3  # sigma_rel peaks at ~0.3003 (gamma ~ -0.38); 0.2887 is gamma = 0, the plain mean
SNAPSHOT_DIR = "ema_snapshots"
SNAPSHOT_FORMAT = "difftrain-ema-snapshot-v1"
_SNAPSHOT_NAME = re.compile(r"^ema_([0-9.e+-]+)_(\d{8,})\.pt$")


# ---------------------------------------------------------------------------------------------
# The profiles (pure math, float64).


def gamma_to_std(gamma: float) -> float:
    """``sigma_rel = ((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3))) ** 0.5`` (EDM2 eq. 4)."""
    return math.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))


def std_to_gamma(std: float) -> float:
    """The exponent gamma of relative standard deviation ``std`` in (0, 0.3): the largest real root
    of ``gamma^3 + 7 gamma^2 + (16 - s) gamma + (12 - s) = 0`` with ``s = std ** -2`` (eq. 4 solved
    for gamma, as EDM2's ``std_to_exp``)."""
    if not 0 < std < SIGMA_REL_MAX:
        raise ValueError(f"a power-function EMA's sigma_rel must be in (0, {SIGMA_REL_MAX}), got {std}")
    s = std**-2
    return float(np.roots([1.0, 7.0, 16.0 - s, 12.0 - s]).real.max())


def power_beta(t: int, gamma: float) -> float:
    """The decay of update ``t`` (1 for the first optimizer step): ``(1 - 1 / t) ** (gamma + 1)``
    (EDM2 eq. 2). ``beta(1) = 0``: the first update copies the weights."""
    return (1.0 - 1.0 / t) ** (gamma + 1.0)


def profile_dot(t_a: np.ndarray, gamma_a: np.ndarray, t_b: np.ndarray, gamma_b: np.ndarray) -> np.ndarray:
    """Inner product ``int_0^inf p_a(tau) p_b(tau) dtau`` of two power-function profiles that end
    at ``t_a`` and ``t_b`` (EDM2 appendix C.3, eq. 57); arguments broadcast.

    With ``m = min(t_a, t_b)``: ``(g_a + 1)(g_b + 1) m ** (g_a + g_b + 1) / ((g_a + g_b + 1)
    t_a ** (g_a + 1) t_b ** (g_b + 1))``, written with ratios so large t does not overflow.
    """
    t_a, g_a, t_b, g_b = (np.asarray(v, dtype=np.float64) for v in (t_a, gamma_a, t_b, gamma_b))
    ratio = np.where(t_a < t_b, t_a / t_b, t_b / t_a)  # (m / t_max), in (0, 1]
    exponent = np.where(t_a < t_b, g_b, g_a)  # the exponent of the longer profile
    return (g_a + 1) * (g_b + 1) * ratio**exponent / ((g_a + g_b + 1) * np.maximum(t_a, t_b))


def profile_weights(t: int, gamma: float, n: int) -> np.ndarray:
    """(n,) the weights a power EMA updated with :func:`power_beta` puts on theta_1 .. theta_n at step
    ``t``: ``(tau ** (gamma + 1) - (tau - 1) ** (gamma + 1)) / t ** (gamma + 1)`` for tau <= t, 0
    after: the integral of p_t over (tau - 1, tau]."""
    tau = np.arange(1, n + 1, dtype=np.float64)
    w = (tau / t) ** (gamma + 1) - ((tau - 1) / t) ** (gamma + 1)
    return np.where(tau <= t, w, 0.0)


def solve_coefficients(
    steps: Sequence[int], gammas: Sequence[float], target_step: int, target_gamma: float, sum_to_one: bool = True
) -> tuple[np.ndarray, float]:
    """Least-squares weights x of the snapshot profiles (ending at ``steps``, exponents ``gammas``)
    whose sum best matches the target profile in L2 (EDM2 appendix C.3): ``A x = b`` with ``A``
    the snapshots' Gram matrix and ``b`` their inner products with the target.

    ``sum_to_one`` adds the constraint ``sum_i x_i = 1`` (a Lagrange multiplier; not in the paper):
    every profile integrates to 1, and so does the fit then, which makes the combined weights an
    affine combination, blind to the part of the weights that all snapshots share. It leaves the
    residual almost as it is but removes most of the weight error (docs/posthoc_ema.md).

    Returns (x (n,), relative residual ``||p_target - sum_i x_i p_i|| / ||p_target||``).
    """
    t = np.asarray(steps, dtype=np.float64)
    g = np.asarray(gammas, dtype=np.float64)
    n = len(t)
    gram = profile_dot(t[:, None], g[:, None], t[None, :], g[None, :])  # (n, n)
    b = profile_dot(t, g, target_step, target_gamma)  # (n,)
    if sum_to_one:  # [[A, 1], [1^T, 0]] [x; lambda] = [b; 1]
        kkt = np.block([[gram, np.ones((n, 1))], [np.ones((1, n)), np.zeros((1, 1))]])
        x = np.linalg.lstsq(kkt, np.append(b, 1.0), rcond=None)[0][:n]
    else:
        x = np.linalg.lstsq(gram, b, rcond=None)[0]
    target_sq = float(profile_dot(target_step, target_gamma, target_step, target_gamma))
    residual_sq = target_sq - 2 * float(x @ b) + float(x @ gram @ x)
    return x, math.sqrt(max(residual_sq, 0.0) / target_sq)


# ---------------------------------------------------------------------------------------------
# The averages kept during training.


class PowerEMA:
    """One power-function EMA of ``model``'s weights per relative std in ``stds``; none is a no-op.

    :meth:`update` after optimizer step t (t = 1 for the first) moves average k by
    ``1 - beta(t, gamma_k)``. A captured step (``CapturedStep``) calls :meth:`lerp_` with a (K,)
    device tensor of those weights that it fills before each replay. Buffers are copied.
    """

    def __init__(self, model: nn.Module, stds: Sequence[float] = ()):
        self.stds = tuple(float(s) for s in stds)
        self.gammas = tuple(std_to_gamma(s) for s in self.stds)
        copies = [averaged_copy(model) for _ in self.stds]  # a frozen base is shared, not copied
        self.models = [m for m, _ in copies]
        self._trained = copies[0][1] if copies else []

    def weights(self, t: int) -> list[float]:
        """``1 - beta(t, gamma_k)`` for each tracked average: the weights of update ``t``."""
        return [1.0 - power_beta(t, g) for g in self.gammas]

    @torch.no_grad()
    def update(self, model: nn.Module, t: int, read: Reader | None = None) -> None:
        """Average in ``model``'s weights after optimizer step ``t`` (counted from 1); ``read``
        as in :meth:`EMA.update`."""
        self.lerp_(model, self.weights(t), read)

    @torch.no_grad()
    def lerp_(self, model: nn.Module, weights: Sequence[float] | torch.Tensor, read: Reader | None = None) -> None:
        """``avg_k += weights[k] * (params - avg_k)`` for each k; copy the buffers."""
        params = trainable(list(model.parameters()), self._trained)  # under no_grad: no detach needed
        for k, avg in enumerate(self.models):
            if params:
                foreach_lerp_(trainable(list(avg.parameters()), self._trained), params, weights[k], read)
            for avg_buf, buf in zip(avg.buffers(), model.buffers()):
                avg_buf.copy_(buf)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the averages (what a captured step's warm-up must restore)."""
        return [t for m in self.models for t in m.state_dict().values()]

    def state_dict(self) -> dict:
        return {"stds": list(self.stds), "gammas": list(self.gammas), "models": [m.state_dict() for m in self.models]}

    def check_resumable(self, saved_stds: list[float], path: str | Path = "checkpoint") -> None:
        """Raise ValueError when a tracked std is not among a checkpoint's ``saved_stds``."""
        missing = [s for s in self.stds if s not in saved_stds]
        if missing:
            raise ValueError(
                f"checkpoint {path} tracks no post-hoc EMA of sigma_rel {missing} (it tracks {saved_stds or 'none'}): "
                "a power-function EMA averages from step 0, so ema.posthoc_std can only drop values on resume; "
                "start a new run to track new ones"
            )

    def load_state_dict(self, state: dict, path: str | Path = "checkpoint") -> None:
        """Load the averages of this object's stds from ``state`` (a checkpoint's ``posthoc_ema``).
        A tracked std the checkpoint lacks cannot start mid-run: its profile must begin at step 0."""
        saved = dict(zip((float(s) for s in state["stds"]), state["models"]))
        self.check_resumable(list(saved), path)
        for s, avg in zip(self.stds, self.models):
            load_weights(avg, saved[s], path, f"posthoc_ema[{s}]")


# ---------------------------------------------------------------------------------------------
# Snapshot files: RUN/ema_snapshots/ema_<std>_<step>.pt, one average at one step.


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A snapshot file as its name gives it (the file holds the exact std, gamma and step)."""

    std: float  # sigma_rel, as the name writes it (6 significant digits)
    step: int  # optimizer steps averaged: the profile ends at t = step
    path: Path


def snapshot_name(std: float, step: int) -> str:
    return f"ema_{std:g}_{step:08d}.pt"


def save_snapshots(power_ema: PowerEMA, run_dir: Path, step: int, config: dict, num_classes: int,
                   dctx: DistContext) -> list[Path]:
    """Write each tracked average at ``step`` as its own file (atomic). Every rank calls this; rank 0
    writes, and every rank gets its outcome (the paths, or its error). Under FSDP each average is
    gathered whole first (a collective), one tensor at a time, onto rank 0 alone (the other ranks
    drop each after the gather), so the files are those of a DDP run. The
    file says what it is: std, gamma, step, and the config and classes to build the network from."""
    folder = Path(run_dir) / SNAPSHOT_DIR
    written = []
    for std, gamma, avg in zip(power_ema.stds, power_ema.gammas, power_ema.models):
        whole = {}  # themselves, unless sharded: then gathered one tensor at a time, kept by rank 0 alone
        for k, v in avg.state_dict().items():
            t = full_tensor(v)  # a collective under FSDP: every rank calls it
            if dctx.is_main:
                whole[k] = t
        record = {"format": SNAPSHOT_FORMAT, "std": std, "gamma": gamma, "step": step,
                  "num_classes": num_classes, "config": config, "model": whole}
        path = folder / snapshot_name(std, step)
        written.append(distributed.run_on_main(partial(_write_snapshot, path, record), dctx))
    return written


def _write_snapshot(path: Path, record: dict) -> Path:
    """Rank 0: ``record`` with its tensors copied to the CPU, to ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**record, "model": {k: v.detach().to("cpu", copy=True) for k, v in record["model"].items()}}
    with atomic_write(path) as f:
        torch.save(record, f)
    return path


def list_snapshots(run_dir: str | Path) -> list[Snapshot]:
    """The snapshot files of ``run_dir/ema_snapshots`` by (step, std), from their names alone."""
    folder = Path(run_dir) / SNAPSHOT_DIR
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        m = _SNAPSHOT_NAME.match(path.name)
        if m:
            try:
                found.append(Snapshot(float(m.group(1)), int(m.group(2)), path))
            except ValueError:  # a name that only looks like one
                continue
    return sorted(found, key=lambda s: (s.step, s.std))


def load_snapshot(path: str | Path) -> dict:
    """A snapshot file, memory-mapped, with ``weights_only=True`` (never runs pickled code)."""
    try:
        record = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise ValueError(f"cannot load EMA snapshot {path}: {e}") from e
    if not isinstance(record, dict) or record.get("format") != SNAPSHOT_FORMAT:
        raise ValueError(f"{path} is not a difftrain EMA snapshot (format {SNAPSHOT_FORMAT!r} expected)")
    return record
