"""DreamBooth (Ruiz et al. 2023, "DreamBooth: Fine Tuning Text-to-Image Diffusion Models for
Subject-Driven Generation"): a few images of one subject under one instance prompt, and
optionally prior preservation: class images made once by the base model from a class prompt,
trained beside them with their loss weighted by ``dreambooth.prior_loss_weight``. An edit family's
instance items are pairs (reference, target, instance prompt); its class images are the base's edits of the
instance references under the class prompt, so that each prior item is a (reference, class image, class prompt)
pair, as the instance items are pairs: the prior keeps what the base does to those references.

    dataset = instance_dataset(folder_dataset, prompt, path)  # every image captioned "a photo of sks dog"
    data = with_class_images(data, cfg, conditioning, run_dir, dctx)   # + the class images (made once)
    weights = loss_weights(cfg.dreambooth, captions, device)  # (B,) 1 or prior_loss_weight; None without a prior

It is data and a per-sample loss weight, not a second loop: the network is the run's own (full
fine-tuning or LoRA), and the step weights each sample's loss by what it was drawn from.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from difftrain.config import DreamBoothConfig
from difftrain.data.pair_cache import file_digest
from difftrain.data.prepare import with_prior_images
from difftrain.data.prompted import PairedDataset, PromptedDataset, instance_dataset  # noqa: F401 - re-exported
from difftrain.diffusion.objective import DEFAULT_SAMPLERS, build_objective
from difftrain.generation.sampling import generate, initial_noise, save_png, to_uint8
from difftrain.networks.build import build_network, without_lora
from difftrain.networks.conditioning import expand_rows, map_condition
from difftrain.runtime import distributed
from difftrain.runtime.device import to_device_async
from difftrain.runtime.files import atomic_write_bytes

CLASS_RECORD = "class_images.json"  # beside the class images: the prompt and base they were made from


def loss_weights(db: DreamBoothConfig, captions, device: torch.device) -> torch.Tensor | None:
    """(B,) per-sample loss weights of a micro-batch's captions (before caption dropout), from the dreambooth
    section ``db``: ``dreambooth.prior_loss_weight`` for a class image, 1 for the rest; None without prior
    preservation (every weight 1)."""
    if not db.class_prompt:
        return None
    weights = torch.tensor([db.prior_loss_weight if c == db.class_prompt else 1.0 for c in captions])
    return to_device_async(weights, device)  # made on the host: no wait for the device per micro-batch


def class_dir(db, run_dir: Path) -> Path:
    """Where the class images of ``dreambooth`` section ``db`` are made and kept."""
    return Path(db.class_dir).expanduser() if db.class_dir else Path(run_dir) / "class_images"


def _class_names(n: int) -> list[str]:
    return [f"class_{i:05d}.png" for i in range(n)]


def class_references(folder: Path) -> Path:
    """Where an edit family's class images' references lie (beside the class folder, not in it: its scan would take
    them for class images), each under its class image's name."""
    return folder.with_name(folder.name + "_references")


def _reference_copy(references: list[Path], folder: Path, i: int) -> Path:
    """Class image i's reference (``folder``: :func:`class_references`): instance reference i mod N, copied under
    the class image's name."""
    source = Path(references[i % len(references)])
    return folder / (Path(_class_names(i + 1)[i]).stem + source.suffix.lower())


def make_class_images(cfg, conditioning, folder: Path, device: torch.device,
                      references: list[Path] | None = None) -> int:
    """Write the missing ones of ``dreambooth.num_class_images`` class images into ``folder``,
    sampled by the base network (``model.init_from``, before any training) from the class prompt
    with DDIM; image i always from the same noise. Returns how many were made. A folder made for
    another prompt or resolution (or other references) is refused (one ValueError naming it).

    An edit family (``references``: the instance pairs' reference files): class image i is the base's edit of
    instance reference i mod N under the class prompt (its reference resized and centre-cropped to the class
    images' size, as ``sample --reference`` takes it), and that reference is copied beside it
    (:func:`class_references`), so that each prior item is a (reference, class image, class prompt) pair."""
    db = cfg.dreambooth
    folder.mkdir(parents=True, exist_ok=True)
    names = _class_names(db.num_class_images)
    refs_folder = class_references(folder)
    missing = [i for i, name in enumerate(names) if not (folder / name).is_file()
               or (references and not _reference_copy(references, refs_folder, i).is_file())]
    record_file = folder / CLASS_RECORD
    record = {"prompt": db.class_prompt, "base": str(cfg.model.init_from), "resolution": cfg.data.resolution}
    if references:  # the instance references the class pairs are made from, by content
        record["references"] = hashlib.sha256("".join(file_digest(Path(r)) for r in references).encode()).hexdigest()
    keys = ("prompt", "resolution", "references")
    if record_file.is_file():
        old = json.loads(record_file.read_text())
        if {k: old.get(k) for k in keys} != {k: record.get(k) for k in keys}:
            raise ValueError(f"dreambooth.class_dir {folder} holds class images of {old.get('prompt')!r} at "
                             f"{old.get('resolution')} px{' from other reference images' if references else ''}, "
                             f"not of {db.class_prompt!r} at {cfg.data.resolution} px; set another dreambooth.class_dir")
    if not missing:
        return 0
    print(f"difftrain: dreambooth: making {len(missing)} class images of {db.class_prompt!r} in {folder} "
          f"(base {cfg.model.init_from}, {DEFAULT_SAMPLERS[cfg.diffusion.objective]} {db.class_steps} steps, guidance {db.class_guidance_scale})")
    net = build_network(without_lora(cfg), conditioning, None, init_weights=True).to(device).eval()
    channels, resolution = conditioning.network_shape()
    seed = int(hashlib.sha256(f"{cfg.train.seed}:{db.class_prompt}".encode()).hexdigest()[:8], 16)
    noise = initial_noise(db.num_class_images, (channels, resolution, resolution), seed)[missing]
    condition = expand_rows(map_condition(lambda t: t.cpu(), conditioning.prompts([db.class_prompt], device)),
                            len(missing))
    if references:  # an edit family: each class image edits its instance reference
        condition = condition | _reference_rows(conditioning, [references[i % len(references)] for i in missing],
                                                db, resolution * conditioning.codec.factor, device)
    sampler = DEFAULT_SAMPLERS[cfg.diffusion.objective]  # DDIM for DDPM bases; the flow bases' ODE solver
    images = generate(net, objective=build_objective(cfg.diffusion), noise=noise, sampler=sampler, steps=db.class_steps,
                      seed=seed, condition=condition, null_condition=conditioning.null(1, device),
                      guidance_scale=db.class_guidance_scale, batch_size=db.class_batch_size, sample_ids=missing,
                      decode=conditioning.decode if conditioning.codec is not None else None,
                      clip=conditioning.codec is None)
    for i, pixels in zip(missing, to_uint8(images)):
        save_png(pixels, folder / names[i])
        if references:
            refs_folder.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(_reference_copy(references, refs_folder, i), Path(references[i % len(references)]).read_bytes())
    record_file.write_text(json.dumps(record, indent=1) + "\n")
    del net
    return len(missing)


def _reference_rows(conditioning, paths: list[Path], db, side: int, device) -> dict:
    """The reference condition of class images edited from ``paths`` (each resized and centre-cropped to ``side``
    px), made ``db.class_batch_size`` rows at a time, on the host."""
    parts = []
    for start in range(0, len(paths), db.class_batch_size):
        chunk = [str(p) for p in paths[start:start + db.class_batch_size]]
        images = conditioning.reference_images(chunk, (side, side))
        latents = conditioning.encode_references(images)
        parts.append(map_condition(lambda t: t.cpu(), conditioning.reference_condition(
            [latents], [db.class_prompt] * len(chunk), images=[images], device=device)))
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def with_class_images(data, cfg, conditioning, run_dir: Path, dctx):
    """``data`` (``TrainingData``) with prior preservation's class images paired in: made once on
    rank 0 (the other ranks wait), then read as a folder under the class prompt (an edit family's with the
    references they were made from). Unchanged without ``dreambooth.class_prompt``."""
    if not cfg.dreambooth.class_prompt:
        return data
    db = cfg.dreambooth
    folder = class_dir(db, run_dir)
    groups = list(getattr(data.train, "reference_files", []) or [])  # an edit family's pairs
    if any(len(g) > 1 for g in groups):
        raise ValueError(f"dreambooth.class_prompt: the pairs of {cfg.data.path} have {len(groups[0])} reference images "
                         "each; prior preservation makes its class pairs from one (leave dreambooth.class_prompt out)")
    references = [g[0] for g in groups] or None
    distributed.run_on_main(lambda: make_class_images(cfg, conditioning, folder, dctx.device, references), dctx,
                            long_wait=True)
    return with_prior_images(data, cfg.data, folder, db.class_prompt, _class_names(db.num_class_images),
                             class_references(folder) if references else None)
