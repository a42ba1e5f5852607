"""diffusers' own ``quantization_config`` (issue 41 item 6) against difftrain's quantized base
(``networks/quantize.py``): ``library_config`` is the diffusers config of each ``model.quantize_base`` kind, a
family's ``load_denoiser`` takes it, and where diffusers' loader runs here (torchao's fp8, on the CPU) it makes
the very layers ``quantize_base`` makes by hand, bit for bit. Where it does not (bitsandbytes' int8 and nf4 need
a GPU in diffusers' loader), training keeps its own path; docs/fine_tuning.md says why and what was measured."""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("bitsandbytes")
pytest.importorskip("torchao")

from difftrain.families import detect  # noqa: E402
from difftrain.networks.quantize import (  # noqa: E402
    INT8_THRESHOLD,
    NF4_BLOCKSIZE,
    keep_float_modules,
    layer_kind,
    library_config,
    quantize_base,
    quantized_layers,
)
from tests.family_bases import write_tiny_flux_folder  # noqa: E402
from tests.text_components import write_tiny_sd_folder  # noqa: E402

WRITERS = {"flux": write_tiny_flux_folder, "sd": write_tiny_sd_folder}


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """A layer's own tensors as stored: an fp8 weight's float8 data and per-row scales, else the tensor."""
    out = []
    for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
        out += [t.qdata, t.scale] if type(t).__name__ == "Float8Tensor" else [t]
    return out


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_diffusers_torchao_config_makes_the_fp8_base_quantize_base_makes(tmp_path, family):
    """A tiny Flux transformer and a tiny SD UNet loaded by their family with diffusers' ``TorchAoConfig``
    (``library_config("fp8")``) against the float32 denoiser quantized by ``quantize_base``: the same layers
    held in fp8, every tensor of every module (float8 data, scales, the float layers) equal, bit for bit, and
    peft's LoRA on the family's targets the same torchao LoRA layer over both."""
    folder = WRITERS[family](tmp_path / family)
    fam = detect(folder)
    ours = fam.load_denoiser(folder)
    assert quantize_base(ours, "fp8", torch.bfloat16) > 0
    theirs = fam.load_denoiser(folder, library_config("fp8", torch.bfloat16, keep_float_modules(ours.model, "fp8")))
    assert quantized_layers(theirs) == quantized_layers(ours) != {}
    mine, library = dict(ours.named_modules()), dict(theirs.named_modules())
    assert mine.keys() == library.keys()
    for name, module in mine.items():
        a, b = _tensors(module), _tensors(library[name])
        assert len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b)), name
    from peft import LoraConfig, inject_adapter_in_model  # the LoRA difftrain puts on a quantized base

    for net in (ours, theirs):
        inject_adapter_in_model(LoraConfig(r=2, target_modules=list(fam.lora_targets)), net.model)
    wrapped = {n: type(m).__name__ for n, m in theirs.named_modules() if hasattr(m, "lora_A")}
    assert wrapped and set(wrapped.values()) == {"TorchaoLoraLinear"}
    assert wrapped == {n: type(m).__name__ for n, m in ours.named_modules() if hasattr(m, "lora_A")}


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_the_bitsandbytes_configs_say_what_quantize_base_does(tmp_path, kind):
    """int8 and nf4 (which diffusers' loader quantizes on a GPU only, below), on a tiny Flux transformer 64 wide:
    the layers nf4 cannot hold (``unfit``'s shape rule: its 32-wide inputs) named to be left unconverted, the
    nf4 layers computing in the given dtype, NormalFloat4 with double quantization (bitsandbytes' own default,
    which ``quantize_base`` keeps; diffusers' default is off) in blocks of ``NF4_BLOCKSIZE`` (bitsandbytes'
    default: diffusers takes no block size), int8 with LLM.int8()'s threshold."""
    folder = write_tiny_flux_folder(tmp_path / "flux", head_dim=32)
    base = detect(folder).load_denoiser(folder)
    keep = keep_float_modules(base.model, kind)  # the diffusers model's names, as its loader takes them
    config = library_config(kind, torch.bfloat16, keep)
    assert config.llm_int8_skip_modules == keep
    quantize_base(base, kind, torch.bfloat16)
    held = quantized_layers(base)
    assert not any(f"model.{name}" in held for name in keep)  # left float by both
    if kind == "int8":
        assert config.load_in_8bit and config.llm_int8_threshold == INT8_THRESHOLD and keep == []
        return
    assert keep and held and all(layer_kind(base.model.get_submodule(name)) is None for name in keep)
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    assert config.bnb_4bit_compute_dtype == torch.bfloat16 and config.bnb_4bit_use_double_quant
    import bitsandbytes as bnb

    defaults = inspect.signature(bnb.nn.Params4bit.__new__).parameters
    assert defaults["compress_statistics"].default is True  # what quantize_base leaves, and double_quant asks
    weight = next(m.weight for m in base.modules() if layer_kind(m) == "nf4")
    assert weight.quant_state.blocksize == NF4_BLOCKSIZE == 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="the limit of a machine without CUDA")
def test_diffusers_bitsandbytes_loader_needs_a_gpu_so_training_keeps_its_own(tmp_path):
    """Why int8 / nf4 bases are quantized by difftrain's own path on the CPU: diffusers 0.42's bitsandbytes
    quantizer refuses to load without a GPU ("No GPU found"; past that check it asks torch for the current CUDA
    device). The day it loads on the CPU this fails, and the library path can take over there."""
    folder = write_tiny_flux_folder(tmp_path / "flux", head_dim=32)
    with pytest.raises(ValueError, match="GPU"):
        detect(folder).load_denoiser(folder, library_config("nf4", torch.bfloat16))
