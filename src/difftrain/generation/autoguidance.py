"""Autoguidance (Karras et al. 2024, "Guiding a diffusion model with a bad version of itself"):
guide the main network with a weaker one of the same task (an earlier checkpoint of the same run,
or a smaller or shorter run), D = D_guide + w (D_main - D_guide) (eq. 2 with D_0 = the guide).

    guided = AutoGuided(main, guide, weight=2.0)    # an nn.Module: net(x, t, cond) like either
    loaded = with_guide(load_model(run), "runs/small", weight=2.0)      # or guide_step=N of run

Every parameterization's denoised image is c_skip x + c_out F with the same coefficients for
both networks (EDM's preconditioning, DDPM's eps / v / x0 map), so guiding the raw outputs F
guides D alike; both networks must therefore share the objective and its parameterization
(:func:`check_compatible`). Cost: two network evaluations per sampler evaluation (w = 1 skips
the guide); with classifier-free guidance on top (``sampling.guided_network``), four.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from difftrain.checkpoints.checkpoint import list_checkpoints
from difftrain.config import DiffusionConfig
from difftrain.generation.inference import load_model

# objective -> the cfg.diffusion keys that fix how its raw output becomes D: equal for the model and its guide.
PARAMETERIZATION_KEYS = {"ddpm": ("prediction", "schedule", "num_timesteps", "zero_terminal_snr"),
                         "edm": ("edm_sigma_data",), "flow": ()}


class AutoGuided(nn.Module):
    """``net(x (B, C, H, W), t (B,), cond=None) -> guide + weight (main - guide)`` (B, C, H, W)
    float32. ``weight`` = 1 is the main network exactly (the guide is not run), 0 the guide."""

    def __init__(self, main: nn.Module, guide: nn.Module, weight: float):
        super().__init__()
        if not weight >= 0:
            raise ValueError(f"the autoguidance weight must be >= 0, got {weight}")
        self.main, self.guide, self.weight = main, guide, float(weight)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        if self.weight == 1.0:
            return self.main(x, t, cond).float()
        guide = self.guide(x, t, cond).float()
        if self.weight == 0.0:
            return guide
        return guide + self.weight * (self.main(x, t, cond).float() - guide)


def guide_checkpoint(main: str | Path, guide: str | Path | None = None, guide_step: int | None = None) -> Path:
    """The guide's checkpoint: ``guide`` (a run, checkpoint or weights file) as given, or, with
    ``guide_step``, the checkpoint of step ``guide_step`` of the run ``guide`` (default: the main
    run ``main``); a ValueError listing the steps there when it has none of that step."""
    if guide_step is None:
        if guide is None:
            raise ValueError("autoguidance needs a guide: a checkpoint or run (--guide) or a step of the run (--guide-step)")
        return Path(guide)
    run = Path(guide if guide is not None else main)
    if run.is_file():
        run = run.parent
    folder = run / "checkpoints" if (run / "checkpoints").is_dir() else run
    found = dict(list_checkpoints(folder))
    if guide_step not in found:
        raise ValueError(f"--guide-step {guide_step}: {folder} has no checkpoint of that step "
                         f"(it has steps {sorted(found) or 'none'})")
    return found[guide_step]


def check_compatible(diffusion: DiffusionConfig, num_classes: int, conditioning, what: str, guide) -> None:
    """A ValueError naming the first setting where the guide (a ``LoadedModel``) cannot guide the
    model ``what`` of ``diffusion`` (its config's section): another parameterization, image shape,
    class count or conditioning."""
    for key in ("objective", *PARAMETERIZATION_KEYS[diffusion.objective]):
        ours, theirs = getattr(diffusion, key), getattr(guide.cfg.diffusion, key)
        if ours != theirs:
            raise ValueError(f"the guide {guide.path} was trained with diffusion.{key}={theirs!r}, the model "
                             f"{what} with {ours!r}: a guide must share the model's objective and parameterization")
    pairs = {"image shape (channels, resolution)": (conditioning.network_shape(), guide.conditioning.network_shape()),
             "class count": (num_classes, guide.num_classes),
             "conditioning": (conditioning.kind, guide.conditioning.kind)}
    for name, (ours, theirs) in pairs.items():
        if ours != theirs:
            raise ValueError(f"the guide {guide.path} has {name} {theirs!r}, the model {what} {ours!r}")


def with_guide(loaded, guide: str | Path | None = None, weight: float = 2.0, *, guide_step: int | None = None,
               use_ema: bool = True):
    """``loaded`` (a ``LoadedModel``) whose model is :class:`AutoGuided` by the guide
    :func:`guide_checkpoint` resolves, loaded on the same device (EMA weights unless ``use_ema``
    is False). Nothing to do (``loaded`` itself) when neither ``guide`` nor ``guide_step`` is given."""
    if guide is None and guide_step is None:
        return loaded
    if not getattr(loaded.objective, "guidable", True):
        raise ValueError(f"{loaded.path}: a {loaded.objective.family} model samples unguided (a blend of its "
                         "outputs is not its guided field's); drop --guide / --guide-step")
    path = guide_checkpoint(loaded.path, guide, guide_step)
    device = next(loaded.model.parameters()).device
    guide_model = load_model(path, use_ema=use_ema, device=str(device))
    check_compatible(loaded.cfg.diffusion, loaded.num_classes, loaded.conditioning, loaded.path, guide_model)
    return dataclasses.replace(loaded, model=AutoGuided(loaded.model, guide_model.model, weight).eval(),
                               guide=guide_model.path, guide_step=guide_model.step, guide_weight=float(weight))


class ValidationGuide:
    """The guide of a run's validation grids and FID samples (``validation.guide``, weight
    ``validation.guide_weight``), loaded on first use; ``wrap(model)`` is ``model`` itself when
    there is none. A guide that is missing or does not fit raises a ValueError naming the key.
    ``v``: the run's validation section; ``diffusion``: its diffusion section (the guide's must match)."""

    def __init__(self, v, diffusion, conditioning):
        self.path, self.weight = v.guide, v.guide_weight
        self._diffusion, self._conditioning = diffusion, conditioning
        self._net: nn.Module | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        """``model`` guided by the guide (:class:`AutoGuided`), or ``model`` when there is none."""
        if not self.path:
            return model
        if self._net is None:
            try:
                guide = load_model(self.path, device=str(next(model.parameters()).device))
                check_compatible(self._diffusion, self._conditioning.num_classes, self._conditioning, "being trained", guide)
            except (OSError, ValueError) as e:
                raise ValueError(f"validation.guide {self.path}: {e}") from None
            self._net = guide.model.requires_grad_(False)
        return AutoGuided(model, self._net, self.weight)
