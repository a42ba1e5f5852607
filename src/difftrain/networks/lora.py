"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") on a difftrain
network, through ``peft``: W x + (alpha / r) B A x on the chosen layers, the base W frozen; and its
variants (``lora.kind``, :data:`KINDS`): DoRA (Liu et al. 2024, a magnitude vector per output times
the normalised W + BA), LoHa (Hyeon-Woo et al. 2022, a Hadamard product of two low-rank products) and
LoKr (a Kronecker product, LyCORIS), each peft's own layer.

    net = apply_lora(base, cfg.lora, base_source="sd-folder")   # a LoraNetwork around base
    net.state_dict()            # the adapter alone: {"...to_q.lora_A.weight": (r, in), ...}
    net.network_record()        # what rebuilds it: the base's record, its source and digest, the LoRA settings
    net.set_scale(0.5)          # the adapter at half strength (sampling)
    net.merged_base_state()     # the base's state dict with the adapter folded in (W + scale B A)

The adapter's names are peft's (``get_peft_model_state_dict``): the base network's own state-dict
names with peft's adapter name left out (``to_q.lora_A.default.weight`` -> ``to_q.lora_A.weight``;
DoRA adds ``to_q.lora_magnitude_vector``, LoHa ``to_q.hada_w1_a`` ..., LoKr ``to_q.lokr_w1`` ...): for a
UNet2DConditionModel they are diffusers' names, so an export only adds diffusers' ``unet.`` prefix. peft is imported only
when an adapter is built (``pip install 'difftrain[lora]'``).
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from difftrain.models.text import weights_digest
from difftrain.networks.quantize import quantize_base
from difftrain.runtime.optional import require
from difftrain.runtime.stored_digest import FLOAT32

NETWORK_KIND = "lora"  # the "kind" of a LoRA network's record in checkpoints


def is_lora_record(network: dict | None) -> bool:
    """Whether a checkpoint's ``network`` record (or None) is a LoRA network's."""
    return bool(network) and network.get("kind") == NETWORK_KIND
ADAPTER = "default"  # peft's adapter name; never in difftrain's names
# lora.kind -> peft's config class (DoRA is LoraConfig(use_dora=True)); records written before
# lora.kind existed are "lora".
KINDS = {"lora": "LoraConfig", "dora": "LoraConfig", "loha": "LoHaConfig", "lokr": "LoKrConfig"}

# The attention projections each network names (peft matches a module by its name's suffix).
ATTENTION_TARGETS = {
    "diffusers.UNet2DConditionModel": ("to_q", "to_k", "to_v", "to_out.0"),
    "unet": ("q", "k", "v", "proj_out"),  # difftrain's UNet: self- and cross-attention (families.UNET.lora_targets)
}
# The convolutions of the residual blocks (``lora.include_conv``); both networks name them so.
CONV_TARGETS = ("conv1", "conv2")


def import_peft():
    """The ``peft`` module, or one ``MissingDependency`` line naming the extra that installs it."""
    require("peft.tuners.lora", "lora", "lora.rank > 0")
    return require("peft", "lora", "lora.rank > 0")


def target_modules(lora_cfg, base_record: dict) -> list[str]:
    """The module-name suffixes LoRA adapts: ``lora.target_modules``, or the attention
    projections of the base network (its record's ``lora_targets``: a family's, see
    ``difftrain.families``), plus the residual convolutions with ``lora.include_conv``."""
    default = base_record.get("lora_targets") or ATTENTION_TARGETS[base_record["kind"]]
    targets = list(lora_cfg.target_modules) or list(default)
    if lora_cfg.include_conv:
        targets += [t for t in CONV_TARGETS if t not in targets]
    return targets


def _matches(name: str, targets: list[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def _check_targets(base: nn.Module, targets: list[str], rank: int) -> None:
    """One ValueError naming the option when the targets match no layer, match a layer peft
    cannot adapt, or the rank exceeds a matched layer's smaller dimension."""
    matched = [(n, m) for n, m in base.named_modules() if n and _matches(n, targets)]
    if not matched:
        raise ValueError(f"lora.target_modules {targets} match no layer of this network "
                         f"(its attention projections are named e.g. {_example_names(base)})")
    sizes = []
    for name, module in matched:
        if isinstance(module, nn.Linear):
            sizes.append((min(module.in_features, module.out_features), name, "Linear"))
        elif isinstance(module, nn.Conv2d):
            fan_in = module.in_channels * module.kernel_size[0] * module.kernel_size[1]
            sizes.append((min(fan_in, module.out_channels), name, "Conv2d"))
        else:
            raise ValueError(f"lora.target_modules: {name} is a {type(module).__name__}; LoRA adapts Linear and "
                             "Conv2d layers (name those)")
    smallest, name, kind = min(sizes)
    if rank > smallest:
        raise ValueError(f"lora.rank={rank} is larger than the layer {name} ({kind}, smallest dimension {smallest}); "
                         f"lower lora.rank to at most {smallest}")


def _example_names(base: nn.Module) -> str:
    names = [n.rsplit(".", 1)[-1] for n, m in base.named_modules() if isinstance(m, nn.Linear)]
    return ", ".join(list(dict.fromkeys(names))[:6])


def base_digest(base: nn.Module) -> str:
    """SHA-256 of the base network's weights (names, shapes, float32 bytes): what an adapter
    records of the base it was trained on, and checks when it is loaded onto one, for a base that is
    not a family's folder (difftrain's UNet, a checkpoint): kind :data:`FLOAT32`. A family's base
    read from its files is digested as stored instead (:class:`BaseDigest`, ``runtime/stored_digest.py``)."""
    return weights_digest(base)


@dataclass(frozen=True)
class BaseDigest:
    """A LoRA base's digest and its kind (``runtime.stored_digest``: STORED, the files' tensors as stored;
    FLOAT32, the float tensors upcast, as written before), with ``legacy``: how to take the FLOAT32 digest of
    the same base, called only to check a record written the old way (slow: reads the whole base)."""

    value: str
    kind: str = FLOAT32
    legacy: Callable[[], str] | None = None


def check_base_digest(digest: BaseDigest, saved: dict, where: str, base_source: str) -> None:
    """One ValueError unless the base of ``digest`` is the one the LoRA record ``saved`` was trained on. A
    record without ``base_digest_kind`` was written with the FLOAT32 digest: a STORED base is then checked
    by its legacy digest (once: the run goes on recording the STORED one). A record without a digest (a LoRA
    file of another program: ``adapters.read_foreign``) is put on the base it fits, unchecked."""
    if not saved["base_digest"]:
        return
    kind = saved.get("base_digest_kind", FLOAT32)
    value = digest.value
    if kind != digest.kind:
        if kind == FLOAT32 and digest.legacy is not None:
            value = digest.legacy()  # a record written before the stored digest: its own digest, once
        else:
            raise ValueError(f"{where}: this LoRA adapter records the base {saved['base_source']} by the digest of its "
                             f"safetensors files, and {base_source} holds no safetensors weights of its denoiser; "
                             "point model.init_from (or --base) at that base")
    if value != saved["base_digest"]:
        raise ValueError(f"{where} is not the base this LoRA adapter was trained on: it was trained on "
                         f"{saved['base_source']} (digest {saved['base_digest'][:12]}), and {base_source} holds "
                         f"different weights (digest {value[:12]}); point model.init_from (or --base) at that base")


def cast_adapter_input(base: nn.Module, enabled: bool) -> None:
    """Whether peft's adapter layers in ``base`` cast their input to the adapter's dtype (float32) before the
    adapter's matmul (peft's ``cast_input_dtype_enabled``, on by default). Off where the network runs under
    autocast with its base held in bf16/fp16 (:attr:`LoraNetwork.held_dtype`; ``tools/base_memory.py`` counts
    it so): autocast casts the input back for the matmul, so the cast only copies it."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")  # peft not loaded: no adapter layer in base (nor peft needed)
    if tuners is None:
        return
    for module in base.modules():
        if isinstance(module, tuners.BaseTunerLayer):
            module.cast_input_dtype_enabled = enabled


class LoraNetwork(nn.Module):
    """``net(x, t, cond)`` of the base network with LoRA layers injected; only they train.

    ``state_dict`` / ``load_state_dict`` hold the adapter alone (the base is referenced by
    ``base_source`` and ``base_digest``, never saved), under the base's names without peft's
    adapter name. Attributes: ``base`` (the network, adapted in place), ``base_record`` (its
    record as checkpoints keep it), ``base_source``, ``base_digest``, ``rank``, ``alpha``,
    ``dropout``, ``targets``.
    """

    def __init__(self, base: nn.Module, *, base_record: dict, base_source: str, digest: str, rank: int,
                 alpha: float, dropout: float, targets: list[str], kind: str = "lora", digest_kind: str = FLOAT32):
        super().__init__()
        self.base = base
        self.base_record, self.base_source, self.base_digest = base_record, base_source, digest
        self.base_digest_kind = digest_kind
        self.rank, self.alpha, self.dropout, self.targets = rank, alpha, dropout, list(targets)
        self.kind = kind
        for attr in ("num_classes", "context_dim", "in_channels", "out_channels"):
            if hasattr(base, attr):
                setattr(self, attr, getattr(base, attr))

    _held_dtype: torch.dtype | None = None

    @property
    def held_dtype(self) -> torch.dtype | None:
        """The dtype the frozen base is held in (``networks/frozen_dtype.py``: a bf16/fp16 LoRA run's training
        copy), None: as loaded (float32)."""
        return self._held_dtype

    @held_dtype.setter
    def held_dtype(self, dtype: torch.dtype | None) -> None:
        """Set it; with a dtype, peft's layers stop casting their input to the adapter's float32 before
        the adapter's matmul (``cast_input_dtype_enabled``): the network then always runs under autocast
        (:meth:`forward`), which casts it back to ``dtype`` for the matmul, the same values, so the cast
        only made a float32 copy of each adapted layer's input and a second ``dtype`` copy kept for
        backward beside the base layer's (measured: 40-60 MiB of a 129M-parameter Flux LoRA step's
        activations at batch 4, 64 px)."""
        self._held_dtype = dtype
        cast_adapter_input(self.base, dtype is None)

    def forward(self, x: Tensor, t: Tensor, cond: Tensor | None = None) -> Tensor:
        """The base network's call: x (B, C, H, W), t (B,), cond -> (B, C, H, W). A base held in bf16/fp16
        (:attr:`held_dtype`) called outside autocast (validation, held-out loss, FID during training) runs
        under autocast to that dtype and answers in ``x``'s dtype; the training step's own autocast is kept."""
        dtype = self.held_dtype
        if dtype is None or torch.is_autocast_enabled(x.device.type):
            return self.base(x, t, cond)
        with torch.autocast(x.device.type, dtype=dtype):
            return self.base(x, t, cond).to(x.dtype)

    def fsdp_inner(self) -> nn.Module:
        """The network whose blocks FSDP shards as this one's units (``runtime/fsdp.py`` asks for it): the
        adapted base, the adapter's layers lying inside its blocks."""
        return self.base

    # -- the adapter as the state dict ---------------------------------------------------------

    def _adapter(self, keep_vars: bool = True) -> dict[str, Tensor]:
        """Public name -> adapter tensor: peft's ``get_peft_model_state_dict`` of the base (lora_A /
        lora_B, DoRA's magnitude, LoHa's and LoKr's factors of every adapted layer)."""
        from peft import get_peft_model_state_dict  # optional (the lora extra): imported once an adapter exists

        params = dict(self.base.named_parameters())  # named as peft found the layers
        raw_names = {id(t): k for k, t in params.items()}
        state_names = {id(t): k for k, t in self.base.state_dict(keep_vars=True).items()}  # a wrapper's hooks may drop a prefix
        out = {}
        for name, t in get_peft_model_state_dict(self.base, state_dict=params, adapter_name=ADAPTER).items():
            cut = len(raw_names[id(t)]) - len(state_names[id(t)])  # the prefix the base's state dict leaves out
            out[name[cut:]] = t if keep_vars else t.detach()
        return out

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):  # noqa: D102
        out = OrderedDict() if destination is None else destination
        for name, t in self._adapter(keep_vars=True).items():
            out[prefix + name] = t if keep_vars else t.detach()
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # noqa: D102
        own = self._adapter()
        missing, extra = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        if strict and (missing or extra):
            raise RuntimeError(f"adapter weights do not fit this network: missing {missing[:3]}, unknown {extra[:3]}")
        with torch.no_grad():
            for name, t in state_dict.items():
                if name in own:
                    own[name].copy_(t)
        return nn.modules.module._IncompatibleKeys(missing, extra)

    # -- what rebuilds it, and what it does to the base ----------------------------------------

    def settings(self) -> dict:
        out = {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}
        return out if self.kind == "lora" else {**out, "kind": self.kind}  # a plain LoRA's record as before

    def network_record(self) -> dict:
        """The checkpoint's ``network``: kind "lora", the base's own record, where the base was
        loaded from and its digest, and the LoRA settings."""
        record = {"kind": NETWORK_KIND, "base": self.base_record, "base_source": self.base_source,
                  "base_digest": self.base_digest, "lora": self.settings()}
        if self.base_digest_kind != FLOAT32:  # a FLOAT32 digest's record as before (no field: read as FLOAT32)
            record["base_digest_kind"] = self.base_digest_kind
        return record

    def lora_layers(self) -> list[nn.Module]:
        """The adapted layers (peft's tuner layers of every kind)."""
        from peft.tuners.tuners_utils import BaseTunerLayer  # optional (the lora extra)

        return [m for m in self.base.modules() if isinstance(m, BaseTunerLayer)]

    def set_scale(self, scale: float) -> None:
        """Scale the adapter's contribution: 1 as trained, 0 the base alone."""
        for layer in self.lora_layers():
            layer.set_scale(ADAPTER, scale)

    @torch.no_grad()
    def merged_base_state(self) -> dict[str, Tensor]:
        """The base network's state dict (its own names) with the adapter folded into every adapted
        layer's weight by peft's own ``merge`` (W + scale B A; DoRA's m (W + s B A) / ||W + s B A||;
        LoHa's and LoKr's products), each on a copy of its layer; this network is left as it was."""
        from peft.tuners.tuners_utils import BaseTunerLayer  # optional (the lora extra)

        merged_weights = {}
        for name, module in self.base.named_modules():
            if isinstance(module, BaseTunerLayer):
                layer = copy.deepcopy(module)
                layer.merge(adapter_names=[ADAPTER])
                merged_weights[name] = layer.get_base_layer().weight.detach()
        adapter = {id(t) for t in self._adapter(keep_vars=True).values()}
        merged = {}
        for key, t in self.base.state_dict(keep_vars=True).items():
            if id(t) in adapter or f".{ADAPTER}" in key:
                continue
            merged[key.replace(".base_layer.", ".")] = t.detach().clone()
        state_names = _state_names(self.base, merged_weights)
        for module_name, weight in merged_weights.items():
            merged[state_names[module_name] + ".weight"] = weight.clone()
        return merged


def _state_names(base: nn.Module, modules: dict) -> dict[str, str]:
    """Module name -> the prefix its weight has in ``base.state_dict()`` (a wrapper's state-dict
    hooks may rename, as ConditionUNet drops ``unet.``)."""
    keys = set(base.state_dict())
    out = {}
    for name in modules:
        for candidate in (name, name.split(".", 1)[-1]):
            if f"{candidate}.base_layer.weight" in keys:
                out[name] = candidate
                break
        else:
            raise KeyError(f"no weight of the adapted layer {name} in the state dict")
    return out


def apply_lora(base: nn.Module, lora_cfg, *, base_record: dict, base_source: str,
               saved: dict | None = None, where: str = "checkpoint", quantize: str = "off",
               quantize_dtype: torch.dtype = torch.float32,
               digest: str | BaseDigest | None = None) -> LoraNetwork:
    """Freeze ``base`` and inject LoRA layers of ``lora_cfg`` (``cfg.lora``) into it, in place.

    base_record: the base's record (``build.network_record``), which picks the default
    targets; base_source: where its weights came from (``model.init_from``). The adapter starts
    as peft starts it (A random from the global torch RNG, B zero: the network is the base).
    saved: the LoRA record of a checkpoint or adapter file (``where``) to rebuild instead: its
    rank, alpha and targets are used (a resume may change lora.dropout), and ``base`` must be
    the base it was trained on (one ValueError if not).
    quantize: ``model.quantize_base``; other than "off", every Linear layer of the base is held quantized
    (``networks/quantize.py``) after its digest is taken, and peft wraps the quantized layers;
    quantize_dtype: the dtype they compute in (``quantize.compute_dtype(train.precision)``).
    digest: the base's digest taken by the caller: a :class:`BaseDigest` (a family's base, digested from its
    files as stored: ``networks/build.py``), or the :func:`base_digest` of a base on the meta device (its
    weights read from its files one tensor at a time); None: :func:`base_digest`, taken here. A saved record is
    checked by :func:`check_base_digest`.
    """
    import_peft()
    targets = target_modules(lora_cfg, base_record)
    rank, alpha, dropout = lora_cfg.rank, lora_cfg.alpha or float(lora_cfg.rank), lora_cfg.dropout
    kind = getattr(lora_cfg, "kind", "lora")
    if saved is not None:
        s = saved["lora"]
        targets, rank, alpha, kind = list(s["targets"]), int(s["rank"]), float(s["alpha"]), record_kind(saved)
    _check_targets(base, targets, rank)
    if not isinstance(digest, BaseDigest):
        digest = BaseDigest(digest or base_digest(base))
    if saved is not None:
        check_base_digest(digest, saved, where, base_source)
    base.requires_grad_(False)
    quantize_base(base, quantize, quantize_dtype)  # the digest above is the unquantized base's: the adapter's
    with warnings.catch_warnings():  # fp8: peft's torchao layer cannot merge; an export merges on the float32 base
        warnings.filterwarnings("ignore", message="TorchaoLoraLinear was instantiated without")
        import_peft().inject_adapter_in_model(peft_config(kind, rank, alpha, dropout, targets, lora_cfg.init), base)
    # peft gives an adapter the dtype of the weight it wraps: bf16 over an nf4 layer not yet on the GPU (bitsandbytes
    # quantizes as it moves there). The adapter trains in float32 (CUDA's GradScaler refuses bf16 gradients).
    from peft.tuners.tuners_utils import cast_adapter_dtype  # optional (the lora extra), loaded by import_peft above

    cast_adapter_dtype(base, ADAPTER)
    return LoraNetwork(base, base_record=base_record, base_source=base_source, digest=digest.value, rank=rank,
                       alpha=alpha, dropout=dropout, targets=targets, kind=kind, digest_kind=digest.kind)


def peft_config(kind: str, rank: int, alpha: float, dropout: float, targets: list[str], init: str = "gaussian"):
    """peft's config of an adapter of ``kind`` (:data:`KINDS`): LoraConfig (``use_dora`` for DoRA),
    LoHaConfig or LoKrConfig, with the rank, alpha (scale alpha / rank) and target modules given.
    ``init``: "gaussian" or "default" (LoRA and DoRA; LoHa and LoKr start as peft starts them, the
    adapter's output zero)."""
    peft = import_peft()
    if kind in ("lora", "dora"):
        return peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                               use_dora=kind == "dora", init_lora_weights=True if init == "default" else init)
    return getattr(peft, KINDS[kind])(r=rank, alpha=alpha, target_modules=targets, init_weights=True)


def record_kind(record: dict) -> str:
    """The ``lora.kind`` of a LoRA network record ("lora" for records written before the key)."""
    return record["lora"].get("kind", "lora")


def resume_mismatch(lora_cfg, record: dict) -> str | None:
    """Why a checkpoint's network (``record``) cannot continue under ``lora_cfg`` (``cfg.lora``):
    a LoRA run resumed without LoRA or the reverse, or another rank, alpha or set of targets;
    None when it can."""
    was_lora = is_lora_record(record)
    if was_lora != bool(lora_cfg.rank):
        return ("it holds a LoRA adapter, but lora.rank is 0 (full fine-tuning)" if was_lora else
                f"it is not a LoRA run, but lora.rank is {lora_cfg.rank}")
    if not was_lora:
        return None
    saved = record["lora"]
    now = {"kind": getattr(lora_cfg, "kind", "lora"), "rank": lora_cfg.rank,
           "alpha": lora_cfg.alpha or float(lora_cfg.rank), "targets": target_modules(lora_cfg, record["base"])}
    for key, value in now.items():
        before = record_kind(record) if key == "kind" else saved[key]  # a plain LoRA's record has no "kind"
        if before != value:
            return f"its adapter has {key} {before!r}, this config {value!r} (lora.*)"
    return None
