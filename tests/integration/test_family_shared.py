"""What every base family shares (families/base.py, issue 40): one weight digest, one LoRA-file reader,
one tokenise-and-copy path and one export path, checked to load, on the tiny offline bases.

The digests of the frozen parts are recorded in checkpoints and compared on resume, so the one digest
must give the values the three former ones gave: each is computed here again as it was written before
(``_old_*``), on the same weights, and compared; no value is pinned, so no CPU's rounding is."""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path

import pytest
import torch

from tests.family_bases import write_tiny_flux_folder, write_tiny_sd3_folder, write_tiny_sdxl_folder
from tests.family_bases_auraflow import write_tiny_auraflow_folder
from tests.family_bases_chroma import write_tiny_chroma_folder
from tests.family_bases_hidream import write_tiny_hidream_folder
from tests.family_bases_z_image import write_tiny_z_image_folder
from tests.family_bases_pixart import write_tiny_pixart_folder
from tests.family_bases_qwen_image import write_tiny_qwen_image_folder
from tests.family_bases_gemma import write_tiny_lumina2_folder, write_tiny_sana_folder
from tests.family_bases_flux2 import write_tiny_flux2_folder, write_tiny_flux2_klein_folder
from tests.family_bases_flux_kontext import write_tiny_flux_kontext_folder
from tests.text_components import write_tiny_sd_folder

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from difftrain.families import FAMILIES, family_named  # noqa: E402
from difftrain.families.base import Family, load_all  # noqa: E402
from difftrain.models.text import TextEncoder  # noqa: E402

BUILDERS = {"sd": write_tiny_sd_folder, "sdxl": write_tiny_sdxl_folder, "sd3": write_tiny_sd3_folder,
            "flux": write_tiny_flux_folder, "hidream": write_tiny_hidream_folder, "z-image": write_tiny_z_image_folder,
            "pixart-sigma": write_tiny_pixart_folder, "qwen-image": write_tiny_qwen_image_folder,
            "chroma": write_tiny_chroma_folder, "auraflow": write_tiny_auraflow_folder,
            "sana": write_tiny_sana_folder, "lumina2": write_tiny_lumina2_folder,
            "flux2": write_tiny_flux2_folder, "flux2-klein": write_tiny_flux2_klein_folder,
            "flux-kontext": write_tiny_flux_kontext_folder}
# The class of each family's denoiser, whose save_pretrained a test damages.
DENOISER_CLASSES = {"sd": "UNet2DConditionModel", "sdxl": "UNet2DConditionModel", "sd3": "SD3Transformer2DModel",
                    "flux": "FluxTransformer2DModel", "hidream": "HiDreamImageTransformer2DModel",
                    "z-image": "ZImageTransformer2DModel", "pixart-sigma": "PixArtTransformer2DModel",
                    "qwen-image": "QwenImageTransformer2DModel", "chroma": "ChromaTransformer2DModel",
                    "auraflow": "AuraFlowTransformer2DModel", "sana": "SanaTransformer2DModel",
                    "lumina2": "Lumina2Transformer2DModel", "flux2": "Flux2Transformer2DModel",
                    "flux2-klein": "Flux2Transformer2DModel", "flux-kontext": "FluxTransformer2DModel"}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    folders = {name: build(root / name) for name, build in BUILDERS.items()}
    folders["sd3-without-t5"] = write_tiny_sd3_folder(root / "sd3-without-t5", t5=False)
    return folders


# ---------------------------------------------------------------------------------------------
# The digests as they were computed before (models/text.weights_digest and mmdit.parts_digest).


def _old_tensors(h, prefix: str, module) -> None:
    tensors = {n: t for n, t in module.state_dict().items() if t.is_floating_point()}
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu", torch.float32).contiguous()
        h.update(f"{prefix}{name}:{tuple(t.shape)}\n".encode())
        h.update(t.numpy().tobytes())


def _old_text_encoder(text: TextEncoder) -> str:
    """TextEncoder's: the CLIP model's names without ``text_model.``, its vocabulary a sorted JSON object."""
    h = hashlib.sha256()
    tensors = {n.removeprefix("text_model."): t for n, t in text.model.state_dict().items()}
    for name in sorted(tensors):
        if tensors[name].is_floating_point():
            t = tensors[name].detach().to("cpu", torch.float32).contiguous()
            h.update(f"{name}:{tuple(t.shape)}\n".encode())
            h.update(t.numpy().tobytes())
    h.update(json.dumps(text.tokenizer.get_vocab(), sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()


def _old_sdxl(encoder) -> str:
    """SDXL's: the ModuleList of both encoders, their vocabularies as ASCII JSON objects."""
    h = hashlib.sha256()
    tensors = dict(encoder.encoders.state_dict())
    for name in sorted(tensors):
        if tensors[name].is_floating_point():
            t = tensors[name].detach().to("cpu", torch.float32).contiguous()
            h.update(f"{name}:{tuple(t.shape)}\n".encode())
            h.update(t.numpy().tobytes())
    h.update(b"".join(json.dumps(t.get_vocab(), sort_keys=True).encode() for t in encoder.tokenizers))
    return h.hexdigest()


def _old_parts(models, tokenizers, extra: str) -> str:
    """mmdit.parts_digest: each model's names prefixed by its index, vocabularies as sorted pair lists."""
    h = hashlib.sha256()
    for i, model in enumerate(models):
        _old_tensors(h, f"{i}.", model)
    for tok in tokenizers:
        h.update(json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False).encode())
    h.update(extra.encode())
    return h.hexdigest()


def test_the_digests_of_the_tiny_bases_frozen_parts_are_unchanged(bases):
    """The FLOAT32 digest records written before the stored one hold (a family's ``legacy_digest``, which
    checks them) is still the old formula; the families' ``digest`` is now of their files (STORED kind)."""
    tiny = TextEncoder.from_path("builtin:tiny-clip")
    assert tiny.digest == _old_text_encoder(tiny)
    sd = family_named("sd").load_prompt_encoder(bases["sd"])
    assert sd.legacy_digest() == _old_text_encoder(sd.text)
    sdxl = family_named("sdxl").load_prompt_encoder(bases["sdxl"])
    assert sdxl.legacy_digest() == _old_sdxl(sdxl)
    sd3 = family_named("sd3").load_prompt_encoder(bases["sd3"])
    assert sd3.legacy_digest() == _old_parts([sd3.clip_l, sd3.clip_g, sd3.t5], [sd3.tok_l, sd3.tok_g, sd3.tok_t5],
                                             f"t5_length={sd3.t5_length}")
    bare = family_named("sd3").load_prompt_encoder(bases["sd3-without-t5"])
    assert bare.legacy_digest() == _old_parts([bare.clip_l, bare.clip_g], [bare.tok_l, bare.tok_g],
                                              f"t5_length={bare.t5_length},t5=zeros({bare.width})")
    flux = family_named("flux").load_prompt_encoder(bases["flux"])
    assert flux.legacy_digest() == _old_parts([flux.clip, flux.t5], [flux.tok_clip, flux.tok_t5],
                                              f"t5_length={flux.t5_length}")
    encoders = (sd, sdxl, sd3, bare, flux)
    assert len({tiny.digest, *(e.legacy_digest() for e in encoders)}) == 6
    assert all(e.digest_kind == "stored" for e in encoders) and len({e.digest for e in encoders}) == 5


# ---------------------------------------------------------------------------------------------
# One of each.


def test_every_family_reads_writes_and_exports_through_the_one_shared_path():
    """No family has its own LoRA reader, LoRA writer or export: Family's (base.py) serve them all, and no
    family file tokenizes captions itself (models.text.token_ids does, for every text encoder)."""
    import difftrain.families.mmdit as mmdit

    families = load_all()
    assert {"sd", "sdxl", "sd3", "flux"} <= set(families)
    for family in (f for f in families.values() if f.base):  # difftrain's UNet has no base folder to export into
        for method in ("export_pipeline", "read_lora", "lora_state", "lora_file", "save_lora"):
            assert getattr(type(family), method) is getattr(Family, method), (family.name, method)
    for module in {inspect.getmodule(type(f)) for f in families.values()} | {mmdit}:
        source = inspect.getsource(module)
        assert 'padding="max_length"' not in source and "hashlib" not in source, module.__name__
        assert "save_pipeline_lora" not in source and "read_pipeline_lora" not in source, module.__name__


def test_a_lora_file_of_a_unet_family_is_checked_as_a_transformers_is(bases, tmp_path):
    """The one reader gives SD and SDXL the transformer families' checks: a missing file, and (given the
    denoiser) a module of another width, each refused in one line naming the file."""
    from safetensors.torch import save_file

    family = FAMILIES["sdxl"]
    net = family.load_denoiser(bases["sdxl"])
    name = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    width = dict(net.model.named_modules())[name].weight.shape[1]
    wrong = tmp_path / "wrong.safetensors"
    save_file({f"unet.{name}.lora_A.weight": torch.zeros(2, width + 3),
               f"unet.{name}.lora_B.weight": torch.zeros(width, 2)}, str(wrong))
    assert set(family.read_lora(wrong)) == {f"{name}.lora_A.weight", f"{name}.lora_B.weight"}
    for path, denoiser, needle in ((wrong, net, "has shape"), (tmp_path / "missing.safetensors", None, "does not exist")):
        with pytest.raises(ValueError, match=needle) as info:
            family.read_lora(path, denoiser=denoiser)
        assert "\n" not in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_an_exported_folder_is_loaded_back_and_one_that_does_not_load_is_one_line(bases, tmp_path, monkeypatch, name):
    """export_pipeline's folder loads in the family's pipeline (its denoiser's weights are the trained ones);
    when the folder written does not load (here: the denoiser's config.json damaged as it is saved), the
    export says so in one line naming the folder instead of returning it."""
    family = family_named(name)
    denoiser = family.load_denoiser(bases[name])
    with torch.no_grad():
        next(denoiser.parameters()).add_(1.0)  # a trained network: not the base's weights
    out = family.export_pipeline(denoiser, bases[name], tmp_path / "good")
    pipe = getattr(diffusers, family.pipeline_class).from_pretrained(str(out))
    loaded = getattr(pipe, family.denoiser_subfolder).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in denoiser.state_dict().items())

    cls = getattr(diffusers, DENOISER_CLASSES[name])
    save = cls.save_pretrained

    def damaged(self, save_directory, *args, **kwargs):
        save(self, save_directory, *args, **kwargs)
        (Path(save_directory) / "config.json").write_text("{ not json")

    monkeypatch.setattr(cls, "save_pretrained", damaged)
    bad = tmp_path / "bad"
    with pytest.raises(ValueError, match="does not load") as info:
        family.export_pipeline(denoiser, bases[name], bad)
    assert "\n" not in str(info.value) and str(bad) in str(info.value)


# ---------------------------------------------------------------------------------------------
# The export keeps the base's frozen parts as they are, and checks the written folder without reading a weight.


def _half_precision_copy(base: Path, out: Path, denoiser: str) -> Path:
    """``base`` copied to ``out`` with every weight outside ``denoiser/`` stored in bfloat16 (as a real
    half-precision base holds its text encoders and VAE), each file's metadata kept."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(base, out)
    for file in sorted(out.rglob("*.safetensors")):
        if file.relative_to(out).parts[0] == denoiser:
            continue
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - a safe_open, not a dict
        save_file({k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in tensors.items()},
                  str(file), metadata=metadata)
    return out


def _dtypes(file: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 - a safe_open, not a dict


@pytest.mark.parametrize("name", list(BUILDERS))
def test_an_export_writes_the_frozen_parts_as_the_base_holds_them(bases, tmp_path, name):
    """Of a bfloat16 base's text encoders and VAE, the export writes the base's files byte for byte (bf16 stays
    bf16: Flux's T5 is 9.5 GB, not 19), every tokenizer file too; only the denoiser is written from the run
    (float32, its trained weights). It was float32 for every part (the pipeline loaded in float32 and saved)."""
    import filecmp

    from safetensors.torch import load_file

    family = family_named(name)
    base = _half_precision_copy(bases[name], tmp_path / "base", family.denoiser_subfolder)
    denoiser = family.load_denoiser(base)
    with torch.no_grad():
        next(denoiser.parameters()).add_(1.0)
    out = family.export_pipeline(denoiser, base, tmp_path / "out")
    index = json.loads((out / "model_index.json").read_text())
    frozen = [k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[0]
              and k not in (family.denoiser_subfolder, "scheduler")]
    assert {"vae", "text_encoder", "tokenizer"} <= set(frozen)
    for part in frozen:
        for file in sorted((base / part).iterdir()):
            assert filecmp.cmp(file, out / part / file.name, shallow=False), (part, file.name)
            if file.suffix == ".safetensors":
                # every floating tensor bf16 (a batch norm's integer count stays: FLUX.2's VAE)
                assert _dtypes(out / part / file.name) - {"I64", "I32", "U8", "BOOL"} == {"BF16"}, (part, file.name)
    written = load_file(str(out / family.denoiser_subfolder / "diffusion_pytorch_model.safetensors"))
    assert {k: v.dtype for k, v in written.items()} == {k: torch.float32 for k in denoiser.state_dict()}
    assert all(torch.equal(written[k], v) for k, v in denoiser.state_dict().items())


class _HeadersOnly:
    """safetensors' ``safe_open`` that gives names, shapes and dtypes and refuses to read a tensor."""

    def __init__(self, real, *args, **kwargs):
        self._file = real(*args, **kwargs)

    def __enter__(self):
        self._file.__enter__()
        return self

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)

    def keys(self):
        return self._file.keys()

    def metadata(self):
        return self._file.metadata()

    def get_slice(self, key):
        return _Header(self._file.get_slice(key))

    def get_tensor(self, key):
        raise AssertionError(f"the check read the tensor {key}")


class _Header:
    def __init__(self, piece):
        self._piece = piece

    def get_shape(self):
        return self._piece.get_shape()

    def get_dtype(self):
        return self._piece.get_dtype()

    def __getitem__(self, index):
        raise AssertionError("the check read a slice of a tensor")


def _refuse_tensor_reads(monkeypatch) -> None:
    """Every way the loaders read weights (safe_open's get_tensor / slices, safetensors.torch.load_file and
    load, torch.load) raises from now on, in every module holding them; headers stay readable."""
    import sys

    import safetensors
    import safetensors.torch

    real = safetensors.safe_open

    def refuse(*args, **kwargs):
        raise AssertionError("the check read a weights file's tensors")

    for module in list(sys.modules.values()):
        if getattr(module, "safe_open", None) is real:
            monkeypatch.setattr(module, "safe_open", lambda *a, **k: _HeadersOnly(real, *a, **k))
        for attr in ("load_file", "safe_load_file"):
            if getattr(module, attr, None) is safetensors.torch.load_file:
                monkeypatch.setattr(module, attr, refuse)
    monkeypatch.setattr(safetensors.torch, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)


@pytest.mark.parametrize("name", ["sd", "flux", "pixart-sigma"])
def test_the_export_check_reads_no_weight_and_still_finds_a_wrong_shape(bases, tmp_path, monkeypatch, name):
    """The check of a written folder reads configs, tokenizers and safetensors headers, never a tensor (a real
    Flux folder loaded whole took about 115 GB of host memory): with every tensor read refused, an export
    passes; a weights file whose header gives a tensor another shape than its config makes, or a part
    model_index.json names and the folder lacks, is one line naming the folder (exit 2). Before, the check
    loaded the whole pipeline."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    family = family_named(name)
    denoiser = family.load_denoiser(bases[name])
    with monkeypatch.context() as patched:
        _refuse_tensor_reads(patched)
        out = family.export_pipeline(denoiser, bases[name], tmp_path / "out")  # checked in it
    from difftrain.families.base import check_written_folder

    file = out / "text_encoder" / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    key = min(k for k in tensors if tensors[k].ndim == 2)
    tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])
    save_file(tensors, str(file), metadata=metadata)
    with monkeypatch.context() as patched:
        _refuse_tensor_reads(patched)
        with pytest.raises(ValueError, match="does not load") as info:
            check_written_folder(family.pipeline_class, out)
    assert "\n" not in str(info.value) and str(out) in str(info.value) and key in str(info.value)

    shutil.rmtree(out / "text_encoder")
    with pytest.raises(ValueError, match="does not load") as info:
        check_written_folder(family.pipeline_class, out)
    assert "\n" not in str(info.value) and str(out) in str(info.value) and "text_encoder" in str(info.value)
