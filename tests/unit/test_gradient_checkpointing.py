"""model.gradient_checkpointing acts on every network's blocks: difftrain's UNet and each base
family's denoiser (SD's and SDXL's UNet2DConditionModel, SD3's and Flux's transformer blocks), as
``build_network`` builds them (a family's from a checkpoint's record of its diffusers config). With
it on, each checkpointed block runs its forward again in backward (twice in all), autograd keeps
fewer tensors for backward, and the gradients are those without it."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_OVERRIDES

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from difftrain.networks.conditioning import Conditioning  # noqa: E402
from difftrain.config import load_config  # noqa: E402
from difftrain.runtime.fsdp import blocks  # noqa: E402
from difftrain.networks.build import build_network  # noqa: E402

B, L = 2, 5  # batch, text tokens


def _diffusers_model(which: str):
    """A tiny diffusers model of the family, built from a seed (the shapes of tests/family_bases.py)."""
    import diffusers

    torch.manual_seed(0)
    if which == "sdxl":  # UNet2DConditionModel (SD 1.x/2.x's too), "text_time" conditioning
        return diffusers.UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
            norm_num_groups=4, attention_head_dim=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
            addition_embed_type="text_time", addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=6 * 8 + 8, use_linear_projection=True)
    if which == "sd3":
        return diffusers.SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=12, out_channels=16,
            pos_embed_max_size=16)
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=8, guidance_embeds=True, axes_dims_rope=(2, 2, 4))


def _condition(which: str, g: torch.Generator) -> dict:
    """What the family's prompt encoder (and SDXL's image conditions) would give, at random."""
    if which == "sdxl":
        return {"prompt_embeds": torch.randn(B, L, 16, generator=g), "pooled": torch.randn(B, 8, generator=g),
                "time_ids": torch.tensor([[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]] * B)}
    if which == "sd3":
        return {"prompt_embeds": torch.randn(B, L, 16, generator=g), "pooled": torch.randn(B, 12, generator=g)}
    return {"prompt_embeds": torch.randn(B, L, 16, generator=g), "pooled": torch.randn(B, 8, generator=g),
            "guidance": torch.full((B,), 3.5)}


def _network_and_batch(which: str, checkpointing: bool):
    """The network as training builds it (build_network, from the config; a family's from the
    checkpoint record of its diffusers config) and one input for it."""
    flag = f"model.gradient_checkpointing={str(checkpointing).lower()}"
    cfg = load_config(None, TINY_OVERRIDES + [flag])
    g = torch.Generator().manual_seed(0)
    if which == "unet":  # difftrain's UNet: ResBlocks (and a text model's attention blocks)
        torch.manual_seed(0)
        net = build_network(cfg, Conditioning(0, channels=3, resolution=16))
        return net, torch.randn(B, 3, 16, 16, generator=g), torch.tensor([10, 50]), None
    record = {"kind": "family", "family": which, "config": json.loads(json.dumps(dict(_diffusers_model(which).config)))}
    net = build_network(cfg, Conditioning(0, channels=3, resolution=16), network=record)
    x = torch.randn(B, 16 if which != "sdxl" else 4, 8, 8, generator=g)  # the VAE's latent (Flux packs it itself)
    return net, x, torch.tensor([10.0, 500.0]), _condition(which, g)


def _run(which: str, checkpointing: bool) -> tuple[int, int, dict]:
    """(forward calls of the blocks' layers, tensors autograd saved, gradients) of one forward and backward."""
    net, x, t, cond = _network_and_batch(which, checkpointing)
    net.train()
    for p in net.parameters():  # the zero-initialised last layers would let no gradient through
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(p.numel()))
    calls = [0]
    units = blocks(net)  # the blocks FSDP shards: each layer inside them counts its forward calls
    layers = [m for u in units for m in u.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    assert layers
    hooks = [m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in layers]
    saved = [0]

    def pack(t):
        saved[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = net(x, t, cond) if cond is not None else net(x, t)
    out.square().mean().backward()
    for h in hooks:
        h.remove()
    return calls[0], saved[0], {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("which", ["unet", "sdxl", "sd3", "flux"])
def test_gradient_checkpointing_recomputes_blocks_and_keeps_the_gradients(which):
    calls, saved, grads = _run(which, False)
    calls_ckpt, saved_ckpt, grads_ckpt = _run(which, True)
    assert calls_ckpt > calls  # checkpointed blocks run again in backward
    assert saved_ckpt < saved  # and autograd keeps fewer tensors for it
    assert grads.keys() == grads_ckpt.keys() and len(grads) > 0
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)
