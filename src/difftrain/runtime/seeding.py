"""Seeds derived from (seed, rank, step), so that a resumed run draws the same numbers."""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from any tuple of ints and strings (stable across processes and runs)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def step_generator(seed: int, rank: int, step: int, device: torch.device, purpose: str) -> torch.Generator:
    """A generator on ``device`` seeded by (seed, rank, step, purpose)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(seed, rank, step, purpose))
    return gen


def rng_state() -> dict:
    """The global torch RNG states (CPU and every CUDA device) for a checkpoint."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
