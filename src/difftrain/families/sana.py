"""Sana (SanaPipeline): a linear-attention DiT (SanaTransformer2DModel) on the 32-channel latents of a
deep-compression autoencoder (AutoencoderDC, factor 32), conditioned on Gemma 2, trained with
rectified flow.

Facts, checked in the installed diffusers (pipeline_sana.py, sana_transformer.py, autoencoder_dc.py,
scheduling_dpmsolver_multistep.py) and diffusers' train_dreambooth_lora_sana.py:

Prompts -> conditioning (``encode_prompt``; the Gemma steps: families/gemma.py). Each prompt is
  lower-cased and stripped (``_text_preprocessing``, clean_caption False), then the pipeline's "complex
  human instruction" (``__call__``'s default ``complex_human_instruction``, its lines joined by "\\n",
  read here from the installed pipeline's signature) is put in front of it; tokens (GemmaTokenizer,
  padding_side "right") padded to n_chi + L - 2, n_chi the instruction's own tokens with BOS, L =
  max_sequence_length (300 by default); Gemma2Model's last hidden state ``[0]`` (B, n_chi + L - 2,
  2304) and the attention mask; then BOS and the last L - 1 tokens are kept (select_index
  [0] + range(-L + 1, 0)): prompt_embeds (B, L, 2304), prompt_attention_mask (B, L). The negative
  prompt "" is encoded without the instruction, L tokens, no selection: the null condition here.
  diffusers' script's --complex_human_instruction defaults to None (no instruction, in training and in its
  validation); difftrain follows the pipeline, whose default the base was published with.
Latents: AutoencoderDC, 32 channels, factor 2 ** (len(encoder_block_out_channels) - 1) = 32; the script
  encodes ``vae.encode(x).latent * scaling_factor`` (0.41407 in the published VAE; deterministic: no
  distribution) and the pipeline decodes latents / scaling_factor: no shift factor.
Transformer call: transformer(x (B, 32, h, w), encoder_hidden_states=prompt_embeds,
  encoder_attention_mask=mask, timestep=t * config.timestep_scale (t the scheduler's timestep, 1000 sigma;
  timestep_scale 1.0 in the published base)). patch_size 1: no side constraint beyond the VAE's. The
  output is the velocity noise - x0 (the script's target; the pipeline's scheduler steps with
  prediction_type "flow_prediction"), difftrain's v = eps - x0 exactly: no sign flip. difftrain's flow
  objective conditions on 1000 t, which is this timestep as it is. An output of twice the latent
  channels (a learned sigma) is cut to its first half, as the pipeline does.
Training (the script): FlowMatchEulerDiscreteScheduler.from_pretrained(the base's scheduler/): the
  published base's scheduler is a DPMSolverMultistepScheduler config (flow_shift, no ``shift``), so the
  Euler scheduler it builds has shift 1: sigma = u, uniform and unshifted (weighting_scheme "none": u
  uniform, loss weight 1): here diffusion.flow_t_sampling = "uniform" and flow_train_shift = the shift
  that scheduler gets (1 for the published base). x_t = (1 - sigma) x0 + sigma eps, target eps - x0.
Sampling: the pipeline's scheduler (the published base: DPMSolverMultistepScheduler, flow_prediction,
  use_flow_sigmas, flow_shift 3.0); CFG with guidance_scale 4.5 by default on the negative prompt "".
  difftrain samples with its flow samplers on the grid of a FlowMatchEulerDiscreteScheduler of that shift
  (diffusion.flow_shift = flow_shift, flow_grid_end its sigma_min); ``export`` writes that Euler scheduler
  (with difftrain's flow keys) into the pipeline folder, so the exported pipeline samples as difftrain does;
  an export without a run's diffusion section keeps the base's scheduler.
LoRA: peft on to_k, to_q, to_v (the script's default targets: both the linear self-attention ``attn1``
  and the cross-attention ``attn2`` of every block); files in SanaLoraLoaderMixin's format
  (``transformer.`` + peft names), written by SanaPipeline.save_lora_weights, read by its lora_state_dict.
FSDP and block swap: the transformer_blocks.
Known bases (tools/bases/, config files only, for ``estimate --base``): ``sana`` is Sana_1600M_1024px: the
  transformer's config is SanaTransformer2DModel's defaults in the installed diffusers (which are that model's:
  20 blocks 2240 wide, 70 linear-attention heads of 32, 20 cross-attention heads of 112, caption 2304;
  1,604,462,752 parameters on meta, the published 1.6B); ``sana-4.8b`` is SANA 1.5 4.8B: NVlabs/Sana's
  SanaMS_4800M_P1_D60 (60 blocks of the same width and heads, qk_norm: its config's "allqknorm"), here
  num_layers 60 and qk_norm "rms_norm_across_heads" (4,721,825,952 parameters); the text encoder Gemma 2 2B
  (Gemma2Config's defaults in the installed transformers: 2,614,341,888 parameters); the VAE the DC-AE f32c32
  (AutoencoderDC's defaults: 6 levels, factor 32, 32 channels; scaling_factor 0.41407 from NVlabs' configs);
  the scheduler DPM-Solver++ with flow_shift 3.0 (NVlabs' configs' flow_shift; the other keys as recalled of
  the published scheduler_config.json, not read here: estimate reads none of them).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import Tensor

from difftrain.families import register
from difftrain.families.base import Denoiser, ExportParts, read_json, require_keys
from difftrain.families.gemma import KEYS, GemmaPromptEncoder
from difftrain.families.mmdit import TransformerDenoiser, TransformerFamily
from difftrain.models.vae import config_factor

DEFAULT_LENGTH = 300  # SanaPipeline's max_sequence_length default (and the script's)
EULER = "FlowMatchEulerDiscreteScheduler"


def sana_instruction() -> str:
    """The complex human instruction SanaPipeline puts in front of every prompt: its ``__call__``'s default
    ``complex_human_instruction``, lines joined by "\\n" (read from the installed diffusers)."""
    from diffusers import SanaPipeline  # an optional package ([text])

    return "\n".join(inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default)


def flow_grid_end(shift: float, steps: int = 1000) -> float:
    """The sigma_min of a FlowMatchEulerDiscreteScheduler of ``shift``: 1 / steps, shifted."""
    return shift * (1 / steps) / (1 + (shift - 1) * (1 / steps))


class SanaDenoiser(TransformerDenoiser):
    """``net(x (B, 32, h, w), t (B,) = 1000 t, cond) -> (B, 32, h, w)`` velocity eps - x0: a
    SanaTransformer2DModel called as SanaPipeline calls it (t x timestep_scale, the attention mask).
    cond: {"prompt_embeds": (B, L, caption_channels), "prompt_attention_mask": (B, L)}."""

    family = "sana"

    @property
    def patch(self) -> int:
        return int(self.model.config.patch_size)

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        b = x.shape[0]
        require_keys(cond, KEYS, b, self.family)
        self.check_latent_size(x.shape[-2], x.shape[-1])
        config = self.model.config
        out = self.model(x, encoder_hidden_states=cond["prompt_embeds"].to(x.dtype),
                         encoder_attention_mask=cond["prompt_attention_mask"],
                         timestep=t.expand(b).to(x.dtype) * config.timestep_scale, return_dict=False)[0]
        if out.shape[1] == 2 * x.shape[1]:  # a learned sigma: the pipeline keeps the first half
            out = out.chunk(2, dim=1)[0]
        return out


class SanaPromptEncoder(GemmaPromptEncoder):
    """Gemma 2 of a Sana folder: the complex human instruction in front of each (lower-cased) caption, the
    last hidden state, BOS and the last L - 1 tokens kept (SanaPipeline.encode_prompt)."""

    default_length = DEFAULT_LENGTH
    layer = -1
    padding_side = "right"

    def __init__(self, folder: Path, max_sequence_length: int = 0, deferred: bool = False):
        self.instruction = sana_instruction()
        super().__init__(folder, max_sequence_length, deferred)

    def preprocess(self, captions: list[str]) -> list[str]:
        return [c.lower().strip() for c in captions]

    def template(self, captions: list[str]) -> tuple[list[str], int]:
        n_instruction = len(self.tokenizer.encode(self.instruction))  # with BOS, as the pipeline counts them
        return [self.instruction + c for c in captions], n_instruction + self.length - 2

    def select(self, states: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        keep = [0, *range(states.shape[1] - self.length + 1, states.shape[1])]
        return states[:, keep], mask[:, keep]


class SanaFamily(TransformerFamily):
    """Sana (600M, 1600M and their fine-tunes)."""

    name = "sana"
    pipeline_class = "SanaPipeline"
    transformer_class = "SanaTransformer2DModel"
    denoiser_class = SanaDenoiser
    lora_targets = ("to_k", "to_q", "to_v")  # diffusers' Sana script's default
    comfyui_layouts = ()  # ComfyUI has no Sana model
    # Lumina 2's and Flux's blocks: a LoRA file naming them is not Sana's
    foreign_modules = ("layers", "noise_refiner", "context_refiner", "single_transformer_blocks")
    applies_shift_factor = False  # SanaPipeline decodes latents / scaling_factor

    def training_defaults(self, folder: Path) -> dict[str, object]:
        """The base's parts, captions on, rectified flow as diffusers' Sana script trains it (uniform t, the
        shift of the Euler scheduler it builds from the base's scheduler config), sampled on the grid of an
        Euler scheduler of the base's flow shift."""
        from diffusers import FlowMatchEulerDiscreteScheduler  # an optional package ([text])

        config = self.scheduler_config(folder)
        trained = FlowMatchEulerDiscreteScheduler.from_config(config).config  # what the script builds
        if config.get("_class_name") == EULER:
            shift = float(config.get("shift", 1.0))
        else:  # DPMSolverMultistepScheduler's flow sigmas (use_flow_sigmas) are shifted by its flow_shift
            shift = float(config.get("flow_shift") or 1.0)
        return {**self._defaults(folder), "diffusion.flow_t_sampling": "uniform",
                "diffusion.flow_train_shift": float(trained.shift), "diffusion.flow_shift": shift,
                "diffusion.flow_grid_end": flow_grid_end(shift, int(config.get("num_train_timesteps", 1000))),
                "diffusion.flow_dynamic_shift": False}

    def native_resolution(self, folder: Path) -> int | None:
        """The transformer's sample_size times the AutoencoderDC's factor (SanaPipeline's default: 32 x 32)."""
        try:
            size = read_json(self.denoiser_folder(folder) / "config.json", f"base {folder}").get("sample_size")
            factor = config_factor(read_json(Path(folder) / "vae" / "config.json", f"base {folder}"))
        except (ValueError, KeyError, TypeError):
            return None
        return size * factor if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None

    def load_prompt_encoder(self, folder: Path, device: torch.device | str = "cpu",
                            max_sequence_length: int = 0, deferred: bool = False) -> SanaPromptEncoder:
        return SanaPromptEncoder(Path(folder), max_sequence_length, deferred).to(device)

    def condition_shapes(self, config: dict, max_sequence_length: int = 0) -> dict[str, tuple[int, ...]]:
        """L Gemma states, ``caption_channels`` wide, and their mask."""
        length = max_sequence_length or DEFAULT_LENGTH
        return {"prompt_embeds": (length, int(config["caption_channels"])), "prompt_attention_mask": (length,)}

    def image_side_multiple(self, codec) -> int:
        """The VAE's factor (patch_size 1 in every published Sana)."""
        return int(codec.factor)

    def export_parts(self, denoiser: Denoiser, base: Path, scheduler: dict | None, vae: Path | None) -> ExportParts:
        """The base's parts; with ``scheduler`` (difftrain's flow keys) a FlowMatchEulerDiscreteScheduler of
        them in place of the base's scheduler (the published base's is DPM-Solver++), so that the exported
        pipeline samples as difftrain does."""
        parts = super().export_parts(denoiser, base, None, vae)
        if scheduler is not None:
            import diffusers  # an optional package ([text])

            steps = int(self.scheduler_config(base).get("num_train_timesteps", 1000))
            parts.scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=steps, **scheduler)
            parts.copied.pop("scheduler", None)
            parts.index = {**parts.index, "scheduler": ["diffusers", EULER]}
        return parts


SANA = register(SanaFamily())
