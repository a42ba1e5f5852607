"""What every training objective provides (see :mod:`difftrain.diffusion.objective`): the
network's call signature, one batch prepared for it, and the objective's methods."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

# network(x (B, C, H, W), cond (B,)) -> raw output (B, C, H, W): labels and guidance bound in.
Network = Callable[[Tensor, Tensor], Tensor]


@dataclasses.dataclass(frozen=True)
class Noised:
    """One batch prepared for the network: ``net(input, cond)`` is regressed onto ``target``
    with per-sample ``weight``."""

    input: Tensor  # (B, C, H, W) what the network sees
    cond: Tensor  # (B,) the noise conditioning the network gets; MeanFlow: (B, 2), its two times
    target: Tensor  # (B, C, H, W)
    weight: Tensor  # (B,) float32


class Objective(Protocol):
    family: str
    samplers: dict[str, Callable[..., Tensor]]
    sampler_nfe: dict[str, Callable[[int], int]]  # network evaluations of each sampler for N steps

    def to(self, device: torch.device) -> Objective: ...
    def draw_levels(self, n: int, generator: torch.Generator, device: torch.device) -> Tensor: ...
    def stratified_levels(self, n: int, generator: torch.Generator) -> Tensor: ...
    def bucket(self, levels: Tensor, num_buckets: int) -> Tensor: ...
    def noised(self, x0: Tensor, levels: Tensor, noise: Tensor) -> Noised: ...
    def x0_hat(self, b: Noised, out: Tensor, levels: Tensor) -> Tensor: ...
    def quantile(self, u: Tensor) -> Tensor: ...
    def sample(self, network: Network, x_T: Tensor, sampler: str, steps: int, generator, **options) -> Tensor: ...
