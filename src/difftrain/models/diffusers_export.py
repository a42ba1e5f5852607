"""Export a difftrain UNet to diffusers' `UNet2DModel`: its config and a renamed state dict.

Usage (diffusers is optional and is not imported here):

    from diffusers import UNet2DModel
    hf = UNet2DModel(**diffusers_config(model))
    hf.load_state_dict(to_diffusers_state_dict(model), strict=True)

The two networks compute the same function. One difference in the call: diffusers requires
`class_labels` for a conditional model, so pass `num_classes` (the null label) for unconditional
samples.
A UNet with the second time embedding (``interval_embedding``, MeanFlow's t - r) maps onto
`class_embed_type="timestep"`: diffusers embeds `class_labels` with the same sinusoids and a second
TimestepEmbedding and adds it to the time embedding, as difftrain does; pass the second time as
`class_labels`.
"""

import re

from torch import Tensor

from difftrain.models.layers import NORM_EPS, bake_magnitude_preserving
from difftrain.models.unet import UNet

# difftrain name -> diffusers name: the first matching block rename, then every matching layer
# rename. Shapes are identical on both sides: the mapping only renames.
_BLOCK_RENAMES = [
    (r"^time_embed\.", "time_embedding."),
    (r"^class_embed\.", "class_embedding."),
    (r"^interval_embed\.", "class_embedding."),  # class_embed_type="timestep": the second time's embedding
    (r"^conv_in\.", "conv_in."),
    (r"^down\.(\d+)\.res\.(\d+)\.", r"down_blocks.\1.resnets.\2."),
    (r"^down\.(\d+)\.attn\.(\d+)\.", r"down_blocks.\1.attentions.\2."),
    (r"^down\.(\d+)\.downsample\.", r"down_blocks.\1.downsamplers.0."),
    (r"^mid\.res_1\.", "mid_block.resnets.0."),
    (r"^mid\.attn\.", "mid_block.attentions.0."),
    (r"^mid\.res_2\.", "mid_block.resnets.1."),
    (r"^up\.(\d+)\.res\.(\d+)\.", r"up_blocks.\1.resnets.\2."),
    (r"^up\.(\d+)\.attn\.(\d+)\.", r"up_blocks.\1.attentions.\2."),
    (r"^up\.(\d+)\.upsample\.", r"up_blocks.\1.upsamplers.0."),
    (r"^norm_out\.", "conv_norm_out."),
    (r"^conv_out\.", "conv_out."),
]
_LAYER_RENAMES = [
    # inside a ResBlock (norm1, conv1, norm2, conv2 keep their names)
    (r"\.time_proj\.", ".time_emb_proj."),
    (r"\.skip\.", ".conv_shortcut."),
    # inside an AttentionBlock
    (r"\.norm\.", ".group_norm."),
    (r"\.q\.", ".to_q."),
    (r"\.k\.", ".to_k."),
    (r"\.v\.", ".to_v."),
    (r"\.proj_out\.", ".to_out.0."),
]


def diffusers_name(name: str) -> str:
    """The diffusers `UNet2DModel` state-dict key of a difftrain `UNet` state-dict key."""
    for pattern, replacement in _BLOCK_RENAMES:
        if re.match(pattern, name):
            name = re.sub(pattern, replacement, name, count=1)
            break
    else:
        raise KeyError(f"no diffusers name for UNet parameter {name!r}")
    for pattern, replacement in _LAYER_RENAMES:
        name = re.sub(pattern, replacement, name, count=1)
    return name


def _check_exportable(model: UNet) -> None:
    """A ValueError for a text model: its cross-attention has no place in a UNet2DModel."""
    if model.config.get("context_dim", 0) > 0:
        raise ValueError("a text-conditioned difftrain UNet (context_dim > 0) has no diffusers equivalent: "
                         "UNet2DModel has no cross-attention, and UNet2DConditionModel's transformer blocks "
                         "are a different architecture; fine-tune a UNet2DConditionModel (model.init_from) "
                         "to export a Stable Diffusion pipeline")
    if model.config.get("interval_embedding") and model.config["num_classes"] > 0:
        raise ValueError("a class-conditional UNet with a second time embedding (MeanFlow) has no UNet2DModel "
                         "equivalent: UNet2DModel's class_embedding holds either the labels or the second time")


def diffusers_config(model: UNet) -> dict:
    """Keyword arguments of `diffusers.UNet2DModel` for the architecture of `model`."""
    _check_exportable(model)
    cfg = model.config
    resolution, channel_mult = cfg["resolution"], cfg["channel_mult"]
    has_attn = [resolution // 2**level in cfg["attention_resolutions"] for level in range(len(channel_mult))]
    down_block_types = tuple("AttnDownBlock2D" if a else "DownBlock2D" for a in has_attn)
    up_block_types = tuple("AttnUpBlock2D" if a else "UpBlock2D" for a in reversed(has_attn))
    return dict(
        sample_size=resolution,
        in_channels=cfg["in_channels"],
        out_channels=cfg["out_channels"],
        center_input_sample=False,
        # sinusoidal_embedding: [sin | cos], frequencies 10000 ** (-i / (half - 1)).
        time_embedding_type="positional",
        flip_sin_to_cos=False,
        freq_shift=1,
        down_block_types=down_block_types,
        mid_block_type="UNetMidBlock2D",
        up_block_types=up_block_types,
        block_out_channels=tuple(cfg["base_channels"] * m for m in channel_mult),
        layers_per_block=cfg["num_res_blocks"],
        mid_block_scale_factor=1,
        downsample_padding=0,  # 0 selects the bottom/right padding of Downsample
        downsample_type="conv",
        upsample_type="conv",
        dropout=cfg["dropout"],
        act_fn="silu",
        # None makes every attention block single-head with head_dim = its channel count.
        attention_head_dim=None,
        norm_num_groups=cfg["norm_groups"],
        attn_norm_num_groups=None,
        norm_eps=NORM_EPS,
        resnet_time_scale_shift="default",
        add_attention=True,
        # the second time (interval_embedding) through class_embedding, the labels' place
        class_embed_type="timestep" if cfg.get("interval_embedding") else None,
        num_class_embeds=cfg["num_classes"] + 1 if cfg["num_classes"] > 0 else None,
    )


def to_diffusers_state_dict(model: UNet) -> dict[str, Tensor]:
    """`model`'s parameters under diffusers `UNet2DModel` names (tensors share storage with model)."""
    _check_exportable(model)
    # The learned loss weighting (logvar.*) acts in training only: diffusers has no place for it.
    state = bake_magnitude_preserving(model.state_dict(), model)  # MP layers: the weights they compute with
    return {diffusers_name(name): tensor for name, tensor in state.items() if not name.startswith("logvar.")}
