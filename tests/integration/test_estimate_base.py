"""`difftrain estimate --base`: a base counted on the meta device from its config.json files, checked against a
real CPU step of the same tiny base (tools/estimate.py's measured path): weights, gradients, optimizer state and
EMA to the byte, the activations autograd keeps to the byte (fp32, with and without checkpointing)."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.config import load_config  # noqa: E402
from difftrain.tools.base_memory import QUANT_BYTES, count_base, format_base, known_bases  # noqa: E402
from difftrain.tools.estimate import estimate  # noqa: E402
from tests.family_bases import T5_LENGTH, write_tiny_flux_folder  # noqa: E402

MiB = 2**20


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """A tiny Flux folder with weights, and a copy holding only its config.json files."""
    return _flux_folders(tmp_path_factory.mktemp("estimate-base"))


@pytest.fixture(scope="module")
def wide_flux(tmp_path_factory):
    """:func:`flux` 64 wide, so that nf4 holds some of its layers (models/quantize.unfit leaves narrower ones float)."""
    return _flux_folders(tmp_path_factory.mktemp("estimate-wide"), head_dim=32)


def _flux_folders(root, head_dim: int = 8):
    folder = write_tiny_flux_folder(root / "flux", head_dim=head_dim)
    configs = root / "flux-configs"
    for f in folder.rglob("*.json"):
        if f.name in ("model_index.json", "config.json", "scheduler_config.json"):
            (configs / f.relative_to(folder)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, configs / f.relative_to(folder))
    assert not list(configs.rglob("*.safetensors"))
    return folder, configs


def _cfg(folder, *extra):
    return load_config(None, ["data.resolution=32", "data.path=/nonexistent", f"model.init_from={folder}",
                              f"model.max_sequence_length={T5_LENGTH}", "train.batch_size=2", "optim.warmup_steps=1",
                              "validation.every_steps=0", "train.progress_bar=false", *extra])


def _row(r, **want):
    return next(row for row in r["rows"] if all(row[k] == v for k, v in want.items()))


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_counted_parts_equal_a_real_step_to_the_byte(flux, mode):
    """The configs-only folder counted on meta against the weights folder measured on the CPU: weights,
    gradients, AdamW state, EMA exact; the activations autograd keeps exact (fp32, so the CPU's own
    precision), with checkpointing the part a real checkpoint shows to hooks (outside + the blocks' inputs)."""
    folder, configs = flux
    extra = ["lora.rank=4", "lora.alpha=4"] if mode == "lora" else []
    for ckpt in (False, True):
        cfg = _cfg(folder, f"model.gradient_checkpointing={str(ckpt).lower()}", *extra)
        measured = estimate(cfg, batch_size=2)
        counted = count_base(_cfg(configs, f"model.gradient_checkpointing={str(ckpt).lower()}", *extra),
                             str(configs), ranks=2)
        row = _row(counted, lora=mode == "lora", ranks=1, optimizer="adamw", checkpointing=ckpt, quantize_base="off")
        assert counted["rows"][0]["ranks"] == 2 and counted["rows"][0]["checkpointing"] == ckpt  # the config's first
        assert row["weights"] / MiB == measured["params_mib"]
        assert row["buffers"] / MiB == 2 * measured["buffers_mib"]  # the model's and the EMA's
        assert row["grads"] / MiB == measured["grads_mib"]
        assert row["optimizer_state"] / MiB == measured["optimizer_mib"]
        assert row["ema"] / MiB == measured["ema_mib"]
        parts = row["activation_parts"]
        assert (parts["saved"] + parts["checkpoint_inputs"]) / MiB == measured["activations_mib"]
        assert (parts["blocks"] > 0) == ckpt
    assert counted["parameters"] == measured["parameters"] if mode == "full" else counted["lora_parameters"] == \
        measured["trained_parameters"]


def test_bf16_lora_counts_the_frozen_base_in_bf16_as_training_holds_it(flux):
    """A LoRA setting in bf16 (networks/frozen_dtype.py): the frozen base counted at 2 bytes a weight, equal to the
    bytes a real bf16 LoRA state holds; no bf16 copies of frozen weights among the activations; the text encoders
    (text cache off) at 2 bytes; fp32, full fine-tuning and FSDP (frozen shards float32) keep 4 bytes."""
    folder, configs = flux
    extra = ["lora.rank=4", "lora.alpha=4", "text.cache=off"]
    measured = estimate(_cfg(folder, "train.precision=bf16", *extra), batch_size=2)
    r = count_base(_cfg(configs, "train.precision=bf16", *extra), str(configs), ranks=2)
    fp32 = count_base(_cfg(configs, "train.precision=fp32", *extra), str(configs), ranks=2)
    lora = dict(lora=True, ranks=1, optimizer="adamw", checkpointing=False, quantize_base="off")
    row, row32 = _row(r, **lora), _row(fp32, **lora)
    trained = 4 * r["lora_parameters"]  # the adapter, float32
    assert row["weights"] == 2 * r["parameters"] + trained  # the base (its parameters) in bf16
    assert row["weights"] / MiB == measured["params_mib"]  # what the real bf16 LoRA state holds
    assert row32["weights"] - trained == 2 * (row["weights"] - trained)  # the frozen base halves
    assert row["activation_parts"]["frozen_casts"] == 0 < row["activation_parts"]["saved"]
    assert row32["text_encoders"] == 2 * row["text_encoders"] > 0
    full = dict(lora=False, ranks=1, optimizer="adamw", checkpointing=False)
    assert _row(r, **full)["weights"] == _row(fp32, **full)["weights"]  # full fine-tuning: float32 master weights
    fsdp = dict(lora=True, ranks=2, parallel="fsdp", optimizer="adamw", checkpointing=False)
    assert _row(r, **fsdp)["weights"] == _row(fp32, **fsdp)["weights"]  # FSDP's frozen shards stay float32
    assert "text encoders loaded, bf16" in format_base(r)


def test_settings_table_and_levers(wide_flux):
    """Every row's total is its parts; checkpointing, 8-bit AdamW, a 4-bit base and FSDP each lower the total
    of an otherwise equal setting; the text encoders count only with the text cache off. (The base 64 wide:
    nf4 leaves layers narrower than its blocks in float32, so on the narrowest base it lowers nothing.)"""
    _, configs = wide_flux
    r = count_base(_cfg(configs, "train.precision=bf16", "lora.rank=4"), str(configs), ranks=4)
    for row in r["rows"]:
        parts = ("weights", "buffers", "grads", "optimizer_state", "ema", "transient", "activations", "text_encoders")
        assert row["total"] == sum(row[k] for k in parts)

    def total(**k):
        return _row(r, **k)["total"]

    base = dict(lora=True, ranks=1, optimizer="adamw", checkpointing=False, quantize_base="off")
    assert total(**{**base, "checkpointing": True}) < total(**base)
    assert total(**{**base, "optimizer": "adamw8bit"}) < total(**base)
    assert total(**{**base, "quantize_base": "nf4"}) < total(**base)
    full = dict(lora=False, ranks=4, optimizer="adamw", checkpointing=False)
    assert total(**full, parallel="fsdp") < total(**full, parallel="ddp")
    assert {row["ranks"] for row in r["rows"]} == {1, 4}
    assert not any(row["parallel"] == "fsdp" and row["optimizer"] == "adamw8bit" for row in r["rows"])  # not under FSDP
    assert all(row["text_encoders"] == 0 for row in r["rows"])  # the text cache is on by default
    off = count_base(_cfg(configs, "text.cache=off"), str(configs), ranks=1)
    assert off["rows"][0]["text_encoders"] > 0
    text = format_base(r)
    assert "16G" in text and "nf4 base" in text and "4 x FSDP" in text


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tensor subclass: its inner tensors')."""
    seen: dict[int, int] = {}

    def add(t):
        if hasattr(t, "__tensor_flatten__"):
            for name in t.__tensor_flatten__()[0]:
                add(getattr(t, name))
        else:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for t in tensors:
        add(t)
    return sum(seen.values())


def test_fp8_weight_bytes_equal_torchao_to_the_byte():
    """QUANT_BYTES["fp8"] against the tensors torchao's Float8WeightOnlyConfig makes of a Linear weight."""
    import torch

    pytest.importorskip("torchao")
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    weight = torch.randn(256, 512)
    layer = torch.nn.Sequential(torch.nn.Linear(512, 256))
    layer[0].weight.data = weight
    quantize_(layer, Float8WeightOnlyConfig())
    assert _storage_bytes([layer[0].weight]) == QUANT_BYTES["fp8"](weight.numel(), weight.shape[0])


def _bnb_held(module) -> list:
    """The tensors a bitsandbytes layer holds besides its parameters: an int8 layer's state (its int8 weight
    and row scales), an nf4 weight's quant_state (block absmax, code table, offset, the nested state's)."""
    import torch

    held = []
    state = getattr(module, "state", None)
    if state is not None and hasattr(state, "SCB"):
        held += [v for v in vars(state).values() if torch.is_tensor(v)]
    quant = getattr(dict(module.named_parameters(recurse=False)).get("weight"), "quant_state", None)
    while quant is not None:
        held += [v for v in vars(quant).values() if torch.is_tensor(v)]
        quant = quant.state2
    return held


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantized_base_weights_equal_bitsandbytes_to_the_byte(wide_flux, kind):
    """A LoRA over an int8 / nf4 base: estimate's weights (counted on meta from the config.json files) equal
    the bytes of every distinct storage of the tiny Flux network that training builds
    (``build_network``: quantized by networks/quantize.py with bitsandbytes, peft's layers over it): its
    parameters and the quantization state bitsandbytes keeps beside them."""
    pytest.importorskip("bitsandbytes")
    from difftrain.networks.conditioning import Conditioning
    from difftrain.networks.quantize import quantized_layers
    from difftrain.networks.build import build_network

    folder, configs = wide_flux
    extra = ("lora.rank=4", "lora.alpha=4", f"model.quantize_base={kind}")
    cfg = _cfg(folder, *extra)
    net = build_network(cfg, Conditioning.from_config(cfg, 0))
    assert set(quantized_layers(net).values()) == {kind}
    held = list(net.parameters()) + [t for m in net.modules() for t in _bnb_held(m)]
    counted = count_base(_cfg(configs, *extra), str(configs), ranks=1)
    assert counted["rows"][0]["quantize_base"] == kind
    assert counted["rows"][0]["weights"] == _storage_bytes(held)


def test_known_bases_are_the_public_architectures():
    """The shipped configs build the public models on meta: SDXL's UNet 2,567,463,684 parameters, Flux.1-dev's
    transformer 11,901,408,320, Stable Diffusion 1.5's UNet 859,520,964 (its CLIP ViT-L/14 text tower 123,060,480)."""
    import torch

    from difftrain.families import detect
    from difftrain.tools.base_memory import base_folder, denoiser_config

    from difftrain.tools.base_memory import text_encoder_params

    assert known_bases() == ["auraflow", "chroma", "flux-dev", "flux-kontext-dev", "flux2-dev", "flux2-klein-4b",
                             "flux2-klein-9b", "hidream", "lumina2", "pixart-sigma", "qwen-image", "qwen-image-edit", "sana", "sana-4.8b",
                             "sd1.5", "sd3.5-large", "sd3.5-medium", "sdxl", "z-image"]
    assert text_encoder_params(base_folder("sd1.5")) == 123_060_480
    for name, params in {"sdxl": 2_567_463_684, "flux-dev": 11_901_408_320, "flux-kontext-dev": 11_901_408_320,
                         "sd1.5": 859_520_964, "chroma": 8_899_983_424,
                         "auraflow": 6_858_605_568}.items():  # Chroma1-HD, AuraFlow v0.3
        folder = base_folder(name)
        with torch.device("meta"):
            net = detect(folder).denoiser_from_record({"config": denoiser_config(folder)})
        assert sum(p.numel() for p in net.parameters()) == params


# The published sizes of the SD3.5 denoisers, from the model cards (huggingface.co/stabilityai/
# stable-diffusion-3.5-medium: "MMDiT-X ... 2.5 billion parameters"; stable-diffusion-3.5-large: "8.1 billion
# parameters"; the same in Stability AI's "Introducing Stable Diffusion 3.5", 2024-10-22).
PUBLISHED = {"sd3.5-medium": 2.5e9, "sd3.5-large": 8.1e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_sd35_counts_are_the_published_sizes(name):
    """SD3.5's shipped configs (Medium: MMDiT-X, dual attention in blocks 0..12, RMSNorm on q and k) count
    within 2% of the published size. The published figure counts the weight file's tensors: the parameters
    (Medium 2,243,171,520) and the position table (a tensor of the file) diffusers holds as a persistent buffer (Medium
    384 x 384 x 1536 = 226,492,416); the parameters alone are 10% short of it."""
    import torch

    from difftrain.families import detect
    from difftrain.tools.base_memory import base_folder, denoiser_config, stored_parameters, text_encoder_params

    folder = base_folder(name)
    config = denoiser_config(folder)
    if name == "sd3.5-medium":
        assert config["dual_attention_layers"] == list(range(13)) and config["qk_norm"] == "rms_norm"
    with torch.device("meta"):
        net = detect(folder).denoiser_from_record({"config": config})
    assert abs(stored_parameters(net) / PUBLISHED[name] - 1) < 0.02
    if name == "sd3.5-medium":
        assert stored_parameters(net) - sum(p.numel() for p in net.parameters()) == 384 * 384 * 1536
    # the three text encoders (Large's are the same), as the published models count them: CLIP ViT-L/14's
    # text tower with its projection 123,650,304, OpenCLIP ViT-bigG/14's 694,659,840, T5 v1.1 XXL's encoder
    # 4,762,310,656
    if name == "sd3.5-medium":
        assert text_encoder_params(folder) == 123_650_304 + 694_659_840 + 4_762_310_656


def test_estimate_base_cli(flux, tmp_path, capsys):
    """The command (in this process: the subprocess start-up is the CLI tests' own): JSON out, a missing base is
    one line and exit 2."""
    from difftrain.cli import main

    _, configs = flux
    assert main(["estimate", "--base", str(configs), "--set", "data.resolution=32", "--set",
                 f"model.max_sequence_length={T5_LENGTH}", "--batch-size", "1", "--world-size", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["family"] == "flux" and r["batch_size"] == 1 and {row["ranks"] for row in r["rows"]} == {1, 2}
    assert main(["estimate", "--base", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "--base" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_config_quantize_base_is_the_first_row(flux):
    """``model.quantize_base`` (read with a default: the key comes with the quantized-base work) sets the
    config's own row; an unknown value is one ValueError naming the key."""
    _, configs = flux
    cfg = _cfg(configs, "lora.rank=4")
    cfg.model.__dict__["quantize_base"] = "int8"  # as the key will, without this branch's config knowing it
    r = count_base(cfg, str(configs), ranks=1)
    own = r["rows"][0]
    assert own["quantize_base"] == "int8" and own["lora"]
    plain = _row(r, lora=True, optimizer="adamw", checkpointing=False, quantize_base="off")
    assert own["weights"] < plain["weights"] and own["activations"] <= plain["activations"]
    cfg.model.__dict__["quantize_base"] = "int3"
    with pytest.raises(ValueError, match="model.quantize_base"):
        count_base(cfg, str(configs), ranks=1)


def test_estimate_counts_lumina2s_activations():
    """`difftrain estimate --base lumina2` counts Lumina 2's activations on the meta device (before: "not counted",
    0 bytes: its transformer reads each row's caption token count from the mask on the host), every caption at
    the full max_sequence_length (256): the 26 checkpointed joint layers' inputs alone hold (256 + the image's
    tokens) x 2304 bf16 values each."""
    from difftrain.config import load_config
    from difftrain.tools.base_memory import _config_setting, base_folder, count_settings, read_base

    cfg = load_config(None, [f"model.init_from={base_folder('lumina2')}", "data.resolution=256", "lora.rank=4",
                             "model.gradient_checkpointing=true", "train.precision=bf16"])
    b = read_base(cfg, "lumina2")
    own = _config_setting(cfg, 1, None)
    rows, info = count_settings(cfg, b, [own])
    assert "not counted" not in info["activations_note"], info["activations_note"]
    parts = rows[own]["activation_parts"]
    tokens = 256 + (256 // 8 // 2) ** 2  # the caption at full length, then the 2x2 patches of the 32 x 32 latents
    assert parts["blocks"] >= 26 and parts["checkpoint_inputs"] >= 26 * tokens * 2304 * 2
    assert rows[own]["activations"] > parts["checkpoint_inputs"]
