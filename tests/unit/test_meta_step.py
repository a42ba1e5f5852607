"""tools/meta_step.py: what a forward keeps for backward, counted on the meta device, equals what a real
CPU forward keeps, to the byte (fp32), and its autocast stand-in keeps what CPU autocast keeps."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import FluxTransformer2DModel, UNet2DConditionModel  # noqa: E402

from difftrain.tools.meta_step import saved_for_backward  # noqa: E402

FLUX = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=24, pooled_projection_dim=12, guidance_embeds=True, axes_dims_rope=(2, 2, 4))
UNET = dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=24, attention_head_dim=4, norm_num_groups=8)


def _flux_inputs(device):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    return dict(hidden_states=r(2, 16, 16), encoder_hidden_states=r(2, 6, 24), pooled_projections=r(2, 12),
                timestep=torch.rand(2, generator=g).to(device), guidance=r(2), img_ids=torch.zeros(16, 3, device=device),
                txt_ids=torch.zeros(6, 3, device=device), return_dict=False)


def _unet_inputs(device):
    g = torch.Generator().manual_seed(0)
    return dict(sample=torch.randn(2, 4, 8, 8, generator=g).to(device), timestep=torch.full((2,), 10.0, device=device),
                encoder_hidden_states=torch.randn(2, 5, 24, generator=g).to(device), return_dict=False)


def _pair(cls, config):
    torch.manual_seed(0)
    real = cls(**config)
    with torch.device("meta"):
        meta = cls(**config)
    return real, meta


def _real_saved(model, inputs, autocast: bool = False) -> int:
    """Bytes of the storages a real CPU forward saves for backward, each once, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs)
    return sum(kept.values())


@pytest.mark.parametrize("cls, config, inputs", [(FluxTransformer2DModel, FLUX, _flux_inputs),
                                                 (UNet2DConditionModel, UNET, _unet_inputs)], ids=["flux", "unet"])
def test_meta_count_equals_a_real_cpu_forward_to_the_byte(cls, config, inputs):
    """fp32: the meta forward (fused-attention stand-in) keeps exactly what the CPU's forward keeps (its
    flash kernel keeps q, k, v, out and the log-sum-exp too)."""
    real, meta = _pair(cls, config)
    counted = saved_for_backward(lambda: meta(**inputs("meta")), meta)
    assert counted.saved == _real_saved(real, inputs("cpu")) > 0
    assert counted.frozen_casts == counted.cast_cache == counted.checkpoint_inputs == 0


@pytest.mark.parametrize("cls, config, inputs", [(FluxTransformer2DModel, FLUX, _flux_inputs),
                                                 (UNet2DConditionModel, UNET, _unet_inputs)], ids=["flux", "unet"])
def test_autocast_stand_in_keeps_what_cpu_autocast_keeps(cls, config, inputs):
    """The autocast stand-in with the CPU's op list, on real tensors without autocast, keeps the bytes
    real CPU bf16 autocast keeps; the trained weights' casts are cached once (autocast's cache)."""
    real, _ = _pair(cls, config)
    counted = saved_for_backward(lambda: real(**inputs("cpu")), real, "bf16", policy="cpu")
    assert counted.saved == _real_saved(real, inputs("cpu"), autocast=True)
    assert counted.saved < _real_saved(real, inputs("cpu"))  # bf16 keeps less than fp32
    assert counted.cast_cache > 0  # the biases' casts: cached, not saved


def test_checkpointing_keeps_the_outside_as_real_checkpointing_does():
    """With diffusers' checkpointing (torch's non-reentrant checkpoint, which saves each block's tensor
    inputs in the outer graph), what autograd keeps outside the blocks is the meta count's ``saved`` plus
    its ``checkpoint_inputs``, to the byte; one block's recompute comes on top, below the whole forward's."""
    real, meta = _pair(FluxTransformer2DModel, FLUX)
    real.enable_gradient_checkpointing()
    outside = _real_saved(real, _flux_inputs("cpu"))
    whole = saved_for_backward(lambda: meta(**_flux_inputs("meta")), meta)
    counted = saved_for_backward(lambda: meta(**_flux_inputs("meta")), meta, checkpointed=meta)
    assert counted.saved + counted.checkpoint_inputs == outside
    assert counted.blocks == 3 and counted.checkpoint_inputs > 0 and counted.largest_block > 0
    assert counted.total < whole.total
    assert not meta.gradient_checkpointing  # switched off again


def test_frozen_weights_casts_and_a_quantized_base():
    """Under bf16 autocast a frozen base's Linear weights are kept as bf16 copies (2 bytes each); a
    quantized base keeps none (its layers dequantize again in backward)."""
    _, meta = _pair(FluxTransformer2DModel, FLUX)
    for name, p in meta.named_parameters():
        p.requires_grad_(name.endswith("bias"))  # the biases train (as a LoRA's adapter would), the weights are frozen
    linears = [m.weight for m in meta.modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad]
    plain = saved_for_backward(lambda: meta(**_flux_inputs("meta")), meta, "bf16")
    quantized = saved_for_backward(lambda: meta(**_flux_inputs("meta")), meta, "bf16",
                                   quantized=frozenset(id(w) for w in linears))
    assert 0 < plain.frozen_casts <= 2 * sum(w.numel() for w in linears)
    assert quantized.frozen_casts == 0
    assert plain.saved - quantized.saved == plain.frozen_casts
    # under FSDP's bf16 gathers no weight copy is kept, quantized or not
    assert plain.sharded_total == plain.saved - plain.frozen_casts - plain.trained_casts == \
        quantized.saved - quantized.trained_casts
