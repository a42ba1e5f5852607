"""The weights of fixed tiny runs, pinned by digest: a refactoring of the training step, the run
state or the objective must leave them bit for bit as they were.

The digests were recorded before the step/state/objective redesign (issue 9) on a 2-core x86 CPU
with AVX-512 and torch 2.13, and again, from the same code, on a 2-core x86 CPU with AVX2 only
(the CI machine of session 7: the small fingerprint below matched there, the weights did not).
Float results of the same code differ between CPUs (oneDNN, MKL and the fused AdamW pick kernels
by instruction set), so each recording is keyed by a fingerprint of the machine's numerics: torch's
CPU capability and a small fixed computation. Where no recording has this machine's fingerprint
the test skips and says why, instead of failing on someone's laptop; where one has, any change of
the weights fails.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from conftest import TINY_OVERRIDES
from difftrain.config import load_config

# Each case: overrides on top of the shared tiny run -> (model sha256, EMA sha256) at its end.
CASES = {
    "epsilon-uniform": [],
    "v-minsnr-accum-dropout-cond": [
        "diffusion.prediction=v",
        "diffusion.loss_weighting=min_snr",
        "train.grad_accum_steps=2",
        "train.batch_size=4",
        "model.dropout=0.1",
        "data.class_conditional=true",
        "data.heldout_fraction=0.05",
    ],
}
RECORDED = {
    # numerics_fingerprint() of the recording machine -> case -> digests
    "AVX512:232a0fa272e5c153": {
        "epsilon-uniform": (
            "bb3c91dba5c26c6df13e6ae8923c12c6395b6159b35aa552854bcd954537e24e",
            "b7f9b5556a6709fdcc1925e8a3f9616a1db5b3fe1d4fd0da82ecd44b0ad4710f",
        ),
        "v-minsnr-accum-dropout-cond": (
            "151d057ff8327545d1c7561a42237147292bdf11a80d339d0df0319fc17bb88b",
            "403c3417f23f3de9b1ef7d1e7cb2b31ed776b53e64bdc8149848a06abd865efc",
        ),
    },
    "AVX2:232a0fa272e5c153": {
        "epsilon-uniform": (
            "037696bc1e9f3c3254b4556c87f5adc60e7ce6bac6acff91b5441b54222096ad",
            "1303cc4636343b42519efa3947183186eaafe13cdca97b33c0bacddca992ff88",
        ),
        "v-minsnr-accum-dropout-cond": (
            "2ba1209cbe67c19dd7a85f581488caf521f77add19c67854a05003cccd010c32",
            "2ba0864b945fb07bdc62507cf25e0696ae7f17bb143f0c910d501e0eb416f38c",
        ),
    },
}


def numerics_fingerprint() -> str:
    """torch's CPU capability (AVX2, AVX512, ...) and a digest of a small fixed convolution forward
    and backward and a fused AdamW step: it changes with the CPU's kernels, not with difftrain's
    code (the digest alone matched on an AVX2 and an AVX-512 machine whose training runs differed)."""
    g = torch.Generator().manual_seed(0)
    conv = torch.nn.Conv2d(8, 8, 3, padding=1)
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    conv.to(memory_format=torch.channels_last)
    x = torch.randn(4, 8, 16, 16, generator=g).to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(conv.parameters(), lr=1e-3, fused=True)
    torch.nn.functional.group_norm(conv(x), 4).square().mean().backward()
    opt.step()
    h = hashlib.sha256()
    for p in conv.parameters():
        h.update(p.detach().contiguous().reshape(-1).numpy().tobytes())
    return f"{torch.backends.cpu.get_cpu_capability()}:{h.hexdigest()[:16]}"


def run_digests(tmp_path, overrides: list[str]) -> tuple[str, str]:
    from difftrain.training.checkpoint import load_checkpoint, state_dict_sha256
    from difftrain.training.loop import train

    cfg = load_config(None, TINY_OVERRIDES + overrides)
    result = train(cfg, tmp_path / "run")
    state = load_checkpoint(result.checkpoint)
    return state_dict_sha256(state["model"]), state_dict_sha256(state["ema"]["model"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_weights_unchanged_by_refactoring(tmp_path, case):
    fingerprint = numerics_fingerprint()
    if fingerprint not in RECORDED:
        pytest.skip(f"this CPU's numerics ({fingerprint}) differ from every recording machine's ({', '.join(RECORDED)})")
    assert run_digests(tmp_path, CASES[case]) == RECORDED[fingerprint][case]
