"""Base families (SD 1.x/2.x, SDXL, SD3, Flux...): the registry, and detection from a local folder.

    from difftrain.families import FAMILIES, detect, family_named
    family = detect("sdxl-folder")        # by model_index.json's _class_name -> FAMILIES["sdxl"]
    family = family_named("sd")           # model.family = "sd"
    family = family_of_record(record)     # a checkpoint's network record -> its family
    family = family_of_config(cfg.model)  # a run's: a base's, else difftrain's own UNet (families/unet.py)

Each family is one module of this package (``sd.py``, ``sdxl.py``, ...) that builds a
:class:`~difftrain.families.base.Family` and registers it here; the interface lives in ``base.py``.
Adding a family is adding one module and one line in :data:`MODULES`. difftrain's own UNet is a
family too (``unet.py``, :data:`UNET`), registered below: what every config and record that is no
base family's answers; it is no base (``Family.base``), so :func:`detect` and ``model.family`` never name it.
"""

from __future__ import annotations

import json
from pathlib import Path

from difftrain.families.base import (FAMILIES, MODULES, RECORD_KIND, Denoiser, Family, PromptEncoder, drop_rows,
                                     family_named, load_all, register)
from difftrain.families.unet import UNET  # difftrain's own UNet: the family of every run that has no base


__all__ = ["FAMILIES", "UNET", "Denoiser", "Family", "PromptEncoder", "detect", "drop_rows", "family_named",
           "family_of_config", "family_of_record", "register"]

# Folder classes difftrain's own network loads (interop.load_init_weights), not a family's.
OWN_NETWORK_CLASSES = ("UNet2DModel",)
# Records of checkpoints written before the families package: the SD UNet's kind.
_LEGACY_KINDS = {"diffusers.UNet2DConditionModel": "sd"}


def _class_names(folder: Path) -> tuple[str | None, str | None]:
    """(model_index.json's _class_name, config.json's _class_name) of ``folder`` (None where absent)."""
    found = []
    for name in ("model_index.json", "config.json"):
        try:
            found.append(json.loads((folder / name).read_text()).get("_class_name"))
        except (OSError, ValueError, AttributeError):
            found.append(None)
    return found[0], found[1]


def is_base_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder some family takes (a pipeline or a bare denoiser folder)."""
    try:
        detect(path)
    except ValueError:
        return False
    return True


def detect(path: str | Path) -> Family:
    """The family of a local diffusers folder: by ``model_index.json``'s ``_class_name`` (the
    pipeline), else by a bare denoiser folder's ``config.json`` (or ``unet/config.json``). One
    ValueError naming the folder, the classes found and the families supported otherwise."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"base folder {folder} does not exist or is not a folder")
    families = {n: f for n, f in load_all().items() if f.base}  # difftrain's UNet is detected by no folder
    pipeline, model = _class_names(folder)
    if model is None and pipeline is None:
        model = _class_names(folder / "unet")[1]
    for family in families.values():
        if pipeline is not None and pipeline == family.pipeline_class:
            return family
    for family in families.values():
        if pipeline is None and model is not None and model in family.model_classes:
            return family
    found = ", ".join(f"{f} {c}" for f, c in (("model_index.json", pipeline), ("config.json", model)) if c) or \
        "no model_index.json nor config.json with a _class_name"
    ordered = sorted(families.values(), key=lambda f: MODULES.index(f.name) if f.name in MODULES else len(MODULES))
    supported = ", ".join(f"{f.name} ({f.pipeline_class})" for f in ordered)  # the same order, whatever imported first
    raise ValueError(f"{folder}: not a base folder of a known family (found {found}); supported: {supported}")


def family_of_record(record: dict | None) -> Family:
    """The family of a checkpoint's network record (:meth:`Denoiser.record`, or an SD UNet's record
    from before this package); :data:`UNET` for difftrain's own networks (``{"kind": "unet"}``, and
    checkpoints and weights files with no record)."""
    if not record:
        return UNET
    if record.get("kind") == RECORD_KIND:
        return family_named(record["family"])
    if record.get("kind") in _LEGACY_KINDS:
        return family_named(_LEGACY_KINDS[record["kind"]])
    return UNET


def family_of_config(model) -> Family:
    """The family of a run's ``model`` section: ``model.family`` by name, or with "auto" the base family
    :func:`detect` finds in ``model.init_from``; :data:`UNET` (difftrain's own networks) when it names no base
    folder (a weights file, a checkpoint, a UNet2DModel folder, nothing) and with ``model.family=""``."""
    name, init_from = getattr(model, "family", "auto"), model.init_from
    if name == "":
        return UNET
    if name != "auto":
        return family_named(name)
    if not init_from or not Path(init_from).expanduser().is_dir():
        return UNET
    pipeline, model = _class_names(Path(init_from).expanduser())
    if pipeline is None and model is None and not (Path(init_from).expanduser() / "unet").is_dir():
        return UNET  # a run directory or a checkpoint folder: not a diffusers base
    try:
        return detect(init_from)
    except ValueError:
        unet = model or _class_names(Path(init_from).expanduser() / "unet")[1]
        if unet in OWN_NETWORK_CLASSES:  # a UNet2DModel (DDPMPipeline) folder: difftrain's own UNet takes it
            return UNET
        raise
