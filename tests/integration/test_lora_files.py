"""LoRA variants and LoRA files both ways (issue 28, items 5 to 7), offline on the tiny Stable Diffusion
folder: DoRA, LoHa and LoKr train, resume exactly and merge; the DoRA and plain LoRA files load in
``StableDiffusionPipeline.load_lora_weights`` (diffusers' and kohya's layout) to the merged export's
outputs; files written by diffusers' scripts, kohya sd-scripts and in the ComfyUI layout (built here
with those tools' documented key patterns) sample as the adapter they hold; bad and hostile files are
one line, exit 2."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain import api  # noqa: E402
from difftrain.config import load_config  # noqa: E402
from difftrain.generation.inference import generate_images, load_model  # noqa: E402
from difftrain.checkpoints import checkpoint as ckpt  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.integration.test_lora import PROMPT, _digests, _one_error_line, _pipeline_images, _sd_overrides  # noqa: E402

SAMPLE = {"sampler": "ddim", "steps": 5, "seed": 3, "prompt": PROMPT, "guidance_scale": 3.0}


def _images(loaded):
    return generate_images(loaded, 2, **SAMPLE)


def _theirs(sd, adapter, cfg):
    """The pipeline's images with the file loaded by diffusers, from difftrain's initial noise of SAMPLE."""
    from difftrain.generation.sampling import initial_noise

    return _pipeline_images(sd, adapter, cfg, initial_noise(2, (4, 8, 8), SAMPLE["seed"]), SAMPLE["steps"],
                            SAMPLE["guidance_scale"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Finished 4-step runs of each lora.kind (rank 4, alpha 8) on the tiny Stable Diffusion UNet."""
    from tests.conftest import TINY_OVERRIDES

    root = tmp_path_factory.mktemp("kinds")
    for kind in ("lora", "dora", "loha", "lokr"):
        train(load_config(None, _sd_overrides(root, list(TINY_OVERRIDES), f"lora.kind={kind}", "train.total_steps=4")),
              root / kind)
    return root


# ---------------------------------------------------------------------------------------------
# Item 5: the kinds.


@pytest.mark.parametrize("kind, names", [("dora", ("lora_A", "lora_B", "lora_magnitude_vector")),
                                         ("loha", ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")),
                                         ("lokr", ("lokr_w1", "lokr_w2"))])
def test_each_kind_trains_resumes_exactly_and_merges(runs, tmp_path, tiny_overrides, kind, names):
    state = ckpt.load_checkpoint(runs / kind)
    assert state["network"]["lora"]["kind"] == kind
    assert {k.rsplit(".", 2 if k.endswith(".weight") else 1)[1] for k in state["model"]} == set(names)
    assert len(state["optimizer"]["state"]) == len(state["model"])  # the adapter alone trains
    cfg = load_config(None, _sd_overrides(runs, tiny_overrides, f"lora.kind={kind}", "train.total_steps=4"))
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert _digests(runs / kind) == _digests(tmp_path / "resumed")
    # Another kind on resume: one line.
    other = load_config(None, _sd_overrides(runs, tiny_overrides, "lora.kind=lora", "train.total_steps=6"))
    with pytest.raises(ValueError, match=f"its adapter has kind '{kind}', this config 'lora'"):
        train(other, tmp_path / "resumed")
    # The merged network (peft's own merge) samples as the adapted one.
    merged = api.export(runs / kind, tmp_path / "m.safetensors", format="safetensors", merge=True)
    expected = _images(load_model(runs / kind, device="cpu"))
    assert (_images(load_model(merged, device="cpu")) - expected).abs().max() < 1e-5


def test_a_plain_lora_resumed_as_another_kind_is_one_line(runs, tiny_overrides):
    from difftrain.networks.lora import resume_mismatch

    network = ckpt.load_checkpoint(runs / "lora")["network"]
    assert "kind" not in network["lora"]  # a plain LoRA's record is as it was before lora.kind
    cfg = load_config(None, _sd_overrides(runs, tiny_overrides, "lora.kind=dora", "train.total_steps=4"))
    assert resume_mismatch(cfg.lora, network) == "its adapter has kind 'lora', this config 'dora' (lora.*)"


def test_dora_file_loads_in_the_pipeline_with_the_merged_exports_outputs(runs, tmp_path, capsys):
    from diffusers import DDIMScheduler, DDPMScheduler, StableDiffusionPipeline

    from difftrain.diffusion.scheduler_configs import scheduler_config
    from difftrain.generation.sampling import initial_noise

    adapter = api.export(runs / "dora", tmp_path / "adapter", format="lora")  # the default layout: diffusers'
    assert "loads in diffusers, not in ComfyUI" in capsys.readouterr().err  # export says so, and names --merge
    merged = api.export(runs / "dora", tmp_path / "merged", format="diffusers", merge=True)
    ours = load_model(runs / "dora", device="cpu")
    theirs = _theirs(runs / "sd", adapter, ours.cfg)
    pipe = StableDiffusionPipeline.from_pretrained(merged, safety_checker=None)
    pipe.scheduler = DDIMScheduler.from_config(DDPMScheduler(**{**scheduler_config(ours.cfg.diffusion),
                                                                "clip_sample": False, "steps_offset": 1}).config)
    folded = pipe([PROMPT] * 2, latents=initial_noise(2, (4, 8, 8), SAMPLE["seed"]), num_inference_steps=SAMPLE["steps"],
                  guidance_scale=SAMPLE["guidance_scale"], eta=0.0, output_type="pt", height=16, width=16).images * 2 - 1
    assert (theirs - folded).abs().max() < 1e-4
    assert (theirs - _images(ours)).abs().max() < 1e-4
    assert (_images(load_model(None, lora=adapter, device="cpu")) - _images(ours)).abs().max() < 1e-6


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_loha_and_lokr_export_kohyas_layout_for_comfyui_and_refuse_the_diffusers_one(runs, tmp_path, capsys, kind):
    """LoHa and LoKr: no pipeline's load_lora_weights reads them, so the diffusers layout is one line; the
    default is kohya's / LyCORIS' layout (lora_unet_... with hada_* / lokr_* and alpha), which ComfyUI applies
    at the trained strength (test_lora_comfyui.py) and sample --lora reads back; the export says where it loads."""
    from safetensors import safe_open

    from difftrain.cli import main

    assert main(["export", str(runs / kind), str(tmp_path / "diffusers"), "--format", "lora", "--layout", "diffusers"]) == 2
    line = _one_error_line(capsys)
    assert f"lora.kind={kind} adapter has no diffusers layout" in line and "--merge" in line and "--layout kohya" in line
    assert main(["export", str(runs / kind), str(tmp_path / "own"), "--format", "lora"]) == 0
    err = capsys.readouterr().err
    assert "loads in ComfyUI, not in diffusers" in err and "--merge" in err, err
    with safe_open(str(tmp_path / "own" / "pytorch_lora_weights.safetensors"), framework="pt") as f:
        keys, metadata = list(f.keys()), f.metadata()
    assert all(k.startswith("lora_unet_") for k in keys) and any(k.endswith(".alpha") for k in keys)
    assert any(f".{'hada' if kind == 'loha' else 'lokr'}_w1" in k for k in keys)
    assert metadata["ss_network_module"] == "lycoris.kohya" and kind in metadata["ss_network_args"]
    expected = _images(load_model(runs / kind, device="cpu"))
    assert (_images(load_model(None, lora=tmp_path / "own", device="cpu")) - expected).abs().max() < 1e-6
    # difftrain's own layout still reads back as it did
    assert main(["export", str(runs / kind), str(tmp_path / "dt"), "--format", "lora", "--layout", "difftrain"]) == 0
    assert (_images(load_model(None, lora=tmp_path / "dt", device="cpu")) - expected).abs().max() < 1e-6


# ---------------------------------------------------------------------------------------------
# Item 6: the kohya layout out, and other programs' files in.


def _kohya_name(module: str) -> str:
    """kohya sd-scripts' name of a UNet module (its documented pattern: lora_unet_ + the module path with
    '.' -> '_'); built here as the tool does, to make files of its layout."""
    return "lora_unet_" + module.replace(".", "_")


def _adapter_by_module(run) -> tuple[dict, float, int]:
    """{module: (A (r, in), B (out, r))} of a run's EMA adapter, its alpha and rank."""
    state = ckpt.load_checkpoint(run)
    out = {}
    for key, value in state["ema"]["model"].items():
        module, which = key.split(".lora_")
        out.setdefault(module, {})[which[0]] = value
    s = state["network"]["lora"]
    return {m: (v["A"], v["B"]) for m, v in out.items()}, float(s["alpha"]), int(s["rank"])


def test_kohya_export_loads_in_diffusers_with_the_same_outputs(runs, tmp_path, capsys):
    from safetensors import safe_open

    from difftrain.cli import main

    assert main(["export", str(runs / "lora"), str(tmp_path / "kohya"), "--format", "lora", "--layout", "kohya"]) == 0
    file = tmp_path / "kohya" / "pytorch_lora_weights.safetensors"
    with safe_open(str(file), framework="pt") as f:
        keys, alpha = list(f.keys()), f.get_tensor([k for k in f.keys() if k.endswith(".alpha")][0])
        assert f.metadata()["ss_network_dim"] == "4"
    assert all(k.startswith("lora_unet_") and k.endswith((".lora_down.weight", ".lora_up.weight", ".alpha")) for k in keys)
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight" in keys
    assert alpha.item() == 8.0  # the run's alpha (scale 2), per module
    ours = load_model(runs / "lora", device="cpu")
    expected = _images(ours)
    diffusers_layout = api.export(runs / "lora", tmp_path / "diffusers", format="lora", lora_layout="diffusers")
    assert "loads in diffusers, not in ComfyUI" in capsys.readouterr().err  # ComfyUI maps none of its keys
    default = api.export(runs / "lora", tmp_path / "default", format="lora")  # kohya's: it loads everywhere
    with safe_open(str(default / "pytorch_lora_weights.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(keys)
    via_kohya, via_diffusers = _theirs(runs / "sd", file, ours.cfg), _theirs(runs / "sd", diffusers_layout, ours.cfg)
    assert (via_kohya - via_diffusers).abs().max() < 1e-5
    assert (via_kohya - expected).abs().max() < 1e-4
    assert (_images(load_model(None, lora=file, device="cpu")) - expected).abs().max() < 1e-5
    # DoRA has no kohya layout diffusers reads back; a transformer family none diffusers writes.
    assert main(["export", str(runs / "dora"), str(tmp_path / "k2"), "--format", "lora", "--layout", "kohya"]) == 2
    assert "lora.kind=dora adapter has no kohya layout" in _one_error_line(capsys)


def test_kohya_layout_is_refused_for_the_transformer_families():
    from difftrain.interop.adapters import Adapter, write_kohya

    record = {"kind": "lora", "base": {"kind": "family", "family": "flux", "config": {}},
              "lora": {"rank": 4, "alpha": 4.0, "dropout": 0.0, "targets": ["attn.to_q"]}}
    with pytest.raises(ValueError, match="kohya layout of a flux LoRA names the original flux network"):
        write_kohya(Adapter({}, record, {}, {}, 0, "run", "ema"), None)


def _their_files(runs, tmp_path) -> dict:
    """The lora run's adapter as other programs write it, one file per layout."""
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import save_file

    modules, alpha, rank = _adapter_by_module(runs / "lora")
    files = {}
    # diffusers' training scripts (train_text_to_image_lora.py, train_dreambooth_lora.py): save_lora_weights with
    # peft's names and the LoraConfig as metadata.
    peft_names = {f"{m}.lora_{w}.weight": t for m, (a, b) in modules.items() for w, t in (("A", a), ("B", b))}
    StableDiffusionPipeline.save_lora_weights(tmp_path / "diffusers", unet_lora_layers=peft_names,
                                              unet_lora_adapter_metadata={"r": rank, "lora_alpha": alpha,
                                                                          "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]})
    files["diffusers-script"] = tmp_path / "diffusers" / "pytorch_lora_weights.safetensors"
    # diffusers' scripts before peft (attention processors): unet.<block>.processor.to_q_lora.down.weight, scale 1
    # (alpha folded into up here, as those files had no alpha).
    old = {}
    for m, (a, b) in modules.items():
        attn, proj = m.rsplit(".", 1) if not m.endswith("to_out.0") else (m[: -len(".to_out.0")], "to_out")
        old[f"unet.{attn}.processor.{proj}_lora.down.weight"] = a
        old[f"unet.{attn}.processor.{proj}_lora.up.weight"] = b * (alpha / rank)
    save_file(old, tmp_path / "old.safetensors")
    files["diffusers-attn-procs"] = tmp_path / "old.safetensors"
    # kohya sd-scripts (networks/lora.py): lora_unet_<path with _>.lora_down / lora_up / alpha (float), its ss_
    # metadata; one module with another alpha and its up weight scaled to keep the function, and a text-encoder
    # module (lora_te_), which difftrain leaves out with a warning.
    kohya = {}
    for i, (m, (a, b)) in enumerate(sorted(modules.items())):
        module_alpha = alpha if i else alpha / 2
        kohya[f"{_kohya_name(m)}.lora_down.weight"] = a
        kohya[f"{_kohya_name(m)}.lora_up.weight"] = b * (alpha / module_alpha)
        kohya[f"{_kohya_name(m)}.alpha"] = torch.tensor(module_alpha)
    te = "lora_te_text_model_encoder_layers_0_self_attn_q_proj"
    kohya.update({f"{te}.lora_down.weight": torch.zeros(rank, 32), f"{te}.lora_up.weight": torch.zeros(32, rank),
                  f"{te}.alpha": torch.tensor(alpha)})
    save_file(kohya, tmp_path / "kohya.safetensors", metadata={"ss_network_module": "networks.lora",
                                                               "ss_network_dim": str(rank), "ss_network_alpha": str(alpha)})
    files["kohya-sd-scripts"] = tmp_path / "kohya.safetensors"
    # ComfyUI (its LoRA loader's kohya names, saved in half precision, alpha as a 0-d float16).
    save_file({k: v.half() for k, v in kohya.items() if not k.startswith("lora_te_")}, tmp_path / "comfy.safetensors")
    files["comfyui"] = tmp_path / "comfy.safetensors"
    return files


def _outputs(net):
    """The network's output on fixed random latents, timesteps and text embeddings."""
    g = torch.Generator().manual_seed(0)
    x, cond, t = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 16, 32, generator=g), torch.tensor([10, 60])
    with torch.no_grad():
        return net(x, t, cond)


def test_files_of_other_programs_hold_the_adapter_and_sample_as_diffusers_does(runs, tmp_path, capsys):
    from difftrain.cli import main

    files = _their_files(runs, tmp_path)
    want = _outputs(load_model(runs / "lora", device="cpu").model)
    for layout, file in files.items():
        loaded = load_model(None, lora=file, base=str(runs / "sd"), device="cpu")
        tolerance = 1e-3 if layout == "comfyui" else 1e-5  # half-precision weights
        assert (_outputs(loaded.model) - want).abs().max() < tolerance, layout
        assert loaded.model.rank == 4 and loaded.cfg.diffusion.num_timesteps == 1000, layout  # the base's schedule
    assert "tensors outside the unet (text encoders) are not applied" in capsys.readouterr().err
    # Sampled on the base's own schedule, as StableDiffusionPipeline.load_lora_weights of the same file samples.
    loaded = load_model(None, lora=files["diffusers-script"], base=str(runs / "sd"), device="cpu")
    assert (_images(loaded) - _theirs(runs / "sd", files["diffusers-script"], loaded.cfg)).abs().max() < 1e-4
    # The CLI: --base names the base; without it, one line saying so.
    common = ["sample", "--num", "1", "--steps", "2", "--prompt", PROMPT, "--out", str(tmp_path / "s")]
    assert main(common + ["--lora", str(files["kohya-sd-scripts"]), "--base", str(runs / "sd")]) == 0
    assert main(common + ["--lora", str(files["kohya-sd-scripts"])]) == 2
    assert "carries no difftrain record of its base" in _one_error_line(capsys)


def test_init_lora_from_starts_the_adapter_from_a_file(runs, tmp_path, tiny_overrides, capsys):
    from difftrain.networks.conditioning import Conditioning
    from difftrain.networks.build import build_network

    files = _their_files(runs, tmp_path)
    want = _outputs(load_model(runs / "lora", device="cpu").model)
    for file in (files["kohya-sd-scripts"], api.export(runs / "lora", tmp_path / "own", format="lora")):
        cfg = load_config(None, _sd_overrides(runs, tiny_overrides, f"model.init_lora_from={file}", "lora.alpha=4"))
        net = build_network(cfg, Conditioning.from_config(cfg, 0))
        assert (_outputs(net) - want).abs().max() < 1e-5  # alpha 8 folded into B at this run's alpha 4
    train(load_config(None, _sd_overrides(runs, tiny_overrides, f"model.init_lora_from={files['comfyui']}",
                                          "train.total_steps=2")), tmp_path / "run")
    from difftrain.cli import main

    args = ["train", "--run-dir", str(tmp_path / "bad")]
    for s in _sd_overrides(runs, tiny_overrides, f"model.init_lora_from={files['kohya-sd-scripts']}", "lora.rank=2"):
        args += ["--set", s]
    assert main(args) == 2
    line = _one_error_line(capsys)
    assert "holds a lora adapter of rank 4; this run's is a lora of rank 2: set lora.kind=lora lora.rank=4" in line


# ---------------------------------------------------------------------------------------------
# Item 7 and hostile files: one line naming the file, exit 2.


def _kohya_file(runs, path, rename=None, damage=None) -> None:
    from safetensors.torch import save_file

    modules, alpha, _ = _adapter_by_module(runs / "lora")
    tensors = {}
    for i, (m, (a, b)) in enumerate(sorted(modules.items())):
        name = rename(i, m) if rename else _kohya_name(m)
        tensors.update({f"{name}.lora_down.weight": a, f"{name}.lora_up.weight": b, f"{name}.alpha": torch.tensor(alpha)})
    if damage:
        damage(tensors)
    save_file(tensors, path)


def _nowhere(i, m):
    return _kohya_name(m.replace("blocks", "sides").replace("mid_block", "mid_side"))


def _half_elsewhere(i, m):
    return _kohya_name(m.replace("attentions", "atentions") if i % 2 else m)


def _first_down(tensors):
    return sorted(k for k in tensors if k.endswith("lora_down.weight"))[0]


def _lying_shape(tensors):
    key = _first_down(tensors)
    tensors[key] = torch.zeros(tensors[key].shape[0], 999)


def _nan(tensors):
    tensors[_first_down(tensors)][0, 0] = float("nan")


def _orphan(tensors):
    del tensors[_first_down(tensors).replace("lora_down", "lora_up")]


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


FOREIGN_DAMAGE = {  # case -> (make(runs, path), what the line says)
    "matches-nothing": (lambda r, p: _kohya_file(r, p, rename=_nowhere), "0 of its 32 modules match a module of the base"),
    "matches-half": (lambda r, p: _kohya_file(r, p, rename=_half_elsewhere), "16 of its 32 modules match a module of the base"),
    "shape-lies": (lambda r, p: _kohya_file(r, p, damage=_lying_shape), "does not fit the base"),
    "nan-weight": (lambda r, p: _kohya_file(r, p, damage=_nan), "is not finite"),
    "down-without-up": (lambda r, p: _kohya_file(r, p, damage=_orphan), "lora_state_dict cannot read it"),
    "another-family": (lambda r, p: __import__("safetensors.torch", fromlist=["save_file"]).save_file(
        {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 8),
         "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(8, 4)}, p),
        "holds no tensor of a sd unet (0 modules match"),
    "crafted-pickle": (lambda r, p: torch.save({"x": _Payload(p.parent / "marker")}, p), "cannot read LoRA adapter"),
    "truncated": (lambda r, p: (_kohya_file(r, p), p.write_bytes(p.read_bytes()[:200])), "cannot read LoRA adapter"),
    "header-length-lies": (lambda r, p: (_kohya_file(r, p), p.write_bytes((2**40).to_bytes(8, "little") + p.read_bytes()[8:])),
                           "cannot read LoRA adapter"),
}


@pytest.mark.parametrize("case", FOREIGN_DAMAGE)
def test_a_bad_or_hostile_file_of_another_program_is_one_line(runs, tmp_path, capsys, case):
    from difftrain.cli import main

    make, says = FOREIGN_DAMAGE[case]
    path = tmp_path / "their.safetensors"
    make(runs, path)
    out = tmp_path / "samples"
    code = main(["sample", "--lora", str(path), "--base", str(runs / "sd"), "--num", "1", "--steps", "2",
                 "--out", str(out), "--prompt", PROMPT])
    line = _one_error_line(capsys)
    assert code == 2 and str(path) in line and says in line, line
    assert not list(out.glob("*.png")) and not (tmp_path / "marker").exists()


def test_inspect_names_the_kind(runs, capsys):
    from difftrain.cli import main

    assert main(["inspect", str(runs / "dora")]) == 0
    assert "dora rank 4, alpha 8 on" in capsys.readouterr().out
    assert json.loads(json.dumps(ckpt.load_checkpoint(runs / "lora")["network"]["lora"])).get("kind") is None


@pytest.mark.parametrize("setting, needle", [
    (["lora.kind=lokr", "lora.dropout=0.1"], "lora.dropout applies to lora.kind lora and dora"),
    (["lora.kind=vera"], "lora.kind"),
    (["lora.rank=0", "model.init_lora_from=x.safetensors"], "model.init_lora_from needs a LoRA run"),
])
def test_bad_kind_settings_are_one_line(tmp_path, tiny_overrides, capsys, setting, needle):
    from difftrain.cli import main

    args = ["train", "--run-dir", str(tmp_path / "run")]
    for s in _sd_overrides(tmp_path, tiny_overrides, *setting):
        args += ["--set", s]
    assert main(args) == 2
    line = _one_error_line(capsys)
    assert needle in line, line


def test_the_python_api_reads_another_programs_file(runs, tmp_path):
    import difftrain

    files = _their_files(runs, tmp_path)
    model = difftrain.load(lora=files["kohya-sd-scripts"], base=runs / "sd", lora_scale=0.5)
    images = difftrain.generate(model, 1, prompt=PROMPT, steps=2)
    assert images.shape == (1, 3, 16, 16) and torch.isfinite(images).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dora", "loha", "lokr"])
def test_each_kind_trains_on_cuda_compiled_in_bf16(tmp_path, tiny_overrides, kind):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cfg = load_config(None, _sd_overrides(tmp_path, tiny_overrides, f"lora.kind={kind}", "train.device=cuda",
                                          "train.compile=on", "train.precision=bf16"))
    result = train(cfg, tmp_path / "run")
    assert result.step == 6 and result.skipped_steps == 0
    images = generate_images(load_model(tmp_path / "run", device="cuda"), 2, steps=3, prompt=PROMPT)
    assert torch.isfinite(images).all()


def test_a_dora_file_of_another_program_reads_with_its_magnitudes(runs, tmp_path):
    """diffusers' layout with lora_magnitude_vector and no difftrain record (as a peft / diffusers script
    writes a DoRA adapter): read onto the base, the network computes the DoRA run's."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from difftrain.interop.adapters import ADAPTER_KEY

    file = api.export(runs / "dora", tmp_path / "dora", format="lora") / "pytorch_lora_weights.safetensors"
    with safe_open(str(file), framework="pt") as f:
        metadata = {k: v for k, v in f.metadata().items() if k != ADAPTER_KEY}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert any(k.endswith("lora_magnitude_vector") for k in tensors)
    save_file(tensors, tmp_path / "theirs.safetensors", metadata=metadata)
    loaded = load_model(None, lora=tmp_path / "theirs.safetensors", base=str(runs / "sd"), device="cpu")
    assert loaded.model.kind == "dora"
    assert (_outputs(loaded.model) - _outputs(load_model(runs / "dora", device="cpu").model)).abs().max() < 1e-5
