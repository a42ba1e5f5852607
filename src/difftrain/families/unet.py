"""difftrain's own UNet (``models/unet.py``, the ``model.*`` presets) as a family: what
``family_of_config`` and ``family_of_record`` answer for every run and checkpoint that is not a base
family's, so the loop, the step, checkpoints, export and the CLI ask a family and never whether there is one.

    family = family_of_record({"kind": "unet"})    # difftrain's UNet (also: no record, an old checkpoint)
    text = family.run_prompt_encoder(cfg, device)  # model.text_encoder: models.text.TextEncoder
    cond = family.condition(c, captions, drop, device)   # (B, L, D) text embeddings (token-id dropout)

Its parts: no text encoder unless ``model.text_encoder`` (then ``models.text.TextEncoder``, run at each
step, never cached), no VAE unless ``model.vae`` (``models.vae.LatentCodec``, :meth:`Family.load_codec`).
Its network is built from the config (``models.build_model``), not loaded from a base folder, so it is no
base: :func:`~difftrain.families.detect` never answers it and ``model.family`` cannot name it. Its records
are ``{"kind": "unet"}`` (:data:`NETWORK_KIND`). Its LoRA targets are the attention projections ``q``,
``k``, ``v`` and ``proj_out`` (self- and cross-attention); its adapters are read by difftrain alone (no
diffusers or kohya layout). Its export is a ``UNet2DModel`` folder (``interop/diffusers.py``'s export of
kind :attr:`export_kind`; EDM and flow: ``interop/ode_export.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from difftrain.families.base import Family, register
from difftrain.models.text import TextEncoder
from difftrain.runtime.device import to_device_async

# The "kind" of difftrain's UNet's network record in checkpoints (networks/build.network_record writes it).
NETWORK_KIND = "unet"


class UNetFamily(Family):
    """difftrain's own UNet: labels (B,), text embeddings (B, L, D) or None as its condition."""

    name = "unet"
    base = False
    diffusers_lora = False
    cuda_graphs = True
    export_kind = "unet2d"
    # self- and cross-attention: what networks/lora.py adapts by default in a {"kind": "unet"} record (ATTENTION_TARGETS,
    # read there without importing the families: runtime/fsdp.py imports networks/lora.py)
    lora_targets = ("q", "k", "v", "proj_out")

    # -- what the base decides: nothing (it has none) ------------------------------------------------

    def training_defaults(self, folder: Path) -> dict[str, object]:
        return {}

    def native_resolution(self, folder: Path) -> int | None:
        return None

    # -- parts ----------------------------------------------------------------------------------------

    def run_prompt_encoder(self, cfg, device: torch.device | str = "cpu", cache=None) -> TextEncoder:
        """``model.text_encoder`` as ``models.text.TextEncoder`` on ``device``: run at each step, never behind
        the text cache (``cache`` given, training: ``text.cache='on'`` refused in one line)."""
        if cache is not None and cfg.text.cache == "on":
            raise ValueError(f"text.cache='on' caches a base family's text encoders (model.init_from a diffusers "
                             f"base folder); model.text_encoder={cfg.model.text_encoder} is difftrain's own, run "
                             "at each step: set text.cache='auto' or 'off'")
        return TextEncoder.from_path(cfg.model.text_encoder).to(device)

    def load_prompt_encoder(self, folder: Path, device: torch.device | str = "cpu") -> TextEncoder:
        return TextEncoder.from_path(str(folder)).to(device)

    def load_denoiser(self, folder: Path, quantization_config=None):
        raise ValueError(f"{folder}: difftrain's own UNet is built from the config (model.preset), not loaded as "
                         "a base's denoiser")

    def denoiser_from_record(self, record: dict):
        raise ValueError("difftrain's own UNet is built from the config (model.preset), not from a family record")

    def fsdp_units(self, denoiser: nn.Module) -> list[nn.Module]:
        raise ValueError("difftrain's own UNet is sharded by runtime/fsdp.py's own units")

    # -- its condition (networks/conditioning.py asks for a text run's) --------------------------------

    def condition(self, c, captions, drop: Tensor | None, device: torch.device, geometry: Tensor | None = None,
                  size: tuple[int, int] | None = None) -> Tensor:
        """(B, L, D) float32 text embeddings of B captions, the empty caption's token ids on the rows where
        ``drop`` (B,) bool is True (chosen on the device: no host read); ``geometry`` and ``size`` unused."""
        ids = to_device_async(c.text.tokenize(list(captions)), device)  # (B, L), made on the host
        if drop is not None:
            ids = torch.where(drop[:, None], self._null_ids(c, device), ids)
        return c.text.encode_ids(ids)

    def prompt_condition(self, c, prompts, device: torch.device | str = "cpu") -> Tensor:
        """(N, L, D) text embeddings of N prompts (sampling)."""
        return c.text.encode_ids(c.text.tokenize(list(prompts)).to(device))

    def null_condition(self, c, n: int, device: torch.device | str = "cpu") -> Tensor:
        """The empty caption's embedding (n, L, D) (expanded views; encoded once per device)."""
        null = c.memo.get("null_text")
        if null is None or null.device != torch.device(device):
            null = c.memo["null_text"] = c.text.encode_ids(c.text.tokenize([""]).to(device))
        return null.expand(n, *null.shape[1:])

    @staticmethod
    def _null_ids(c, device: torch.device) -> Tensor:
        """(1, L) token ids of the empty caption on ``device``, tokenized and copied once (so a step reads
        nothing back from the device to drop a caption)."""
        key = ("null_ids", str(device))  # as given: "cuda" and the tensor's "cuda:0" would never compare equal
        if key not in c.memo:
            c.memo[key] = to_device_async(c.text.tokenize([""]), device)
        return c.memo[key]

    # -- files out and in: difftrain's own ------------------------------------------------------------

    def export_pipeline(self, denoiser, base: Path, out: Path, scheduler: dict | None = None,
                        vae: Path | None = None) -> Path:
        raise ValueError("difftrain's own UNet is exported as a UNet2DModel folder (interop/diffusers.py, "
                         f"export kind {self.export_kind!r}), not into a base's pipeline")

    def save_lora(self, adapter: dict[str, Tensor], lora_config: dict, out: Path,
                  metadata: dict[str, str] | None = None) -> Path:
        raise ValueError("an adapter of difftrain's own UNet has no diffusers LoRA file (--layout difftrain)")

    def read_lora(self, path: Path) -> dict[str, Tensor]:
        raise ValueError(f"LoRA file {path}: difftrain's own UNet reads only difftrain's adapter files")

    def __repr__(self) -> str:
        return "<family unet: difftrain's own UNet>"


UNET = register(UNetFamily())
