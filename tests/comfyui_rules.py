"""ComfyUI's LoRA loading rules, as facts, to check difftrain's LoRA files against offline (no ComfyUI here).

    applied = comfyui_apply(file_tensors, "flux", base_weights)   # {module: the weight ComfyUI would run}
    applied.not_loaded                                             # the file's keys ComfyUI would skip

Facts read from ComfyUI's source, Comfy-Org/ComfyUI at a125cd84b054a57729b5eecab930ca9408719832
(2025-10-12): comfy/lora.py (``model_lora_keys_unet``: which key names map to a denoiser weight;
``load_lora``: the ``.alpha`` / ``.dora_scale`` tensors and the adapter classes tried per key),
comfy/utils.py (``unet_to_diffusers``, ``mmdit_to_diffusers``, ``flux_to_diffusers``: which diffusers
modules it maps), comfy/weight_adapter/{lora,loha,lokr,base}.py (``calculate_weight``,
``weight_decompose``), comfy/lora_convert.py (``convert_lora``: no conversion applies to these files).
Written here independently from those facts (ComfyUI is GPL; none of its code is in difftrain).

The rules:

* A key ``x`` of the file is a module ComfyUI knows when ``x`` is one of the names below of a diffusers
  module its maps cover (module path ``m``, ``m_`` = ``m`` with "." -> "_"):
  SD / SDXL (a UNet): ``lora_unet_<m_>``, ``lycoris_<m_>``, and the old diffusers ``[unet.]<m with
  .to_ -> .processor.to_, a trailing .to_out.0 -> .to_out>``; never ``unet.<m>`` (peft's names).
  SD3: ``transformer.<m>``, ``base_model.model.<m>``, ``lora_transformer_<m_>``, ``lycoris_<m_>``.
  Flux: ``transformer.<m>``, ``lycoris_<m_>``, ``lora_transformer_<m_>``.
* The families of 2026, read from Comfy-Org/ComfyUI's comfy/lora.py at ec93dcacb96b922f7cb1417b3ba22bccb082df32
  (``model_lora_keys_unet``), comfy/utils.py at 09708eae709a992a5684bed3595ce4d07e705b4e (``flux_to_diffusers``,
  ``z_image_to_diffusers``, ``auraflow_to_diffusers``, ``pixart_to_diffusers``), comfy/model_base.py (``Flux2`` and
  ``Chroma`` subclass ``Flux``), comfy/lora_convert.py at 2bffe2f4ce5763dcb83df6a670657b6d5c8f85a5 (``convert_lora``:
  BFL control, Wan Fun, USO and fused ``attn.to_qkv`` files only; none of difftrain's):
  every model: ``diffusion_model.<n>`` and ``lora_unet_<n_>`` for each weight ``n`` of ComfyUI's own network (its
  native names: BFL's ``double_blocks.N.img_attn.qkv`` for the Flux classes, ``layers.N.attention.qkv`` for
  NextDiT). Flux classes (FLUX.1, Kontext, FLUX.2 and klein, Chroma): ``transformer.<m>``, ``lycoris_<m_>``,
  ``lora_transformer_<m_>`` and ``<m>`` for the diffusers modules of ``flux_to_diffusers`` (FLUX.2's ``ff.linear_in``
  / ``linear_out``, single blocks' ``attn.to_qkv_mlp_proj`` and ``attn.to_out`` included). QwenImage: ``<n>``,
  ``transformer.<n>``, ``lycoris_<n_>`` of its native names, which are diffusers' (``transformer_blocks.N.attn.to_q``).
  Lumina2 (Lumina 2 and Z-Image, both NextDiT): ``diffusion_model.<m>``, ``transformer.<m>``, ``lycoris_<m_>``, ``<m>``
  for ``z_image_to_diffusers``' modules, Z-Image's diffusers names (``layers.N.attention.to_q``; q, k, v as slices
  of ``dim`` rows of the fused qkv); Lumina 2's diffusers names (``layers.N.attn.to_q``) are none of them. HiDream:
  ``transformer.<n>``, ``lycoris_<n_>`` of its native names, which are diffusers' (``double_stream_blocks.N.block.
  attn1.to_q``). AuraFlow: ``transformer.<m>`` of ``auraflow_to_diffusers``. PixArt: ``transformer.<m>``,
  ``base_model.model.<m>``, ``unet.base_model.model.<m>`` of ``pixart_to_diffusers``. Sana: no model class (no
  loader at all).
* Per known ``x``: alpha = ``x.alpha`` (a number) if present; every adapter kind is tried:
  LoRA: up / down = ``x.lora_up.weight`` / ``x.lora_down.weight``, or ``x_lora.up.weight`` /
  ``x_lora.down.weight``, or ``x.lora_B.weight`` / ``x.lora_A.weight`` (and three rarer pairs);
  delta = (alpha / rank) up @ down, rank = down's first dimension; scale 1 without an alpha tensor.
  LoHa: ``x.hada_w1_a, hada_w1_b, hada_w2_a, hada_w2_b``; delta = (alpha / hada_w1_b's first dim)
  (w1a @ w1b) * (w2a @ w2b); 1 without alpha.
  LoKr: ``x.lokr_w1`` or ``lokr_w1_a @ lokr_w1_b``, ``x.lokr_w2`` or ``lokr_w2_a @ lokr_w2_b``;
  delta = s kron(w1, w2), s = alpha / dim where dim is the first dimension of the last decomposed
  factor's ``_b`` (w2's if decomposed, else w1's), and s = 1 when neither is decomposed or no alpha.
  DoRA (``x.dora_scale``, shape (out, 1) or (1, in)): W' = dora_scale (W + delta) / (n + eps), n the
  row norms of the BASE weight W when dora_scale's first dim is out, else the column norms of
  W + delta (peft's DoRA: m (W + delta) / row norms of W + delta).
* Every key of the file not consumed above is logged "lora key not loaded" and ignored.
* Strength 1 (the LoraLoader node's default): W' = W + delta.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import Tensor

_ATTN = r"(to_q|to_k|to_v|to_out\.0)"
_UNET_BLOCK = r"(down_blocks\.\d+|up_blocks\.\d+|mid_block)"
# comfy/utils.py unet_to_diffusers: UNET_MAP_ATTENTIONS, TRANSFORMER_BLOCKS, UNET_MAP_RESNET, UNET_MAP_BASIC.
UNET_MODULES = [
    rf"{_UNET_BLOCK}\.attentions\.\d+\.transformer_blocks\.\d+\.(attn1|attn2)\.{_ATTN}",
    rf"{_UNET_BLOCK}\.attentions\.\d+\.transformer_blocks\.\d+\.(ff\.net\.0\.proj|ff\.net\.2|norm1|norm2|norm3)",
    rf"{_UNET_BLOCK}\.attentions\.\d+\.(proj_in|proj_out|norm)",
    rf"{_UNET_BLOCK}\.resnets\.\d+\.(conv1|conv2|time_emb_proj|conv_shortcut|norm1|norm2)",
    r"down_blocks\.\d+\.downsamplers\.0\.conv", r"up_blocks\.\d+\.upsamplers\.0\.conv",
    r"(conv_in|conv_out|conv_norm_out|(time_embedding|add_embedding|class_embedding)\.linear_[12])",
]
# comfy/utils.py mmdit_to_diffusers (MMDIT_MAP_BLOCK, MMDIT_MAP_BASIC; qkv and attn2 slices).
SD3_MODULES = [
    r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj|to_out\.0|to_add_out)",
    rf"transformer_blocks\.\d+\.attn2\.{_ATTN}",
    r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.(0\.proj|2)",
    r"transformer_blocks\.\d+\.(norm1|norm1_context)\.linear",
    r"(context_embedder|pos_embed\.proj|proj_out|norm_out\.linear|time_text_embed\.(timestep|text)_embedder\.linear_[12])",
]
# comfy/utils.py flux_to_diffusers (double and single blocks; qkv and linear1 slices).
FLUX_MODULES = [
    r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj|to_out\.0|to_add_out)",
    r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.(0\.proj|2)",
    r"transformer_blocks\.\d+\.(norm1|norm1_context)\.linear",
    r"single_transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v)",
    r"single_transformer_blocks\.\d+\.(proj_mlp|proj_out|norm\.linear)",
    r"(x_embedder|context_embedder|proj_out|norm_out\.linear|time_text_embed\.(timestep|text|guidance)_embedder\.linear_[12])",
]


def _old_diffusers(m: str) -> str:
    name = m.replace(".to_", ".processor.to_")
    return name[:-2] if name.endswith(".to_out.0") else name


# comfy/utils.py flux_to_diffusers, FLUX.2's rows: its feed-forward and single blocks' fused projections.
FLUX_MODULES += [
    r"transformer_blocks\.\d+\.(ff|ff_context)\.(linear_in|linear_out)",
    r"single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)",
]
# comfy/lora.py's QwenImage branch: every weight of its network, whose names are diffusers'.
QWEN_MODULES = [
    r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj|to_out\.0|to_add_out)",
    r"transformer_blocks\.\d+\.(img_mlp|txt_mlp)\.net\.(0\.proj|2)", r"transformer_blocks\.\d+\.(img_mod|txt_mod)\.1",
    r"(img_in|txt_in|proj_out|norm_out\.linear|time_text_embed\.timestep_embedder\.linear_[12])",
]
# comfy/utils.py z_image_to_diffusers (layers, context_refiner, noise_refiner; q, k, v slices of attention.qkv).
NEXTDIT_MODULES = [
    (r"(layers|context_refiner|noise_refiner)\.\d+\.(attention\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.(w1|w2|w3)"
     r"|adaLN_modulation\.0)"),
    r"(all_final_layer\.2-1\.(linear|adaLN_modulation\.1)|all_x_embedder\.2-1|cap_embedder\.1|t_embedder\.mlp\.[02])",
]
# comfy/lora.py's HiDream branch: every weight of its network (comfy/ldm/hidream/model.py), named as diffusers'.
HIDREAM_MODULES = [
    r"(double_stream_blocks|single_stream_blocks)\.\d+\.block\.attn1\.(to_q|to_k|to_v|to_out)(_t)?",
    (r"(double_stream_blocks|single_stream_blocks)\.\d+\.block\.(adaLN_modulation\.1|ff_t\.(w1|w2|w3)"
     r"|ff_i\.(shared_experts|experts\.\d+)\.(w1|w2|w3))"),
]
# comfy/utils.py auraflow_to_diffusers.
AURAFLOW_MODULES = [
    r"joint_transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",
    r"joint_transformer_blocks\.\d+\.(ff|ff_context)\.(linear_1|linear_2|out_projection)",
    r"joint_transformer_blocks\.\d+\.(norm1|norm1_context)\.linear",
    r"single_transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0)|norm1\.linear|ff\.(linear_1|linear_2|out_projection))",
    r"(time_step_proj\.linear_[12]|context_embedder|pos_embed\.proj|proj_out|norm_out\.linear)",
]
# comfy/utils.py pixart_to_diffusers (attn1's q, k, v slices of attn.qkv; attn2's k, v of cross_attn.kv_linear).
PIXART_MODULES = [
    r"transformer_blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)", r"transformer_blocks\.\d+\.ff\.net\.(0\.proj|2)",
    (r"(adaln_single\.emb\.(resolution_embedder|aspect_ratio_embedder|timestep_embedder)\.linear_[12]|pos_embed\.proj"
     r"|caption_projection\.linear_[12]|adaln_single\.linear|proj_out)"),
]


# comfy/utils.py flux_to_diffusers read backwards: (block kind, ComfyUI's native weight in that block, the block's
# diffusers modules whose weights stacked by rows are it). FLUX.1 and FLUX.2 name some differently: both listed.
FLUX_NATIVE = [
    ("double", "img_attn.qkv", ["attn.to_q", "attn.to_k", "attn.to_v"]),
    ("double", "txt_attn.qkv", ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"]),
    ("double", "img_attn.proj", ["attn.to_out.0"]), ("double", "txt_attn.proj", ["attn.to_add_out"]),
    ("double", "img_mlp.0", ["ff.linear_in"]), ("double", "img_mlp.0", ["ff.net.0.proj"]),
    ("double", "img_mlp.2", ["ff.linear_out"]), ("double", "img_mlp.2", ["ff.net.2"]),
    ("double", "txt_mlp.0", ["ff_context.linear_in"]), ("double", "txt_mlp.0", ["ff_context.net.0.proj"]),
    ("double", "txt_mlp.2", ["ff_context.linear_out"]), ("double", "txt_mlp.2", ["ff_context.net.2"]),
    ("single", "linear1", ["attn.to_qkv_mlp_proj"]), ("single", "linear1", ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"]),
    ("single", "linear2", ["attn.to_out"]), ("single", "linear2", ["proj_out"]),
]
FLUX_BLOCKS = {"double": ("transformer_blocks", "double_blocks"), "single": ("single_transformer_blocks", "single_blocks")}


def _flux_native(modules: list[str]) -> dict[str, list[str]]:
    """ComfyUI's own (BFL) names of a Flux-class network's weights, each the diffusers modules whose weights, stacked
    by rows, are that weight (:data:`FLUX_NATIVE`): ``double_blocks.N.img_attn.qkv`` = to_q, to_k, to_v...; a single
    block's ``linear1`` = FLUX.2's ``attn.to_qkv_mlp_proj`` (FLUX.1's to_q, to_k, to_v, proj_mlp), ``linear2`` =
    FLUX.2's ``attn.to_out`` (FLUX.1's ``proj_out``)."""
    have, out = set(modules), {}
    blocks = {(kind, g[1]) for m in modules for kind, (ours, _) in FLUX_BLOCKS.items()
              if (g := re.match(rf"{ours}\.(\d+)\.", m))}
    for kind, i in blocks:
        ours, theirs = FLUX_BLOCKS[kind]
        for k, native, parts in FLUX_NATIVE:
            if k == kind and all(f"{ours}.{i}.{p}" in have for p in parts):
                out[f"{theirs}.{i}.{native}"] = [f"{ours}.{i}.{p}" for p in parts]
    return out


def _nextdit_native(modules: list[str]) -> dict[str, list[str]]:
    """ComfyUI's own (NextDiT) names of Lumina 2's and Z-Image's attention weights: ``<block>.attention.qkv`` = the
    block's to_q, to_k, to_v stacked (Lumina 2's fewer key/value heads included), ``<block>.attention.out`` = to_out.0
    (diffusers' ``attn`` on Lumina 2, ``attention`` on Z-Image)."""
    out = {}
    for m in modules:
        if (g := re.fullmatch(r"((layers|context_refiner|noise_refiner)\.\d+)\.(attn|attention)\.to_q", m)):
            a = f"{g[1]}.{g[3]}"
            out[f"{g[1]}.attention.qkv"] = [f"{a}.to_q", f"{a}.to_k", f"{a}.to_v"]
            out[f"{g[1]}.attention.out"] = [f"{a}.to_out.0"]
    return {n: parts for n, parts in out.items() if all(p in modules for p in parts)}


def _native_keys(native: dict[str, list[str]]) -> dict[str, tuple[str, ...]]:
    """The generic names every ComfyUI model maps (comfy/lora.py model_lora_keys_unet, first loop): ``diffusion_model.<n>``
    and ``lora_unet_<n with _>`` of each native weight ``n``."""
    return {k: tuple(parts) for n, parts in native.items()
            for k in (f"diffusion_model.{n}", f"lora_unet_{n.replace('.', '_')}")}


# family -> (the modules it maps, the key names of a module m) (comfy/lora.py model_lora_keys_unet)
NAMES = {
    "sd": (UNET_MODULES, lambda m: [f"lora_unet_{m.replace('.', '_')}", f"lycoris_{m.replace('.', '_')}",
                                    _old_diffusers(m), "unet." + _old_diffusers(m)]),
    "sd3": (SD3_MODULES, lambda m: [f"transformer.{m}", f"base_model.model.{m}", f"lora_transformer_{m.replace('.', '_')}",
                                    f"lycoris_{m.replace('.', '_')}"]),
    "flux": (FLUX_MODULES, lambda m: [f"transformer.{m}", f"lycoris_{m.replace('.', '_')}",
                                      f"lora_transformer_{m.replace('.', '_')}"]),
}
NAMES["sdxl"] = NAMES["sd"]
for _name in ("flux-kontext", "flux2", "flux2-klein", "chroma"):  # comfy/model_base.py: Flux subclasses
    NAMES[_name] = (FLUX_MODULES, lambda m: [f"transformer.{m}", f"lycoris_{m.replace('.', '_')}",
                                             f"lora_transformer_{m.replace('.', '_')}", m])
NAMES["qwen-image"] = (QWEN_MODULES, lambda m: [m, f"transformer.{m}", f"lycoris_{m.replace('.', '_')}",
                                                f"diffusion_model.{m}", f"lora_unet_{m.replace('.', '_')}"])
for _name in ("z-image", "lumina2"):  # comfy/model_base.py Lumina2: both run as NextDiT
    NAMES[_name] = (NEXTDIT_MODULES, lambda m: [f"diffusion_model.{m}", f"transformer.{m}",
                                                f"lycoris_{m.replace('.', '_')}", m])
NAMES["hidream"] = (HIDREAM_MODULES, lambda m: [f"transformer.{m}", f"lycoris_{m.replace('.', '_')}",
                                                f"diffusion_model.{m}", f"lora_unet_{m.replace('.', '_')}"])
NAMES["auraflow"] = (AURAFLOW_MODULES, lambda m: [f"transformer.{m}"])
NAMES["pixart-sigma"] = (PIXART_MODULES, lambda m: [f"transformer.{m}", f"base_model.model.{m}",
                                                    f"unet.base_model.model.{m}"])
NO_MODEL = ("sana",)  # families ComfyUI has no model class for: no LoRA of theirs loads
# family -> its native weights as stacks of diffusers modules (for the generic diffusion_model. names)
NATIVE = {**{f: _flux_native for f in ("flux", "flux-kontext", "flux2", "flux2-klein", "chroma")},
          "z-image": _nextdit_native, "lumina2": _nextdit_native}

# comfy/weight_adapter/lora.py LoRAAdapter.load: (up, down) name pairs, in the order tried.
LORA_PAIRS = [(".lora_up.weight", ".lora_down.weight"), ("_lora.up.weight", "_lora.down.weight"),
              (".lora_B.weight", ".lora_A.weight"), (".lora.up.weight", ".lora.down.weight"), (".lora_B", ".lora_A"),
              (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
              (".lora_B.default.weight", ".lora_A.default.weight")]
LOHA = (".hada_w1_a", ".hada_w1_b", ".hada_w2_a", ".hada_w2_b")
LOKR = (".lokr_w1", ".lokr_w2", ".lokr_w1_a", ".lokr_w1_b", ".lokr_w2_a", ".lokr_w2_b")


def key_map(family: str, modules: list[str]) -> dict[str, tuple[str, ...]]:
    """ComfyUI's names -> the diffusers modules they patch (one, or several whose weights stacked by rows are one
    weight of ComfyUI's network), for a denoiser whose modules with weights are ``modules`` (diffusers paths)."""
    if family in NO_MODEL:
        return {}
    patterns, names = NAMES[family]
    known = [m for m in modules if any(re.fullmatch(p, m) for p in patterns)]
    out = _native_keys(NATIVE[family](modules)) if family in NATIVE else {}
    return {**out, **{name: (m,) for m in known for name in names(m)}}


@dataclass
class Applied:
    """What ComfyUI does with a file: ``weights`` {module: the weight it runs}; ``not_loaded``: its keys
    it logs as "lora key not loaded"."""

    weights: dict[str, Tensor] = field(default_factory=dict)
    not_loaded: list[str] = field(default_factory=list)


def _delta(x: str, file: dict[str, Tensor], alpha: float | None, used: set[str]) -> Tensor | None:
    """The delta of the adapter of key ``x`` (ComfyUI's rules, float32), or None."""
    f = {k: v.float() for k, v in file.items() if k.startswith(x)}
    delta = None
    for up, down in LORA_PAIRS:
        if x + up in f:
            u, d = f[x + up], f[x + down]
            used.update({x + up, x + down})
            delta = (alpha / d.shape[0] if alpha is not None else 1.0) * (u.flatten(1) @ d.flatten(1))
            break
    if x + LOHA[0] in f:
        w1a, w1b, w2a, w2b = (f[x + n] for n in LOHA)
        used.update(x + n for n in LOHA)
        delta = (alpha / w1b.shape[0] if alpha is not None else 1.0) * ((w1a @ w1b) * (w2a @ w2b))
    if any(x + n in f for n in LOKR):
        used.update(x + n for n in LOKR if x + n in f)
        dim = None
        w1 = f.get(x + ".lokr_w1")
        if w1 is None:
            dim, w1 = f[x + ".lokr_w1_b"].shape[0], f[x + ".lokr_w1_a"] @ f[x + ".lokr_w1_b"]
        w2 = f.get(x + ".lokr_w2")
        if w2 is None:
            dim, w2 = f[x + ".lokr_w2_b"].shape[0], f[x + ".lokr_w2_a"] @ f[x + ".lokr_w2_b"]
        delta = (alpha / dim if alpha is not None and dim is not None else 1.0) * torch.kron(w1, w2)
    return delta


def comfyui_apply(file: dict[str, Tensor], family: str, base: dict[str, Tensor]) -> Applied:
    """The weights ComfyUI's LoraLoader (strength 1) runs with ``file`` on a ``family`` base whose
    module weights are ``base`` ({diffusers module path: weight (out, in)})."""
    out, used = Applied(), set()
    for x, parts in key_map(family, list(base)).items():
        alpha = float(file[x + ".alpha"]) if x + ".alpha" in file else None
        if x + ".alpha" in file:
            used.add(x + ".alpha")
        dora_scale = file.get(x + ".dora_scale")
        if dora_scale is not None:
            used.add(x + ".dora_scale")
        delta = _delta(x, file, alpha, used)
        if delta is None:
            continue
        w = torch.cat([base[m].float() for m in parts])  # one weight of ComfyUI's network (out, in)
        delta = delta.reshape(w.shape)
        if dora_scale is None:
            out.weights.update(zip(parts, (w + delta).split([base[m].shape[0] for m in parts])))
            continue
        module = parts[0]  # DoRA files of these tests name diffusers modules, never a stack
        adapted = w + delta
        eps = torch.finfo(w.dtype).eps
        if dora_scale.shape[0] == w.shape[0]:
            norm = w.reshape(w.shape[0], -1).norm(dim=1, keepdim=True)
        else:
            norm = adapted.reshape(w.shape[0], -1).norm(dim=0, keepdim=True)
        out.weights[module] = adapted * (dora_scale.float() / (norm + eps))  # (out, 1) or (1, in)
    out.not_loaded = sorted(set(file) - used)
    return out
