"""Memory per rank of fine-tuning a base (SD, SDXL, SD3, Flux), counted on the meta device: no weights, no download.

    r = count_base(cfg, "flux-dev", ranks=8)      # a known base (configs shipped in tools/bases/) or a folder
    print(format_base(r))                         # the parts of cfg's setting, then which settings fit which card
    check_fits(cfg, "flux-dev", 24 * GiB)         # cfg's setting alone against a card; where it misses, what fits

A base is a pipeline folder of which only the ``config.json`` files are read (``model_index.json``, the
denoiser's, the text encoders', the VAE's): the known bases in ``tools/bases/`` are such folders, written
from the public configs of stabilityai/stable-diffusion-xl-base-1.0, stabilityai/stable-diffusion-3.5-large
and -medium, black-forest-labs/FLUX.1-dev (and ``flux-kontext-dev``: FLUX.1-Kontext-dev, FLUX.1-dev's configs in a
FluxKontextPipeline folder) and stable-diffusion-v1-5/stable-diffusion-v1-5 (``sd1.5``), and the families of 2026
(their sources in each family's module: families/sana.py, lumina2.py, flux2.py, qwen_image.py, z_image.py,
hidream.py, chroma.py, auraflow.py, pixart.py). The
family's denoiser is built on the meta device (``Family.denoiser_from_record``) and, for LoRA, peft's layers
are injected as training injects them (``networks/lora.py``'s targets and ``LoraConfig``). Per rank
(``parallel_memory.rank_memory``, DDP or FSDP):

- weights: the trained ones in float32; the frozen base as difftrain holds it (``networks/frozen_dtype.py``):
  in a LoRA setting in bf16/fp16 in that dtype (2 bytes a weight; float32 under FSDP, where its shards are
  gathered in the compute dtype), float32 otherwise, or with ``model.quantize_base`` its Linear weights at
  :data:`QUANT_BYTES` (the rest float32);
- with ``model.swap_blocks = N`` (the configured setting's row), the frozen bytes of the base's last N blocks
  leave the weights but for two of them (the one running and the one prefetched), shown as a host figure
  (``networks/block_swap.planned_bytes``);
- buffers (SD3's position embedding table: 0.84 GiB in SD3.5 Medium), whole on every rank, in the model and
  in each EMA copy;
- gradients of the trained weights; optimizer state by ``optim.name`` (``training/optimizers.py``'s exact
  count per shape); the EMA and each post-hoc EMA (a copy of the trained weights);
- activations of one micro-batch at ``data.resolution`` (``tools/meta_step.py``: the forward on meta
  tensors, autocast, fused attention, with and without gradient checkpointing); a frozen base held in the
  compute dtype is used as it is, so autocast keeps no copies of it for backward (none counted); under FSDP in
  bf16 the weights are gathered in bf16, so autocast keeps no copies of them (``SavedBytes.sharded_total``);
- the frozen text encoders when the text cache is off (with it on they are never loaded): in bf16/fp16 in a
  LoRA setting, float32 otherwise.

The sum is a planning figure (an upper bound of the step's peak, which frees activations as gradients
appear); a card "fits" when it is at most :data:`HEADROOM` of the card's memory (the CUDA context and the
allocator's slack take the rest). Where cfg's setting misses a card, :func:`advise` names the smallest change
that fits it, trying the single levers of :data:`LEVERS` and then their pairs (``estimate --base ... --card``;
at a CUDA run's start, ``api.check_device_memory``).
"""

from __future__ import annotations

import itertools
import json
import math
import types
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from difftrain.data.pair_cache import FILL_ROWS
from difftrain.data.text_cache import text_cache_wanted
from difftrain.diffusion.objective import build_objective, per_sample_loss
from difftrain.families import detect
from difftrain.models.text import first_line
from difftrain.models.vae import VAE_FACTORS
from difftrain.networks.block_swap import OPTION as SWAP_OPTION, planned_bytes
from difftrain.networks.lora import cast_adapter_input, import_peft, peft_config, target_modules
from difftrain.networks.quantize import QUANTIZE_KINDS, unfit_shape
from difftrain.runtime.fsdp import blocks
from difftrain.runtime.precision import DTYPES
from difftrain.tools.meta_step import SavedBytes, saved_for_backward
from difftrain.tools.parallel_memory import optimizer_state, rank_bytes, rank_memory
from difftrain.training.optimizers import OPTIMIZERS

KNOWN = Path(__file__).parent / "bases"  # known bases: folders of config.json files
CARDS_GIB = (16, 24, 48, 80)
HEADROOM = 0.9  # share of a card's memory planned for (the rest: CUDA context, allocator slack)
GiB = 2**30
# Bytes of a quantized Linear weight of n elements and `rows` output rows (model.quantize_base), as the library
# networks/quantize.py trains with holds it (checked to the byte in tests/integration/test_estimate_base.py):
# - int8, bitsandbytes 0.50's Int8Params under Linear8bitLt: the int8 weight (state.CB) and a float32 absmax
#   scale per row (state.SCB);
# - nf4, bitsandbytes 0.50's Params4bit (blocks of 64, double quantization: Params4bit's default, which
#   networks/quantize.py keeps): two weights a byte, a uint8 absmax per block, the absmax quantized again in
#   blocks of 256 (a float32 absmax per 256 blocks and the layer's own copy of the 256-entry float32 dynamic
#   map), a float32 offset and the 16-entry float32 NF4 code table;
# - fp8, torchao's Float8WeightOnlyConfig: a float8 weight and a float32 scale per row.
QUANT_BYTES = {
    "int8": lambda n, rows: n + 4 * rows,
    "fp8": lambda n, rows: n + 4 * rows,
    "nf4": lambda n, rows: (math.ceil(n / 2) + math.ceil(n / 64) + 4 * math.ceil(math.ceil(n / 64) / 256)
                            + 4 + 16 * 4 + 256 * 4),
}


def known_bases() -> list[str]:
    """The names ``--base`` takes besides a folder."""
    return sorted(p.name for p in KNOWN.iterdir() if (p / "model_index.json").is_file())


def base_folder(base: str) -> Path:
    """The folder of ``base``: a known name or a local folder; one ValueError otherwise."""
    if base in known_bases():
        return KNOWN / base
    folder = Path(base).expanduser()
    if not folder.is_dir():
        raise ValueError(f"--base {base}: not a folder nor a known base ({', '.join(known_bases())})")
    return folder


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--base: unreadable {path} ({e})") from None


def denoiser_config(folder: Path) -> dict:
    """The denoiser's diffusers config: ``transformer/`` or ``unet/config.json`` (a bare denoiser folder's own)."""
    for sub in ("transformer", "unet", "."):
        if (folder / sub / "config.json").is_file():
            return _json(folder / sub / "config.json")
    raise ValueError(f"--base {folder}: no transformer/config.json nor unet/config.json")


def vae_factor(folder: Path) -> int:
    """The VAE's downsampling (an AutoencoderKL's 2 ** (levels - 1), another class's ``models.vae.VAE_FACTORS``;
    8 when the folder has no vae/config.json)."""
    path = folder / "vae" / "config.json"
    if not path.is_file():
        return 8
    config = _json(path)
    return int(VAE_FACTORS.get(config.get("_class_name"), VAE_FACTORS["AutoencoderKL"])(config))


def text_encoder_params(folder: Path) -> int:
    """Parameters of the folder's text encoders (``model_index.json``'s ``text_encoder*``), built on meta."""
    import transformers  # an optional package ([text]); 1.1 s to import

    index, total = _json(folder / "model_index.json"), 0
    for part, value in sorted(index.items()):
        if not part.startswith("text_encoder") or not isinstance(value, list) or not (folder / part).is_dir():
            continue
        cls = getattr(transformers, value[1])
        config = cls.config_class.from_dict({k: v for k, v in _json(folder / part / "config.json").items()
                                             if not k.startswith("_")})
        with torch.device("meta"):
            total += sum(p.numel() for p in cls(config).parameters())
    return total


PADDED_POSITIONS = 1024  # CLIP's 77 positions are each prompt's length; a language model's (Qwen2.5-VL's 128000) are not


def text_cache_fill_bytes(folder: Path, cfg, family=None) -> tuple[int, str]:
    """Peak device bytes of filling the text cache (``data/text_cache.py``: one encoder on the device at a
    time, in the compute dtype, before training starts; then released), and the largest encoder's name: its
    weights in ``train.precision``'s dtype (float32 for fp32) plus one fill batch's (``validation.heldout_batch_size``
    captions) largest activation: per caption, the larger of a layer's input and output (2 x tokens x
    max(hidden, feed-forward width)) and its attention scores (heads x tokens^2); tokens: an encoder's
    ``max_position_embeddings`` when at most :data:`PADDED_POSITIONS` (CLIP's 77: prompts are padded to it), else
    (T5, which has none; a language model's thousands) ``model.max_sequence_length`` or 512; a multimodal model's
    widths are its ``text_config``'s. ``family`` (the base's): its ``cache_fill_tokens`` (an edit family's reference
    tokens) added to each prompt's, its kind of cache's prompts per encoder call (``data/pair_cache.FILL_ROWS``)
    instead of the held-out batch where it has its own."""
    import transformers  # an optional package ([text]); 1.1 s to import

    index, itemsize, peak, name = _json(folder / "model_index.json"), DTYPES[cfg.train.precision].itemsize, 0, ""
    extra = family.cache_fill_tokens() if family is not None else 0
    rows = (FILL_ROWS[family.text_cache] if family is not None else 0) or cfg.validation.heldout_batch_size
    for part, value in sorted(index.items()):
        if not part.startswith("text_encoder") or not isinstance(value, list) or not (folder / part).is_dir():
            continue
        raw = {k: v for k, v in _json(folder / part / "config.json").items() if not k.startswith("_")}
        cls = getattr(transformers, value[1])
        with torch.device("meta"):
            params = sum(p.numel() for p in cls(cls.config_class.from_dict(raw)).parameters())
        dims = raw.get("text_config") or raw  # a multimodal model's language model (Mistral3's) runs the prompt
        positions = dims.get("max_position_embeddings") or math.inf
        tokens = (positions if positions <= PADDED_POSITIONS else cfg.model.max_sequence_length or 512) + extra
        width = max(dims.get("hidden_size") or dims.get("d_model", 0), dims.get("intermediate_size") or dims.get("d_ff", 0))
        heads = dims.get("num_attention_heads") or dims.get("num_heads", 0)
        total = (params + rows * max(2 * tokens * width, heads * tokens**2)) * itemsize
        if total > peak:
            peak, name = total, f"{part} ({value[1]})"
    return peak, name


def stored_parameters(model: nn.Module) -> int:
    """The numbers the base's weight files hold: its parameters and persistent buffers (its state dict).
    SD3's position table (226M numbers in SD3.5 Medium) is a buffer in diffusers but a tensor of the file,
    and the published sizes (2.5B for SD3.5 Medium's MMDiT-X, against 2.24B parameters) count it."""
    return sum(t.numel() for t in model.state_dict().values())


@dataclass(frozen=True)
class Setting:
    """One way to train: full fine-tuning or LoRA, and the levers."""

    lora: bool
    checkpointing: bool
    optimizer: str
    quantize: str  # "off", "int8", "nf4", "fp8" (LoRA's frozen base)
    parallel: str
    ranks: int
    swap: int = 0  # model.swap_blocks: the base's blocks whose frozen weights live on the host

    def label(self) -> str:
        parts = ["LoRA" if self.lora else "full", f"{self.ranks} x {self.parallel.upper()}" if self.ranks > 1 else "1 GPU",
                 "checkpointing" if self.checkpointing else "no checkpointing", self.optimizer]
        return ", ".join(parts + ([f"{self.quantize} base"] if self.quantize != "off" else [])
                         + ([f"{self.swap} blocks swapped"] if self.swap else []))


class _Network:
    """The denoiser on the meta device, whole (full fine-tuning) until :meth:`add_lora` (one build serves both)."""

    def __init__(self, family, config: dict):
        with torch.device("meta"):
            self.denoiser = family.denoiser_from_record({"config": config})
        self.model: nn.Module = self.denoiser
        self.linear_weights: list[nn.Parameter] = []  # the frozen base's Linear weights (what a quantized base holds)

    def add_lora(self, lc) -> None:
        """Freeze the base and inject the layers of the lora section ``lc`` as training does (rank 16 when
        ``lora.rank`` is 0)."""
        rank = lc.rank or 16
        targets = target_modules(lc, self.denoiser.record())
        self.denoiser.requires_grad_(False)
        with torch.device("meta"):
            import_peft().inject_adapter_in_model(
                peft_config(lc.kind, rank, lc.alpha or float(rank), lc.dropout, targets, lc.init), self.denoiser)
        self.linear_weights = [m.weight for m in self.denoiser.modules()
                               if isinstance(m, nn.Linear) and not m.weight.requires_grad]

    def hold(self, dtype: torch.dtype | None) -> None:
        """The frozen parameters held in ``dtype`` (None: float32), as ``training/frozen_dtype.hold_frozen``
        holds a LoRA run's base, and its adapter layers casting their input as ``LoraNetwork.held_dtype`` has them
        (not to float32 over a base held in ``dtype``); on the meta device, free."""
        for p in self.model.parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(dtype or torch.float32)
        cast_adapter_input(self.model, dtype is None)

    def quantized(self, quantize: str) -> list[nn.Parameter]:
        """The frozen base's Linear weights that ``quantize`` holds quantized: those whose shape its library takes
        on every machine (``models/quantize.unfit``: the others stay float32, as in training)."""
        if quantize == "off":
            return []
        return [w for w in self.linear_weights if unfit_shape(quantize, w.shape[0], w.shape[1]) is None]

    def weight_bytes(self, quantize: str, parallel: str, ranks: int) -> int:
        """Rank 0's weights: the quantized Linear weights of the frozen base at QUANT_BYTES, the rest as held."""
        weights = self.quantized(quantize)
        quantized = {id(w) for w in weights}
        rest = [p for p in self.model.parameters() if id(p) not in quantized]
        return rank_bytes(rest, parallel, ranks) + sum(QUANT_BYTES[quantize](w.numel(), w.shape[0]) for w in weights)

    def activations(self, family, config: dict, cfg, batch: int, latent: tuple[int, int], checkpointing: bool,
                    quantize: str) -> SavedBytes:
        """What the training loss of one micro-batch (``per_sample_loss``, as the step computes it) keeps
        for backward, on meta tensors: latents (B, C, h, w), the family's condition shapes (an edit family's
        reference latents too, the target's shape: the tokens it adds)."""
        shapes = family.condition_shapes(config, int(getattr(cfg.model, "max_sequence_length", 0)))
        objective = build_objective(cfg.diffusion)
        levels = objective.draw_levels(batch, torch.Generator().manual_seed(0), torch.device("cpu")).to("meta")
        objective = objective.to("meta")

        def forward():
            x0 = torch.empty(batch, family.latent_channels(config), *latent, device="meta")
            cond = {k: torch.empty(batch, *s, device="meta") for k, s in shapes.items()}
            if family.references:  # an edit family's reference latents: each at the target's size (its bucket)
                cond |= family.reference_condition([torch.empty_like(x0) for _ in range(family.references)])
            return per_sample_loss(objective, self.model, x0, cond, levels, torch.empty_like(x0)).mean()

        quantized = frozenset(id(w) for w in self.quantized(quantize))
        with self.denoiser.counted_on_meta():  # a model reading values on the host (Lumina 2's mask) says how
            return saved_for_backward(forward, self.model, cfg.train.precision,
                                      self.denoiser.model if checkpointing else None, quantized)


def _settings(optimizer_name: str, ranks: int) -> list[Setting]:
    """The settings the table compares: the run's optimizer (``optim.name``), AdamW and 8-bit AdamW, checkpointing off and on, a
    4-bit base under LoRA (one process or DDP: not with FSDP), DDP and FSDP on ``ranks`` ranks (FSDP with
    the optimizers verified under it)."""
    optimizers = list(dict.fromkeys([optimizer_name, "adamw", "adamw8bit"]))
    out = []
    for lora, n in itertools.product((False, True), sorted({1, ranks})):
        for parallel in (("ddp",) if n == 1 else ("ddp", "fsdp")):
            for optimizer, ckpt in itertools.product(optimizers, (False, True)):
                if parallel == "fsdp" and not OPTIMIZERS[optimizer].fsdp:
                    continue
                for quantize in (("off", "nf4") if lora and parallel == "ddp" else ("off",)):
                    out.append(Setting(lora, ckpt, optimizer, quantize, parallel, n))
    return out


def held_dtype(s: Setting, precision: str, part: str = "denoiser") -> torch.dtype | None:
    """The dtype setting ``s`` holds its frozen ``part`` in ("denoiser", or "text" the text encoders), None for
    float32: ``training/frozen_dtype.frozen_dtype``'s rule (a LoRA setting in bf16/fp16; the denoiser not when
    quantized or under FSDP)."""
    if not s.lora or precision == "fp32":
        return None
    if part == "denoiser" and (s.quantize != "off" or s.parallel == "fsdp"):
        return None
    return DTYPES[precision]


def _config_setting(cfg, ranks: int, parallel: str | None) -> Setting:
    quantize = str(getattr(cfg.model, "quantize_base", "off") or "off")
    quantize = "off" if quantize in ("off", "none") else quantize
    if quantize != "off" and quantize not in QUANT_BYTES:
        raise ValueError(f"model.quantize_base={quantize!r}: estimate counts {', '.join(QUANT_BYTES)} (or off)")
    return Setting(bool(cfg.lora.rank), cfg.model.gradient_checkpointing, cfg.optim.name, quantize,
                   parallel or cfg.train.parallel, ranks, cfg.model.swap_blocks)


def swapped_bytes(net: _Network, swap: int) -> tuple[int, int]:
    """(device bytes a block swap of ``swap`` blocks saves, host bytes it holds): the frozen bytes of the base's
    blocks as held (``networks/block_swap.planned_bytes``: at most two swapped blocks on the device at once)."""
    units = blocks(net.model)
    if swap > len(units):
        raise ValueError(f"{SWAP_OPTION} = {swap} is more than the {len(units)} blocks of the base: "
                         f"set it to at most {len(units)}")
    device, host = planned_bytes(units, swap)
    return planned_bytes(units, 0)[0] - device, host


def _row(net: _Network, s: Setting, a: SavedBytes, cfg, text_params: int) -> dict:
    """One setting's parts per rank (bytes) and the cards it fits; ``net`` holds its frozen base as ``s`` does
    (:meth:`_Network.hold`); ``text_params``: the text encoders' numbers when they are loaded, else 0."""
    precision = cfg.train.precision
    text = text_params * (DTYPES[precision].itemsize if held_dtype(s, precision, "text") else 4)
    trained = [p for p in net.model.parameters() if p.requires_grad]
    state = optimizer_state(trained, s.optimizer, s.parallel)
    ema = trained * (1 + len(cfg.ema.posthoc_std))
    rank = rank_memory(net.model, state, ema, s.parallel, s.ranks, precision)
    saved, host = swapped_bytes(net, s.swap)  # model.swap_blocks: off the device, onto the host
    weights = net.weight_bytes(s.quantize, s.parallel, s.ranks) - saved
    activations = a.sharded_total if s.parallel == "fsdp" and precision != "fp32" else a.total
    # buffers: whole on every rank, in the model and in each EMA copy (ema.averaged_copy copies them)
    buffers = (1 + len(cfg.ema.posthoc_std) + 1) * sum(b.numel() * b.element_size() for b in net.model.buffers())
    total = weights + buffers + rank.grads + rank.optimizer + rank.ema + rank.transient + activations + text
    return {"setting": s.label(), "lora": s.lora, "checkpointing": s.checkpointing, "optimizer": s.optimizer,
            "quantize_base": s.quantize, "parallel": s.parallel, "ranks": s.ranks, "weights": weights,
            "buffers": buffers, "grads": rank.grads, "optimizer_state": rank.optimizer, "ema": rank.ema,
            "transient": rank.transient, "activations": activations, "activation_parts": vars(a),
            "text_encoders": text, "total": total, "swap_blocks": s.swap, "host_swapped": host, "fits_gib": [c for c in CARDS_GIB if total <= HEADROOM * c * GiB]}


@dataclass(frozen=True)
class Base:
    """A base folder read for counting: its family, the denoiser's config, the step's shapes and the text encoders'
    numbers when they are loaded (0 with the text cache on)."""

    name: str
    folder: Path
    family: object
    config: dict
    resolution: int
    batch: int
    latent: tuple[int, int]
    text: int


def read_base(cfg, base: str, resolution: int | None = None, batch_size: int | None = None) -> Base:
    """``base`` (a known name or a folder) read for counting with ``cfg``; one ValueError naming the option where
    it is not a base or ``resolution`` (default ``data.resolution``) does not suit it."""
    folder = base_folder(base)
    try:
        family = detect(folder)
    except ValueError as e:
        raise ValueError(f"--base: {e}") from None
    config = denoiser_config(folder)
    resolution = resolution or cfg.data.resolution
    factor = family.image_side_multiple(types.SimpleNamespace(factor=vae_factor(folder)))
    if resolution % factor:
        raise ValueError(f"resolution {resolution} must be a multiple of {factor} for this {family.name} base")
    latent = (resolution // vae_factor(folder), resolution // vae_factor(folder))
    text = 0 if text_cache_wanted(cfg.text) else text_encoder_params(folder)  # numbers; bytes by setting (_row)
    return Base(str(base), folder, family, config, resolution, batch_size or cfg.train.batch_size, latent, text)


def count_settings(cfg, b: Base, settings: list[Setting]) -> tuple[dict[Setting, dict], dict]:
    """Each of ``settings`` counted on ``b`` (one meta build of the denoiser; one meta forward per distinct
    checkpointing / quantized base / held dtype): (its row per setting, the network's counts: ``parameters``,
    ``stored_parameters``, ``lora_parameters``, ``activations_note``)."""
    precision = cfg.train.precision
    net = _Network(b.family, b.config)
    info = {"parameters": sum(p.numel() for p in net.model.parameters()),
            "stored_parameters": stored_parameters(net.model),  # before LoRA: the base's own tensors
            "lora_parameters": 0, "activations_note": "counted on meta tensors (tools/meta_step.py)"}
    swapped_bytes(net, max(s.swap for s in settings))  # a model.swap_blocks above the base's blocks: refused first
    rows: dict[Setting, dict] = {}
    for lora in (False, True):  # full fine-tuning first: LoRA's injection changes the network for good
        todo = [s for s in settings if s.lora == lora]
        if not todo:
            continue
        if lora:
            net.add_lora(cfg.lora)
        acts: dict[tuple, SavedBytes] = {}
        for s in todo:
            held = held_dtype(s, precision)
            net.hold(held)  # the frozen base as this setting holds it: its bytes and autocast's copies follow
            key = (s.checkpointing, s.quantize, held)
            if key not in acts:
                try:
                    acts[key] = net.activations(b.family, b.config, cfg, b.batch, b.latent, s.checkpointing,
                                                s.quantize)
                except (NotImplementedError, RuntimeError, TypeError, ValueError) as e:  # a forward meta cannot run
                    acts[key] = SavedBytes(0, 0, 0)
                    info["activations_note"] = (
                        f"not counted: the {b.family.name} denoiser's forward fails on the meta device "
                        f"({first_line(e)}); `difftrain estimate --config ...` measures them on a model that fits")
            rows[s] = _row(net, s, acts[key], cfg, b.text)
    info["lora_parameters"] = sum(p.numel() for p in net.model.parameters() if p.requires_grad)
    return rows, info


# The single changes the advice tries, each a field of Setting, its value and the override that makes it, in the
# order of their cost to the run (ties of the resulting figure go to the earlier): checkpointing costs time only
# (a recomputed forward), 8-bit AdamW rounds the adapter's optimizer state, fp8 rounds the frozen base's weights to
# 8 bits, nf4 to 4 bits (the largest quality cost of these).
LEVERS = (
    ("checkpointing", True, "--set model.gradient_checkpointing=true"),
    ("optimizer", "adamw8bit", "--set optim.name=adamw8bit"),
    ("quantize", "fp8", "--set model.quantize_base=fp8"),
    ("quantize", "nf4", "--set model.quantize_base=nf4"),
)


def _allowed(s: Setting) -> bool:
    """Whether training runs setting ``s``: a quantized base under LoRA and not under FSDP, fp8 in one process
    (``networks/quantize.QUANTIZE_KINDS``' ddp), a block swap over a float base of a LoRA run without FSDP, the
    optimizer verified under FSDP there."""
    if s.quantize != "off" and (not s.lora or s.parallel == "fsdp" or s.quantize not in QUANTIZE_KINDS
                                or (s.ranks > 1 and not QUANTIZE_KINDS[s.quantize].ddp)):
        return False
    if s.swap and (not s.lora or s.quantize != "off" or s.parallel == "fsdp"):  # config._check_swap_blocks
        return False
    return s.parallel != "fsdp" or OPTIMIZERS[s.optimizer].fsdp


def changes(own: Setting) -> list[tuple[tuple[str, ...], Setting]]:
    """The settings one lever away from ``own``, then two (levers on two different fields), that training runs:
    (the overrides, the setting), in :data:`LEVERS`' order. The block swap (``model.swap_blocks``) is not
    among them: its count is the swap's own (networks/block_swap.py)."""
    singles = [(field, value, line) for field, value, line in LEVERS if getattr(own, field) != value]
    out = []
    for n in (1, 2):
        for combo in itertools.combinations(singles, n):
            if len({field for field, _, _ in combo}) < n:
                continue
            s = replace(own, **{field: value for field, value, _ in combo})
            if _allowed(s):
                out.append((tuple(line for _, _, line in combo), s))
    return out


def size_text(n: float) -> str:
    """Bytes in words: GiB to 2 decimals, MiB below a tenth of a GiB (tiny test bases)."""
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"


def fits(total: int, card_bytes: int) -> bool:
    """Whether a setting of ``total`` bytes fits a card of ``card_bytes`` (:data:`HEADROOM` of it)."""
    return total <= HEADROOM * card_bytes


def advise(own_row: dict, tried: list[tuple[tuple[str, ...], dict]], card_bytes: int) -> dict:
    """The smallest change that fits a card of ``card_bytes``: among the changes ``tried`` ((overrides, its
    row), in :func:`changes`' order), the fitting ones of the fewest lines, the one whose figure is the largest
    (the least departure from the setting; a tie to the cheaper lever); every fitting change ranked in ``fitting``.
    ``line``: one line naming it and the figures, or saying that none fits."""
    fitting = [(lines, row) for lines, row in tried if fits(row["total"], card_bytes)]
    fitting.sort(key=lambda t: (len(t[0]), -t[1]["total"]))
    card = card_bytes / GiB
    own, card_text = size_text(own_row["total"]), size_text(card_bytes)
    if fits(own_row["total"], card_bytes):
        line = f"fits {card_text} ({own} <= {HEADROOM:.0%} of it)"
    elif fitting:
        lines, row = fitting[0]
        line = (f"does not fit {card_text} ({own} > {HEADROOM:.0%} of it); the smallest change that fits: "
                f"{' '.join(lines)} ({own} -> {size_text(row['total'])})")
    else:
        line = (f"does not fit {card_text} ({own} > {HEADROOM:.0%} of it), nor does any single change or pair of "
                f"{', '.join(line for _, _, line in LEVERS)}; lower data.resolution or train.batch_size, or shard "
                "the run over several GPUs (train.parallel=fsdp)")
    return {"card_gib": card, "fits": fits(own_row["total"], card_bytes), "line": line,
            "change": list(fitting[0][0]) if fitting else [], "changed_total": fitting[0][1]["total"] if fitting else None,
            "fitting": [{"set": list(lines), "total": row["total"]} for lines, row in fitting]}


def count_base(cfg, base: str, ranks: int = 8, parallel: str | None = None, resolution: int | None = None,
               batch_size: int | None = None, own_ranks: int | None = None, card_gib: float | None = None) -> dict:
    """Per-rank memory of training ``base`` with ``cfg`` (its precision, optimizer, EMAs, LoRA, checkpointing,
    quantize_base, text cache) on ``own_ranks`` ranks (default ``ranks``), and of the other settings at 1 and
    ``ranks`` ranks; ``advice``: whether cfg's setting fits a card of ``card_gib`` GiB (default the smallest of
    :data:`CARDS_GIB`) and, where not, the smallest change that does (:func:`advise`). Returns a JSON-ready
    dict, sizes in bytes; ``resolution`` (pixels; default ``data.resolution``) and ``batch_size`` (per rank;
    default ``train.batch_size``) give the activations."""
    if ranks < 1 or (own_ranks is not None and own_ranks < 1):
        raise ValueError(f"--world-size must be >= 1, got {min(ranks, own_ranks or 1)}")
    if card_gib is not None and card_gib <= 0:
        raise ValueError(f"--card must be > 0 (GiB of the card), got {card_gib}")
    b = read_base(cfg, base, resolution, batch_size)
    own = _config_setting(cfg, own_ranks or ranks, parallel)
    settings = [own] + [s for s in _settings(cfg.optim.name, ranks) if s != own]
    tried = changes(own)
    rows, info = count_settings(cfg, b, list(dict.fromkeys(settings + [s for _, s in tried])))
    card = card_gib if card_gib is not None else min(CARDS_GIB)
    return {
        "device": "meta (counted from the configs' shapes, not measured)",
        "base": str(base), "family": b.family.name, "resolution": b.resolution, "batch_size": b.batch,
        "latent": [b.family.latent_channels(b.config), *b.latent], "precision": cfg.train.precision,
        "parameters": info["parameters"],
        "stored_parameters": info["stored_parameters"],
        "lora_rank": cfg.lora.rank or 16,
        "lora_parameters": info["lora_parameters"],
        "text_encoders": "cached (not loaded)" if text_cache_wanted(cfg.text) else
                         f"loaded, {'float32' if held_dtype(own, cfg.train.precision, 'text') is None else cfg.train.precision}",
        "text_cache_fill": text_cache_fill_bytes(b.folder, cfg, b.family) if text_cache_wanted(cfg.text) else None,
        "ema_copies": 1 + len(cfg.ema.posthoc_std),
        "activations_note": info["activations_note"],
        "rows": [rows[s] for s in settings],
        "advice": advise(rows[own], [(lines, rows[s]) for lines, s in tried], int(card * GiB)),
    }


def check_fits(cfg, base: Base | str | Path, card_bytes: int, ranks: int = 1) -> dict:
    """Whether training ``base`` (:func:`read_base`'s, or a name or folder) with ``cfg`` on ``ranks`` ranks fits a
    device of ``card_bytes``, counted as ``difftrain estimate --base`` counts it: cfg's setting alone first (one meta
    build and forward), and only where it does not fit, the changes of :func:`changes` (:func:`advise`'s dict, with
    ``total`` cfg's figure)."""
    b = base if isinstance(base, Base) else read_base(cfg, str(base))
    own = _config_setting(cfg, ranks, None)
    rows, _ = count_settings(cfg, b, [own])
    tried = []
    if not fits(rows[own]["total"], card_bytes):
        tried = changes(own)
        rows, _ = count_settings(cfg, b, [own] + [s for _, s in tried])
    return {**advise(rows[own], [(lines, rows[s]) for lines, s in tried], card_bytes), "total": rows[own]["total"]}


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def format_base(r: dict) -> str:
    """``count_base``'s result: the configured setting's parts, then every setting against the cards."""
    own = r["rows"][0]
    a = own["activation_parts"]
    head = [
        ("device", r["device"]),
        ("base", f"{r['base']} ({r['family']}): {r['parameters']:,} parameters"
                 + (f" ({r['stored_parameters']:,} in its files, buffers included)"
                    if r["stored_parameters"] != r["parameters"] else "") + f"; LoRA rank {r['lora_rank']}: "
                 f"{r['lora_parameters']:,} trained"),
        ("step", f"{r['resolution']} px, batch {r['batch_size']} per rank, latents {'x'.join(map(str, r['latent']))}, "
                 f"{r['precision']}; text encoders {r['text_encoders']}; {r['ema_copies']} EMA cop"
                 f"{'y' if r['ema_copies'] == 1 else 'ies'}"),
        ("your setting", own["setting"]),
        ("  weights", _gib(own["weights"]) + " GiB" + (f" (base {own['quantize_base']})" if own["quantize_base"] != "off" else "")),
        ("  buffers", _gib(own["buffers"]) + " GiB (model and EMA copies; e.g. SD3's position embedding)"),
        ("  gradients", _gib(own["grads"]) + " GiB"),
        ("  optimizer state", _gib(own["optimizer_state"]) + f" GiB ({own['optimizer']})"),
        ("  EMA", _gib(own["ema"]) + " GiB"),
        ("  FSDP/DDP transient", _gib(own["transient"]) + " GiB"),
        ("  activations", _gib(own["activations"]) + f" GiB (kept for backward {_gib(a['saved'])}, of which frozen "
                          f"weights' casts {_gib(a['frozen_casts'])}; checkpointed inputs {_gib(a['checkpoint_inputs'])}; "
                          f"largest block's recompute {_gib(a['largest_block'])}; autocast cache {_gib(a['cast_cache'])})"),
        ("  text encoders", _gib(own["text_encoders"]) + " GiB"),
        *([("  host (block swap)", _gib(own["host_swapped"]) + f" GiB pinned: {own['swap_blocks']} blocks' frozen "
            "weights, off the device figures")] if own["swap_blocks"] else []),
        ("  total per rank", _gib(own["total"]) + " GiB"),
    ]
    if r.get("text_cache_fill"):  # before training, one encoder at a time: a peak of its own, not in the total
        head.append(("  text cache fill", f"{_gib(r['text_cache_fill'][0])} GiB at most while the cache fills, before "
                                          f"training (largest: {r['text_cache_fill'][1]}, {r['precision']})"))
    if not r["activations_note"].startswith("counted"):
        head.append(("  activations", r["activations_note"]))
    lines = [f"{k:22s} {v}" for k, v in head]
    cards = "  ".join(f"{c:>3d}G" for c in CARDS_GIB)
    lines += ["", f"{'setting':72s} {'GiB/rank':>8s}  {cards}"]
    for row in r["rows"]:
        marks = "  ".join(f"{'yes' if c in row['fits_gib'] else ' - ':>4s}" for c in CARDS_GIB)
        lines.append(f"{row['setting']:72s} {_gib(row['total']):>8s}  {marks}")
    lines.append(f"(fits: total per rank <= {HEADROOM:.0%} of the card; counted on the meta device, not measured)")
    lines.append(f"your setting {r['advice']['line']}")
    return "\n".join(lines)
