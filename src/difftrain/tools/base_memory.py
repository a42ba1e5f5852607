"""Memory per rank of fine-tuning a base (SD, SDXL, SD3, Flux), counted on the meta device: no weights, no download.

    r = count_base(cfg, "flux-dev", ranks=8)      # a known base (configs shipped in tools/bases/) or a folder
    print(format_base(r))                         # the parts of cfg's setting, then which settings fit which card

A base is a pipeline folder of which only the ``config.json`` files are read (``model_index.json``, the
denoiser's, the text encoders', the VAE's): the known bases in ``tools/bases/`` are such folders, written
from the public configs of stabilityai/stable-diffusion-xl-base-1.0, stabilityai/stable-diffusion-3.5-large
and -medium and black-forest-labs/FLUX.1-dev. The family's denoiser is built on the meta device
(``Family.denoiser_from_record``) and, for LoRA, peft's layers are injected as training injects them
(``networks/lora.py``'s targets and ``LoraConfig``). Per rank (``parallel_memory.rank_memory``, DDP or FSDP):

- weights: the trained ones in float32; the frozen base as difftrain holds it (``networks/frozen_dtype.py``):
  in a LoRA setting in bf16/fp16 in that dtype (2 bytes a weight; float32 under FSDP, where its shards are
  gathered in the compute dtype), float32 otherwise, or with ``model.quantize_base`` its Linear weights at
  :data:`QUANT_BYTES` (the rest float32);
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
allocator's slack take the rest).
"""

from __future__ import annotations

import itertools
import types
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from difftrain.networks.quantize import unfit_shape
from difftrain.models.text import first_line
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
    """The VAE's downsampling (2 ** (levels - 1); 8 when the folder has no vae/config.json)."""
    path = folder / "vae" / "config.json"
    return 2 ** (len(_json(path)["block_out_channels"]) - 1) if path.is_file() else 8


def text_encoder_params(folder: Path) -> int:
    """Parameters of the folder's text encoders (``model_index.json``'s ``text_encoder*``), built on meta."""
    import transformers

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

    def label(self) -> str:
        parts = ["LoRA" if self.lora else "full", f"{self.ranks} x {self.parallel.upper()}" if self.ranks > 1 else "1 GPU",
                 "checkpointing" if self.checkpointing else "no checkpointing", self.optimizer]
        return ", ".join(parts + ([f"{self.quantize} base"] if self.quantize != "off" else []))


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
        from difftrain.networks.lora import import_peft, peft_config, target_modules

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
        from difftrain.networks.lora import cast_adapter_input

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
        for backward, on meta tensors: latents (B, C, h, w), the family's condition shapes."""
        from difftrain.diffusion.objective import build_objective, per_sample_loss

        shapes = family.condition_shapes(config, int(getattr(cfg.model, "max_sequence_length", 0)))
        objective = build_objective(cfg.diffusion)
        levels = objective.draw_levels(batch, torch.Generator().manual_seed(0), torch.device("cpu")).to("meta")
        objective = objective.to("meta")

        def forward():
            x0 = torch.empty(batch, family.latent_channels(config), *latent, device="meta")
            cond = {k: torch.empty(batch, *s, device="meta") for k, s in shapes.items()}
            return per_sample_loss(objective, self.model, x0, cond, levels, torch.empty_like(x0)).mean()

        quantized = frozenset(id(w) for w in self.quantized(quantize))
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
                   parallel or cfg.train.parallel, ranks)


def _row(net: _Network, s: Setting, a: SavedBytes, cfg, text_params: int) -> dict:
    """One setting's parts per rank (bytes) and the cards it fits; ``net`` holds its frozen base as ``s`` does
    (:meth:`_Network.hold`); ``text_params``: the text encoders' numbers when they are loaded, else 0."""
    precision = cfg.train.precision
    text = text_params * (DTYPES[precision].itemsize if held_dtype(s, precision, "text") else 4)
    trained = [p for p in net.model.parameters() if p.requires_grad]
    state = optimizer_state(trained, s.optimizer, s.parallel)
    ema = trained * (1 + len(cfg.ema.posthoc_std))
    rank = rank_memory(net.model, state, ema, s.parallel, s.ranks, precision)
    weights = net.weight_bytes(s.quantize, s.parallel, s.ranks)
    activations = a.sharded_total if s.parallel == "fsdp" and precision != "fp32" else a.total
    # buffers: whole on every rank, in the model and in each EMA copy (ema.averaged_copy copies them)
    buffers = (1 + len(cfg.ema.posthoc_std) + 1) * sum(b.numel() * b.element_size() for b in net.model.buffers())
    total = weights + buffers + rank.grads + rank.optimizer + rank.ema + rank.transient + activations + text
    return {"setting": s.label(), "lora": s.lora, "checkpointing": s.checkpointing, "optimizer": s.optimizer,
            "quantize_base": s.quantize, "parallel": s.parallel, "ranks": s.ranks, "weights": weights,
            "buffers": buffers, "grads": rank.grads, "optimizer_state": rank.optimizer, "ema": rank.ema,
            "transient": rank.transient, "activations": activations, "activation_parts": vars(a),
            "text_encoders": text, "total": total, "fits_gib": [c for c in CARDS_GIB if total <= HEADROOM * c * GiB]}


def text_cache_on(t) -> bool:
    """Whether the text encoders stay unloaded (``text.cache`` of the text section ``t``: auto is on unless
    captions change per sample)."""
    mode = t.cache
    return mode == "on" or (mode == "auto" and not t.shuffle_tags and not t.tag_dropout)


def count_base(cfg, base: str, ranks: int = 8, parallel: str | None = None, resolution: int | None = None,
               batch_size: int | None = None) -> dict:
    """Per-rank memory of training ``base`` with ``cfg`` (its precision, optimizer, EMAs, LoRA, checkpointing,
    quantize_base, text cache), and of the other settings at 1 and ``ranks`` ranks. Returns a JSON-ready
    dict, sizes in bytes; ``resolution`` (pixels; default ``data.resolution``) and ``batch_size`` (per rank;
    default ``train.batch_size``) give the activations."""
    from difftrain.families import detect

    if ranks < 1:
        raise ValueError(f"--world-size must be >= 1, got {ranks}")
    folder = base_folder(base)
    try:
        family = detect(folder)
    except ValueError as e:
        raise ValueError(f"--base: {e}") from None
    config = denoiser_config(folder)
    resolution = resolution or cfg.data.resolution
    batch = batch_size or cfg.train.batch_size
    factor = family.image_side_multiple(types.SimpleNamespace(factor=vae_factor(folder)))
    if resolution % factor:
        raise ValueError(f"resolution {resolution} must be a multiple of {factor} for this {family.name} base")
    latent = (resolution // vae_factor(folder), resolution // vae_factor(folder))
    precision = cfg.train.precision
    text = 0 if text_cache_on(cfg.text) else text_encoder_params(folder)  # numbers; bytes by setting (_row)
    own = _config_setting(cfg, ranks, parallel)
    settings = [own] + [s for s in _settings(cfg.optim.name, ranks) if s != own]
    net = _Network(family, config)
    parameters = sum(p.numel() for p in net.model.parameters())
    stored = stored_parameters(net.model)  # before LoRA: the base's own tensors
    failed = ""
    rows: dict[Setting, dict] = {}
    for lora in (False, True):
        if lora:
            net.add_lora(cfg.lora)
        acts: dict[tuple, SavedBytes] = {}
        for s in (s for s in settings if s.lora == lora):
            held = held_dtype(s, precision)
            net.hold(held)  # the frozen base as this setting holds it: its bytes and autocast's copies follow
            key = (s.checkpointing, s.quantize, held)
            if key not in acts:
                try:
                    acts[key] = net.activations(family, config, cfg, batch, latent, s.checkpointing, s.quantize)
                except (NotImplementedError, RuntimeError, TypeError, ValueError) as e:  # a forward meta cannot run
                    acts[key] = SavedBytes(0, 0, 0)
                    failed = (f"not counted: the {family.name} denoiser's forward fails on the meta device "
                              f"({first_line(e)}); `difftrain estimate --config ...` measures them on a model that fits")
            rows[s] = _row(net, s, acts[key], cfg, text)
    lora_parameters = sum(p.numel() for p in net.model.parameters() if p.requires_grad)
    return {
        "device": "meta (counted from the configs' shapes, not measured)",
        "base": str(base), "family": family.name, "resolution": resolution, "batch_size": batch,
        "latent": [family.latent_channels(config), *latent], "precision": precision,
        "parameters": parameters,
        "stored_parameters": stored,
        "lora_rank": cfg.lora.rank or 16,
        "lora_parameters": lora_parameters,
        "text_encoders": "cached (not loaded)" if text_cache_on(cfg.text) else
                         f"loaded, {'float32' if held_dtype(own, precision, 'text') is None else precision}",
        "ema_copies": 1 + len(cfg.ema.posthoc_std),
        "activations_note": failed or "counted on meta tensors (tools/meta_step.py)",
        "rows": [rows[s] for s in settings],
    }


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
        ("  total per rank", _gib(own["total"]) + " GiB"),
    ]
    if not r["activations_note"].startswith("counted"):
        head.append(("  activations", r["activations_note"]))
    lines = [f"{k:22s} {v}" for k, v in head]
    cards = "  ".join(f"{c:>3d}G" for c in CARDS_GIB)
    lines += ["", f"{'setting':72s} {'GiB/rank':>8s}  {cards}"]
    for row in r["rows"]:
        marks = "  ".join(f"{'yes' if c in row['fits_gib'] else ' - ':>4s}" for c in CARDS_GIB)
        lines.append(f"{row['setting']:72s} {_gib(row['total']):>8s}  {marks}")
    lines.append(f"(fits: total per rank <= {HEADROOM:.0%} of the card; counted on the meta device, not measured)")
    return "\n".join(lines)
