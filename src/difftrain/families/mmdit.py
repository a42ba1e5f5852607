"""What the transformer (MMDiT) families share: SD3 (sd3.py) and Flux (flux.py) wrap a diffusers
transformer (``Denoiser.model``), load their parts from a pipeline folder, are trained with
rectified flow as their scheduler config says, export through ``Family.export_pipeline`` (the base's
pipeline with the trained ``transformer/``, checked to load) and keep LoRA files in their pipeline's
own format (``Family.save_lora`` / ``Family.read_lora``: its ``save_lora_weights`` / ``lora_state_dict``,
the ``transformer.`` prefix, peft's LoraConfig as metadata). The single-T5 families (Chroma, PixArt-Sigma,
AuraFlow) share one prompt encoder, :class:`T5PromptEncoder`. diffusers and transformers are imported
only when a part is loaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from difftrain.families.base import (Denoiser, Family, PromptEncoder, frozen_part, load_part, quantized, read_json,
                                     token_ids_and_mask)
from difftrain.models.text import files_digest, vocab_bytes

PATCH = 2  # the transformers' patch side (SD3's patch_size, Flux's 2x2 packing) in every released base


def t5_length(requested: int, default: int, tokenizer, folder, limit: int = 512) -> int:
    """The T5 sequence length: ``requested`` (0 = ``default`` capped by the tokenizer's
    model_max_length) if the base's T5 tokenizer and pipeline (<= 512) take it; else one ValueError."""
    most = min(int(getattr(tokenizer, "model_max_length", limit)), limit)
    length = min(default, most) if requested == 0 else requested
    if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= most:
        raise ValueError(f"model.max_sequence_length={requested!r}: the base {folder} cannot take it: its T5 "
                         f"tokenizer and pipeline take 1 to {most} tokens")
    return length


def masked_t5(encoder: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
    """(B, L, W): the encoder's last hidden state run with the tokenizer's mask (padding attends to nothing)."""
    return encoder(input_ids=ids, attention_mask=mask)[0]


class T5PromptEncoder(PromptEncoder):
    """One T5-kind encoder of a pipeline folder (``text_encoder/``, ``tokenizer/``), frozen, run with the
    tokenizer's mask: ``encode(captions, device) -> {key: (B, t5_length, ...)}``, the keys :meth:`outputs`
    makes of the last hidden state (B, t5_length, W) and the mask (B, t5_length). The single-T5 families
    (Chroma, PixArt-Sigma, AuraFlow) subclass it and set what differs: the classes, the default length, the
    digest's settings string, the text preprocessing (:meth:`texts`) and :meth:`outputs`.

    The digest is ``files_digest`` of the two folders with ``extra`` b"t5_length=N,<digest_extra>"; the
    FLOAT32 record's extra is the tokenizer's vocabulary (sorted pairs) then the same bytes."""

    parts = ("t5",)
    encoder_class = "T5EncoderModel"  # a transformers class name
    tokenizer_class = "T5TokenizerFast"
    encoder_what = "T5 text encoder"  # the part's name in error lines
    tokenizer_what = "T5 tokenizer"
    default_length = 512  # the pipeline's max_sequence_length default
    digest_extra = ""  # the family's settings after "t5_length=N," in the digest (never change: records hold it)

    def __init__(self, folder: Path, max_sequence_length: int = 0, deferred: bool = False):
        super().__init__()
        import transformers  # an optional package ([text])

        folder = Path(folder)
        self.source = str(folder)
        self.add_part("t5", folder / "text_encoder", frozen_part(
            folder, "text_encoder", getattr(transformers, self.encoder_class), self.encoder_what), deferred)
        self.tok_t5 = load_part(folder, "tokenizer", self.tokenizer_type(folder), self.tokenizer_what)
        self.t5_length = t5_length(max_sequence_length, self.default_length, self.tok_t5, folder)
        self.width = int(read_json(folder / "text_encoder" / "config.json", f"base {folder}")["d_model"])
        self.digest = files_digest([folder / "text_encoder"], [folder / "tokenizer"], self._extra())

    def tokenizer_type(self, folder: Path) -> type:
        """The tokenizer's class: :attr:`tokenizer_class` of transformers."""
        import transformers  # an optional package ([text])

        return getattr(transformers, self.tokenizer_class)

    def _extra(self) -> bytes:
        return f"t5_length={self.t5_length},{self.digest_extra}".encode()

    def legacy_extra(self) -> bytes:
        return vocab_bytes([self.tok_t5], pairs=True) + self._extra()

    @property
    def dim(self) -> int:
        """The width of ``prompt_embeds`` (the encoder's d_model)."""
        return self.width

    def texts(self, captions: list[str]) -> list[str]:
        """The captions as the pipeline tokenizes them (as given, unless a family preprocesses them)."""
        return captions

    def outputs(self, states: Tensor, mask: Tensor) -> dict[str, Tensor]:  # pragma: no cover - interface
        """The condition of the last hidden state ``states`` (B, L, W) and the tokenizer's ``mask`` (B, L)."""
        raise NotImplementedError(type(self).__name__)

    def encode_part(self, name: str, captions: list[str]) -> dict[str, Tensor]:
        ids, mask = token_ids_and_mask(self.tok_t5, self.texts(captions), self.t5_length, self.t5.device)
        return self.outputs(masked_t5(self.t5, ids, mask), mask)

    def assemble(self, outputs: dict[str, dict[str, Tensor]], device: torch.device | str) -> dict[str, Tensor]:
        return {k: v.float().to(device) for k, v in outputs["t5"].items()}


def flux_lora_renamed(tensors: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor] | None:
    """Two layouts of Chroma's LoRA files (FLUX.1's module names) that FluxLoraLoaderMixin.lora_state_dict (diffusers
    0.42) reads only after a plain renaming (``Family.renamed_lora``; no tensor changed), or None:

    - BFL's module names with peft's factors, ai-toolkit's Chroma files (``diffusion_model.double_blocks.0.img_attn.
      qkv.lora_A.weight``, no alpha): ``lora_A`` / ``lora_B`` named kohya's ``lora_down`` / ``lora_up``, which its
      kohya converter reads (ComfyUI's ``diffusion_model.`` names; alpha = rank where the file has none).
    - OneTrainer's ``lora_transformer_<diffusers module path with _>`` with kohya's tensors: named after the
      module of ``model`` they name (``transformer.<module>.lora_A.weight``, ``.lora_B.weight``, ``.alpha``); its
      converter for them ("mixture") maps the attention projections alone and puts every other module's tensors
      on its block. A name of no module keeps its underscores, for the check that names it.
    """
    keys = list(tensors)
    factors = (".lora_A.weight", ".lora_B.weight", ".alpha")
    if keys and all(k.startswith("diffusion_model.") and k.endswith(factors) for k in keys):
        return {k.replace(".lora_A.weight", ".lora_down.weight").replace(".lora_B.weight", ".lora_up.weight"): v
                for k, v in tensors.items()}
    prefix, kohya = "lora_transformer_", {".lora_down.weight": ".lora_A.weight", ".lora_up.weight": ".lora_B.weight",
                                          ".alpha": ".alpha"}
    if keys and all(k.startswith(prefix) and k.endswith(tuple(kohya)) for k in keys):
        named = {prefix + m.replace(".", "_"): m for m, _ in model.named_modules() if m}
        out = {}
        for key, value in tensors.items():
            name, leaf = key.split(".", 1)
            out[f"transformer.{named.get(name, name[len(prefix):])}{kohya['.' + leaf]}"] = value
        return out
    return None


def canonical_lora_renamed(tensors: dict[str, Tensor]) -> dict[str, Tensor] | None:
    """OneTrainer's "canonical" (legacy) LoRA layout, diffusers' module names with kohya's tensors
    (``transformer.<module>.lora_down.weight``, ``.lora_up.weight``, ``.alpha``), renamed to ComfyUI's
    ``diffusion_model.<module>...``, which Qwen-Image's and Z-Image's lora_state_dict convert (diffusers 0.42 reads the
    file as it is with a second ``transformer.`` prefix: no module matches); None for any other layout."""
    kohya = (".lora_down.weight", ".lora_up.weight", ".alpha")
    if not tensors or not all(k.startswith("transformer.") and k.endswith(kohya) for k in tensors):
        return None
    return {"diffusion_model." + k[len("transformer."):]: v for k, v in tensors.items()}


class TransformerDenoiser(Denoiser):
    """A diffusers transformer on (B, 16, h, w) latents; ``check_latent_size`` refuses sides the
    patches cannot divide, in one line."""

    @property
    def patch(self) -> int:
        """The side of the square patches the transformer takes its latents in (Flux's 2x2 packing)."""
        return PATCH

    def check_latent_size(self, h: int, w: int) -> None:
        p = self.patch
        if h % p or w % p:
            raise ValueError(f"latents of {h}x{w} do not divide into the {self.family} transformer's "
                             f"{p}x{p} patches: image sides must be multiples of {p} x the VAE's factor")


class TransformerFamily(Family):
    """The shared half of the SD3 and Flux families; subclasses set ``transformer_class``,
    ``denoiser_class``, ``foreign_modules`` and write what differs."""

    transformer_class = ""
    denoiser_class: type[TransformerDenoiser] = TransformerDenoiser
    lora_prefix = "transformer"
    kohya_prefix = "lora_transformer_"  # what ComfyUI maps for SD3 and Flux (OneTrainer's names)
    denoiser_subfolder = "transformer"

    @staticmethod
    def scheduler_config(folder: Path) -> dict:
        """The base's FlowMatchEulerDiscreteScheduler config (scheduler/scheduler_config.json)."""
        return read_json(Path(folder) / "scheduler" / "scheduler_config.json", f"base {folder}")

    def prompt_options(self, model) -> dict[str, object]:
        """``max_sequence_length``: the T5 tokens per prompt (``model.max_sequence_length`` of the
        ``cfg.model`` section; 0 = the pipeline's default)."""
        return {"max_sequence_length": int(getattr(model, "max_sequence_length", 0))}

    def _defaults(self, folder: Path) -> dict[str, object]:
        return {"model.text_encoder": str(folder), "model.vae": str(folder), "data.captions": True,
                "diffusion.objective": "flow"}

    @staticmethod
    def shift_range(sched: dict, max_shift: float = 1.15, max_seq_len: int = 4096) -> dict[str, object]:
        """The resolution-dependent shift of the base's scheduler config ``sched`` as difftrain's flow keys: mu
        from base_shift at base_image_seq_len tokens to max_shift at max_image_seq_len. Where the config has
        none, FlowMatchEulerDiscreteScheduler's defaults (or the pipeline's: ``max_shift``, ``max_seq_len``)."""
        return {"diffusion.flow_base_shift": float(sched.get("base_shift", 0.5)),
                "diffusion.flow_max_shift": float(sched.get("max_shift", max_shift)),
                "diffusion.flow_base_seq_len": int(sched.get("base_image_seq_len", 256)),
                "diffusion.flow_max_seq_len": int(sched.get("max_image_seq_len", max_seq_len))}

    @classmethod
    def unshifted_flow(cls, sched: dict, **shift_range) -> dict[str, object]:
        """Rectified flow as diffusers' Flux-style scripts train it: uniform, unshifted training t; sampling
        with the scheduler's resolution-dependent shift (:meth:`shift_range`, its defaults overridden by
        ``shift_range``) unless its config turns ``use_dynamic_shifting`` off."""
        return {"diffusion.flow_t_sampling": "uniform", "diffusion.flow_train_shift": 1.0, "diffusion.flow_shift": 1.0,
                "diffusion.flow_grid_end": None,
                "diffusion.flow_dynamic_shift": bool(sched.get("use_dynamic_shifting", True)),
                **cls.shift_range(sched, **shift_range)}

    def load_denoiser(self, folder: Path, quantization_config=None) -> TransformerDenoiser:
        import diffusers  # an optional package ([text])

        return self.denoiser_class(load_part(folder, "transformer", getattr(diffusers, self.transformer_class),
                                             f"{self.name} transformer", **quantized(quantization_config)))

    def denoiser_from_record(self, record: dict) -> TransformerDenoiser:
        import diffusers  # an optional package ([text])

        return self.denoiser_class(getattr(diffusers, self.transformer_class).from_config(dict(record["config"])).float())

    def image_side_multiple(self, codec) -> int:
        """The VAE's factor times the 2x2 patches."""
        return int(codec.factor) * PATCH

    applies_shift_factor = True  # the pipelines decode latents / scaling + shift

    def export_scheduler(self, diffusion) -> dict:
        return self.flow_scheduler(diffusion)

    @staticmethod
    def flow_scheduler(diffusion) -> dict:
        """FlowMatchEulerDiscreteScheduler settings of difftrain's flow keys (``cfg.diffusion``), for
        :meth:`export_pipeline`: ``shift``, or ``use_dynamic_shifting`` with the base/max shift and
        sequence lengths, so that the exported pipeline samples on difftrain's grid (SD3's grid end
        follows from the shift, as ``training_defaults`` sets it)."""
        if diffusion.objective != "flow":
            raise ValueError(f"a transformer base exports a flow model; diffusion.objective is {diffusion.objective!r}")
        if not diffusion.flow_dynamic_shift:
            return {"shift": float(diffusion.flow_shift), "use_dynamic_shifting": False}
        return {"use_dynamic_shifting": True,  # the scheduler then ignores its shift
                "base_shift": float(diffusion.flow_base_shift), "max_shift": float(diffusion.flow_max_shift),
                "base_image_seq_len": int(diffusion.flow_base_seq_len),
                "max_image_seq_len": int(diffusion.flow_max_seq_len)}

    def fsdp_units(self, denoiser: Denoiser) -> list[nn.Module]:
        return list(denoiser.model.transformer_blocks)

