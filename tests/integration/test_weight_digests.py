"""The weights of fixed tiny runs, pinned by digest: a refactoring of the training step, the run
state or the objective must leave them bit for bit as they were.

The digests were recorded before the step/state/objective redesign (issue 9) on a 2-core x86 CPU
with torch 2.13. Float results of the same code can differ on another CPU (oneDNN and the fused
AdamW pick kernels by instruction set), so each recording keeps a fingerprint of this machine's
numerics beside it: where the fingerprint differs the test skips and says why, instead of
failing on someone's laptop; where it matches, any change of the weights fails.
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
    "epsilon-uniform": (
        "bb3c91dba5c26c6df13e6ae8923c12c6395b6159b35aa552854bcd954537e24e",
        "b7f9b5556a6709fdcc1925e8a3f9616a1db5b3fe1d4fd0da82ecd44b0ad4710f",
    ),
    "v-minsnr-accum-dropout-cond": (
        "151d057ff8327545d1c7561a42237147292bdf11a80d339d0df0319fc17bb88b",
        "403c3417f23f3de9b1ef7d1e7cb2b31ed776b53e64bdc8149848a06abd865efc",
    ),
}
FINGERPRINT = "232a0fa272e5c153"  # numerics_fingerprint() on the recording machine


def numerics_fingerprint() -> str:
    """A digest of a small fixed convolution forward and backward and a fused AdamW step: it
    changes with the CPU's kernels, not with difftrain's code."""
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
    return h.hexdigest()[:16]


def run_digests(tmp_path, overrides: list[str]) -> tuple[str, str]:
    from difftrain.training.checkpoint import load_checkpoint, state_dict_sha256
    from difftrain.training.loop import train

    cfg = load_config(None, TINY_OVERRIDES + overrides)
    result = train(cfg, tmp_path / "run")
    state = load_checkpoint(result.checkpoint)
    return state_dict_sha256(state["model"]), state_dict_sha256(state["ema"]["model"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_weights_unchanged_by_refactoring(tmp_path, case):
    if numerics_fingerprint() != FINGERPRINT:
        pytest.skip(f"this CPU's numerics differ from the recording machine's ({numerics_fingerprint()} != {FINGERPRINT})")
    assert run_digests(tmp_path, CASES[case]) == RECORDED[case]
