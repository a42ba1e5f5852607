"""What a network sees besides the noisy input and its noise level, and the frozen parts around it.

A run is unconditional, class-conditional (a label per image) or text-conditional (a caption per
image, encoded by a frozen text encoder); pixel-space, or latent when a frozen VAE maps images to
latents and back. :class:`Conditioning` holds that choice and the frozen parts, so that the step,
validation, sampling and checkpoints ask it instead of branching on the config:

    c = Conditioning.from_config(cfg, num_classes)   # loads model.text_encoder and model.vae
    c.network_shape()                               # (channels, resolution) the network works at
    c.condition(batch_second, drop)                 # labels (B,) / text embeddings (B, L, D) / None
    c.null(n)                                       # the null condition of guidance (n rows)
    c.decode(x)                                     # network space -> images in [-1, 1]
    c.references()                                  # {"text_encoder": {source, digest, digest_kind}, ...}

The frozen parts are never saved in checkpoints: a checkpoint names them and their digests, and a
run or a sampler that loads it checks that the parts it finds are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch
from torch import Tensor

from difftrain.data.pair_cache import TEXT_CACHES
from difftrain.data.transforms import load_image, resize_center_crop, resize_crop, to_tensor
from difftrain.families import UNET, Family, family_of_config
from difftrain.models import MODEL_PRESETS
from difftrain.models.vae import vae_factor
from difftrain.networks.frozen_dtype import hold_frozen
from difftrain.runtime.stored_digest import FLOAT32

# A network's condition: labels (B,), text embeddings (B, L, D), a base family's dict of batch-first
# tensors (difftrain.families: {"prompt_embeds", "pooled", "time_ids", ...}), or None.
Condition = Tensor | dict[str, Tensor] | None


def map_condition(fn: Callable[[Tensor], Tensor], c: Condition) -> Condition:
    """``fn`` applied to the condition's tensor, or to each tensor of a dict condition (None stays None)."""
    if c is None:
        return None
    if isinstance(c, dict):
        return {k: fn(v) for k, v in c.items()}
    return fn(c)


def condition_rows(c: Condition, start: int, stop: int) -> Condition:
    """Rows ``start:stop`` of every tensor of a condition (batch-first)."""
    return map_condition(lambda t: t[start:stop], c)


def expand_rows(c: Condition, n: int) -> Condition:
    """A one-row (or broadcastable) condition expanded to ``n`` rows (views)."""
    return map_condition(lambda t: t.expand(n, *t.shape[1:]) if t.ndim else t.expand(n), c)


def image_side_multiple(model) -> int:
    """The multiple every image side must be for the network of a run's ``model`` section, from config
    files alone (nothing loaded): a latent run's family's (``Family.image_side_multiple``: the VAE's factor,
    Flux's times 2), or a pixel UNet's downsampling ``2 ** (len(channel_mult) - 1)``. Aspect-ratio buckets
    (``data/buckets.py``) round their sides to it."""
    if model.vae:
        family = family_of_config(model)
        return family.image_side_multiple(SimpleNamespace(factor=vae_factor(model.vae)))
    mult = model.channel_mult or MODEL_PRESETS.get(model.preset, {}).get("channel_mult", (1,))
    return 2 ** (len(mult) - 1)


class Conditioning:
    """The condition of a run's network and its frozen text encoder and VAE (either may be None).

    Args:
        num_classes: classes of a class-conditional run (label ``num_classes`` is the null label).
        text: a ``difftrain.models.text.TextEncoder`` for a text-conditional run, else None.
        codec: a ``difftrain.models.vae.LatentCodec`` for a latent run, else None.
        channels, resolution: the images' (``data.channels``, ``data.resolution``).
        family: the ``difftrain.families.Family`` whose text ``text`` is (its ``condition``, ``prompt_condition``
            and ``null_condition`` make a text run's conditions): a base's (``text`` its PromptEncoder), or
            difftrain's own UNet (``families.UNET``, the default: ``text`` a ``models.text.TextEncoder``).
    """

    def __init__(self, num_classes: int = 0, text=None, codec=None, *, channels: int = 3, resolution: int = 32,
                 family: Family = UNET):
        if num_classes and text is not None:
            raise ValueError("a run is class-conditional or text-conditional, not both")
        self.num_classes, self.text, self.codec = num_classes, text, codec
        self.channels, self.resolution = channels, resolution
        self.family = family
        # what the family's condition methods compute once (the empty caption's tokens or embedding per device)
        self.memo: dict = {}
        # the family's per-run scalars (Family.run_conditions: Flux's distilled guidance), training's and sampling's
        self.train_values: dict[str, float] = {}
        self.sample_values: dict[str, float] = {}
        if codec is not None and resolution % codec.factor:
            raise ValueError(f"data.resolution={resolution} must be a multiple of the VAE's downsampling factor "
                             f"{codec.factor} (model.vae {codec.source})")

    @classmethod
    def from_config(cls, cfg, num_classes: int = 0, device: torch.device | str = "cpu",
                    text_cache: bool = False) -> Conditioning:
        """The conditioning of ``cfg``: loads ``model.text_encoder`` and ``model.vae`` (local folders,
        frozen) onto ``device``. ``text_cache`` (training): a base family's encoders behind the text cache
        where ``text.cache`` asks for it (``data/text_cache.py``; an edit family's whose encoder sees the reference:
        ``data/pair_cache.py``, ``Family.text_cache``), loaded only to fill it."""
        text = codec = None
        family = family_of_config(cfg.model)  # a base family encodes its own prompts; difftrain's UNet with TextEncoder
        if cfg.model.text_encoder:
            text = family.run_prompt_encoder(cfg, device, TEXT_CACHES[family.text_cache] if text_cache else None)
        if cfg.model.vae:
            codec = family.load_codec(cfg.model.vae, device)  # the family's VAE class (LatentCodec's by default)
        made = cls(num_classes, text, codec, channels=cfg.data.channels, resolution=cfg.data.resolution, family=family)
        if text is not None:  # the family's scalars and multiple apply to its text runs (UNet: none, the VAE's)
            made.train_values = family.run_conditions(cfg.model)  # training's; the samples' from validation
            made.sample_values = family.run_conditions(cfg.validation)
        if text is not None and codec is not None and cfg.data.resolution % family.image_side_multiple(codec):
            raise ValueError(f"data.resolution={cfg.data.resolution} must be a multiple of "
                             f"{family.image_side_multiple(codec)} for the {family.name} base {cfg.model.init_from} "
                             f"(its VAE's factor {codec.factor} and its denoiser's patches)")
        return made

    # -- what the network is -------------------------------------------------------------------

    @property
    def kind(self) -> str:
        """"text", "class" or "none"."""
        return "text" if self.text is not None else "class" if self.num_classes else "none"

    @property
    def context_dim(self) -> int:
        """D of the text embeddings the network cross-attends to; 0 without text (or a family's own)."""
        return getattr(self.text, "dim", 0) if self.text is not None else 0

    def network_shape(self) -> tuple[int, int]:
        """(channels, resolution) of what the network denoises: the VAE's latents or the images."""
        if self.codec is None:
            return self.channels, self.resolution
        return self.codec.latent_channels, self.resolution // self.codec.factor

    # -- conditions ----------------------------------------------------------------------------

    def condition(self, second: Tensor | Sequence[str] | None, drop: Tensor | None, device: torch.device,
                  geometry: Tensor | None = None, size: tuple[int, int] | None = None) -> Tensor | None:
        """The network's condition for one loaded batch.

        second: the loader's second entry: labels (B,) long, or captions (a list of B strings).
        drop: (B,) bool, the rows whose label or caption is dropped (classifier-free guidance), or None.
        geometry: (B, 4) long on the host, each image's original (height, width) and crop (top, left), as
            every dataset of difftrain gives them (the loader's third entry); None (a dataset that carries
            none: warned once where the family conditions on them): uncropped at ``size``.
        size: the batch's (H, W) in pixels; None: (data.resolution, data.resolution).
        Returns labels (B,) long (the null label where dropped), text embeddings (B, L, D) float32
        (of "" where dropped), or None for an unconditional run.
        """
        if self.text is not None:  # the family's: a base's dict, difftrain's UNet's (B, L, D); no host read
            return self.family.condition(self, second, drop, device, geometry, size)
        if self.num_classes:
            labels = second.to(device, non_blocking=True)
            return labels if drop is None else torch.where(drop, torch.full_like(labels, self.num_classes), labels)
        return None

    def prompts(self, prompts: Sequence[str], device: torch.device | str = "cpu") -> Tensor:
        """(N, L, D) text embeddings of ``prompts`` (a text run only)."""
        if self.text is None:
            raise ValueError("prompts need a text-conditioned model (model.text_encoder)")
        return self.family.prompt_condition(self, prompts, device)

    def null(self, n: int, device: torch.device | str = "cpu") -> Tensor | None:
        """The null condition for ``n`` rows: the null label (n,), the empty caption's embedding
        (n, L, D), or None for an unconditional run."""
        if self.text is not None:
            return self.family.null_condition(self, n, device)
        if self.num_classes:
            return torch.full((n,), self.num_classes, dtype=torch.long, device=device)
        return None

    # -- reference images (an edit family: Family.references) ------------------------------------------

    def reference_condition(self, latents: list[Tensor], captions=None, drop: Tensor | None = None,
                            images: list[Tensor] | None = None, device: torch.device | str = "cpu"
                            ) -> dict[str, Tensor]:
        """The condition reference latents add (one (B, c, h', w') tensor in the model's space per reference):
        the family's (``Family.edit_condition``: what its denoiser packs into its input; with the rows'
        ``captions``, ``drop`` and the references' pixels ``images`` for a family whose prompt encoder sees them)."""
        return self.family.edit_condition(self, latents, captions, drop, images, device)

    def reference_latents(self, paths: Sequence[str], size: tuple[int, int], device: torch.device | str = "cpu"
                          ) -> Tensor:
        """(N, c, h, w) model-space latents of the images ``paths``, each resized to cover ``size`` (H, W) pixels
        and centre-cropped, encoded by the VAE's mode (the mean: the edit pipelines' ``sample_mode="argmax"``).
        An unreadable file is one ValueError naming it."""
        return self.encode_references(self.reference_images(paths, size), device)

    def encode_references(self, images: Tensor, device: torch.device | str = "cpu") -> Tensor:
        """(N, c, h, w) model-space latents of reference images (N, 3, H, W) in [-1, 1]: the VAE's mode."""
        codec_device = next(self.codec.parameters()).device
        with torch.no_grad():
            mean, _ = self.codec.encode_moments(images.to(codec_device))
            return self.codec.to_model(mean).float().to(device)

    def reference_images(self, paths: Sequence[str], size: tuple[int, int]) -> Tensor:
        """(N, 3, H, W) float32 in [-1, 1] on the host: the images ``paths``, each resized to cover ``size`` (H, W)
        and centre-cropped; one ValueError naming an unreadable file (or for a run without a VAE)."""
        if self.codec is None:
            raise ValueError("reference images need a latent model (model.vae)")
        images = []
        for path in paths:
            try:
                img = load_image(path, self.channels)
            except OSError as e:
                raise ValueError(f"reference image {path}: cannot read it ({e})") from None
            img = resize_center_crop(img, size[0]) if size[0] == size[1] else resize_crop(img, size)[0]
            images.append(to_tensor(img))
        return torch.stack(images)

    def check_reference_data(self, data, base: str) -> None:
        """One ValueError unless the run's data section ``data`` (``data.references`` or ``data.reference_column``)
        and its family agree: an edit family (``Family.references``) trains on pairs, a family that takes none on
        single images (``base``: ``model.init_from``, named in the line)."""
        folders = data.references if isinstance(data.references, str) else ", ".join(data.references)
        references = folders or (f"(data.reference_column {data.reference_column!r})"
                                          if data.reference_column else "")
        if self.family.references and not references:
            raise ValueError(f"the {self.family.name} base {base} is an edit model: set data.references to a folder "
                             "holding each training image's reference image under the same name, or "
                             "data.reference_column to the metadata.jsonl key naming it")
        if references and not self.family.references:
            raise ValueError(f"data.references {references}: the {self.family.name} base {base or '(none)'} takes no "
                             "reference images (only an edit family does)")
        if references and self.codec is None:
            raise ValueError(f"data.references {references}: reference images need a latent model (model.vae)")

    def hold_frozen(self, dtype: torch.dtype | None) -> None:
        """The text encoders and the VAE held in ``dtype`` in place (``networks/frozen_dtype.hold_frozen``: a LoRA
        run's bf16/fp16); None leaves them as loaded (float32)."""
        for part in (self.text, self.codec):
            hold_frozen(part, dtype)

    def pixel_size(self, x: Tensor) -> tuple[int, int]:
        """(H, W) in pixels of a batch of what the network denoises (latents: times the VAE's factor)."""
        f = self.codec.factor if self.codec is not None else 1
        return int(x.shape[-2]) * f, int(x.shape[-1]) * f

    # -- latents -------------------------------------------------------------------------------

    def decode(self, x: Tensor) -> Tensor:
        """(B, C, H, W) images in [-1, 1] from what the network denoises (identity in pixel space)."""
        if self.codec is None:
            return x
        with torch.no_grad():
            return self.codec.decode(x.to(next(self.codec.parameters()).device)).float().cpu()

    # -- references ----------------------------------------------------------------------------

    def references(self) -> dict:
        """{"text_encoder": {"source", "digest"[, "digest_kind"]}, "vae": {...}} of the frozen parts present. A
        base family's text encoders are digested from their files (``digest_kind`` "stored":
        ``models.text.files_digest``); a reference without a kind holds the FLOAT32 digest (every weight upcast,
        ``models.text.weights_digest``): difftrain's own text encoder, the VAE, and records written before."""
        refs = {}
        for name, part in (("text_encoder", self.text), ("vae", self.codec)):
            if part is not None:
                refs[name] = {"source": part.source, "digest": part.digest}
                kind = getattr(part, "digest_kind", FLOAT32)
                if kind != FLOAT32:
                    refs[name]["digest_kind"] = kind
        return refs

    def check_references(self, saved: dict, where: str) -> None:
        """Raise ValueError if the frozen parts differ from those a checkpoint was trained with. A record of
        another digest kind than this run's (one written before the stored digest: FLOAT32) is checked by
        the part's digest of that kind (``digest_of``: slow for FLOAT32, each encoder loaded in float32 for its
        turn, once; the run goes on recording its own kind)."""
        mine = self.references()
        parts = {"text_encoder": self.text, "vae": self.codec}
        for name in sorted(set(saved) | set(mine)):
            old, new = saved.get(name), mine.get(name)
            if old is None or new is None:
                raise ValueError(f"{where} was trained {'with' if old else 'without'} a {name.replace('_', ' ')}, "
                                 f"this run is {'with' if new else 'without'} one")
            kind = old.get("digest_kind", FLOAT32)
            if kind != new.get("digest_kind", FLOAT32) and hasattr(parts.get(name), "digest_of"):
                new = {**new, "digest": parts[name].digest_of(kind)}
            if old["digest"] != new["digest"]:
                raise ValueError(
                    f"{where} was trained with the {name.replace('_', ' ')} {old['source']} (digest {old['digest'][:12]}), "
                    f"but {new['source']} holds different weights (digest {new['digest'][:12]}); "
                    f"set model.{'vae' if name == 'vae' else name} to the folder it was trained with"
                )


def moved_parts(model, text_encoder: str | None, vae: str | None) -> None:
    """Point the ``model`` section's ``text_encoder`` / ``vae`` where the frozen parts are now (each None:
    unchanged); refused for a model without that part."""
    for key, value in (("text_encoder", text_encoder), ("vae", vae)):
        if value is not None:
            if not getattr(model, key):
                raise ValueError(f"--{key.replace('_', '-')} given, but the model was trained without a "
                                 f"{key.replace('_', ' ')}")
            setattr(model, key, value)
