"""LoRA end to end, offline: train an adapter on a tiny random Stable Diffusion UNet
(tests/text_components.py), resume it exactly, export it (kohya's layout: a plain UNet LoRA's default),
load it with ``StableDiffusionPipeline.load_lora_weights`` and compare the samples with difftrain's own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.config import load_config  # noqa: E402
from difftrain.generation.inference import generate_images, load_model  # noqa: E402
from difftrain.checkpoints import checkpoint as ckpt  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.integration.test_text_train import _captioned_folder  # noqa: E402
from tests.text_components import write_tiny_sd_folder  # noqa: E402

PROMPT = "a red square on a dark background"


def _sd_overrides(tmp_path, tiny_overrides, *extra):
    """A LoRA (rank 4, alpha 8) run on the tiny Stable Diffusion folder and captioned squares."""
    sd = tmp_path / "sd"
    if not sd.exists():
        write_tiny_sd_folder(sd)
        _captioned_folder(tmp_path / "data")
    return tiny_overrides + [f"data.path={tmp_path / 'data'}", "data.captions=true", f"model.text_encoder={sd}",
                             f"model.vae={sd}", f"model.init_from={sd}", "validation.every_steps=0",
                             "lora.rank=4", "lora.alpha=8", "optim.lr=1e-2", *extra]


def _digests(run_dir) -> tuple[str, str]:
    state = ckpt.load_checkpoint(run_dir)
    return ckpt.state_dict_sha256(state["model"]), ckpt.state_dict_sha256(state["ema"]["model"])


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A finished 6-step LoRA run on the tiny Stable Diffusion UNet, shared by the export tests."""
    from tests.conftest import TINY_OVERRIDES

    root = tmp_path_factory.mktemp("lora")
    cfg = load_config(None, _sd_overrides(root, list(TINY_OVERRIDES)))
    train(cfg, root / "run")
    return root


def test_lora_checkpoint_holds_the_adapter_and_the_base_digest_and_trains_only_it(lora_run):
    state = ckpt.load_checkpoint(lora_run / "run")
    assert state["network"]["kind"] == "lora" and len(state["network"]["base_digest"]) == 64
    assert state["network"]["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0,
                                        "targets": ["to_q", "to_k", "to_v", "to_out.0"]}
    names = list(state["model"])
    assert names and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in names)
    assert set(state["ema"]["model"]) == set(names)
    # The optimizer holds state for the adapter alone: one entry per adapter tensor.
    assert len(state["optimizer"]["state"]) == len(names)
    assert len(state["optimizer"]["param_groups"][0]["params"]) == len(names)
    assert any(t.abs().sum() > 0 for n, t in state["model"].items() if "lora_B" in n)  # it trained (B starts at 0)
    # The base did not move: the network rebuilt from the folder + adapter has the folder's base weights.
    from diffusers import UNet2DConditionModel

    base = UNet2DConditionModel.from_pretrained(lora_run / "sd" / "unet").state_dict()
    loaded = load_model(lora_run / "run", device="cpu").model
    merged_free = {k.replace(".base_layer.", "."): v for k, v in loaded.base.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(merged_free[k], v) for k, v in base.items())


def test_lora_run_resumes_exactly(tmp_path, tiny_overrides):
    cfg = load_config(None, _sd_overrides(tmp_path, tiny_overrides, "lora.dropout=0.1", "validation.every_steps=3",
                                          f"validation.prompts=['{PROMPT}']", "data.heldout_fraction=0.1",
                                          "ema.posthoc_std=[0.1]"))
    train(cfg, tmp_path / "straight")
    train(cfg, tmp_path / "resumed", stop_at_step=3)
    assert train(cfg, tmp_path / "resumed").step == 6
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")
    posthoc = ckpt.load_checkpoint(tmp_path / "straight")["posthoc_ema"]["models"][0]
    assert posthoc and all("lora_" in k for k in posthoc)  # the power EMAs average the adapter alone
    from difftrain.cli import main

    out = tmp_path / "posthoc.pt"
    assert main(["posthoc-ema", str(tmp_path / "straight"), "--std", "0.1", "--out", str(out)]) == 0
    images = generate_images(load_model(out, device="cpu"), 1, steps=2, prompt=PROMPT)
    assert torch.isfinite(images).all()


def test_resume_refuses_another_base_in_one_line(tmp_path, tiny_overrides):
    import shutil

    cfg = load_config(None, _sd_overrides(tmp_path, tiny_overrides))
    train(cfg, tmp_path / "run", stop_at_step=2)
    for setting, needle in (("lora.rank=2", "its adapter has rank 4, this config 2"),
                            ("lora.rank=0", "it holds a LoRA adapter, but lora.rank is 0"),
                            ("lora.target_modules=['to_q']", "its adapter has targets")):
        with pytest.raises(ValueError, match=needle):
            train(load_config(None, _sd_overrides(tmp_path, tiny_overrides, setting)), tmp_path / "run")
    other = write_tiny_sd_folder(tmp_path / "other", seed=1)
    shutil.rmtree(tmp_path / "sd" / "unet")
    shutil.copytree(other / "unet", tmp_path / "sd" / "unet")  # the same folder, another UNet
    with pytest.raises(ValueError) as info:
        train(cfg, tmp_path / "run")
    message = str(info.value)
    assert "\n" not in message and "not the base this LoRA adapter was trained on" in message
    assert str(tmp_path / "sd") in message


def _pipeline_images(sd, adapter_dir, cfg, noise, steps, guidance, scale=1.0):
    """The tiny Stable Diffusion pipeline with difftrain's DDIM scheduler settings (as its
    export writes them), the adapter loaded by diffusers, run from ``noise``; images in [-1, 1]."""
    from diffusers import DDIMScheduler, DDPMScheduler, StableDiffusionPipeline

    from difftrain.diffusion.scheduler_configs import scheduler_config

    pipe = StableDiffusionPipeline.from_pretrained(sd, safety_checker=None)
    ddpm = DDPMScheduler(**{**scheduler_config(cfg.diffusion), "clip_sample": False, "steps_offset": 1})
    pipe.scheduler = DDIMScheduler.from_config(ddpm.config)
    pipe.load_lora_weights(adapter_dir)
    images = pipe([PROMPT] * len(noise), latents=noise.clone(), num_inference_steps=steps, guidance_scale=guidance, eta=0.0,
                  output_type="pt", height=16, width=16, cross_attention_kwargs={"scale": scale}).images
    return images * 2 - 1


def test_exported_adapter_loads_in_diffusers_and_samples_as_difftrain_does(lora_run, tmp_path):
    from difftrain import api
    from difftrain.generation.sampling import initial_noise

    out = api.export(lora_run / "run", tmp_path / "adapter", format="lora")
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    ours = load_model(lora_run / "run", device="cpu")
    steps, guidance = 5, 3.0
    expected = generate_images(ours, 2, sampler="ddim", steps=steps, seed=3, prompt=PROMPT, guidance_scale=guidance)
    noise = initial_noise(2, (4, 8, 8), 3)
    theirs = _pipeline_images(lora_run / "sd", out, ours.cfg, noise, steps, guidance)
    assert theirs.shape == expected.shape
    assert (theirs - expected).abs().max() < 1e-4
    base_only = generate_images(load_model(lora_run / "run", device="cpu", lora_scale=0.0), 2, sampler="ddim",
                                steps=steps, seed=3, prompt=PROMPT, guidance_scale=guidance)
    assert (base_only - expected).abs().max() > 1e-3  # the adapter changes the samples
    # The adapter file alone, on the base it names, samples the same (sample --lora), at any scale.
    from_file = load_model(None, device="cpu", lora=out)
    again = generate_images(from_file, 2, sampler="ddim", steps=steps, seed=3, prompt=PROMPT, guidance_scale=guidance)
    assert torch.equal(again, expected)
    half = generate_images(load_model(None, device="cpu", lora=out, lora_scale=0.5), 2, sampler="ddim", steps=steps,
                           seed=3, prompt=PROMPT, guidance_scale=guidance)
    theirs_half = _pipeline_images(lora_run / "sd", out, ours.cfg, noise, steps, guidance, scale=0.5)
    assert (theirs_half - half).abs().max() < 1e-4


def test_merged_export_is_the_adapted_unet(lora_run, tmp_path):
    from diffusers import StableDiffusionPipeline

    from difftrain import api

    out = api.export(lora_run / "run", tmp_path / "pipe", format="diffusers", merge=True)
    unet = StableDiffusionPipeline.from_pretrained(out, safety_checker=None).unet.eval()
    ours = load_model(lora_run / "run", device="cpu").model
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 16, 32, generator=g)
    t = torch.tensor([10, 60])
    with torch.no_grad():
        assert (unet(x, t, encoder_hidden_states=cond).sample - ours(x, t, cond)).abs().max() < 1e-5


def test_sample_command_takes_an_adapter_and_a_scale(lora_run, tmp_path, capsys):
    from difftrain.cli import main

    adapter = tmp_path / "adapter"
    assert main(["export", str(lora_run / "run"), str(adapter), "--format", "lora"]) == 0
    out = tmp_path / "samples"
    assert main(["sample", "--lora", str(adapter), "--lora-scale", "0.7", "--num", "2", "--steps", "2",
                 "--out", str(out), "--prompt", PROMPT]) == 0
    assert (out / "grid.png").is_file()
    # Neither or both of --checkpoint and --lora: one line, exit code 2.
    assert main(["sample", "--num", "1", "--steps", "2", "--out", str(out), "--prompt", PROMPT]) == 2
    assert "--lora" in capsys.readouterr().err
    pixels = np.asarray(__import__("PIL.Image", fromlist=["Image"]).open(out / "000000.png"))
    assert pixels.shape == (16, 16, 3)


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("difftrain ")]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("setting, needle", [
    ("lora.rank=64", "lora.rank=64 is larger than the layer"),
    ("lora.target_modules=['nothing']", "lora.target_modules ['nothing'] match no layer"),
    ("lora.target_modules=['norm1']", "LoRA adapts Linear and Conv2d layers"),
])
def test_bad_lora_settings_are_one_line(tmp_path, tiny_overrides, capsys, setting, needle):
    from difftrain.cli import main

    args = ["train", "--run-dir", str(tmp_path / "run")]
    for s in _sd_overrides(tmp_path, tiny_overrides, setting):
        args += ["--set", s]
    assert main(args) == 2
    line = _one_error_line(capsys)
    assert needle in line, line


def test_missing_peft_names_the_extra(tmp_path, tiny_overrides, capsys, monkeypatch):
    import importlib.util

    from difftrain.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    args = ["train", "--run-dir", str(tmp_path / "run")]
    for s in _sd_overrides(tmp_path, tiny_overrides):
        args += ["--set", s]
    assert main(args) == 2
    assert "lora.rank > 0 needs the peft package, which is not installed: pip install 'difftrain[lora]'" \
        in _one_error_line(capsys)
    assert not (tmp_path / "run").exists()  # refused before anything was written
    # Past that check (the Python API's build, a sampler): the same line where peft is imported.
    import sys

    from difftrain.networks.lora import import_peft
    from difftrain.runtime.optional import MissingDependency

    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(MissingDependency, match=r"needs the peft package.*difftrain\[lora\]"):
        import_peft()


def test_a_base_without_adapter_layers_needs_no_peft_for_the_input_cast(monkeypatch):
    """``estimate --base`` holds a full fine-tuning's base as LoRA's (tools/base_memory.py): no adapter layer, no
    peft to import."""
    import sys

    from difftrain.networks.lora import cast_adapter_input

    monkeypatch.setitem(sys.modules, "peft.tuners.tuners_utils", None)  # an import of it now fails
    cast_adapter_input(torch.nn.Linear(2, 2), False)


def test_adapter_on_another_base_and_other_misuse_are_one_line(lora_run, tmp_path, capsys):
    from difftrain.cli import main

    adapter = tmp_path / "adapter"
    assert main(["export", str(lora_run / "run"), str(adapter), "--format", "lora"]) == 0
    other = write_tiny_sd_folder(tmp_path / "other", seed=1)
    common = ["sample", "--num", "1", "--steps", "2", "--out", str(tmp_path / "s"), "--prompt", PROMPT]
    assert main(common + ["--lora", str(adapter), "--base", str(other)]) == 2
    line = _one_error_line(capsys)
    assert "not the base this LoRA adapter was trained on" in line and str(other) in line
    assert main(common + ["--lora", str(tmp_path / "missing")]) == 2
    assert "does not exist" in _one_error_line(capsys)
    capsys.readouterr()
    # export --format lora of a run without an adapter; --merge with --format lora
    from tests.conftest import TINY_OVERRIDES

    full = tmp_path / "full"
    train(load_config(None, TINY_OVERRIDES + ["train.total_steps=2", "validation.every_steps=0"]), full)
    assert main(["export", str(full), str(tmp_path / "a2"), "--format", "lora"]) == 2
    assert "is not a LoRA run" in _one_error_line(capsys)
    assert main(["export", str(lora_run / "run"), str(tmp_path / "a3"), "--format", "lora", "--merge"]) == 2
    assert "--merge" in _one_error_line(capsys)
    assert main(["export", str(lora_run / "run"), str(tmp_path / "a4")]) == 2  # a pipeline needs --merge
    assert "is a LoRA run: export --format lora" in _one_error_line(capsys)
    assert main(["sample", "--checkpoint", str(full), "--base", str(other), "--num", "1", "--steps", "2",
                 "--out", str(tmp_path / "s")]) == 2
    assert "holds no LoRA adapter" in _one_error_line(capsys)
    assert main(["sample", "--checkpoint", str(full), "--lora-scale", "0.5", "--num", "1", "--steps", "2",
                 "--out", str(tmp_path / "s")]) == 2
    assert "holds no LoRA adapter" in _one_error_line(capsys)


def test_inspect_names_the_adapter_and_its_base(lora_run, capsys):
    from difftrain.cli import main

    assert main(["inspect", str(lora_run / "run")]) == 0
    out = capsys.readouterr().out
    assert "rank 4, alpha 8 on to_q, to_k, to_v, to_out.0 of the base" in out and "not in the checkpoint" in out


def test_safetensors_export_of_a_lora_run_holds_the_adapter_and_merge_the_whole_network(lora_run, tmp_path):
    from difftrain import api

    adapter_only = api.export(lora_run / "run", tmp_path / "a.safetensors", format="safetensors")
    merged = api.export(lora_run / "run", tmp_path / "m.safetensors", format="safetensors", merge=True)
    assert adapter_only.stat().st_size * 5 < merged.stat().st_size
    expected = generate_images(load_model(lora_run / "run", device="cpu"), 1, steps=2, prompt=PROMPT)
    for path in (adapter_only, merged):
        got = generate_images(load_model(path, device="cpu"), 1, steps=2, prompt=PROMPT)
        assert (got - expected).abs().max() < 1e-5


def test_lora_on_difftrains_own_text_unet_trains_resumes_and_merges(tmp_path, tiny_overrides):
    from difftrain import api

    text = ["data.captions=true", "model.text_encoder=builtin:tiny-clip", "validation.every_steps=0"]
    train(load_config(None, tiny_overrides + text + ["train.total_steps=2"]), tmp_path / "base")
    cfg = load_config(None, tiny_overrides + text + [f"model.init_from={tmp_path / 'base'}", "lora.rank=2",
                                                     "lora.include_conv=true", "optim.lr=1e-2"])
    train(cfg, tmp_path / "straight")
    train(cfg, tmp_path / "resumed", stop_at_step=3)
    assert train(cfg, tmp_path / "resumed").step == 6
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")
    state = ckpt.load_checkpoint(tmp_path / "straight")
    assert state["network"]["base"] == {"kind": "unet"}
    assert state["network"]["lora"]["targets"] == ["q", "k", "v", "proj_out", "conv1", "conv2"]
    assert any(".conv1.lora_A." in k for k in state["model"]) and any(".k.lora_B." in k for k in state["model"])
    with pytest.raises(ValueError, match="difftrain's own network, which diffusers cannot load"):
        api.export(tmp_path / "straight", tmp_path / "adapter", format="lora", lora_layout="diffusers")
    merged = api.export(tmp_path / "straight", tmp_path / "m.safetensors", format="safetensors", merge=True)
    prompt = "a red disc on a dark background"
    expected = generate_images(load_model(tmp_path / "straight", device="cpu"), 1, steps=2, prompt=prompt)
    assert (generate_images(load_model(merged, device="cpu"), 1, steps=2, prompt=prompt) - expected).abs().max() < 1e-5
    # The adapter alone, as a small file in difftrain's layout (the default for its own networks), which
    # sample --lora and the API read back onto the base the record names.
    adapter = api.export(tmp_path / "straight", tmp_path / "adapter", format="lora")
    file = adapter / "pytorch_lora_weights.safetensors"
    assert file.stat().st_size * 5 < merged.stat().st_size
    got = generate_images(load_model(None, lora=adapter, device="cpu"), 1, steps=2, prompt=prompt)
    assert (got - expected).abs().max() < 1e-6
    from difftrain.cli import main

    assert main(["sample", "--lora", str(file), "--num", "1", "--steps", "2", "--prompt", prompt,
                 "--out", str(tmp_path / "s")]) == 0


def test_estimate_counts_the_adapter_as_what_trains(lora_run):
    from difftrain.tools.estimate import estimate

    cfg = load_config(None, _sd_overrides(lora_run, []) + ["data.resolution=16", "train.device=cpu"])
    lora = estimate(cfg, batch_size=2)
    object.__setattr__(cfg.lora, "rank", 0)
    full = estimate(cfg, batch_size=2)
    assert lora["parameters"] > full["parameters"] == full["trained_parameters"] > 10 * lora["trained_parameters"]
    for key in ("grads_mib", "optimizer_mib", "ema_mib"):  # the frozen base has none of these
        assert lora[key] * 10 < full[key], key
    assert lora["params_mib"] > full["params_mib"]  # the base is there, plus the adapter


@pytest.mark.gpu
def test_lora_trains_on_cuda_compiled_in_bf16(tmp_path, tiny_overrides):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cfg = load_config(None, _sd_overrides(tmp_path, tiny_overrides, "train.device=cuda", "train.compile=on",
                                          "train.precision=bf16"))
    result = train(cfg, tmp_path / "run")
    assert result.step == 6 and result.skipped_steps == 0
    state = ckpt.load_checkpoint(tmp_path / "run")
    assert all("lora_" in k for k in state["model"])
    assert any(t.abs().sum() > 0 for n, t in state["ema"]["model"].items() if "lora_B" in n)  # the EMA moved too
    images = generate_images(load_model(tmp_path / "run", device="cuda"), 2, steps=3, prompt=PROMPT)
    assert torch.isfinite(images).all()


@pytest.mark.slow
def test_lora_under_torchrun_matches_one_process(tmp_path, tiny_overrides):
    """2 processes (gloo) of 4 images against 1 of 8: the same adapter (DDP leaves the frozen base alone)."""
    import os
    import subprocess
    import sys

    sets = _sd_overrides(tmp_path, tiny_overrides, "train.total_steps=4", "train.device=cpu",
                         "tracking.tensorboard=false", f"data.cache_dir={tmp_path / 'cache'}")
    for run_dir, nproc, batch in (("one", 1, 8), ("two", 2, 4)):
        args = ["-m", "difftrain", "train", "--run-dir", str(tmp_path / run_dir),
                *[a for kv in sets + [f"train.batch_size={batch}"] for a in ("--set", kv)]]
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else []
        proc = subprocess.run([sys.executable, *launcher, *args], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
    one, two = (ckpt.load_checkpoint(tmp_path / r)["model"] for r in ("one", "two"))
    assert set(one) == set(two) and all("lora_" in k for k in one)
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5  # float rounding of the all-reduce


# Hostile adapter files (issue 26): each refused with one line naming the file, exit 2.


@pytest.fixture(scope="module")
def adapter_file(lora_run) -> "Path":
    from difftrain.cli import main

    assert main(["export", str(lora_run / "run"), str(lora_run / "adapter"), "--format", "lora"]) == 0
    return lora_run / "adapter" / "pytorch_lora_weights.safetensors"


def _rewritten(path, tensors=None, record=None) -> None:
    """``path`` written again with ``tensors(dict)`` / ``record(dict)`` applied to its contents."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from difftrain.interop.adapters import ADAPTER_KEY

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    weights = load_file(str(path))
    if tensors:
        tensors(weights)
    if record:
        fields = json.loads(metadata[ADAPTER_KEY])
        record(fields)
        metadata[ADAPTER_KEY] = json.dumps(fields)
    save_file(weights, str(path), metadata=metadata)


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _first_nan(weights) -> None:
    weights[sorted(k for k in weights if weights[k].dim())[0]][0] = float("nan")  # a factor, not a 0-d alpha


def _misnamed(weights) -> None:
    key = sorted(k for k in weights if k.endswith(".lora_down.weight"))[0]
    weights[key.replace("attn1", "attn9")] = weights.pop(key)


def _wrong_shape(weights) -> None:
    key = sorted(k for k in weights if k.endswith(".lora_down.weight"))[0]
    weights[key] = torch.zeros(weights[key].shape[0], 999)


def _cut(path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


ADAPTER_DAMAGE = {  # case -> (damage(path), what the line says)
    "nan-weights": (lambda p: _rewritten(p, tensors=_first_nan), "is not finite"),
    "step-negative": (lambda p: _rewritten(p, record=lambda r: r.update(step=-5)), "'step' must be an integer >= 0"),
    "not-a-lora-record": (lambda p: _rewritten(p, record=lambda r: r.update(network={"kind": "unet"})),
                          "not a LoRA adapter's"),
    "names-no-module": (lambda p: _rewritten(p, tensors=_misnamed), "attn9_to_k.lora_down.weight names no module of its sd"),
    "shape-lies": (lambda p: _rewritten(p, tensors=_wrong_shape), "has shape (4, 999)"),
    "crafted-pickle": (lambda p: torch.save({"x": _Payload(p.parent / "marker")}, p), "cannot read LoRA adapter"),
    "truncated": (lambda p: _cut(p, 100), "cannot read LoRA adapter"),
    "header-claims-more-bytes": (lambda p: _cut(p, p.stat().st_size - 64), "cannot read LoRA adapter"),
    "header-length-lies": (lambda p: p.write_bytes((2**40).to_bytes(8, "little") + p.read_bytes()[8:]),
                           "cannot read LoRA adapter"),
    "missing": (lambda p: p.unlink(), "does not exist"),
}


@pytest.mark.parametrize("case", ADAPTER_DAMAGE)
def test_a_hostile_adapter_is_one_line_naming_the_file(adapter_file, case, tmp_path, capsys):
    import shutil

    from difftrain.cli import main

    damage, says = ADAPTER_DAMAGE[case]
    path = tmp_path / adapter_file.name
    shutil.copy(adapter_file, path)
    damage(path)
    out = tmp_path / "samples"
    code = main(["sample", "--lora", str(path), "--num", "1", "--steps", "2", "--out", str(out), "--prompt", PROMPT])
    line = _one_error_line(capsys)
    assert code == 2 and str(path) in line and says in line, line
    assert not list(out.glob("*.png")) and not (tmp_path / "marker").exists()
    if case == "nan-weights":
        assert "lora_unet_" in line  # the first bad tensor, by its name in the file (the default layout: kohya's)
