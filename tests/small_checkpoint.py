"""A checkpoint of a very small UNet with random weights, for tests that compare samplers and
exports rather than image quality (test_interop, test_ode_export)."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_OVERRIDES
from difftrain.config import load_config
from difftrain.checkpoints.checkpoint import load_checkpoint, save_checkpoint
from difftrain.training.state import RunState

SMALL = TINY_OVERRIDES + ["model.base_channels=8", "model.channel_mult=[1, 2]", "train.progress_bar=false"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread for the module (import it into a test module to apply it there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_checkpoint(tmp_path, *overrides: str, num_classes: int = 0) -> dict:
    """A checkpoint of random (non-zero) EMA weights, written where load_checkpoint reads it, read back."""
    cfg = load_config(None, SMALL + list(overrides))
    state = RunState.build(cfg, num_classes, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in state.ema.model.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return load_checkpoint(save_checkpoint(state.state_dict(), tmp_path / "checkpoints", step=0))
