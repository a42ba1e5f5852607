"""Frozen parts in the compute dtype (issue 41 item 1, ``networks/frozen_dtype.py``): a bf16 LoRA run on a tiny
SD base and a tiny Flux base holds every frozen parameter of the denoiser, the text encoders and the VAE in
bfloat16 and every trainable one (the adapter, its EMA, its optimizer state) in float32, trains, resumes bit
for bit, and its LoRA export still loads in diffusers' pipeline; an fp32 LoRA run and a bf16 full fine-tune
keep float32. The memory check counts bytes held (numel * element_size), never a measured peak."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.config import load_config  # noqa: E402
from difftrain.checkpoints import checkpoint as ckpt  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from difftrain.training.state import RunState  # noqa: E402
from tests.family_bases import T5_LENGTH, write_tiny_flux_folder  # noqa: E402
from tests.integration.test_text_train import _captioned_folder  # noqa: E402
from tests.text_components import write_tiny_sd_folder  # noqa: E402

PROMPT = "a red square on a dark background"


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("frozen-dtype")
    _captioned_folder(root / "data16", n=8, size=16)
    _captioned_folder(root / "data32", n=8, size=32)
    return {"sd": write_tiny_sd_folder(root / "sd") or root / "sd", "flux": write_tiny_flux_folder(root / "flux"),
            "root": root}


def _overrides(bases, name, *extra):
    """A 4-step run (checkpoints at 2 and 4) of the tiny ``name`` base, text encoders held (text.cache off)."""
    common = ["data.num_workers=0", "optim.warmup_steps=1", "train.total_steps=4", "train.batch_size=2",
              "train.log_every_steps=2", "train.progress_bar=false", "ema.decay=0.9", "checkpoint.every_steps=2",
              "checkpoint.keep_last=2", "validation.every_steps=0", "text.cache=off", "optim.lr=1e-2"]
    if name == "sd":
        sd = bases["sd"]
        return common + ["data.resolution=16", f"data.path={bases['root'] / 'data16'}", "data.captions=true",
                         f"model.init_from={sd}", f"model.text_encoder={sd}", f"model.vae={sd}",
                         "diffusion.num_timesteps=100", *extra]
    return common + ["data.resolution=32", f"data.path={bases['root'] / 'data32'}", f"model.init_from={bases[name]}",
                     f"model.max_sequence_length={T5_LENGTH}", *extra]


@pytest.fixture
def built(monkeypatch):
    """Every RunState the loop builds, with its conditioning (the frozen text encoders and VAE)."""
    states = []
    original = RunState.build.__func__

    def spy(cls, *args, **kwargs):
        state = original(cls, *args, **kwargs)
        states.append(state)
        return state

    monkeypatch.setattr(RunState, "build", classmethod(spy))
    return states


def _frozen_dtypes(state) -> dict[str, set]:
    """{part: the dtypes of its frozen params} for the denoiser, the text encoders and the VAE."""
    parts = {"denoiser": state.model, "text": state.conditioning.text, "vae": state.conditioning.codec}
    return {k: {p.dtype for p in m.parameters() if not p.requires_grad} for k, m in parts.items()}


def held_bytes(module) -> int:
    """Bytes of ``module``'s frozen parameters as held: sum of numel * element_size."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if not p.requires_grad)


def _digests(run_dir) -> tuple[str, str]:
    state = ckpt.load_checkpoint(run_dir)
    return ckpt.state_dict_sha256(state["model"]), ckpt.state_dict_sha256(state["ema"]["model"])


@pytest.mark.parametrize("name", ["sd", "flux"])
def test_bf16_lora_holds_frozen_parts_in_bf16_trains_resumes_and_exports(tmp_path, bases, built, name):
    validation = [f"validation.prompts=['{PROMPT}']", "validation.every_steps=2", "validation.num_images=2",
                  "validation.steps=2"] if name == "sd" else []  # sampling outside the step's autocast
    cfg = load_config(None, _overrides(bases, name, "lora.rank=4", "lora.alpha=4", "train.precision=bf16", *validation))
    train(cfg, tmp_path / "straight")
    state = built[-1]
    assert _frozen_dtypes(state) == {"denoiser": {torch.bfloat16}, "text": {torch.bfloat16}, "vae": {torch.bfloat16}}
    trainable = [p for p in state.model.parameters() if p.requires_grad]
    assert trainable and {p.dtype for p in trainable} == {torch.float32}  # the adapter
    assert {p.dtype for p in state.ema.model.parameters() if p.is_floating_point()} >= {torch.float32}
    assert all(p.dtype == torch.float32 for p in state.ema._ema_params)  # the EMA of the adapter
    moments = [t for s in state.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    assert moments and {t.dtype for t in moments} == {torch.float32}
    # The memory held: every frozen parameter in 2 bytes, half of float32's 4 (counted, never measured).
    for part in (state.model, state.conditioning.text, state.conditioning.codec):
        numel = sum(p.numel() for p in part.parameters() if not p.requires_grad)
        assert numel and held_bytes(part) * 2 == numel * 4
    saved = ckpt.load_checkpoint(tmp_path / "straight")
    assert all(t.dtype == torch.float32 for t in saved["model"].values())  # checkpoints: the adapter, float32
    assert any(t.abs().sum() > 0 for n, t in saved["model"].items() if "lora_B" in n)  # it trained
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")
    assert _frozen_dtypes(built[-1])["denoiser"] == {torch.bfloat16}  # the resumed run holds it so too
    if name == "flux":
        from tests.family_exports import assert_lora_export_loads_in_the_pipeline
        from tests.family_runs import TinyBase

        base = TinyBase(bases["flux"], bases["root"] / "data32", T5_LENGTH)
        assert_lora_export_loads_in_the_pipeline(tmp_path, "flux", base, (16, 8, 8))
    else:
        _sd_export_loads_in_the_pipeline(tmp_path, bases)


def _sd_export_loads_in_the_pipeline(tmp_path, bases):
    """``export --format lora`` of the SD run loads in StableDiffusionPipeline and samples as difftrain does
    (tests/integration/test_lora.py's check)."""
    from difftrain import api
    from difftrain.generation.inference import generate_images, load_model
    from difftrain.generation.sampling import initial_noise
    from tests.integration.test_lora import _pipeline_images

    out = api.export(tmp_path / "straight", tmp_path / "adapter", format="lora")
    ours = load_model(tmp_path / "straight", device="cpu")
    assert {p.dtype for p in ours.model.parameters()} == {torch.float32}  # sampling loads the parts anew, float32
    expected = generate_images(ours, 2, sampler="ddim", steps=5, seed=3, prompt=PROMPT, guidance_scale=3.0)
    theirs = _pipeline_images(bases["sd"], out, ours.cfg, initial_noise(2, (4, 8, 8), 3), 5, 3.0)
    assert theirs.shape == expected.shape
    assert (theirs - expected).abs().max() < 1e-4


@pytest.mark.parametrize("extra", [["lora.rank=4", "lora.alpha=4", "train.precision=fp32"], ["train.precision=bf16"]],
                         ids=["fp32-lora", "bf16-full"])
def test_fp32_lora_and_full_fine_tune_keep_float32(tmp_path, bases, built, extra):
    cfg = load_config(None, _overrides(bases, "sd", *extra, "train.total_steps=1", "checkpoint.every_steps=1"))
    train(cfg, tmp_path / "run")
    state = built[-1]
    assert {p.dtype for p in state.model.parameters()} == {torch.float32}
    if "train.precision=fp32" in extra:  # a LoRA run in fp32: its frozen text encoders and VAE too
        assert _frozen_dtypes(state)["text"] == _frozen_dtypes(state)["vae"] == {torch.float32}


def test_difftrain_unet_lora_in_bf16_holds_its_base_in_bf16_and_validates(tmp_path, bases, built):
    """difftrain's own UNet as a LoRA base (a checkpoint of a text run): frozen in bf16, the adapter float32,
    validation grids sampled (outside the step's autocast) and finite."""
    from difftrain.checkpoints.checkpoint import find_checkpoint

    sd, data = bases["sd"], bases["root"] / "data16"
    from tests.conftest import TINY_OVERRIDES

    base = list(TINY_OVERRIDES) + [f"data.path={data}", "data.captions=true", f"model.text_encoder={sd}",
                                   f"model.vae={sd}", "validation.every_steps=0", "train.total_steps=2"]
    train(load_config(None, base), tmp_path / "base")
    ck = find_checkpoint(tmp_path / "base" / "checkpoints")
    cfg = load_config(None, base + [f"model.init_from={ck}", "lora.rank=4", "train.precision=bf16",
                                    "validation.every_steps=2", f"validation.prompts=['{PROMPT}']"])
    assert train(cfg, tmp_path / "lora").step == 2
    state = built[-1]
    assert {p.dtype for p in state.model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in state.model.parameters() if p.requires_grad} == {torch.float32}
    assert list((tmp_path / "lora").rglob("*.png"))  # the validation grid was written


def test_autocast_keeps_no_bf16_copies_of_a_base_held_in_bf16(bases):
    """What one bf16 LoRA step keeps for backward (tools/estimate.py's count, parameters excluded), tiny Flux base:
    with the base held in bf16, fewer bytes than with the same base cast back to float32, where autocast keeps a
    bf16 copy of each frozen weight a matmul saves. Bytes counted, not measured."""
    from torch import nn

    from difftrain.tools.common import build_setup
    from difftrain.tools.estimate import activation_bytes

    cfg = load_config(None, ["data.resolution=32", "data.path=/nonexistent", f"model.init_from={bases['flux']}",
                             f"model.max_sequence_length={T5_LENGTH}", "train.batch_size=2", "validation.every_steps=0",
                             "lora.rank=4", "train.precision=bf16"])
    setup = build_setup(cfg, need_data=False)
    linears = [m.weight for m in setup.model.modules() if isinstance(m, nn.Linear) and not m.weight.requires_grad]
    assert linears and {w.dtype for w in linears} == {torch.bfloat16}
    held, _ = activation_bytes(setup, 2)
    for w in [p for p in setup.model.parameters() if not p.requires_grad]:
        w.data = w.data.float()  # the float32 base of before
    as_float32, _ = activation_bytes(setup, 2)
    assert held < as_float32


def test_adapted_layers_keep_their_bf16_input_once_for_backward(bases):
    """A bf16 LoRA step on a base held in bf16, tiny Flux: peft's layers do not cast their bf16 input to the
    adapter's float32 (``LoraNetwork.held_dtype`` turns ``cast_input_dtype_enabled`` off), since autocast casts it
    back for the adapter's matmul: fewer bytes kept for backward than with peft's cast (a second bf16 copy of
    each adapted layer's input beside the base layer's), and the same output and adapter gradients, bit for bit.
    Bytes counted, not measured."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from difftrain.diffusion.objective import per_sample_loss
    from difftrain.runtime.distributed import DistContext
    from difftrain.tools.common import build_setup, fetch_batch
    from difftrain.tools.estimate import activation_bytes
    from difftrain.training.step import draw_micro_batch

    cfg = load_config(None, ["data.resolution=32", "data.path=/nonexistent", f"model.init_from={bases['flux']}",
                             f"model.max_sequence_length={T5_LENGTH}", "train.batch_size=2", "validation.every_steps=0",
                             "lora.rank=4", "train.precision=bf16"])
    setup = build_setup(cfg, need_data=False)
    layers = [m for m in setup.model.modules() if isinstance(m, BaseTunerLayer)]
    assert setup.model.held_dtype == torch.bfloat16 and layers

    def cast_input(on: bool | None):
        for layer in layers if on is not None else ():
            layer.cast_input_dtype_enabled = on
        x0, labels = fetch_batch(setup, 2, seed=0)
        b = draw_micro_batch(setup.state, setup.objective, x0, labels, 0, DistContext(device=setup.device))
        loss = per_sample_loss(setup.objective, setup.model, b.x0, b.condition, b.levels, b.noise,
                               setup.state.precision.autocast()).mean()
        loss.backward()
        grads = [p.grad.clone() for p in setup.model.parameters() if p.requires_grad]
        setup.model.zero_grad(set_to_none=True)
        return activation_bytes(setup, 2)[0], loss.detach(), grads

    without, loss, grads = cast_input(None)  # as built: held_dtype set it
    with_cast, loss_cast, grads_cast = cast_input(True)  # peft's default
    assert without < with_cast
    assert torch.equal(loss, loss_cast) and all(torch.equal(a, b) for a, b in zip(grads, grads_cast))
