"""A transformer family's denoiser refuses latent sides its own patches cannot divide, in one line:
SD3 by its transformer's ``patch_size``, Flux by its 2x2 packing."""

from __future__ import annotations

import pytest

diffusers = pytest.importorskip("diffusers")

from difftrain.families.flux import FluxDenoiser  # noqa: E402
from difftrain.families.sd3 import SD3Denoiser  # noqa: E402


def sd3(patch: int) -> SD3Denoiser:
    return SD3Denoiser(diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=patch, in_channels=16, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=12, out_channels=16,
        pos_embed_max_size=16))


@pytest.mark.parametrize("patch, fits, refused", [(1, (5, 7), None), (2, (6, 8), (6, 7)), (4, (8, 12), (6, 8))])
def test_sd3_checks_the_sides_against_its_transformers_own_patch_size(patch, fits, refused):
    net = sd3(patch)
    assert net.patch == patch
    net.check_latent_size(*fits)
    if refused is not None:
        with pytest.raises(ValueError, match=rf"latents of {refused[0]}x{refused[1]} do not divide into the sd3 "
                                             rf"transformer's {patch}x{patch} patches"):
            net.check_latent_size(*refused)


def test_flux_checks_the_sides_against_its_2x2_packing_not_its_configs_patch_size_of_1():
    net = FluxDenoiser(diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=8, guidance_embeds=True, axes_dims_rope=(2, 2, 4)))
    assert net.patch == 2
    net.check_latent_size(4, 6)
    with pytest.raises(ValueError, match="latents of 4x5 do not divide into the flux transformer's 2x2 patches"):
        net.check_latent_size(4, 5)
