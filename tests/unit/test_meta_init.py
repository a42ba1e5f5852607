"""runtime/meta_init.py: a network built on the meta device, its initialisation recorded and replayed
one parameter at a time, holds bit for bit what an ordinary CPU build from the same seed holds, and
leaves the global generator where that build leaves it; what cannot be replayed exactly is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import TINY_OVERRIDES

from difftrain.networks.conditioning import Conditioning
from difftrain.config import load_config
from difftrain.runtime import meta_init
from difftrain.networks.build import build_network

pytest.importorskip("accelerate")


def _replayed(build) -> tuple[dict, nn.Module]:
    with meta_init.recorded_build() as recording:
        model = build()
    recording.bind(model)
    assert all(p.is_meta for p in model.parameters())
    got: dict = {}
    meta_init.replay(recording, got.__setitem__)
    return got, model


@pytest.mark.parametrize("extra", [[], ["diffusion.uncertainty_weighting=true"], ["data.class_conditional=true"]])
def test_a_replayed_build_equals_the_ordinary_one_bit_for_bit(extra):
    cfg = load_config(None, TINY_OVERRIDES + extra)
    classes = 3 if extra == ["data.class_conditional=true"] else 0
    cond = Conditioning(classes, channels=3, resolution=16)
    torch.manual_seed(7)
    ordinary = build_network(cfg, cond)
    rng_after = torch.random.get_rng_state()
    torch.manual_seed(7)
    got, meta = _replayed(lambda: build_network(cfg, cond))
    want = dict(ordinary.named_parameters())
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(torch.random.get_rng_state(), rng_after)  # dropout and the rest draw the same numbers next
    for name, b in ordinary.named_buffers():  # buffers are built real
        assert torch.equal(meta.get_buffer(name), b)


class _DrawsInConstructor(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.randn(3))  # drawn outside any initialisation call


def test_a_build_drawing_random_numbers_outside_an_init_is_refused():
    torch.manual_seed(0)
    with pytest.raises(meta_init.NotReplayable, match="draws random numbers"):
        _replayed(_DrawsInConstructor)
