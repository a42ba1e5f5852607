"""Pinning weights without pinning one CPU's rounding.

Float results of the same code differ in their last bits between CPUs (oneDNN, MKL and torch's own
kernels are chosen by instruction set and CPU model), so a digest of float weights holds on one
kind of machine only. A test that pins weights keeps an exact digest of their layout (names,
dtypes, shapes) and, for the values, sums with fixed random signs compared with a tolerance: each
is a random projection, so changing a tensor's elements by a vector ``d`` moves it by about
``|d|`` (Euclidean norm), whichever elements moved, while rounding moves it by far less.
"""

from __future__ import annotations

import hashlib

import torch


def layout_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the names, dtypes and shapes of a state dict (not its values), in name order."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
    return h.hexdigest()


def signed_sums(state_dict: dict[str, torch.Tensor], k: int = 2) -> dict[str, list[float]]:
    """Per tensor, ``k`` sums of its elements times fixed random signs, in float64.

    The signs are integers drawn from one generator seeded 0, per tensor in name order ((k, n)
    for a tensor of n elements), the same on every CPU. Summed over the tensors, they are ``k``
    random-sign sums of the whole state dict.
    """
    g = torch.Generator().manual_seed(0)
    out = {}
    for name in sorted(state_dict):
        w = state_dict[name].detach().cpu().double().reshape(-1)
        signs = torch.randint(0, 2, (k, w.numel()), generator=g).double().mul_(2).sub_(1)
        out[name] = (signs @ w).tolist()
    return out


def total_signed_sums(state_dict: dict[str, torch.Tensor], k: int = 2) -> list[float]:
    """``k`` random-sign sums over every element of the state dict (see :func:`signed_sums`)."""
    return [sum(column) for column in zip(*signed_sums(state_dict, k).values())]
