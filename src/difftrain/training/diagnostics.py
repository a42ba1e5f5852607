"""What to print when training diverges: batch statistics, timesteps, per-layer gradient norms."""

from __future__ import annotations

import torch

from difftrain.diffusion.losses import diffusion_loss


def _stats(name: str, x: torch.Tensor) -> str:
    x = x.detach().float()
    finite = torch.isfinite(x)
    bad = int((~finite).sum())
    v = x[finite]
    if v.numel() == 0:
        return f"  {name}: shape {tuple(x.shape)}, all {bad} values non-finite"
    return (
        f"  {name}: shape {tuple(x.shape)}, min {v.min():.4g}, max {v.max():.4g}, "
        f"mean {v.mean():.4g}, std {v.std() if v.numel() > 1 else 0.0:.4g}, non-finite {bad}"
    )


def divergence_report(model: torch.nn.Module, objective, batch, max_layers: int = 12) -> str:
    """Recompute the last micro-batch's loss and gradients and describe them.

    Args:
        model: the network (its weights are not changed; its gradients are cleared after).
        objective: the run's objective; batch: the last ``step.MicroBatch`` (x0, labels, levels, noise).

    Returns lines with the statistics of each batch tensor, the noise levels, the per-sample
    loss, and the gradient norm of each parameter tensor: every non-finite one, then the largest.
    """
    b = objective.noised(batch.x0, batch.levels, batch.noise)
    x0, x_t, target, t = batch.x0, b.input, b.target, batch.levels
    lines = ["diagnostic (the last micro-batch, recomputed in fp32):"]
    for name, x in (("x0", x0), ("x_t", x_t), ("target", target)):
        lines.append(_stats(name, x))
    lines.append(f"  noise levels: {t.tolist()}")
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        per_sample = diffusion_loss(model(x_t, b.cond, batch.condition).float(), target, b.weight)
        lines.append(f"  per-sample loss: {[round(v, 4) for v in per_sample.detach().tolist()]}")
        per_sample.mean().backward()
    norms = {
        n: float(p.grad.detach().float().norm()) for n, p in model.named_parameters() if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    bad = [n for n, v in norms.items() if not torch.isfinite(torch.tensor(v))]
    lines.append(f"  gradient norms: {len(bad)} of {len(norms)} parameter tensors non-finite")
    for n in bad[:max_layers]:
        lines.append(f"    {n}: {norms[n]}")
    finite = sorted(((v, n) for n, v in norms.items() if n not in bad), reverse=True)
    for v, n in finite[:max_layers]:
        lines.append(f"    {n}: {v:.4g}")
    return "\n".join(lines)
