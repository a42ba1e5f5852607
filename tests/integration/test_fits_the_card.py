"""Issue 41 items 2 and 8: the shipped family presets fit a 24 GB card by `difftrain estimate --base` with their own
settings, the 16 GB setting each preset's header documents fits 16 GB, `estimate` names the smallest change that
fits a card, and a run on CUDA whose setting cannot fit the device is refused at start, before any weight is loaded
(torch.cuda monkeypatched: no GPU here)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from difftrain.config import ConfigError, load_config  # noqa: E402
from difftrain.tools.base_memory import (  # noqa: E402
    GiB, HEADROOM, LEVERS, _config_setting, base_folder, check_fits, count_base, count_settings, read_base, size_text,
)
from tests.family_bases import T5_LENGTH, write_tiny_flux_folder  # noqa: E402
from tests.text_components import write_tiny_sd_folder  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# Each family preset and the known bases (tools/bases/) of its family.
FAMILY_PRESETS = {
    "flux-lora.toml": ["flux-dev"],
    "flux-kontext-lora.toml": ["flux-kontext-dev"],
    "sd3-lora.toml": ["sd3.5-large", "sd3.5-medium"],
    "sdxl-lora.toml": ["sdxl"],
    "sd-lora.toml": ["sd1.5"],
    "hidream-lora.toml": ["hidream"],
    "z-image-lora.toml": ["z-image"],
    "pixart-sigma-lora.toml": ["pixart-sigma"],
    "qwen-image-lora.toml": ["qwen-image"],
    "qwen-image-edit-lora.toml": ["qwen-image-edit"],
    "chroma-lora.toml": ["chroma"], "auraflow-lora.toml": ["auraflow"],
    "sana-lora.toml": ["sana", "sana-4.8b"], "lumina2-lora.toml": ["lumina2"],
    "flux2-lora.toml": ["flux2-dev"], "flux2-klein-lora.toml": ["flux2-klein-4b", "flux2-klein-9b"],
}
# Presets known not to fit 24 GB yet, and why (strict: the day one fits, the test says so and the entry goes).
DOES_NOT_FIT_YET: dict[tuple[str, str], str] = {}
PAIRS = [pytest.param(preset, base, id=f"{preset}-{base}",
                      marks=[pytest.mark.xfail(strict=True, reason=DOES_NOT_FIT_YET[(preset, base)])]
                      if (preset, base) in DOES_NOT_FIT_YET else [])
         for preset, bases in FAMILY_PRESETS.items() for base in bases]


def test_every_family_preset_is_covered():
    assert sorted(p.name for p in CONFIGS.glob("*-lora.toml")) == sorted(FAMILY_PRESETS)


def sixteen_gb_overrides(preset: str) -> list[str] | None:
    """The ``--set`` lines of the preset header's "# 16 GB:" line ("as shipped": none; "does not fit": None)."""
    line = next(x for x in (CONFIGS / preset).read_text().splitlines() if x.startswith("# 16 GB:"))
    head = line.removeprefix("# 16 GB:").split("(")[0].strip()
    if head.startswith("does not fit"):
        return None
    return [] if head.startswith("as shipped") else re.findall(r"--set (\S+)", head)


@pytest.mark.parametrize("preset,base", PAIRS)
def test_every_family_preset_fits_24gb_and_its_16gb_setting_fits_16gb(preset, base):
    """The preset's own setting on one GPU (as `difftrain estimate --base BASE --config PRESET` counts it) at most
    HEADROOM of 24 GiB, with checkpointing on and bf16; the header's 16 GB overrides (levers of the count's
    settings: checkpointing, quantized base, optimizer) at most HEADROOM of 16 GiB."""
    cfg = load_config(CONFIGS / preset, [f"model.init_from={base_folder(base)}"])
    b = read_base(cfg, base)
    own = _config_setting(cfg, 1, None)
    rows, _ = count_settings(cfg, b, [own])
    assert rows[own]["total"] <= HEADROOM * 24 * GiB, f"{preset} on {base}: {rows[own]['total'] / GiB:.2f} GiB"
    assert own.checkpointing and cfg.train.precision == "bf16" and own.lora  # the shipped levers
    sets = sixteen_gb_overrides(preset)
    if sets is None:  # the header says no lever fits 16 GB: checked true (nf4 and adamw8bit, the least of them)
        least = _config_setting(load_config(CONFIGS / preset, [f"model.init_from={base_folder(base)}",
                                                               "model.quantize_base=nf4", "optim.name=adamw8bit"]), 1, None)
        rows, _ = count_settings(cfg, b, [least])
        assert rows[least]["total"] > HEADROOM * 16 * GiB
        return
    assert all(s.split("=")[0] in ("model.gradient_checkpointing", "model.quantize_base", "optim.name") for s in sets)
    small = _config_setting(load_config(CONFIGS / preset, [f"model.init_from={base_folder(base)}", *sets]), 1, None)
    if small != own:
        rows, _ = count_settings(cfg, b, [small])
    assert rows[small]["total"] <= HEADROOM * 16 * GiB, f"{preset} {sets} on {base}: {rows[small]['total'] / GiB:.2f}"


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """A tiny Flux folder 64 wide (nf4 holds its layers): with weights, and a copy holding only its config files."""
    root = tmp_path_factory.mktemp("fits-the-card")
    folder = write_tiny_flux_folder(root / "flux", head_dim=32)
    configs = root / "flux-configs"
    for f in folder.rglob("*.json"):
        if f.name in ("model_index.json", "config.json", "scheduler_config.json"):
            (configs / f.relative_to(folder)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, configs / f.relative_to(folder))
    return folder, configs


SETS = ["data.resolution=32", "data.path=/nonexistent", f"model.max_sequence_length={T5_LENGTH}",
        "train.batch_size=2", "optim.warmup_steps=1", "validation.every_steps=0", "train.progress_bar=false",
        "train.precision=bf16", "lora.rank=4", "lora.alpha=4"]


def _cfg(folder, *extra):
    return load_config(None, [f"model.init_from={folder}", *SETS, *extra])


def _between(low: int, high: int) -> int:
    """A card's bytes on which a total of ``low`` fits and one of ``high`` does not."""
    return int((low + high) / 2 / HEADROOM)


def test_advice_names_the_smallest_change_that_fits(flux):
    """On a card the config's setting misses, `count_base`'s advice names one override that fits, the fitting one
    of the fewest overrides with the largest figure; applied to the config, the count fits that card. On a card
    nothing fits, one line says so."""
    _, configs = flux
    cfg = _cfg(configs)
    plain = count_base(cfg, str(configs), ranks=1, card_gib=1e6)
    assert plain["advice"]["fits"] and plain["advice"]["line"].startswith("fits")
    own = plain["rows"][0]["total"]
    ckpt = check_fits(_cfg(configs, "model.gradient_checkpointing=true"), configs, 10**15)["total"]
    assert ckpt < own
    card = _between(ckpt, own)
    r = count_base(cfg, str(configs), ranks=1, card_gib=card / GiB)
    advice = r["advice"]
    assert not advice["fits"] and "does not fit" in advice["line"] and advice["change"]
    assert " ".join(advice["change"]) in advice["line"]
    assert len(advice["change"]) == 1  # one override fits: no pair is advised
    singles = [f for f in advice["fitting"] if len(f["set"]) == 1]
    assert advice["changed_total"] == max(f["total"] for f in singles) <= HEADROOM * card
    changed = _cfg(configs, *(line.removeprefix("--set ") for line in advice["change"]))
    assert check_fits(changed, configs, card)["fits"]
    assert all(line in [lever for *_, lever in LEVERS] for line in advice["change"])
    none = count_base(cfg, str(configs), ranks=1, card_gib=1e-6)["advice"]
    assert not none["fits"] and not none["change"] and "nor does any single change or pair" in none["line"]


def test_estimate_base_answers_for_the_config_on_one_gpu_and_a_named_card(flux, capsys):
    """`estimate --base X --config C`: the config's own setting on 1 GPU (not the table's N ranks) unless
    --world-size says; `--card GIB` gives the card the advice line answers for."""
    from difftrain.cli import main

    _, configs = flux
    args = ["estimate", "--base", str(configs), *(a for s in SETS for a in ("--set", s))]
    assert main([*args, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["rows"][0]["ranks"] == 1 and {row["ranks"] for row in r["rows"]} == {1, 8}
    assert main([*args, "--json", "--world-size", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["ranks"] == 2
    own = r["rows"][0]["total"]
    assert main([*args, "--card", f"{own / HEADROOM / GiB * 0.999:.12f}"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("your setting does not fit") and "the smallest change that fits: --set " in last
    assert main([*args, "--card", "0"]) == 2
    assert "--card" in capsys.readouterr().err


class _Props:
    name = "NVIDIA Test Card"
    total_memory = 0


def _fake_cuda(monkeypatch, total: int, started: list):
    """torch.cuda as a machine with one device of ``total`` bytes; ``started`` records every start of the training
    loop (which loads the base) and every weight file opened."""
    import safetensors
    import safetensors.torch

    from difftrain.training import loop

    _Props.total_memory = total
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total, total))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _Props())
    monkeypatch.setattr(loop, "train", lambda *a, **k: started.append("train"))
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: started.append(a))
    monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: started.append(a))


def test_a_setting_that_cannot_fit_the_device_is_refused_at_start(flux, monkeypatch, tmp_path, capsys):
    """`difftrain train` on a CUDA device too small for the run's setting (by `estimate`'s count): exit 2 before any
    weight is loaded or anything written, one line naming estimate's figure, the card's and the smallest change
    that fits; with that change the check passes."""
    from difftrain.api import check_machine
    from difftrain.cli import main

    folder, _ = flux
    data = tmp_path / "images"
    data.mkdir()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(data / "red.png")
    (data / "red.txt").write_text("a red square")

    def cuda_cfg(*extra):
        return _cfg(folder, "train.device=cuda", f"data.path={data}", *extra)

    cfg = cuda_cfg()
    own = check_fits(cfg, folder, 10**15)["total"]
    ckpt = check_fits(cuda_cfg("model.gradient_checkpointing=true"), folder, 10**15)["total"]
    card = _between(ckpt, own)
    started: list = []
    _fake_cuda(monkeypatch, card, started)
    run = tmp_path / "run"
    sets = [f"model.init_from={folder}", *SETS, "train.device=cuda", f"data.path={data}"]
    assert main(["train", "--run-dir", str(run), *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    line = err[0]
    assert f"{size_text(own)} per GPU by `difftrain estimate --base" in line
    assert f"NVIDIA Test Card's {size_text(card)}" in line
    assert "the smallest change that fits: --set " in line
    assert not started and not run.exists()
    change = re.search(r"fits: (.*) \(", line).group(1).replace("--set ", "").split()
    check_machine(cuda_cfg(*change))  # the named change passes
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (own * 2, own * 2))
    check_machine(cfg)  # a card it fits: no refusal
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1, 1))
    with pytest.raises(ConfigError, match="no single change or pair"):
        check_machine(cfg)


def test_the_check_counts_nothing_off_cuda(flux, monkeypatch):
    """On the CPU the check is skipped (the count takes seconds on a real base: docs/fine_tuning.md)."""
    from difftrain import api

    folder, _ = flux
    monkeypatch.setattr(api, "check_fits", lambda *a, **k: pytest.fail("counted off CUDA"))
    api.check_device_memory(_cfg(folder, "train.device=cpu"))



def test_the_check_counts_a_block_swap(monkeypatch, tmp_path):
    """A block swap (``model.swap_blocks``) is counted at start: on a card that the tiny SD base's LoRA run misses
    without it but fits with all but one block's frozen weights on the host, the swapped run passes and the plain
    one is refused."""
    from difftrain.api import check_machine

    folder = write_tiny_sd_folder(tmp_path / "sd")
    (tmp_path / "images").mkdir()
    sets = [f"model.init_from={folder}", "data.resolution=16", f"data.path={tmp_path / 'images'}", "train.batch_size=2",
            "lora.rank=4", "train.precision=bf16", "validation.every_steps=0", "train.device=cuda",
            "model.gradient_checkpointing=true"]
    plain = load_config(None, sets)
    swapped = load_config(None, [*sets, "model.swap_blocks=8"])
    without, with_swap = check_fits(plain, folder, 10**15)["total"], check_fits(swapped, folder, 10**15)["total"]
    assert with_swap < without
    _fake_cuda(monkeypatch, _between(with_swap, without), [])
    check_machine(swapped)
    with pytest.raises(ConfigError, match="smallest change|no single change"):
        check_machine(plain)
    _fake_cuda(monkeypatch, int(with_swap / HEADROOM) - 1, [])  # a card the swapped run misses too: refused
    with pytest.raises(ConfigError, match="per GPU by `difftrain estimate"):
        check_machine(swapped)
