"""The families of 2026 in ComfyUI (issue 42 item 4): each family's LoRA export, in the layout ``export --format lora``
writes by default, is applied by ComfyUI's rules (tests/comfyui_rules.py, facts from ComfyUI's source) at the trained
strength, every key mapped, on every family ComfyUI has a loader for; the export's one-line note says which families
it does not load in. And LoRA files in ComfyUI's layouts (``diffusion_model.`` + its own names, kohya's ``lora_unet_``)
are read by ``sample --lora FILE --base FOLDER`` (``load_model``) at the strength ComfyUI applies them.
Tiny random bases (tests/family_bases_*.py); rank 4, alpha 8 (scale 2, so a reader that drops alpha is caught)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.config import config_to_dict, load_config  # noqa: E402
from difftrain.families import detect  # noqa: E402
from difftrain.interop.adapters import LORA_LAYOUTS, Adapter, default_layout, where_it_loads  # noqa: E402
from difftrain.networks.lora import apply_lora  # noqa: E402
from difftrain.networks.lora_import import read_adapter  # noqa: E402
from tests.comfyui_rules import comfyui_apply  # noqa: E402
from tests.family_bases_auraflow import write_tiny_auraflow_folder  # noqa: E402
from tests.family_bases_chroma import write_tiny_chroma_folder  # noqa: E402
from tests.family_bases_flux2 import write_tiny_flux2_folder, write_tiny_flux2_klein_folder  # noqa: E402
from tests.family_bases_flux_kontext import write_tiny_flux_kontext_folder  # noqa: E402
from tests.family_bases_gemma import write_tiny_lumina2_folder, write_tiny_sana_folder  # noqa: E402
from tests.family_bases_hidream import write_tiny_hidream_folder  # noqa: E402
from tests.family_bases_pixart import write_tiny_pixart_folder  # noqa: E402
from tests.family_bases_qwen_image import write_tiny_qwen_image_folder  # noqa: E402
from tests.family_bases_z_image import write_tiny_z_image_folder  # noqa: E402

BASES = {"flux-kontext": write_tiny_flux_kontext_folder, "flux2": write_tiny_flux2_folder,
         "flux2-klein": write_tiny_flux2_klein_folder, "chroma": write_tiny_chroma_folder,
         "qwen-image": write_tiny_qwen_image_folder, "z-image": write_tiny_z_image_folder,
         "lumina2": write_tiny_lumina2_folder, "hidream": write_tiny_hidream_folder,
         "auraflow": write_tiny_auraflow_folder, "pixart-sigma": write_tiny_pixart_folder, "sana": write_tiny_sana_folder}
# The layouts whose names ComfyUI maps for each family (docs/lora_files.md): the diffusers layout's transformer.<module>
# on all but Lumina 2 (ComfyUI's Lumina2 maps Z-Image's attention. names, not Lumina 2's attn.) and Sana (no model
# class); the kohya layout's lora_transformer_ (Flux classes) or lycoris_ (Qwen-Image, Z-Image, HiDream) names.
COMFYUI = {name: {"diffusers", "kohya"} for name in BASES}
COMFYUI.update({"auraflow": {"diffusers"}, "pixart-sigma": {"diffusers"}, "lumina2": set(), "sana": set()})


@pytest.fixture(scope="module", params=list(BASES))
def base(request, tmp_path_factory):
    """(family name, family, base folder)."""
    folder = BASES[request.param](tmp_path_factory.mktemp(request.param) / "base")
    family = detect(folder)
    assert family.name == request.param
    return request.param, family, folder


def _adapted(model) -> dict[str, torch.nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)}


def _merged(model) -> dict[str, torch.Tensor]:
    """{module: its weight with the adapter merged by peft} of every adapted layer of ``model``."""
    out = {}
    for name, layer in _adapted(model).items():
        layer = copy.deepcopy(layer)
        layer.merge()
        out[name] = layer.get_base_layer().weight.detach()
    return out


def _adapter(family, folder, kind, root):
    """A random ``kind`` adapter (rank 4, alpha 8, the family's default targets) as difftrain trains it: the Adapter
    the writers take, the base weights and peft's merged weights of the adapted modules."""
    cfg = load_config(None, [f"model.init_from={folder}", "lora.rank=4", "lora.alpha=8", f"lora.kind={kind}"])
    denoiser = family.load_denoiser(folder)
    net = apply_lora(denoiser, cfg.lora, base_record=denoiser.record(), base_source=str(folder))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in net.state_dict(keep_vars=True).values():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    base = {n: m.get_base_layer().weight.detach().clone() for n, m in _adapted(denoiser.model).items()}
    adapter = Adapter({k: v.clone() for k, v in net.state_dict().items()}, net.network_record(), config_to_dict(cfg),
                      {}, 0, str(root / kind), "raw")
    return adapter, base, _merged(denoiser.model)


@pytest.mark.parametrize("kind", ["lora", "loha", "lokr"])
def test_the_default_lora_export_of_each_new_family_loads_in_comfyui_at_the_trained_strength(base, tmp_path, kind):
    """The default layout's file, applied by ComfyUI's rules: every key mapped and consumed, every adapted module at
    peft's merged weight (1e-4), on the families whose names ComfyUI maps; the export's note says "not in ComfyUI"
    exactly where it does not (Lumina 2, Sana; LoHa and LoKr on AuraFlow and PixArt too)."""
    from safetensors.torch import load_file

    name, family, folder = base
    adapter, weights, want = _adapter(family, folder, kind, tmp_path)
    layout = default_layout(adapter.record)
    assert layout == ("diffusers" if kind == "lora" else "kohya")
    out = LORA_LAYOUTS[layout](adapter, tmp_path / layout)
    file = out / "pytorch_lora_weights.safetensors"
    back = read_adapter(out)["tensors"]  # difftrain reads back the adapter it wrote (the lycoris_ names too)
    assert set(back) == set(adapter.tensors)
    assert all(torch.allclose(back[k], adapter.tensors[k], rtol=1e-6, atol=0) for k in back)
    applied = comfyui_apply(load_file(str(file)), name, weights)
    exact = (not applied.not_loaded and set(applied.weights) == set(want)
             and max((applied.weights[m] - want[m]).abs().max().item() for m in want) < 1e-4)
    assert exact == (layout in COMFYUI[name]), (layout, applied.not_loaded[:3], sorted(set(want) - set(applied.weights))[:3])
    if layout not in COMFYUI[name]:
        assert not applied.weights, "ComfyUI maps none of it: nothing applied, every key 'not loaded'"
    note = where_it_loads(adapter.record, layout) or ""
    assert ("not in ComfyUI" in note or "difftrain only" in note) == (layout not in COMFYUI[name]), note
    assert "\n" not in note


def _linear_weights(model) -> dict[str, torch.Tensor]:
    return {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _comfyui_file(name: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA file in a layout ComfyUI writes and maps for ``name``, random rank-4 factors: FLUX.2's BFL names
    (``diffusion_model.double_blocks.0.img_attn.qkv``: q, k, v in one fused weight; ``single_blocks.0.linear1`` /
    ``linear2``; ai-toolkit's and ComfyUI's own, lora_A / lora_B and no alpha), Qwen-Image's kohya names
    (``lora_unet_transformer_blocks_0_attn_to_q`` with an alpha of 8), Z-Image's ``diffusion_model.layers.0.attention.
    to_q`` (lora_down / lora_up, alpha 8)."""
    g = torch.Generator().manual_seed(3)
    rank, out = 4, {}

    def pair(key, rows, cols, down="lora_down.weight", up="lora_up.weight", alpha=8.0):
        out[f"{key}.{down}"] = 0.1 * torch.randn(rank, cols, generator=g)
        out[f"{key}.{up}"] = 0.1 * torch.randn(rows, rank, generator=g)
        if alpha is not None:
            out[f"{key}.alpha"] = torch.tensor(alpha)

    w = weights
    if name == "flux2":
        q, o = w["transformer_blocks.0.attn.to_q"], w["single_transformer_blocks.0.attn.to_out"]
        lin1 = w["single_transformer_blocks.0.attn.to_qkv_mlp_proj"]
        ab = {"down": "lora_A.weight", "up": "lora_B.weight", "alpha": None}
        pair("diffusion_model.double_blocks.0.img_attn.qkv", 3 * q.shape[0], q.shape[1], **ab)
        pair("diffusion_model.double_blocks.0.img_attn.proj", *w["transformer_blocks.0.attn.to_out.0"].shape, **ab)
        pair("diffusion_model.single_blocks.0.linear1", *lin1.shape, **ab)
        pair("diffusion_model.single_blocks.0.linear2", *o.shape, **ab)
    elif name == "qwen-image":
        for m in ("to_q", "to_k", "to_v", "to_out.0"):
            pair(f"lora_unet_transformer_blocks_0_attn_{m.replace('.', '_')}", *w[f"transformer_blocks.0.attn.{m}"].shape)
    else:  # z-image
        for block in ("layers.0", "layers.1", "noise_refiner.0", "context_refiner.0"):
            for m in ("to_q", "to_k", "to_v", "to_out.0"):
                pair(f"diffusion_model.{block}.attention.{m}", *w[f"{block}.attention.{m}"].shape)
    return out


@pytest.mark.parametrize("name", ["flux2", "qwen-image", "z-image"])
def test_a_comfyui_layout_file_samples_at_the_strength_comfyui_applies(tmp_path, name):
    """``sample --lora FILE --base FOLDER`` (load_model) reads a file in ComfyUI's layout for FLUX.2, Qwen-Image and
    Z-Image: every module ComfyUI patches is adapted, and its merged weight is the one ComfyUI runs (1e-4)."""
    from safetensors.torch import save_file

    from difftrain.generation.inference import load_model

    folder = BASES[name](tmp_path / "base")
    if name == "z-image":  # load_model's probe runs at the pipeline's 1024 px (no sample_size): 64 x 64 patches
        config = folder / "transformer" / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "axes_lens": [256, 128, 128]}))
    family = detect(folder)
    weights = _linear_weights(family.load_denoiser(folder).model)
    file = _comfyui_file(name, weights)
    applied = comfyui_apply(file, name, weights)
    assert not applied.not_loaded and applied.weights, applied.not_loaded[:3]
    path = tmp_path / "comfy.safetensors"
    save_file(file, str(path))
    loaded = load_model(None, lora=path, base=str(folder), device="cpu")
    got = {}
    for n, w in _merged(loaded.model).items():  # every module difftrain adapted is one ComfyUI patches
        match = [m for m in applied.weights if n == m or n.endswith("." + m)]
        assert len(match) == 1, n
        got[match[0]] = w
    assert set(got) == set(applied.weights)
    worst = max((got[m] - applied.weights[m]).abs().max().item() for m in got)
    assert worst < 1e-4, worst
