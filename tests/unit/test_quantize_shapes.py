"""Which Linear layers ``model.quantize_base`` holds quantized: decided by the layer's shape, the same on
every machine; a layer bitsandbytes' kernels cannot take stays float32, with one note (issue 39)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from difftrain.networks.quantize import NF4_BLOCKSIZE, quantize_base, quantized_layers, unfit


def test_the_rule_is_the_layers_shape():
    assert unfit("nf4", nn.Linear(32, 64)) == f"in_features not a multiple of nf4's block of {NF4_BLOCKSIZE}"
    assert "out_features not a multiple of 32" in unfit("nf4", nn.Linear(64, 16))
    assert unfit("nf4", nn.Linear(64, 32)) is None and unfit("nf4", nn.Linear(320, 1280)) is None
    assert all(unfit(kind, nn.Linear(8, 8)) is None for kind in ("int8", "fp8"))


def test_a_layer_narrower_than_nf4s_block_stays_float_with_one_note(capsys):
    """A 32-wide layer crashed on a CPU with AVX-512 BF16 at its first call outside training
    (bitsandbytes reshaped its block scales to (32, 0)); held float32, it computes as before."""
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    base = nn.ModuleDict({"narrow": nn.Linear(32, 64), "fits": nn.Linear(64, 64), "few_rows": nn.Linear(64, 16),
                          "wide": nn.Linear(128, 32)})
    narrow = base["narrow"].weight.detach().clone()
    assert quantize_base(base, "nf4") == 2
    assert quantized_layers(base) == {"fits": "nf4", "wide": "nf4"}
    assert type(base["narrow"]) is nn.Linear and torch.equal(base["narrow"].weight, narrow)
    notes = [line for line in capsys.readouterr().out.splitlines() if "note" in line]
    assert notes == ["difftrain: note: model.quantize_base='nf4': 2 of 4 Linear layers stay float32 (1 with "
                     "in_features not a multiple of nf4's block of 64; 1 with out_features not a multiple of 32 "
                     "(bitsandbytes' CPU kernel's row block))"]
    base.eval()
    with torch.no_grad():  # outside training: where bitsandbytes takes its AVX-512 BF16 kernel, if this CPU has one
        for name, layer in base.items():
            y = layer(torch.randn(3, layer.in_features))
            assert y.shape == (3, layer.out_features) and torch.isfinite(y).all(), name
    assert quantize_base(base, "nf4") == 0 and "note" not in capsys.readouterr().out  # decided once
