"""Which LoRA file loads where, at the trained strength (issue 39): every family (SD, SDXL, SD3, Flux) x
layout (diffusers, kohya, difftrain) x kind (lora, dora, loha, lokr), on the tiny bases, each adapter
built with peft directly (rank 4, alpha 8: scale 2, so a reader that drops alpha is caught). Each written
file is checked against ComfyUI's key mapping and strength rules (tests/comfyui_rules.py, facts from
ComfyUI's source) and against diffusers' ``load_lora_weights``, to 1e-4 of peft's merged weight; and read
back by difftrain. The matrix below is docs/lora_files.md's table."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.interop.adapters import LORA_LAYOUTS, Adapter, default_layout, where_it_loads  # noqa: E402
from difftrain.config import config_to_dict, load_config  # noqa: E402
from difftrain.families import detect  # noqa: E402
from difftrain.networks.lora_import import read_adapter  # noqa: E402
from difftrain.networks.lora import apply_lora  # noqa: E402
from tests.comfyui_rules import comfyui_apply  # noqa: E402
from tests.family_bases import write_tiny_flux_folder, write_tiny_sd3_folder, write_tiny_sdxl_folder  # noqa: E402
from tests.text_components import write_tiny_sd_folder  # noqa: E402

BASES = {"sd": write_tiny_sd_folder, "sdxl": write_tiny_sdxl_folder, "sd3": write_tiny_sd3_folder,
         "flux": write_tiny_flux_folder}
KINDS = ("lora", "dora", "loha", "lokr")
UNETS = ("sd", "sdxl")


def loads_in(family: str, layout: str, kind: str) -> set[str] | None:
    """The programs a ``layout`` file of a ``kind`` adapter on ``family`` loads in at the trained strength
    (besides difftrain, which reads every file it writes); None: the export refuses it in one line."""
    if layout == "difftrain":
        return set()
    if layout == "diffusers":
        if kind in ("loha", "lokr"):
            return None
        return {"diffusers"} if kind == "dora" or family in UNETS else {"diffusers", "comfyui"}
    if kind == "dora" or (kind == "lora" and family not in UNETS):
        return None
    return {"diffusers", "comfyui"} if kind == "lora" else {"comfyui"}


@pytest.fixture(scope="module", params=list(BASES))
def base(request, tmp_path_factory):
    """(family name, family, folder, the family's pipeline loaded from it)."""
    folder = BASES[request.param](tmp_path_factory.mktemp(request.param) / "base")
    family = detect(folder)
    pipe = getattr(diffusers, family.pipeline_class).from_pretrained(str(folder))
    return request.param, family, folder, pipe


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


def _adapter(name, family, folder, kind, root, rank=4):
    """A random adapter of ``kind`` (``rank``, alpha 8) on the family's denoiser, as difftrain trains it (apply_lora):
    the Adapter the writers take, the base weights and peft's merged weights of the adapted modules."""
    cfg = load_config(None, [f"model.init_from={folder}", f"lora.rank={rank}", "lora.alpha=8", f"lora.kind={kind}"])
    denoiser = family.load_denoiser(folder)
    net = apply_lora(denoiser, cfg.lora, base_record=denoiser.record(), base_source=str(folder))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, p in net.state_dict(keep_vars=True).items():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(p * (1 + 0.1 * noise) if "magnitude" in key else 0.1 * noise)
    model = denoiser.model
    base = {n: m.get_base_layer().weight.detach().clone() for n, m in _adapted(model).items()}
    adapter = Adapter({k: v.clone() for k, v in net.state_dict().items()}, net.network_record(), config_to_dict(cfg),
                      {}, 0, str(root / f"{name}-{kind}"), "raw")
    return adapter, base, _merged(model)


# LoKr at rank 4 keeps both Kronecker factors whole on these tiny layers (ComfyUI then ignores alpha); at rank 2
# peft decomposes the larger factor of the UNets' layers (lokr_w2_a @ lokr_w2_b: ComfyUI scales by alpha / rank).
@pytest.mark.parametrize("kind, rank", [(k, 4) for k in KINDS] + [("lokr", 2)])
def test_each_layout_loads_where_the_docs_say_at_the_trained_strength(base, tmp_path, kind, rank):
    from safetensors.torch import load_file

    name, family, folder, pipe = base
    adapter, weights, want = _adapter(name, family, folder, kind, tmp_path, rank)
    denoiser = pipe.unet if name in UNETS else pipe.transformer
    for layout, write in LORA_LAYOUTS.items():
        where = loads_in(name, layout, kind)
        if where is None:
            with pytest.raises(ValueError, match=f"lora.kind={kind} adapter has no {layout} layout|export --layout") as e:
                write(adapter, tmp_path / layout)
            assert "\n" not in str(e.value)
            continue
        out = write(adapter, tmp_path / layout)
        file = out / "pytorch_lora_weights.safetensors"
        # difftrain reads back the adapter it wrote
        back = read_adapter(out)["tensors"]
        assert set(back) == set(adapter.tensors), layout
        assert all(torch.allclose(back[k], adapter.tensors[k], rtol=1e-6, atol=0) for k in back), layout
        # ComfyUI: every key mapped and consumed, every adapted module at peft's merged weight
        applied = comfyui_apply(load_file(str(file)), name, weights)
        exact = (not applied.not_loaded and set(applied.weights) == set(want)
                 and max((applied.weights[m] - want[m]).abs().max().item() for m in want) < 1e-4)
        assert exact == ("comfyui" in where), (layout, applied.not_loaded[:3], sorted(set(want) - set(applied.weights))[:3])
        # diffusers: load_lora_weights on the base gives peft's merged weights
        try:
            pipe.load_lora_weights(str(out))
            got = _merged(denoiser)
            same = set(got) == set(want) and max((got[m] - want[m]).abs().max().item() for m in want) < 1e-4
        except (ValueError, KeyError, RuntimeError, NotImplementedError):
            same = False
        finally:
            pipe.unload_lora_weights()
        assert same == ("diffusers" in where), layout
        # the note at export names what does not load it
        note = where_it_loads(adapter.record, layout) or ""
        if layout == "difftrain":
            assert note.startswith("loads in difftrain only"), note
        else:
            assert ("not in ComfyUI" in note) == ("comfyui" not in where), (layout, note)
            assert ("not in diffusers" in note) == ("diffusers" not in where), (layout, note)
        assert "\n" not in note
    # The default layout is one that loads in the most programs.
    best = max(len(loads_in(name, layout, kind) or ()) for layout in LORA_LAYOUTS)
    assert len(loads_in(name, default_layout(adapter.record), kind)) == best
