"""bench/mmdit_demo.py's pieces at a toy size (not its quality): the VAE it trains and judges, the
random SD3 folder it writes (StableDiffusion3Pipeline loads it, difftrain detects it as sd3), the
fine-tunes' settings (valid configs on that folder); and, marked slow, the whole demo end to end with
``--toy`` (from-scratch base, export, LoRA and DreamBooth + LoRA, every model judged)."""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import mmdit_demo  # noqa: E402

from difftrain.config import load_config  # noqa: E402


def _args(**over) -> Namespace:
    """The demo's defaults with ``--toy``'s sizes."""
    base = dict(steps=2, batch=2, rank=4, lora_lr=1e-3, full=True, full_lr=1e-4, ema_decay=0.9, class_images=2,
                guidance=3.0, sampling_steps=2, base_lr=1e-3, base_steps=4, base_batch=4, base_ema=0.9)
    return Namespace(**{**base, **over})


def test_pieces_at_a_toy_size(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    from difftrain.families import detect

    size = mmdit_demo.SIZES["toy"]
    vae = mmdit_demo.train_vae(size, steps=2, batch=2, lr=1e-3, kl_weight=1e-5, seed=0)
    assert vae.config.scaling_factor > 0 and vae.config.shift_factor is not None  # set from its latents
    scores = mmdit_demo.judge_reconstructions(vae, n=6)
    assert set(scores) == {"shape", "colour", "both", "red_ring"} and all(0 <= v <= 1 for v in scores.values())

    folder = mmdit_demo.write_random_base(tmp_path / "random-base", vae, size, seed=0)
    pipe = StableDiffusion3Pipeline.from_pretrained(str(folder))
    assert pipe.transformer.config.in_channels == size["latent_channels"]
    assert detect(folder).name == "sd3"

    # The from-scratch base and every fine-tune are valid configs on that folder (flow, from the family).
    cfg = load_config(None, mmdit_demo.base_overrides(_args(), folder))
    assert cfg.diffusion.objective == "flow" and cfg.data.path == "builtin:shapes"
    rings = mmdit_demo.write_rings(tmp_path / "rings", 2, mmdit_demo.RESOLUTION)
    runs = mmdit_demo.modes(_args(), folder, rings)
    assert len(runs) == 4
    for name, overrides in runs.items():
        cfg = load_config(None, overrides)
        assert (cfg.lora.rank > 0) == ("LoRA" in name)
        assert bool(cfg.dreambooth.class_prompt) == ("DreamBooth" in name)


@pytest.mark.slow
def test_the_demo_runs_end_to_end_at_a_toy_size(tmp_path):
    out = tmp_path / "rows.json"
    grid = tmp_path / "grid.png"
    assert mmdit_demo.main(["--toy", "--work", str(tmp_path / "work"), "--json", str(out), "--grid", str(grid)]) == 0
    result = json.loads(out.read_text())
    rows = {r["mode"]: r for r in result["rows"]}
    assert list(rows) == ["base (before)", "LoRA rank 8", "DreamBooth + LoRA rank 8"]
    for r in rows.values():  # the judge ran on every model
        assert r["n_new"] == 2 and r["n_old"] == 48
        assert all(0 <= r[k] <= 1 for k in ("ring", "red_ring", "old_shape", "old_colour", "old_both"))
    assert 0 < rows["LoRA rank 8"]["trained"] < rows["base (before)"]["trained"]  # the adapter alone
    assert (tmp_path / "work" / "base" / "model_index.json").is_file()  # the exported base
    from PIL import Image

    assert Image.open(grid).size[1] > 3 * 16 * 3  # three models' rows
    assert len(list((tmp_path / "work" / "dreambooth-lora-rank-8" / "class_images").glob("class_*.png"))) == 2

    # --reuse-base keeps the trained base (not retrained: its checkpoint is untouched) and redoes the fine-tunes.
    checkpoint = next((tmp_path / "work" / "base-run" / "checkpoints").glob("*.pt"))
    stamp = checkpoint.stat().st_mtime_ns
    assert mmdit_demo.main(["--toy", "--reuse-base", "--work", str(tmp_path / "work"), "--json", str(out)]) == 0
    again = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(again) == list(rows) and checkpoint.stat().st_mtime_ns == stamp
    assert again["base (before)"] == {**rows["base (before)"], "train_s": 0.0}  # the same base, the same noise
