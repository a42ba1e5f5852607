"""A diffusers `UNet2DConditionModel` (a Stable Diffusion UNet) as a difftrain network.

    net = ConditionUNet.from_folder("sd-folder")      # or the UNet folder itself (sd-folder/unet)
    out = net(x, t, text_embeddings)                   # (B, C, H, W)
    rebuilt = ConditionUNet.from_config(net.unet_config)   # the architecture, random weights

Its ``state_dict`` is the wrapped UNet's (diffusers names, no prefix), so a checkpoint's weights
load into ``UNet2DConditionModel`` as they are, and ``unet_config`` (a JSON-able dict) rebuilds
the architecture without the original folder. diffusers is imported only when a network is built.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from difftrain.runtime.optional import require

CONDITION_UNET_CLASS = "UNet2DConditionModel"
# The "kind" of the network record checkpoints keep of a ConditionUNet (with its diffusers config).
NETWORK_KIND = "diffusers.UNet2DConditionModel"
# The prefix of the wrapped UNet's parameters inside this module, hidden from state dicts.
_PREFIX = "unet."


def _config_file(path: Path) -> Path | None:
    """The config.json of the UNet in ``path`` (itself, or its ``unet/``), or None."""
    for folder in (path, path / "unet"):
        if (folder / "config.json").is_file():
            return folder / "config.json"
    return None


def _is_condition_config(config: dict) -> bool:
    name = config.get("_class_name")
    return name == CONDITION_UNET_CLASS or (name is None and "cross_attention_dim" in config)


def is_condition_unet_folder(path: str | Path) -> bool:
    """True when ``path`` is a UNet2DConditionModel folder or a pipeline folder whose ``unet/``
    is one (a Stable Diffusion folder); False for anything else, a UNet2DModel folder included."""
    config_file = _config_file(Path(path).expanduser()) if Path(path).expanduser().is_dir() else None
    if config_file is None:
        return False
    try:
        return _is_condition_config(json.loads(config_file.read_text()))
    except (OSError, ValueError):
        return False


def unet_folder(path: str | Path) -> Path:
    """The UNet2DConditionModel folder of ``path`` (itself or its ``unet/``), or a ValueError
    naming ``path`` and what it lacks."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ValueError(f"UNet2DConditionModel folder {path} does not exist or is not a folder")
    config_file = _config_file(path)
    if config_file is None:
        raise ValueError(f"{path} is not a UNet2DConditionModel folder nor a Stable Diffusion folder "
                         "(no config.json, nor unet/config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_file}: unreadable UNet config ({e})") from None
    if not _is_condition_config(config):
        raise ValueError(f"{config_file} describes a {config.get('_class_name', 'model without _class_name')}, "
                         f"not a {CONDITION_UNET_CLASS}")
    return config_file.parent


def _jsonable(config) -> dict:
    """A plain dict of lists, numbers and strings (diffusers configs hold tuples and FrozenDicts)."""
    return json.loads(json.dumps(dict(config)))


class ConditionUNet(nn.Module):
    """``net(x (B, C, H, W), t (B,), cond (B, L, D)) -> (B, C, H, W)``: a diffusers
    UNet2DConditionModel called with ``encoder_hidden_states=cond``.

    Attributes: ``unet`` (the wrapped model), ``unet_config`` (its config as a JSON-able dict),
    ``context_dim`` (its cross_attention_dim D), ``in_channels``, ``out_channels``,
    ``num_classes`` (0: it is a text model).
    """

    num_classes = 0

    def __init__(self, unet: nn.Module) -> None:
        super().__init__()
        self.unet = unet
        # The state dict is the wrapped UNet's: strip the prefix on save, add it on load.
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    @property
    def unet_config(self) -> dict:
        """The wrapped UNet's config, as ``from_config`` takes it and a checkpoint can store it."""
        return _jsonable(self.unet.config)

    @property
    def context_dim(self) -> int:
        dim = self.unet.config.cross_attention_dim
        return int(dim if isinstance(dim, int) else dim[0])

    @property
    def in_channels(self) -> int:
        return int(self.unet.config.in_channels)

    @property
    def out_channels(self) -> int:
        return int(self.unet.config.out_channels)

    @classmethod
    def from_config(cls, config: dict) -> ConditionUNet:
        """The architecture of a UNet2DConditionModel config (``unet_config``), weights random,
        in float32."""
        require("diffusers", "text", "a checkpoint of a diffusers UNet2DConditionModel")
        from diffusers import UNet2DConditionModel

        return cls(UNet2DConditionModel.from_config(dict(config)).float())

    @classmethod
    def from_folder(cls, path: str | Path) -> ConditionUNet:
        """The UNet2DConditionModel of a UNet folder or of a Stable Diffusion folder (its
        ``unet/``), weights included, in float32; a ValueError naming the folder if it is not one
        or its weights do not load."""
        require("diffusers", "text", f"model.init_from={path} (a diffusers UNet2DConditionModel)")
        from diffusers import UNet2DConditionModel

        folder = unet_folder(path)
        try:
            unet = UNet2DConditionModel.from_pretrained(str(folder), torch_dtype=torch.float32)
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"cannot load the UNet2DConditionModel in {folder}: {first}") from None
        return cls(unet.float())

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Turn diffusers' activation checkpointing of the UNet's blocks on or off."""
        if enabled:
            self.unet.enable_gradient_checkpointing()
        else:
            self.unet.disable_gradient_checkpointing()

    def forward(self, x: Tensor, t: Tensor, cond: Tensor | None = None) -> Tensor:
        """x: (B, in_channels, H, W), t: (B,) timesteps (a 0-d tensor is broadcast), cond:
        (B, L, context_dim) text embeddings (required) -> (B, out_channels, H, W)."""
        if cond is None or cond.ndim != 3 or cond.shape[0] != x.shape[0] or cond.shape[2] != self.context_dim:
            got = "None" if cond is None else f"shape {tuple(cond.shape)}"
            raise ValueError(f"cond of this UNet2DConditionModel must be text embeddings "
                             f"({x.shape[0]}, L, {self.context_dim}); got {got}")
        return self.unet(x, t.expand(x.shape[0]), encoder_hidden_states=cond, return_dict=False)[0]


def _strip_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict post-hook: ``{prefix}unet.name`` -> ``{prefix}name``, in place, order kept."""
    ours = [k for k in state_dict if k.startswith(prefix + _PREFIX)]
    for key in ours:
        state_dict[prefix + key[len(prefix) + len(_PREFIX):]] = state_dict.pop(key)


def _add_prefix(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Load pre-hook: ``{prefix}name`` -> ``{prefix}unet.name``, in place."""
    ours = [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + _PREFIX)]
    for key in ours:
        state_dict[prefix + _PREFIX + key[len(prefix):]] = state_dict.pop(key)
