"""Other programs' LoRA files for the families of 2026 (issue 42 item 4): for each (family, program) pair that exists in
the wild, a file written in that program's layout for the tiny base is read by ``sample --lora FILE --base FOLDER``
(``load_model``) and by ``model.init_lora_from`` (``adapter_start``), and the network's outputs equal those of the same
adapter in difftrain's own layout (1e-5); a file of another family, or one naming a module no base of the family has,
is refused in one line, exit 2 (docs/lora_files.md, "The families of 2026: other programs' files").

The layouts are facts from each program's source (no code of theirs here):

- kohya sd-scripts (``networks/lora_flux.py`` for FLUX.1 Kontext and Chroma, ``networks/lora_lumina.py``) and
  musubi-tuner (``networks/lora_flux.py``, ``lora_flux_2.py``, ``lora_qwen_image.py``, ``lora_zimage.py``): one LoRA per
  Linear of the blocks of the program's own model, named ``lora_unet_`` + its module path with "_" for ".", tensors
  ``.lora_down.weight`` (rank, in), ``.lora_up.weight`` (out, rank) and ``.alpha`` (delta = alpha / rank up @ down).
  Their models are BFL's for FLUX.1 / Chroma / FLUX.2 (a fused ``img_attn.qkv``, ``single_blocks.N.linear1``), the
  original NextDiT for Lumina 2 (a fused ``attention.qkv``, ``attention.out``, ``feed_forward.w1..w3``,
  ``adaLN_modulation.1``, ``final_layer``), diffusers' own names for Qwen-Image and Z-Image. musubi-tuner leaves out
  the modulation layers (``img_mod.lin``, ``_mod_``, ``_modulation``) and Z-Image's refiners; sd-scripts adapts
  them. One fused LoRA's ``lora_up`` rows are the fused weight's rows in order (q, k, v, then the MLP's).
- ai-toolkit (``convert_lora_weights_before_save`` of its Chroma, HiDream, Qwen-Image, Z-Image models; peft format in
  ``toolkit/network_mixins.py``): ``diffusion_model.`` + the module path of its model (BFL's for Chroma, diffusers'
  for the others), ``.lora_A.weight`` / ``.lora_B.weight``, no alpha (alpha = rank).
- ai-toolkit's FLUX.1 Kontext and PixArt-Sigma, SimpleTuner (diffusers' models, the pipelines' save_lora_weights):
  diffusers' own layout (``transformer.`` + peft's names), here without alpha.
- OneTrainer's legacy layouts (its newer KOHYA, COMFY and DIFFUSERS formats are the layouts above; ``modules/
  modelSaver/*LoRASaver.py``): Chroma's ``lora_transformer_`` + the diffusers module path with "_", kohya's tensors;
  Qwen-Image's, Z-Image's and FLUX.2's "canonical" ``transformer.`` + the diffusers module path, kohya's tensors.

Tiny random bases (tests/family_bases_*.py); rank 4; alpha 8 where the program writes one (scale 2, so a reader that
drops alpha is caught)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.config import config_to_dict, load_config  # noqa: E402
from difftrain.families import detect  # noqa: E402
from difftrain.interop.adapters import LORA_LAYOUTS, Adapter  # noqa: E402
from difftrain.networks.conditioning import Conditioning  # noqa: E402
from difftrain.networks.lora import apply_lora  # noqa: E402
from difftrain.networks.lora_import import adapter_start, native_resolution, read_adapter  # noqa: E402
from tests.family_bases_chroma import write_tiny_chroma_folder  # noqa: E402
from tests.family_bases_flux2 import write_tiny_flux2_folder, write_tiny_flux2_klein_folder  # noqa: E402
from tests.family_bases_flux_kontext import write_tiny_flux_kontext_folder  # noqa: E402
from tests.family_bases_auraflow import write_tiny_auraflow_folder  # noqa: E402
from tests.family_bases_gemma import write_tiny_lumina2_folder, write_tiny_sana_folder  # noqa: E402
from tests.family_bases_hidream import write_tiny_hidream_folder  # noqa: E402
from tests.family_bases_pixart import write_tiny_pixart_folder  # noqa: E402
from tests.family_bases_qwen_image import write_tiny_qwen_image_folder  # noqa: E402
from tests.family_bases_qwen_image_edit import write_tiny_qwen_image_edit_folder  # noqa: E402
from tests.family_bases_z_image import write_tiny_z_image_folder  # noqa: E402

BASES = {"flux-kontext": write_tiny_flux_kontext_folder, "chroma": write_tiny_chroma_folder,
         "flux2": write_tiny_flux2_folder, "flux2-klein": write_tiny_flux2_klein_folder,
         "qwen-image": write_tiny_qwen_image_folder, "qwen-image-edit": write_tiny_qwen_image_edit_folder,
         "z-image": write_tiny_z_image_folder, "lumina2": write_tiny_lumina2_folder, "hidream": write_tiny_hidream_folder,
         "sana": write_tiny_sana_folder, "pixart-sigma": write_tiny_pixart_folder, "auraflow": write_tiny_auraflow_folder}
RANK = 4
# load_model's finite-output probe (lora_import.check_adapted_output) runs the null condition, which Qwen-Image-Edit's
# denoiser refuses without its reference ("the qwen-image-edit model edits a reference image..."), for any LoRA file:
# its file is read on the edit base, its outputs compared on Qwen-Image's (the same transformer class and names).
PROBE_REFUSES = {"qwen-image-edit"}


def _same(*names: str) -> list[tuple[str, list[str]]]:
    """Modules a program names as diffusers does: (its path, [the diffusers module])."""
    return [(n, [n]) for n in names]


def _bfl_flux1(mods: bool) -> list[tuple[str, list[str]]]:
    """BFL's FLUX.1 (and Chroma) block Linears of one double and one single block, and the diffusers modules whose
    rows each holds (fused q, k, v). Without the single block's ``linear1`` (q, k, v and the MLP's input): diffusers'
    kohya FLUX converter splits it at FLUX.1's widths (3072, 3072, 3072, 12288), written in its code, which a real
    FLUX.1 Kontext or Chroma base has and the tiny one has not."""
    d, s = "transformer_blocks.0", "single_transformer_blocks.0"
    out = [("double_blocks.0.img_attn.qkv", [f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"]),
           ("double_blocks.0.img_attn.proj", [f"{d}.attn.to_out.0"]),
           ("double_blocks.0.img_mlp.0", [f"{d}.ff.net.0.proj"]), ("double_blocks.0.img_mlp.2", [f"{d}.ff.net.2"]),
           ("double_blocks.0.txt_attn.qkv", [f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj"]),
           ("double_blocks.0.txt_attn.proj", [f"{d}.attn.to_add_out"]),
           ("double_blocks.0.txt_mlp.0", [f"{d}.ff_context.net.0.proj"]),
           ("double_blocks.0.txt_mlp.2", [f"{d}.ff_context.net.2"]),
           ("single_blocks.0.linear2", [f"{s}.proj_out"])]
    if mods:  # sd-scripts adapts the modulation Linears too (musubi-tuner leaves them out)
        out += [("double_blocks.0.img_mod.lin", [f"{d}.norm1.linear"]),
                ("double_blocks.0.txt_mod.lin", [f"{d}.norm1_context.linear"]),
                ("single_blocks.0.modulation.lin", [f"{s}.norm.linear"])]
    return out


def _bfl_flux2() -> list[tuple[str, list[str]]]:
    """BFL's FLUX.2 block Linears (musubi-tuner's Flux2 model) of one double and one single block."""
    d, s = "transformer_blocks.0", "single_transformer_blocks.0"
    return [("double_blocks.0.img_attn.qkv", [f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"]),
            ("double_blocks.0.img_attn.proj", [f"{d}.attn.to_out.0"]),
            ("double_blocks.0.img_mlp.0", [f"{d}.ff.linear_in"]), ("double_blocks.0.img_mlp.2", [f"{d}.ff.linear_out"]),
            ("double_blocks.0.txt_attn.qkv", [f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj"]),
            ("double_blocks.0.txt_attn.proj", [f"{d}.attn.to_add_out"]),
            ("double_blocks.0.txt_mlp.0", [f"{d}.ff_context.linear_in"]),
            ("double_blocks.0.txt_mlp.2", [f"{d}.ff_context.linear_out"]),
            ("single_blocks.0.linear1", [f"{s}.attn.to_qkv_mlp_proj"]), ("single_blocks.0.linear2", [f"{s}.attn.to_out"])]


def _qwen() -> list[tuple[str, list[str]]]:
    b = "transformer_blocks.0"
    return _same(*(f"{b}.attn.{m}" for m in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                                              "add_v_proj", "to_add_out")),
                 f"{b}.img_mlp.net.0.proj", f"{b}.img_mlp.net.2", f"{b}.txt_mlp.net.0.proj", f"{b}.txt_mlp.net.2")


def _z_image() -> list[tuple[str, list[str]]]:
    return _same(*(f"layers.{i}.{m}" for i in (0, 1) for m in ("attention.to_q", "attention.to_k", "attention.to_v",
                                                                "attention.to_out.0", "feed_forward.w1",
                                                                "feed_forward.w2", "feed_forward.w3")))


def _lumina2() -> list[tuple[str, list[str]]]:
    """sd-scripts' Lumina 2 LoRA (the NextDiT's names): every Linear of each JointTransformerBlock (the refiners'
    too; the context refiner has no modulation) and of the FinalLayer."""
    out = []
    for block, modulated in (("noise_refiner.0", True), ("context_refiner.0", False), ("layers.0", True)):
        out += [(f"{block}.attention.qkv", [f"{block}.attn.to_q", f"{block}.attn.to_k", f"{block}.attn.to_v"]),
                (f"{block}.attention.out", [f"{block}.attn.to_out.0"])]
        out += [(f"{block}.feed_forward.w{i}", [f"{block}.feed_forward.linear_{i}"]) for i in (1, 2, 3)]
        if modulated:
            out.append((f"{block}.adaLN_modulation.1", [f"{block}.norm1.linear"]))
    return out + [("final_layer.linear", ["norm_out.linear_2"]), ("final_layer.adaLN_modulation.1", ["norm_out.linear_1"])]


def _hidream() -> list[tuple[str, list[str]]]:
    out = []
    for block, stream in (("double_stream_blocks.0.block", ("", "_t")), ("single_stream_blocks.0.block", ("",))):
        out += _same(*(f"{block}.attn1.{m}{t}" for t in stream for m in ("to_q", "to_k", "to_v", "to_out")))
    return out


def _onetrainer_flux(names: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """OneTrainer's names are the diffusers modules': each of a BFL fused module's parts on its own."""
    return [(m, [m]) for _, modules in names for m in modules]


# (family, program): (the program's modules and the diffusers modules each covers, its key style)
KOHYA, AITK, ONETRAINER, PEFT, CANONICAL = "kohya", "ai-toolkit", "onetrainer", "peft", "canonical"
PAIRS = {
    ("flux-kontext", "sd-scripts"): (_bfl_flux1(mods=True), KOHYA),
    ("flux-kontext", "musubi-tuner"): (_bfl_flux1(mods=False), KOHYA),
    ("flux-kontext", "ai-toolkit"): (_onetrainer_flux(_bfl_flux1(mods=False)), PEFT),  # diffusers' model and names
    ("chroma", "sd-scripts"): (_bfl_flux1(mods=False), KOHYA),
    ("chroma", "ai-toolkit"): (_bfl_flux1(mods=False), AITK),
    ("chroma", "onetrainer"): (_onetrainer_flux(_bfl_flux1(mods=False)), ONETRAINER),
    ("lumina2", "sd-scripts"): (_lumina2(), KOHYA),
    ("flux2", "musubi-tuner"): (_bfl_flux2(), KOHYA),
    ("flux2-klein", "musubi-tuner"): (_bfl_flux2(), KOHYA),
    ("qwen-image", "musubi-tuner"): (_qwen(), KOHYA),
    ("qwen-image-edit", "musubi-tuner"): (_qwen(), KOHYA),
    ("qwen-image", "ai-toolkit"): (_qwen(), AITK),
    ("z-image", "musubi-tuner"): (_z_image(), KOHYA),
    ("z-image", "ai-toolkit"): (_z_image(), AITK),
    ("hidream", "ai-toolkit"): (_hidream(), AITK),
    ("qwen-image", "onetrainer"): (_qwen(), CANONICAL),
    ("z-image", "onetrainer"): (_z_image(), CANONICAL),
    ("flux2", "onetrainer"): (_onetrainer_flux(_bfl_flux2()), CANONICAL),
    ("lumina2", "simpletuner"): (_same(*(m for _, ms in _lumina2() for m in ms)), PEFT),  # diffusers' save_lora_weights
    ("hidream", "simpletuner"): (_hidream(), PEFT),
    ("sana", "simpletuner"): (_same(*(f"transformer_blocks.0.attn1.{m}" for m in ("to_q", "to_k", "to_v"))), PEFT),
    ("pixart-sigma", "ai-toolkit"): (_same(*(f"transformer_blocks.0.{a}.{m}" for a in ("attn1", "attn2")
                                            for m in ("to_q", "to_k", "to_v", "to_out.0"))), PEFT),
    ("auraflow", "simpletuner"): (_same(*(f"{b}.0.attn.{m}" for b in ("joint_transformer_blocks", "single_transformer_blocks")
                                          for m in ("to_q", "to_k", "to_v", "to_out.0"))), PEFT),
}
# Pairs difftrain refuses in one line, and the words of its line: diffusers' PixArtTransformer2DModel has no
# load_lora_adapter (PixArtSigmaPipeline no LoRA loader), through which other programs' files are read.
# FLUX.2 in OneTrainer's canonical layout: Flux2Pipeline's lora_state_dict reads diffusers' names without alpha only, and
# its kohya converter leaves every tensor of it out (reading it would fold alpha into the tensors).
NOT_READ = {("pixart-sigma", "ai-toolkit"): "lacks", ("flux2", "onetrainer"): "leaves tensors of it out"}
READ = [p for p in PAIRS if p not in NOT_READ]
LOUD = {"auraflow": 1.0}  # the factors' scale (0.1 elsewhere): the tiny AuraFlow's output hardly feels its attention
ALPHA = {KOHYA: 8.0, ONETRAINER: 8.0, AITK: None, PEFT: None, CANONICAL: 8.0}  # None: no alpha tensor (ai-toolkit's peft format: alpha = rank)


def _key(style: str, path: str) -> tuple[str, str, str]:
    """(module name, down suffix, up suffix) of ``path`` in a program's key style."""
    if style == KOHYA:
        return "lora_unet_" + path.replace(".", "_"), ".lora_down.weight", ".lora_up.weight"
    if style == ONETRAINER:
        return "lora_transformer_" + path.replace(".", "_"), ".lora_down.weight", ".lora_up.weight"
    if style == PEFT:
        return "transformer." + path, ".lora_A.weight", ".lora_B.weight"
    if style == CANONICAL:
        return "transformer." + path, ".lora_down.weight", ".lora_up.weight"
    return "diffusion_model." + path, ".lora_A.weight", ".lora_B.weight"


def their_file(pair, weights: dict[str, torch.Tensor], seed: int = 3):
    """(the program's file as tensors, the same adapter in peft's names of the diffusers modules, its alpha): random
    rank-4 factors; a fused module's ``lora_up`` rows split among the diffusers modules it covers, its ``lora_down``
    shared by them."""
    names, style = PAIRS[pair]
    g = torch.Generator().manual_seed(seed)
    size = LOUD.get(pair[0], 0.1)
    alpha = ALPHA[style]
    file, ours = {}, {}
    for path, modules in names:
        rows = [weights[m].shape[0] for m in modules]
        down = size * torch.randn(RANK, weights[modules[0]].shape[1], generator=g)
        up = size * torch.randn(sum(rows), RANK, generator=g)
        name, d, u = _key(style, path)
        file[name + d], file[name + u] = down, up
        if alpha is not None:
            file[name + ".alpha"] = torch.tensor(alpha)
        for m, part in zip(modules, up.split(rows)):
            ours[f"{m}.lora_A.weight"], ours[f"{m}.lora_B.weight"] = down.clone(), part.clone()
    return file, ours, alpha or float(RANK)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """{family name: (family, base folder, its Linear weights)}, built on first use."""
    made = {}

    def get(name):
        if name not in made:
            folder = BASES[name](tmp_path_factory.mktemp(name) / "base")
            if name == "z-image":  # load_model's probe runs at the pipeline's 1024 px (no sample_size): 64 x 64 patches
                config = folder / "transformer" / "config.json"
                config.write_text(json.dumps({**json.loads(config.read_text()), "axes_lens": [256, 128, 128]}))
            family = detect(folder)
            assert family.name == name
            model = family.load_denoiser(folder).model
            made[name] = family, folder, {n: m.weight.detach().clone() for n, m in model.named_modules()
                                          if isinstance(m, torch.nn.Linear)}
        return made[name]
    return get


def _lora_config(folder, alpha: float, modules):
    """A LoRA run's config on ``folder`` adapting ``modules``, at the base's native resolution (as read_foreign's)."""
    side = native_resolution(folder, detect(folder).load_denoiser(folder))
    return load_config(None, [f"model.init_from={folder}", f"lora.rank={RANK}", f"lora.alpha={alpha}",
                              f"lora.target_modules={json.dumps(sorted(modules))}", f"data.resolution={side}"])


def _own_file(family, folder, ours: dict[str, torch.Tensor], alpha: float, out):
    """The adapter ``ours`` (peft's names, scale alpha / rank) in difftrain's own layout (``export --layout
    difftrain``), on ``folder``."""
    cfg = _lora_config(folder, alpha, {k.split(".lora_")[0] for k in ours})
    denoiser = family.load_denoiser(folder)
    net = apply_lora(denoiser, cfg.lora, base_record=denoiser.record(), base_source=str(folder))
    tensors = net.state_dict()
    assert set(tensors) == set(ours), sorted(set(tensors) ^ set(ours))[:4]
    frozen = Conditioning.from_config(cfg, 0, "cpu").references()  # the base's frozen parts, as a run records them
    adapter = Adapter(dict(ours), net.network_record(), config_to_dict(cfg), frozen, 0, str(out), "raw")
    return LORA_LAYOUTS["difftrain"](adapter, out) / "pytorch_lora_weights.safetensors"


@torch.no_grad()
def _output(loaded, like=None) -> torch.Tensor:
    """The network's output on a fixed input at the shape of ``like`` (a LoadedModel; default ``loaded``): x_t noised
    from fixed noise to the median training level, the null condition."""
    like = like or loaded
    channels, resolution = like.conditioning.network_shape()
    noise = torch.randn((1, channels, resolution, resolution), generator=torch.Generator().manual_seed(0))
    b = like.objective.noised(torch.zeros_like(noise), like.objective.quantile(torch.tensor([0.5])), noise)
    return loaded.model(b.input, b.cond, loaded.conditioning.null(1, "cpu"))


@pytest.mark.parametrize("pair", READ, ids=["-".join(p) for p in READ])
def test_another_programs_file_samples_as_the_same_adapter_in_difftrains_layout(bases, tmp_path, pair):
    """``sample --lora FILE --base FOLDER`` (load_model) on the program's file: the network's outputs equal the same
    adapter's, read from difftrain's own layout (1e-5 of their scale); ``model.init_lora_from`` (adapter_start) starts
    a LoRA run of that rank and alpha on exactly that adapter."""
    from safetensors.torch import save_file

    from difftrain.generation.inference import load_model

    family, folder, weights = bases(pair[0])
    file, ours, alpha = their_file(pair, weights)
    path = tmp_path / "theirs.safetensors"
    save_file(file, str(path))

    # model.init_lora_from: a new LoRA network of the file's rank and alpha on these modules starts on its adapter
    cfg = _lora_config(folder, alpha, {k.split(".lora_")[0] for k in ours})
    denoiser = family.load_denoiser(folder)
    net = apply_lora(denoiser, cfg.lora, base_record=denoiser.record(), base_source=str(folder))
    start = adapter_start(net, path)
    assert set(start) == set(ours)
    for a in (k for k in ours if ".lora_A." in k):  # B A of each module (a converter may share alpha between them)
        b = a.replace(".lora_A.", ".lora_B.")
        assert torch.allclose(start[b] @ start[a], ours[b] @ ours[a], rtol=1e-5, atol=1e-7), a

    # sample --lora FILE --base FOLDER
    if pair[0] in PROBE_REFUSES:  # the adapter read on the edit base; its outputs on Qwen-Image's (same transformer)
        read = read_adapter(path, base=str(folder))
        lora, got = read["network"]["lora"], read["tensors"]
        assert {k.split(".lora_")[0] for k in got} == {k.split(".lora_")[0] for k in ours}
        for a in (k for k in ours if ".lora_A." in k):
            b = a.replace(".lora_A.", ".lora_B.")
            assert torch.allclose(got[b] @ got[a] * (lora["alpha"] / lora["rank"]), ours[b] @ ours[a] * alpha / RANK,
                                  rtol=1e-5, atol=1e-7), a
        family, folder, _ = bases("qwen-image")
    theirs = load_model(None, lora=path, base=str(folder), device="cpu")
    own = load_model(None, lora=_own_file(family, folder, ours, alpha, tmp_path / "own"), device="cpu")
    got, want = _output(theirs), _output(own, like=theirs)
    base = load_model(None, lora=path, base=str(folder), device="cpu", lora_scale=0.0)
    assert (want - _output(base, like=theirs)).abs().max() > 1e-3, "the adapter changes the outputs"
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


def _other_family(pair) -> tuple[str, str]:
    """A pair of this program's style (or any) whose family is not ``pair``'s, and whose file names modules this
    family's base lacks."""
    near = {"flux-kontext": "flux2", "chroma": "flux2", "flux2": "flux-kontext", "flux2-klein": "flux-kontext",
            "qwen-image": "z-image", "qwen-image-edit": "z-image", "z-image": "qwen-image", "lumina2": "z-image",
            "hidream": "qwen-image", "sana": "auraflow", "pixart-sigma": "auraflow", "auraflow": "sana"}[pair[0]]
    same_style = [p for p in PAIRS if p[0] == near and PAIRS[p][1] == PAIRS[pair][1]]
    return same_style[0] if same_style else next(p for p in PAIRS if p[0] == near)


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("damage", ["another family", "a block the base lacks", "a module no block has"])
@pytest.mark.parametrize("pair", list(PAIRS), ids=["-".join(p) for p in PAIRS])
def test_a_file_of_another_family_or_damaged_is_one_line(bases, tmp_path, capsys, pair, damage):
    """``difftrain sample --lora FILE --base FOLDER``: a file of another family in this program's layout, or this
    family's file with one module renamed (to a block index past the base's, or to a name no block has), is refused
    with one line naming the file, exit 2, no image written (a file applies whole or not at all)."""
    from safetensors.torch import save_file

    from difftrain.cli import main

    family, folder, weights = bases(pair[0])
    if damage == "another family":
        other = _other_family(pair)
        file = their_file(other, bases(other[0])[2])[0]
    else:
        file = their_file(pair, weights)[0]
        first = sorted({k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in file})[0]
        if damage == "a block the base lacks":
            bad = first.replace("_0_", "_7_").replace(".0.", ".7.")
        else:
            bad = first + "x"
        assert bad != first
        file = {(bad + k[len(first):] if k.startswith(first + ".") else k): v for k, v in file.items()}
    path = tmp_path / "theirs.safetensors"
    save_file(file, str(path))
    out = tmp_path / "samples"
    code = main(["sample", "--lora", str(path), "--base", str(folder), "--num", "1", "--steps", "1", "--out", str(out),
                 "--prompt", "a red disc"])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and str(path) in line, line
    assert not list(out.glob("*.png"))


@pytest.mark.parametrize("pair", list(NOT_READ), ids=["-".join(p) for p in NOT_READ])
def test_a_pair_difftrain_does_not_read_is_one_line_saying_why(bases, tmp_path, capsys, pair):
    """``sample --lora FILE --base FOLDER`` and ``model.init_lora_from`` on a file of a pair docs/lora_files.md
    says is not read: one line naming the file and why, exit 2."""
    from safetensors.torch import save_file

    from difftrain.cli import main

    family, folder, weights = bases(pair[0])
    file, ours, alpha = their_file(pair, weights)
    path = tmp_path / "theirs.safetensors"
    save_file(file, str(path))
    code = main(["sample", "--lora", str(path), "--base", str(folder), "--num", "1", "--steps", "1",
                 "--out", str(tmp_path / "samples"), "--prompt", "a red disc"])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and str(path) in line and NOT_READ[pair] in line, line
    cfg = _lora_config(folder, alpha, {k.split(".lora_")[0] for k in ours})
    denoiser = family.load_denoiser(folder)
    net = apply_lora(denoiser, cfg.lora, base_record=denoiser.record(), base_source=str(folder))
    with pytest.raises(ValueError, match=NOT_READ[pair]) as e:
        adapter_start(net, path)
    assert "\n" not in str(e.value)
