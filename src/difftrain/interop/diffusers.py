"""difftrain's own UNet out to a diffusers pipeline folder, and a fine-tuned UNet2DConditionModel
out to a StableDiffusionPipeline folder.

    export_diffusers(state, "pipeline/")             # DDPMPipeline / DDIMPipeline folder (EDM, flow: ode_export.py)
    export_stable_diffusion(net, objective_cfg=..., text_encoder_source=..., vae_source=..., out_dir=...)

diffusers is needed only to write a pipeline folder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from difftrain.checkpoints.checkpoint import load_weights
from difftrain.config import config_from_dict
from difftrain.diffusion.meanflow import COND_SCALE
from difftrain.diffusion.objective import build_objective
from difftrain.diffusion.scheduler_configs import scheduler_config
from difftrain.families import family_of_record
from difftrain.families.sd import ConditionUNet, write_pipeline
from difftrain.interop.ode_export import export_ode_diffusers
from difftrain.models import build_model, network_of_preset
from difftrain.models.diffusers_export import diffusers_config, to_diffusers_state_dict
from difftrain.networks.conditioning import Conditioning, moved_parts
from difftrain.runtime.seeding import derive_seed

# diffusers pipeline folders.

CONDITIONAL_SNIPPET = '''\
import torch
from diffusers import DDIMScheduler, UNet2DModel

folder = "{folder}"
unet = UNet2DModel.from_pretrained(folder, subfolder="unet").eval()
scheduler = DDIMScheduler.from_pretrained(folder, subfolder="scheduler")
scheduler.set_timesteps(50)  # a divisor of num_train_timesteps matches difftrain's DDIM
labels = torch.tensor([0, 1, 2, 3])  # classes in [0, {num_classes}); {num_classes} = unconditional
size = unet.config.sample_size
x = torch.randn(len(labels), unet.config.in_channels, size, size, generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    for t in scheduler.timesteps:
        out = unet(x, t, class_labels=labels).sample
        x = scheduler.step(out, t, x, use_clipped_model_output=True).prev_sample
images = (x / 2 + 0.5).clamp(0, 1)  # (N, C, H, W) in [0, 1]
'''

MEANFLOW_SNIPPET = '''\
import torch
from diffusers import UNet2DModel

unet = UNet2DModel.from_pretrained("{folder}", subfolder="unet").eval()
steps = 1  # network evaluations; MeanFlow eq. 12: z_r = z_t - (t - r) u(z_t, r, t) from t = 1 to 0
size = unet.config.sample_size
x = torch.randn(4, unet.config.in_channels, size, size, generator=torch.Generator().manual_seed(0))
times = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64).tolist()
with torch.no_grad():
    for t, r in zip(times[:-1], times[1:]):
        # the UNet sees t as its timestep and t - r as class_labels (its second time embedding)
        tt, gap = torch.full((len(x),), {scale} * t), torch.full((len(x),), {scale} * (t - r))
        x = x - (t - r) * unet(x, tt, class_labels=gap).sample
images = (x.clamp(-1, 1) / 2 + 0.5)  # (N, C, H, W) in [0, 1]
'''


def _export_meanflow(unet, out: Path) -> Path:
    """A MeanFlow UNet (``class_embed_type="timestep"``: the second time): ``out/unet`` and a README with
    its sampling loop; no diffusers scheduler takes MeanFlow's step (eq. 12), which needs both times."""
    unet.eval().save_pretrained(out / "unet", safe_serialization=True)
    (out / "README.md").write_text(
        "# A MeanFlow difftrain model (few-step sampling)\n\nNo diffusers scheduler or pipeline takes MeanFlow's "
        "step, which conditions the UNet on two times; the loop below gives the images of "
        "`difftrain sample --steps N` from the same noise.\n\n"
        f"```python\n{MEANFLOW_SNIPPET.format(folder=out, scale=COND_SCALE)}```\n")
    return out


def export_diffusers(state: dict, out: str | Path, use_ema: bool = True, *, text_encoder: str | None = None,
                     vae: str | None = None) -> Path:
    """Write a diffusers pipeline folder (``model_index.json``, ``unet/`` as safetensors,
    ``scheduler/``) from a checkpoint read by ``load_checkpoint``; ``DDPMPipeline`` and
    ``DDIMPipeline`` ``.from_pretrained`` load it. A class-conditional model gets a README.md
    in the folder with a sampling loop that passes the labels (the stock pipelines pass none).

    A fine-tuned UNet2DConditionModel becomes a ``StableDiffusionPipeline`` folder with the text
    encoder and VAE it was trained with (``text_encoder`` / ``vae``: where they are now, if their
    folders moved), checked against the checkpoint's digests first. The checkpoint's family says which
    (``Family.export_kind``, a key of :data:`EXPORTS`)."""
    try:
        import diffusers  # noqa: F401 - optional: only to say in one line that it is needed
    except ImportError:
        raise ValueError("export --format diffusers needs diffusers: pip install 'difftrain[bench]' "
                         "(or pip install diffusers)") from None
    cfg = config_from_dict(state["config"], source=state["path"])
    moved_parts(cfg.model, text_encoder, vae)
    family = family_of_record(state["network"])
    return EXPORTS[family.export_kind](state, cfg, family, Path(out), use_ema)


def _export_pipeline(state: dict, cfg, family, out: Path, use_ema: bool) -> Path:
    """A fine-tuned base of a family: its pipeline's folder (``Family.export_pipeline``), the frozen parts
    checked against the checkpoint's digests."""
    frozen = Conditioning.from_config(cfg)
    frozen.check_references(state["frozen"], f"checkpoint {state['path']}")
    if frozen.codec is not None and frozen.codec.shift_factor and not family.applies_shift_factor:
        raise ValueError(f"the VAE {cfg.model.vae} has a shift_factor ({frozen.codec.shift_factor}), which "
                         "StableDiffusionPipeline does not apply when it decodes; export --format safetensors")

    unet = family.denoiser_from_record(state["network"])
    load_weights(unet, state["ema"]["model"] if use_ema else state["model"], state["path"],
                 "ema.model" if use_ema else "model")
    # The pipeline would rewrite both keys (with a deprecation warning): clip_sample=False, and
    # steps_offset=1, which acts only on "leading" timestep spacing, not on difftrain's "trailing".
    scheduler = family.export_scheduler(cfg.diffusion) or {**scheduler_config(cfg.diffusion), "clip_sample": False,
                                                            "steps_offset": 1}
    base = Path(cfg.model.text_encoder).expanduser()
    vae_folder = Path(cfg.model.vae).expanduser() if cfg.model.vae else None
    return family.export_pipeline(unet, base, out, scheduler, vae=vae_folder if vae_folder != base else None)


def _export_unet2d(state: dict, cfg, family, out: Path, use_ema: bool) -> Path:
    """difftrain's own pixel UNet: a ``UNet2DModel`` folder, DDPM's ``DDPMPipeline`` (EDM and flow:
    ``ode_export.export_ode_diffusers``); a text or latent model is refused in one line."""
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel  # optional: export_diffusers checked it is here

    if cfg.model.text_encoder:
        raise ValueError(f"{state['path']}: difftrain's own text UNet has no diffusers pipeline (a Stable Diffusion "
                         "pipeline needs a UNet2DConditionModel, from model.init_from); export --format safetensors")
    if cfg.model.vae:
        raise ValueError(f"{state['path']}: a latent model (model.vae) has no diffusers pixel pipeline; "
                         "export --format safetensors")
    refusal = network_of_preset(cfg.model.preset).no_diffusers
    if refusal:
        raise ValueError(f"{state['path']}: model.preset={cfg.model.preset!r}: {refusal}")
    model = build_model(cfg, state["num_classes"])
    load_weights(model, state["ema"]["model"] if use_ema else state["model"], state["path"],
                 "ema.model" if use_ema else "model")
    unet = UNet2DModel(**diffusers_config(model))
    unet.load_state_dict(to_diffusers_state_dict(model), strict=True)
    if cfg.diffusion.objective == "meanflow":
        return _export_meanflow(unet, out)
    if cfg.diffusion.objective != "ddpm":  # EDM and flow: diffusers' own ODE schedulers (ode_export.py)
        return export_ode_diffusers(unet, build_objective(cfg.diffusion), out, state["num_classes"])
    scheduler = DDPMScheduler(**scheduler_config(cfg.diffusion))
    DDPMPipeline(unet=unet.eval(), scheduler=scheduler).save_pretrained(out, safe_serialization=True)
    if state["num_classes"]:
        snippet = CONDITIONAL_SNIPPET.format(folder=out, num_classes=state["num_classes"])
        (out / "README.md").write_text(
            f"# A class-conditional difftrain model ({state['num_classes']} classes)\n\n"
            "DDPMPipeline and DDIMPipeline pass no class labels, which this UNet requires "
            "(\"class_labels should be provided\"). Sample with the scheduler and the UNet:\n\n"
            f"```python\n{snippet}```\n")
    return out


# Family.export_kind -> the writer of its export --format diffusers folder: (state, cfg, family, out, use_ema) -> out.
EXPORTS: dict[str, Callable[[dict, object, object, Path, bool], Path]] = {"pipeline": _export_pipeline,
                                                                         "unet2d": _export_unet2d}


def pipeline_generator(seed: int) -> torch.Generator:
    """A CPU generator whose first draw is difftrain's initial noise for ``seed``: a DDIM
    pipeline (eta = 0) called with it gives the images of ``difftrain sample --seed SEED``."""
    return torch.Generator().manual_seed(derive_seed(seed, "initial-noise"))


def export_stable_diffusion(
    unet: ConditionUNet,
    *,
    objective_cfg,
    text_encoder_source: str,
    vae_source: str | None,
    out_dir: str | Path,
) -> Path:
    """Write a ``StableDiffusionPipeline`` folder (``families.sd.write_pipeline``): ``unet``'s weights,
    the text encoder and tokenizer of ``text_encoder_source``, the VAE of ``vae_source`` and a
    ``scheduler/`` of :func:`scheduler_config` of ``objective_cfg`` (the ``cfg.diffusion`` section),
    with x0 not clipped (StableDiffusionPipeline turns ``clip_sample`` off, as latents are not confined
    to [-1, 1]). Returns ``out_dir``. A text model of difftrain's own UNet, or a model without a VAE,
    raises a ValueError saying why.
    """
    # The pipeline would rewrite both keys (with a deprecation warning): clip_sample=False, and
    # steps_offset=1, which acts only on "leading" timestep spacing, not on difftrain's "trailing".
    scheduler = {**scheduler_config(objective_cfg), "clip_sample": False, "steps_offset": 1}
    return write_pipeline(unet, scheduler, text_encoder_source, vae_source, out_dir)


