"""Learning-rate schedule: linear warm-up, then cosine decay, constant or EDM2's inverse square
root decay, in optimizer steps."""

from __future__ import annotations

import math


def lr_at(
    step: int,
    *,
    peak_lr: float,
    warmup_steps: int,
    total_steps: int,
    schedule: str = "cosine",
    min_lr_ratio: float = 0.0,
    ref_steps: int = 0,
) -> float:
    """The learning rate for optimizer step ``step`` (0-based).

    Warm-up rises linearly from ``peak_lr / warmup_steps`` to ``peak_lr`` over ``warmup_steps``;
    "cosine" then decays to ``min_lr_ratio * peak_lr`` at ``total_steps`` (Loshchilov & Hutter
    2017, without restarts) and "constant" holds the peak. Counted in optimizer steps, so the
    schedule is the same whatever the gradient accumulation. "inverse_sqrt" is EDM2's decay
    (Karras et al. 2024, "Analyzing and improving the training dynamics of diffusion models",
    eq. 17): ``peak_lr / sqrt(max(step / ref_steps, 1))``, constant up to ``ref_steps`` (t_ref).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak_lr
    if schedule == "inverse_sqrt":
        if not ref_steps > 0:
            raise ValueError(f"optim.lr_ref_steps must be > 0 for optim.lr_schedule='inverse_sqrt', got {ref_steps}")
        return peak_lr / math.sqrt(max(step / ref_steps, 1.0))
    if schedule != "cosine":
        raise ValueError(f"optim.lr_schedule must be 'cosine', 'constant' or 'inverse_sqrt', got {schedule!r}")
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    floor = min_lr_ratio * peak_lr
    return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
