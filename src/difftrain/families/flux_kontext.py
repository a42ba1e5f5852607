"""FLUX.1 Kontext (FluxKontextPipeline): Flux.1's transformer taking a reference image's packed latents
after the target's in the image sequence: an edit model, trained on (reference, target, instruction).

Facts, checked in the installed diffusers (pipeline_flux_kontext.py, transformer_flux.py) and diffusers'
train_dreambooth_lora_flux_kontext.py; everything not listed is Flux.1's (flux.py: the CLIP + T5 prompt
encoder, 2x2 packing, img_ids, t / 1000, the distilled guidance input, rectified flow, uniform unshifted
training t, the scheduler's resolution-dependent shift for sampling):

Reference (``prepare_latents`` / ``_encode_vae_image``): the reference image is encoded by the VAE's mode
  (``sample_mode="argmax"``: the Gaussian's mean; the script's --vae_encode_mode default "mode" too),
  scaled as the targets (z - shift_factor) * scaling_factor, packed 2x2 as the targets
  (``flux.pack``) and appended to the target's tokens:
      hidden_states = cat([pack(x_t) (B, hw/4, 64), pack(reference) (B, h'w'/4, 64)], dim=1)
      img_ids       = cat([image_ids(h, w) (first axis 0), image_ids(h', w') with first axis 1], dim=0)
  the output is cut back to the target's tokens (``noise_pred[:, : latents.size(1)]``) before unpacking:
  the reference tokens are seen by attention, never denoised, and carry no loss (the script's
  ``model_pred[:, : orig_inp_shape[1]]``). The reference's latent size may differ from the target's
  (the pipeline resizes it to a preferred Kontext resolution); the script resizes and crops each pair
  together to the target's bucket (``paired_transform``): difftrain's data side does the same
  (``data.references``, ``data/folder.py``), so a training batch's references have the target's shape.
  Without an image the pipeline samples text-to-image (no reference tokens); difftrain trains only on
  pairs (a run of this family needs ``data.references``).
Conditioning: {"prompt_embeds", "pooled", "guidance"} as Flux, plus {"reference": (B, 16, h', w')} in the
  model's latent space (:meth:`FluxKontextFamily.reference_condition`); the null (dropped) condition of
  caption dropout replaces the text only, the reference stays (the step adds it after the dropout).
Training (the script): guidance = --guidance_scale 3.5 for every sample ("Kontext always has guidance"),
  weighting_scheme "none" (uniform u, unshifted sigmas), target noise - x0, weight 1: flux.py's defaults.
  Its default LoRA targets are Flux's plus the single blocks' ``proj_mlp``.
Sampling (the pipeline): guidance_scale 3.5 by default (Flux's distilled convention, no CFG unless
  true_cfg_scale > 1 with a negative prompt), the scheduler's dynamic shift on the TARGET's token count
  (calculate_shift of latents.shape[1]): difftrain's flow_dynamic_shift takes the target's latent size too.
Export: the base's FluxKontextPipeline folder with the trained transformer (Family.export_pipeline); LoRA
  files in FluxLoraLoaderMixin's format (FluxKontextPipeline.save_lora_weights / lora_state_dict).
Real size: FLUX.1-Kontext-dev's transformer has FLUX.1-dev's config (12B: 19 double and 38 single blocks,
  24 heads of 128, in_channels 64, joint_attention_dim 4096, guidance_embeds), its VAE is FLUX.1-dev's (16
  channels, 0.3611 / 0.1159): Black Forest Labs' reference code (black-forest-labs/flux, src/flux/util.py, the
  "flux-dev-kontext" ModelSpec: the same FluxParams and AutoEncoderParams as "flux-dev"); its text encoders are
  FLUX.1-dev's CLIP-L and T5-XXL (the pipeline's classes). The known base ``flux-kontext-dev`` (tools/bases/) is
  flux-dev's config files with model_index.json naming FluxKontextPipeline.
"""

from __future__ import annotations

import torch
from torch import Tensor

from difftrain.families import register
from difftrain.families.base import Condition, require_keys
from difftrain.families.flux import KEYS, FluxDenoiser, FluxFamily, image_ids, pack, unpack

REFERENCE = "reference"  # the condition key of the reference latents (B, c, h', w')
REFERENCE_ID = 1.0  # the first img_ids axis of the reference's tokens (the target's: 0)


def reference_tokens(references: list[Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(tokens (B, sum h'w'/4, 4c), ids (sum h'w'/4, 3)) of reference latents, each (B, c, h', w'), packed 2x2
    (``flux.pack``) and concatenated in order; every reference's ids (REFERENCE_ID, row, col)."""
    tokens, ids = [], []
    for ref in references:
        h, w = ref.shape[-2:]
        tokens.append(pack(ref.to(dtype)))
        marked = image_ids(h, w, ref.device, dtype).clone()
        marked[:, 0] = REFERENCE_ID
        ids.append(marked)
    return torch.cat(tokens, dim=1), torch.cat(ids, dim=0)


class FluxKontextDenoiser(FluxDenoiser):
    """``net(x (B, 16, h, w), t (B,) = 1000 t, cond) -> (B, 16, h, w)``: FluxDenoiser with cond's
    ``"reference"`` (B, 16, h', w') latents packed and appended to the image tokens (ids first axis 1), the
    output cut to the target's tokens, as FluxKontextPipeline calls the transformer. Without a
    ``"reference"`` key: Flux's call (the pipeline without an image)."""

    family = "flux-kontext"

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        b, _, h, w = x.shape
        require_keys(cond, KEYS + ((REFERENCE,) if REFERENCE in cond else ()), b, self.family)
        self.check_latent_size(h, w)
        tokens, ids = pack(x), image_ids(h, w, x.device, x.dtype)
        if REFERENCE in cond:
            self.check_latent_size(*cond[REFERENCE].shape[-2:])
            ref_tokens, ref_ids = reference_tokens([cond[REFERENCE]], x.dtype)
            tokens, ids = torch.cat([tokens, ref_tokens], dim=1), torch.cat([ids, ref_ids], dim=0)
        text = cond["prompt_embeds"]
        guidance = cond["guidance"].to(x.dtype) if self.model.config.guidance_embeds else None
        out = self.model(hidden_states=tokens, timestep=t.expand(b).to(x.dtype) / 1000, guidance=guidance,
                         pooled_projections=cond["pooled"], encoder_hidden_states=text,
                         txt_ids=text.new_zeros(text.shape[1], 3), img_ids=ids, return_dict=False)[0]
        return unpack(out[:, : (h // 2) * (w // 2)], h, w)


class FluxKontextFamily(FluxFamily):
    """FLUX.1 Kontext [dev] and its fine-tunes: Flux.1 with a reference image (an edit family)."""

    name = "flux-kontext"
    pipeline_class = "FluxKontextPipeline"
    denoiser_class = FluxKontextDenoiser
    # diffusers' Kontext script's default LoRA targets: Flux's and the single blocks' proj_mlp.
    lora_targets = FluxFamily.lora_targets + ("proj_mlp",)
    references = 1  # one reference image per sample (data.references)

    def reference_condition(self, references: list[Tensor]) -> Condition:
        """``{"reference": (B, 16, h', w')}``: the one reference's latents (model space), which
        :class:`FluxKontextDenoiser` packs after the target's tokens."""
        if len(references) != self.references:
            raise ValueError(f"the {self.name} family takes {self.references} reference image per sample, "
                             f"got {len(references)}")
        return {REFERENCE: references[0]}


FLUX_KONTEXT = register(FluxKontextFamily())
