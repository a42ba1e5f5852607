"""Post-hoc EMA: the power-function EMA of any length at a step of a finished run, reconstructed
from the run's EMA snapshots (Karras et al. 2024, EDM2, sec. 3.2 and appendix C.3); what
``difftrain posthoc-ema`` calls.

    rec = reconstruct("runs/tiny", std=0.08)              # at the newest checkpoint's step
    write_checkpoint(rec, "tiny-ema0.08.pt")              # for sample, eval, inspect, diagnose

The snapshots are those of ``RUN/ema_snapshots`` before the step, plus the run's tracked averages
at the step itself, taken from the checkpoint of that step (so the step must be a kept one).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from difftrain.checkpoints.checkpoint import find_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint_file
from difftrain.training.power_ema import list_snapshots, load_snapshot, solve_coefficients, std_to_gamma

RESIDUAL_WARNING = 0.05  # a relative profile residual above this is reported as a poor fit


@dataclasses.dataclass
class Source:
    """One averaged profile the reconstruction combines."""

    std: float
    gamma: float
    step: int  # the profile ends at t = step
    where: str  # the snapshot file, or "CHECKPOINT[posthoc_ema]"
    coefficient: float = 0.0


@dataclasses.dataclass
class Reconstruction:
    std: float  # sigma_rel asked for
    gamma: float
    step: int
    residual: float  # ||p_target - sum_i x_i p_i|| / ||p_target||, the L2 error of the fitted profile
    sources: list[Source]
    weights: dict[str, torch.Tensor]  # the reconstructed EMA's state dict
    checkpoint: dict  # the run's checkpoint of ``step`` (load_checkpoint's result)

    def describe(self) -> str:
        stds = ", ".join(f"{s:g}" for s in sorted({s.std for s in self.sources}))
        steps = sorted({s.step for s in self.sources})
        return (f"sigma_rel {self.std:g} (gamma {self.gamma:.3f}) at step {self.step} from {len(self.sources)} "
                f"snapshots (sigma_rel {stds}; steps {steps[0]}..{steps[-1]}); profile residual {self.residual:.3g} "
                f"(relative L2)")


def reconstruct(run_dir: str | Path, std: float, step: int | None = None,
                from_stds: Sequence[float] | None = None) -> Reconstruction:
    """The EMA of relative std ``std`` at ``step`` (default: the newest checkpoint's) of the run in
    ``run_dir`` (or at a checkpoint file of it), as the least-squares combination of its snapshots
    (of ``from_stds`` only, if given).
    """
    run_dir = Path(run_dir)
    gamma = std_to_gamma(std)
    if run_dir.is_file():  # a checkpoint file: its step, and the run above its checkpoints/ folder
        state = load_checkpoint(run_dir)
        if step is not None and step != state["step"]:
            raise ValueError(f"--step {step} differs from the step of checkpoint {run_dir} ({state['step']})")
        run_dir = run_dir.parent.parent if run_dir.parent.name == "checkpoints" else run_dir.parent
    else:
        state = load_checkpoint(_checkpoint_of(run_dir, step))
    step = state["step"]

    def wanted(s: float) -> bool:
        return from_stds is None or any(math.isclose(s, f, rel_tol=1e-9) for f in from_stds)

    sources, tensors = [], []
    for snap in list_snapshots(run_dir):
        if snap.step < step and wanted(snap.std):
            record = load_snapshot(snap.path)  # memory-mapped: the weights are read when combined
            if int(record["step"]) != snap.step or not math.isclose(float(record["std"]), snap.std, rel_tol=1e-5):
                raise ValueError(f"{snap.path} holds sigma_rel {record['std']} at step {record['step']}, not what "
                                 "its name says: a renamed file?")
            sources.append(Source(float(record["std"]), float(record["gamma"]), snap.step, str(snap.path)))
            tensors.append(record["model"])
    tracked = state["posthoc_ema"]  # the checkpoint's own averages stand for the snapshots of its step
    for s, model in zip(tracked["stds"], tracked["models"]):
        if wanted(s):
            sources.append(Source(s, std_to_gamma(s), step, f"{state['path']}[posthoc_ema]"))
            tensors.append(model)
    if not sources:
        raise ValueError(
            f"no post-hoc EMA snapshots in {run_dir} up to step {step}"
            + (f" of sigma_rel {list(from_stds)}" if from_stds is not None else "")
            + ": train with ema.posthoc_std set (e.g. [0.05, 0.10])"
        )
    x, residual = solve_coefficients([s.step for s in sources], [s.gamma for s in sources], step, gamma)
    for src, c in zip(sources, x):
        src.coefficient = float(c)
    weights = _combine(sources, tensors)
    return Reconstruction(std, gamma, step, residual, sources, weights, state)


def _combine(sources: list[Source], tensors: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``sum_i x_i theta_i``, accumulated in float64 one source at a time (snapshot files are
    memory-mapped); tensors that are not floating point come from the last (newest) source."""
    total: dict[str, torch.Tensor] = {}
    last: dict[str, torch.Tensor] = {}
    for src, weights in zip(sources, tensors):
        if last and set(weights) != set(last):
            raise ValueError(f"{src.where} holds other weights than {sources[0].where}: not a snapshot of this run's model")
        for name, t in weights.items():
            if t.is_floating_point():
                if name not in total:
                    total[name] = torch.zeros(t.shape, dtype=torch.float64)
                total[name].add_(t.to(torch.float64), alpha=src.coefficient)
            last[name] = t
    return {name: total[name].to(t.dtype) if name in total else t.clone() for name, t in last.items()}


def _checkpoint_of(run_dir: Path, step: int | None) -> Path:
    """The run's checkpoint of ``step`` (default its newest), or an error naming the kept steps."""
    if step is None:
        return find_checkpoint(run_dir)
    kept = list_checkpoints(run_dir / "checkpoints")
    for s, path in kept:
        if s == step:
            return path
    raise ValueError(
        f"--step {step}: {run_dir / 'checkpoints'} keeps no checkpoint of that step (kept: {[s for s, _ in kept]}); "
        "the reconstruction needs it for the tracked averages at that step (checkpoint.keep_every_steps keeps more)"
    )


def write_checkpoint(rec: Reconstruction, out: str | Path) -> Path:
    """The checkpoint of ``rec.step`` with its EMA weights replaced by the reconstruction, and
    ``ema.posthoc`` saying how they were made: ``sample`` and ``eval`` use them by default."""
    state = {k: v for k, v in rec.checkpoint.items() if k not in ("path", "format")}
    state["ema"] = {
        **state["ema"],
        "model": rec.weights,
        "posthoc": {
            "std": rec.std, "gamma": rec.gamma, "step": rec.step, "residual": rec.residual,
            "sources": [[s.std, s.step, s.coefficient] for s in rec.sources],
        },
    }
    out = Path(out)
    save_checkpoint_file(state, out)
    return out


def posthoc_file(run: str | Path, std: float, folder: str | Path, step: int | None = None) -> tuple[Path, Reconstruction]:
    """The checkpoint (written in ``folder``) of the run ``run`` (or of its checkpoint file) whose
    EMA is the one of ``std`` reconstructed post hoc at ``step`` (default: the newest checkpoint's),
    and the reconstruction; what ``sample --ema-std`` / ``--guide-ema-std`` load. A ValueError
    naming the run when it has no snapshots of its ``ema.posthoc_std`` or lacks the step."""
    rec = reconstruct(run, std, step=step)
    name = Path(run).resolve().name.removesuffix(".pt")
    return write_checkpoint(rec, Path(folder) / f"{name}-step{rec.step}-ema{std:g}.pt"), rec

