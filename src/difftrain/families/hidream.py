"""HiDream-I1 (HiDreamImagePipeline): a sparse (mixture-of-experts) dual- then single-stream DiT on 2x2
patches of a Flux-style 16-channel VAE, conditioned on four text encoders, trained with rectified flow.

Facts, checked in the installed diffusers (pipeline_hidream_image.py, transformer_hidream_image.py,
lora_pipeline.py's HiDreamImageLoraLoaderMixin) and diffusers' train_dreambooth_lora_hidream.py:

Prompts -> conditioning (``encode_prompt``), every encoder reading the same caption, padded to max_length:
  L = max_sequence_length (the pipeline's and the script's default 128).
  pooled = cat([CLIP-L(tokens, L_clip).text_embeds, CLIP-G(tokens, L_clip).text_embeds], -1)
           (B, 768 + 1280 = 2048): text_encoder / text_encoder_2 are CLIPTextModelWithProjection; output[0] is
           the projected pooled EOS state. L_clip = min(L, 218): NOT the tokenizer's model_max_length, so the
           CLIPs need at least L_clip positions (the released ones are long CLIPs; a base whose CLIPs have
           fewer is refused in one line here, where the pipeline would fail inside CLIP).
  t5 = T5EncoderModel(ids, attention_mask)[0]                   (B, min(L, tokenizer_3's max), 4096)
  llama = LlamaForCausalLM(ids, attention_mask, output_hidden_states=True).hidden_states[1:]: every
           layer's output (not the embeddings), stacked. The pipeline stacks them layer-first, (32, B, L_l,
           4096); difftrain keeps conditions batch-first, (B, 32, L_l, 4096), and hands the transformer the
           layer-first view. L_l = min(L, tokenizer_4's max); tokenizer_4's pad token is its EOS (the pipeline
           sets it); no template, no system prompt. The hidden states are LlamaModel's: difftrain runs the
           causal LM's ``.model`` (the LM head's logits are never used).
  The transformer picks the Llama layers of its config's ``llama_layers`` (one per block: 16 + 32 = 48 in
  HiDream-I1, layers 0..31 then 31 sixteen more times), so all 32 are kept.
  The negative prompt is "" through all four encoders (CFG with guidance_scale 5.0 by default):
  ``encode([""])`` is difftrain's null condition. Text cache: an entry holds every Llama layer (32 x 128 x
  4096 values per caption, 64 MiB in float32): what the transformer reads.
Latents: latents = (z - shift_factor) * scaling_factor (the VAE's config: Flux's VAE, 0.1159, 0.3611).
Transformer call (``__call__``): transformer(hidden_states=latents (B, 16, h, w), timesteps=1000 sigma (B,),
  encoder_hidden_states_t5=t5, encoder_hidden_states_llama3=llama (layer-first), pooled_embeds=pooled); it
  patches 2x2 itself (img_ids (row, col), img_sizes; non-square latents padded to max_seq tokens with a mask,
  max_seq = max_resolution[0] * max_resolution[1] / 4 = 4096, so h * w / 4 must not exceed it), and its
  output is negated: ``noise_pred = -transformer(...)`` is the velocity noise - x0 the scheduler steps with.
  So HiDreamDenoiser returns minus the transformer's output: difftrain's v = eps - x0.
The MoE blocks in training mode (``model.train()``, config force_inference_output False): the gate routes
  each token to 2 of 4 experts differentiably (the routed experts and the gate get gradients) and the
  transformer returns its patches unfolded, (B, C, tokens, 4): HiDreamDenoiser folds them back to (B, C, h, w)
  in the same order as the inference path. The gate also computes DeepSeek's auxiliary load-balancing loss
  there, and diffusers drops it (MOEFeedForwardSwiGLU's ``AddAuxiliaryLoss`` line is commented out); the
  script loads the transformer with force_inference_output=True, which skips it too, and routes in
  ``moe_infer`` under ``torch.no_grad``: its gradients never reach the routed experts nor the gate, nor flow
  back through them. difftrain adds no auxiliary loss either, and trains on the differentiable path (the
  same forward values; the true gradient; full fine-tuning trains the experts and gates). It runs that path as
  :func:`routed_moe`: diffusers' values and gradients bit for bit, without its per-expert boolean masks (two host
  syncs per expert on CUDA) nor the auxiliary loss it computes and drops. What remains beyond the script's step
  is the true gradient's cost: backward through the two routed experts of every token (the script's gradient
  skips them): the denoiser's step 0.77x the script's routing on the tests' tiny base (docs/fine_tuning.md).
Training (the script): FlowMatchEulerDiscreteScheduler loaded with shift=3.0 whatever the base's config
  says; u uniform (weighting_scheme "none"), timesteps = scheduler.timesteps[floor(1000 u)], the shifted grid:
  here diffusion.flow_t_sampling = "uniform", flow_train_shift = 3.0 (the script's constant); x_t = (1 - sigma)
  x0 + sigma eps, target eps - x0, weight 1 (flow_loss "velocity"). No guidance input.
Sampling (the pipeline): set_timesteps(N, mu=calculate_shift(max_seq)) on the base's scheduler. HiDream-I1's
  is FlowMatchEulerDiscreteScheduler, shift 3.0, no dynamic shifting (so mu is unused): sigmas linspace(1,
  sigma_min, N) shifted by 3, then 0: here diffusion.flow_shift = the scheduler's shift (e^mu when it has
  use_dynamic_shifting, a constant: the pipeline's mu follows max_seq, not the image) and flow_grid_end =
  its shifted 1/1000. CFG: guidance_scale 5.0, uncond + s (cond - uncond), negative "". The pipeline
  rescales every request to default_sample_size (128) x the VAE factor squared pixels, keeping the aspect
  (1024 x 1024 for the real VAE): native_resolution is that side.
LoRA: the script's default targets ["to_k", "to_q", "to_v", "to_out"]: peft's suffix match takes the image
  stream's attention projections of every block (not the text stream's to_*_t); rank = alpha; files in
  HiDreamImageLoraLoaderMixin's format (``transformer.`` + peft names), whose lora_state_dict also reads
  ComfyUI's ``diffusion_model.`` layout.
FSDP units and block swap: the 16 double-stream and 32 single-stream HiDreamBlocks, in forward order.
``difftrain estimate`` on the meta device: the MoE's routing is data (boolean masks, bincount), which meta
  tensors lack; there each MoE feed-forward splits its tokens' copies evenly among the experts
  (:func:`balanced_moe`), which keeps the same bytes for backward as any routing does.

Known base ``tools/bases/hidream`` (HiDream-I1-Full, 17.1B transformer parameters counted on meta): the
transformer's config as diffusers' HiDream conversion script writes it (hlky/diffusers,
scripts/convert_hidream_to_diffusers.py: 16 double + 32 single blocks, 20 heads of 128, 4 routed experts of
which 2 active, caption_channels [4096, 4096], text_emb_dim 2048, llama_layers 0..31 then 31 x 16,
max_resolution 128 x 128); T5 v1.1 XXL's encoder as flux-dev's; Llama 3.1 8B (4096 wide, 32 layers, 32 heads,
8 key/value heads, 14336 feed-forward, 128256 tokens, 131072 positions: meta-llama's published config, written
from its known values, not read here); CLIP-L (768, 12 layers) and CLIP-G (1280, 32 layers) with projections
and 248 positions: Long-CLIP's context, an assumption (the pipeline pads CLIP to up to 218 tokens, so the
released CLIPs are longer than 77; the file itself was not read here); Flux's VAE; the scheduler:
FlowMatchEulerDiscreteScheduler, shift 3.0, no dynamic shifting (the value the script trains with; the
published scheduler_config.json was not read here).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
from torch import Tensor, nn

from difftrain.families import register
from difftrain.families.base import (Denoiser, PromptEncoder, frozen_part, load_part, read_json, require_keys,
                                     token_ids_and_mask)
from difftrain.families.mmdit import TransformerDenoiser, TransformerFamily
from difftrain.models.text import files_digest

DEFAULT_LENGTH = 128  # HiDreamImagePipeline's max_sequence_length default (and the script's)
CLIP_MOST = 218  # the pipeline pads CLIP to min(max_sequence_length, 218)
TRAIN_SHIFT = 3.0  # the script loads its scheduler with shift=3.0
KEYS = ("pooled", "t5", "llama")
LLAMA_WHAT = ("Llama 3.1 text encoder (HiDream-I1 folders often ship without it: "
              "meta-llama/Llama-3.1-8B-Instruct's files)")


# ---------------------------------------------------------------------------------------------
# The text encoders' steps (small functions: other families share CLIP, T5 and Llama).


def clip_projected(model, tokenizer, captions: list[str], length: int) -> Tensor:
    """(B, projection_dim): a CLIPTextModelWithProjection's ``text_embeds`` (its output[0]) of ``length`` tokens."""
    ids, _ = token_ids_and_mask(tokenizer, captions, length, model.device)
    return model(ids).text_embeds


def t5_states(model, tokenizer, captions: list[str], length: int) -> Tensor:
    """(B, length, d_model): T5's last hidden state, the attention mask passed."""
    ids, mask = token_ids_and_mask(tokenizer, captions, length, model.device)
    return model(ids, attention_mask=mask)[0]


def llama_layers(model, tokenizer, captions: list[str], length: int) -> Tensor:
    """(B, layers, length, hidden): every decoder layer's output (``hidden_states[1:]``, the embeddings left out)
    of a Llama causal LM's base model, batch-first, the attention mask passed."""
    ids, mask = token_ids_and_mask(tokenizer, captions, length, model.device)
    states = model.model(ids, attention_mask=mask, output_hidden_states=True).hidden_states[1:]
    return torch.stack(states, dim=1)


def prompt_lengths(requested: int, clip_positions: int, t5_most: int, llama_most: int, folder) -> tuple[int, int, int]:
    """(CLIP's, T5's, Llama's tokens) for ``model.max_sequence_length`` = ``requested`` (0: the pipeline's 128),
    as the pipeline derives them; one ValueError naming the folder when the base's CLIPs cannot take them."""
    length = DEFAULT_LENGTH if requested == 0 else requested
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"model.max_sequence_length={requested!r}: the HiDream base {folder} takes a positive "
                         f"number of tokens (0: the pipeline's {DEFAULT_LENGTH})")
    clip = min(length, CLIP_MOST)
    if clip > clip_positions:
        raise ValueError(f"model.max_sequence_length={requested!r}: the HiDream base {folder} pads CLIP to "
                         f"min(it, {CLIP_MOST}) = {clip} tokens, its CLIP text encoders have {clip_positions} "
                         f"positions: set it to at most {clip_positions}")
    return clip, min(length, t5_most), min(length, llama_most)


# ---------------------------------------------------------------------------------------------
# The denoiser.


def fold_training_output(out: Tensor, h: int, w: int, p: int) -> Tensor:
    """(B, C, tokens, p*p) -> (B, C, h, w): the transformer's training-mode output (its ``unpatchify`` with
    is_training, tokens row-major over the (h/p, w/p) grid, padded to max_seq for non-square latents) in the
    order of its inference path."""
    b, c = out.shape[:2]
    grid = out[:, :, : (h // p) * (w // p)].reshape(b, c, h // p, w // p, p, p)
    return grid.permute(0, 1, 2, 4, 3, 5).reshape(b, c, h, w)


def balanced_moe(moe, x: Tensor) -> Tensor:
    """A MOEFeedForwardSwiGLU's training-mode forward with the routing left out: each token's ``k`` copies split
    evenly among the experts (the routing is data: meta tensors have none). What it keeps for backward is what
    the real routing keeps, whatever it routes: the gate's scores and top-k weights, the (N k, D) copies, each
    expert's SwiGLU over its share (N k tokens in all) and the weighted sum."""
    n, d, k = x.numel() // x.shape[-1], x.shape[-1], moe.num_activated_experts
    scores = nn.functional.linear(x.reshape(n, d), moe.gate.weight).softmax(dim=-1)
    weights = torch.topk(scores, k=k, dim=-1, sorted=False)[0]
    copies = x.reshape(n, d).repeat_interleave(k, dim=0)
    q, r = divmod(n * k, len(moe.experts))
    shares = [q + (i < r) for i in range(len(moe.experts))]
    routed = torch.cat([expert(part) for expert, part in zip(moe.experts, copies.split(shares))])
    y = (routed.view(n, k, d) * weights.unsqueeze(-1)).sum(dim=1).view(x.shape)
    return y + moe.shared_experts(x)


def routed_moe(moe, x: Tensor) -> Tensor:
    """A MOEFeedForwardSwiGLU's training-mode forward (differentiable routing), equal to diffusers' in its values
    and gradients, bit for bit: the gate picks each token's ``k`` experts and weights; the token's k copies (copy j
    of token n is row n k + j) run through their experts; y = sum over its copies of weight x expert(copy), plus
    the shared experts. diffusers selects each expert's copies with a boolean mask and writes them back through
    another (2 masks per expert, each a host sync on CUDA: 8 per MoE forward with HiDream-I1's 4 experts, 384 per
    forward of its 48 blocks, twice that with gradient checkpointing's recompute) and computes an auxiliary
    load-balancing loss it drops. Here the copies are sorted by expert once (a stable sort: each expert sees the
    rows, in the order, its mask takes), each expert runs on its slice, and one gather puts the outputs back in
    copy order: one host sync (the experts' counts). The gate's auxiliary loss is switched off
    (:func:`route_experts` sets its alpha to 0).

    x: (..., D) -> (..., D)."""
    shape, d, k = x.shape, x.shape[-1], moe.num_activated_experts
    idx, weight, _ = moe.gate(x)  # (N, k) experts and weights of the N = x.numel() / D tokens
    flat = idx.reshape(-1)  # (N k,) the expert of each copy
    order = torch.argsort(flat, stable=True)  # the copies grouped by expert, each group in copy order
    counts = torch.bincount(flat, minlength=len(moe.experts)).tolist()
    copies = x.reshape(-1, d).index_select(0, order // k)  # (N k, D) the copies' tokens, expert by expert
    routed = torch.cat([expert(part).to(x.dtype) for expert, part in zip(moe.experts, copies.split(counts))])
    y = routed.index_select(0, torch.argsort(order))  # (N k, D) back in copy order
    y = (y.view(*weight.shape, d) * weight.unsqueeze(-1)).sum(dim=1).view(shape).to(x.dtype)
    return y + moe.shared_experts(x)


def moe_forward(moe, x: Tensor) -> Tensor:
    """What a HiDream MoE feed-forward runs (installed by :func:`route_experts`): on meta tensors (``difftrain
    estimate``) :func:`balanced_moe`; in training mode, where diffusers routes differentiably, :func:`routed_moe`;
    otherwise (inference, or a transformer loaded with force_inference_output) diffusers' own forward."""
    if x.is_meta:
        return balanced_moe(moe, x)
    if moe.training and not moe._force_inference_output:
        return routed_moe(moe, x)
    return type(moe).forward(moe, x)


def route_experts(model: nn.Module) -> None:
    """Every MoE feed-forward of ``model`` (a HiDreamImageTransformer2DModel) runs :func:`moe_forward` (its
    instance's ``forward``, as accelerate's hooks install theirs: a deep copy, the EMA's, keeps it); its gate
    computes no auxiliary loss (diffusers drops it: ``AddAuxiliaryLoss`` is commented out)."""
    for moe in model.modules():
        if hasattr(moe, "experts") and hasattr(moe, "gate") and hasattr(moe, "shared_experts"):
            moe.forward = functools.partial(moe_forward, moe)
            moe.gate.alpha = 0.0


class HiDreamDenoiser(TransformerDenoiser):
    """``net(x (B, 16, h, w), t (B,) = 1000 t, cond) -> (B, 16, h, w)`` velocity eps - x0: a
    HiDreamImageTransformer2DModel called as HiDreamImagePipeline calls it, its output negated (the pipeline's
    ``noise_pred = -noise_pred``). cond: {"pooled": (B, text_emb_dim), "t5": (B, L_t5, caption_channels[0]),
    "llama": (B, layers, L_l, caption_channels[1])} (the transformer takes the Llama layers layer-first)."""

    family = "hidream"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        route_experts(model)

    @property
    def patch(self) -> int:
        return int(self.model.config.patch_size)

    def check_latent_size(self, h: int, w: int) -> None:
        super().check_latent_size(h, w)
        tokens, most = (h // self.patch) * (w // self.patch), int(self.model.max_seq)
        if h != w and tokens > most:
            raise ValueError(f"latents of {h}x{w} are {tokens} patches, more than the HiDream transformer pads "
                             f"non-square latents to (max_resolution: {most} patches)")

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        b, _, h, w = x.shape
        require_keys(cond, KEYS, b, self.family)
        self.check_latent_size(h, w)
        out = self.model(hidden_states=x, timesteps=t.expand(b), encoder_hidden_states_t5=cond["t5"],
                         encoder_hidden_states_llama3=cond["llama"].transpose(0, 1),
                         pooled_embeds=cond["pooled"], return_dict=False)[0]
        if self.model.training and not self.model.config.force_inference_output:
            out = fold_training_output(out, h, w, self.patch)
        return -out


# ---------------------------------------------------------------------------------------------
# The prompt encoder.


class HiDreamPromptEncoder(PromptEncoder):
    """CLIP-L, CLIP-G, T5 and Llama 3.1 of a HiDream-I1 folder, frozen: ``encode(captions, device) ->
    {"pooled": (B, P_L + P_G), "t5": (B, L_t5, W_t5), "llama": (B, layers, L_l, W_l)}`` as
    HiDreamImagePipeline.encode_prompt; its null condition encode([""]) is the pipeline's negative prompt."""

    parts = ("clip_l", "clip_g", "t5", "llama")
    SUBS = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")
    TOKS = ("tokenizer", "tokenizer_2", "tokenizer_3", "tokenizer_4")

    def __init__(self, folder: Path, max_sequence_length: int = 0, deferred: bool = False):
        super().__init__()
        from transformers import (CLIPTextModelWithProjection, CLIPTokenizer, LlamaForCausalLM,  # optional ([text])
                                  PreTrainedTokenizerFast, T5EncoderModel, T5Tokenizer)

        self.source = str(folder)
        models = (CLIPTextModelWithProjection, CLIPTextModelWithProjection, T5EncoderModel, LlamaForCausalLM)
        whats = ("CLIP-L text encoder", "CLIP-G text encoder", "T5 text encoder", LLAMA_WHAT)
        for name, sub, cls, what in zip(self.parts, self.SUBS, models, whats):
            self.add_part(name, folder / sub, frozen_part(folder, sub, cls, what), deferred)
        self.tok_l = load_part(folder, "tokenizer", CLIPTokenizer, "CLIP-L tokenizer")
        self.tok_g = load_part(folder, "tokenizer_2", CLIPTokenizer, "CLIP-G tokenizer")
        self.tok_t5 = load_part(folder, "tokenizer_3", T5Tokenizer, "T5 tokenizer")
        self.tok_llama = load_part(folder, "tokenizer_4", PreTrainedTokenizerFast, "Llama tokenizer")
        self.tok_llama.pad_token = self.tok_llama.eos_token  # as HiDreamImagePipeline.__init__ sets it
        configs = [read_json(folder / sub / "config.json", f"base {folder}") for sub in self.SUBS]
        positions = min(int(c.get("max_position_embeddings", 0)) for c in configs[:2])
        self.clip_length, self.t5_length, self.llama_length = prompt_lengths(
            max_sequence_length, positions, int(self.tok_t5.model_max_length), int(self.tok_llama.model_max_length),
            folder)
        self.width = int(configs[2]["d_model"])
        self.digest = files_digest([folder / s for s in self.SUBS], [folder / s for s in self.TOKS], self._extra())

    def _extra(self) -> bytes:
        return f"lengths={self.clip_length},{self.t5_length},{self.llama_length}".encode()

    def legacy_extra(self) -> bytes:  # no record of this family predates the stored digest
        return self._extra()

    @property
    def dim(self) -> int:
        """The width of the T5 states (``t5``)."""
        return self.width

    def encode_part(self, name: str, captions: list[str]) -> dict[str, Tensor]:
        """CLIP-L's or CLIP-G's ``{"pooled": (B, P)}``, T5's ``{"t5": (B, L_t5, W)}`` or Llama's
        ``{"llama": (B, layers, L_l, W_l)}``."""
        model = getattr(self, name)
        if name == "t5":
            return {"t5": t5_states(model, self.tok_t5, captions, self.t5_length)}
        if name == "llama":
            return {"llama": llama_layers(model, self.tok_llama, captions, self.llama_length)}
        return {"pooled": clip_projected(model, self.tok_l if name == "clip_l" else self.tok_g, captions,
                                         self.clip_length)}

    def assemble(self, outputs: dict[str, dict[str, Tensor]], device: torch.device | str) -> dict[str, Tensor]:
        clip_l = outputs["clip_l"]["pooled"]
        pooled = torch.cat([clip_l, outputs["clip_g"]["pooled"].to(clip_l.device)], dim=-1)
        return {"pooled": pooled.float().to(device), "t5": outputs["t5"]["t5"].float().to(device),
                "llama": outputs["llama"]["llama"].float().to(device)}


# ---------------------------------------------------------------------------------------------
# The family.


def sampling_shift(sched: dict, config: dict) -> float:
    """The shift of the base's scheduler as HiDreamImagePipeline samples with it: FlowMatchEuler's ``shift``, or
    with ``use_dynamic_shifting`` e^mu of the pipeline's mu = calculate_shift(max_seq) (one value: max_seq is
    the transformer's, not the image's); UniPC's ``flow_shift``; 3.0 (the script's) when it gives none."""
    if sched.get("use_dynamic_shifting"):
        res, p = config.get("max_resolution", (128, 128)), int(config.get("patch_size") or 2)
        seq = int(res[0]) * int(res[1]) // (p * p)
        base, most = int(sched.get("base_image_seq_len", 256)), int(sched.get("max_image_seq_len", 4096))
        lo, hi = float(sched.get("base_shift", 0.5)), float(sched.get("max_shift", 1.15))
        return math.exp(lo + (hi - lo) / (most - base) * (seq - base))
    return float(sched.get("shift", sched.get("flow_shift", TRAIN_SHIFT)))


class HiDreamFamily(TransformerFamily):
    """HiDream-I1 (Full, Dev, Fast and their fine-tunes)."""

    name = "hidream"
    pipeline_class = "HiDreamImagePipeline"
    transformer_class = "HiDreamImageTransformer2DModel"
    denoiser_class = HiDreamDenoiser
    lora_targets = ("to_k", "to_q", "to_v", "to_out")  # the script's default target_modules
    kohya_prefix = "lycoris_"  # what ComfyUI maps for HiDream (SimpleTuner's LyCORIS names)
    foreign_modules = ("transformer_blocks", "single_transformer_blocks", "attn2")  # SD3's and Flux's
    default_sample_size = 128  # HiDreamImagePipeline's fixed default_sample_size (latent pixels)

    def training_defaults(self, folder: Path) -> dict[str, object]:
        """The base's parts, captions on, and rectified flow as the script trains it (uniform t on the grid
        shifted by 3) and the pipeline samples it (the scheduler's shift, its grid end)."""
        sched = self.scheduler_config(folder)
        config = read_json(Path(folder) / "transformer" / "config.json", f"base {folder}")
        shift, steps = sampling_shift(sched, config), int(sched.get("num_train_timesteps", 1000))
        grid_end = shift * (1 / steps) / (1 + (shift - 1) * (1 / steps))  # the scheduler's shifted 1/1000
        return {**self._defaults(folder), "diffusion.flow_t_sampling": "uniform",
                "diffusion.flow_train_shift": TRAIN_SHIFT, "diffusion.flow_shift": shift,
                "diffusion.flow_grid_end": grid_end, "diffusion.flow_dynamic_shift": False}

    def load_prompt_encoder(self, folder: Path, device: torch.device | str = "cpu",
                            max_sequence_length: int = 0, deferred: bool = False) -> HiDreamPromptEncoder:
        return HiDreamPromptEncoder(Path(folder), max_sequence_length, deferred).to(device)

    def condition_shapes(self, config: dict, max_sequence_length: int = 0) -> dict[str, tuple[int, ...]]:
        """The pooled CLIP embeddings, T5's and every Llama layer's tokens (the released tokenizers cap neither
        below 128), as wide as the transformer's caption_channels."""
        length = max_sequence_length or DEFAULT_LENGTH
        t5, llama = (int(c) for c in config["caption_channels"])
        return {"pooled": (int(config["text_emb_dim"]),), "t5": (length, t5),
                "llama": (max(int(k) for k in config["llama_layers"]) + 1, length, llama)}

    def fsdp_units(self, denoiser: Denoiser) -> list[nn.Module]:
        return [*denoiser.model.double_stream_blocks, *denoiser.model.single_stream_blocks]


HIDREAM = register(HiDreamFamily())
