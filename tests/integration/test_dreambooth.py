"""DreamBooth end to end, offline, on the tiny random Stable Diffusion folder: instance images
under one prompt, prior preservation's class images made once by the base model, full
fine-tuning and LoRA alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from difftrain.config import load_config  # noqa: E402
from difftrain.checkpoints import checkpoint as ckpt  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.text_components import write_tiny_sd_folder  # noqa: E402

INSTANCE, CLASS = "a photo of sks dog", "a photo of a dog"


def _instance_folder(root, n=6, size=16):
    """n small images of one 'subject' and no caption files."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for i in range(n):
        a = np.full((size, size, 3), 40, np.uint8)
        a[3:13, 5:11] = (200, 150, 60)
        a = np.clip(a.astype(int) + rng.integers(-8, 9, a.shape), 0, 255).astype(np.uint8)
        Image.fromarray(a).save(root / f"dog{i}.png")
    return root


def _overrides(tmp_path, tiny_overrides, *extra):
    sd = tmp_path / "sd"
    if not sd.exists():
        write_tiny_sd_folder(sd)
        _instance_folder(tmp_path / "instance")
    return tiny_overrides + [f"data.path={tmp_path / 'instance'}", "data.captions=true", f"model.text_encoder={sd}",
                             f"model.vae={sd}", f"model.init_from={sd}", "validation.every_steps=0",
                             "train.batch_size=4", f"dreambooth.instance_prompt={INSTANCE}", *extra]


PRIOR = [f"dreambooth.class_prompt={CLASS}", "dreambooth.num_class_images=5", "dreambooth.class_steps=2",
         "dreambooth.class_batch_size=3", "dreambooth.prior_loss_weight=0.5"]


def test_paired_dataset_alternates_instance_and_class_items_and_weights_the_class_loss(tmp_path, tiny_overrides):
    from difftrain.training.dreambooth import PairedDataset, PromptedDataset, loss_weights

    instance = PromptedDataset([(torch.zeros(3, 2, 2), 0)] * 3, INSTANCE)
    prior = PromptedDataset([(torch.ones(3, 2, 2), 0)] * 5, CLASS)
    paired = PairedDataset(instance, prior)
    assert len(paired) == 10
    assert [paired[i][1] for i in range(4)] == [INSTANCE, CLASS, INSTANCE, CLASS]
    assert paired.targets() == [INSTANCE, CLASS] * 5
    cfg = load_config(None, _overrides(tmp_path, tiny_overrides, *PRIOR))
    w = loss_weights(cfg.dreambooth, [INSTANCE, CLASS, CLASS, INSTANCE], torch.device("cpu"))
    assert w.tolist() == [1.0, 0.5, 0.5, 1.0]
    assert loss_weights(load_config(None, _overrides(tmp_path, tiny_overrides)).dreambooth, [INSTANCE], "cpu") is None


def test_dreambooth_with_prior_makes_class_images_once_and_resumes_exactly(tmp_path, tiny_overrides, capsys):
    cfg = load_config(None, _overrides(tmp_path, tiny_overrides, *PRIOR, f"dreambooth.class_dir={tmp_path / 'cls'}"))
    train(cfg, tmp_path / "straight")
    made = sorted(p.name for p in (tmp_path / "cls").iterdir())
    assert made == [f"class_{i:05d}.png" for i in range(5)] + ["class_images.json"]
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cls").iterdir()}
    assert capsys.readouterr().out.count("making 5 class images") == 1
    train(cfg, tmp_path / "resumed", stop_at_step=3)
    assert train(cfg, tmp_path / "resumed").step == 6
    assert "making" not in capsys.readouterr().out  # made once, reused
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cls").iterdir()} == stamps
    a, b = (ckpt.load_checkpoint(tmp_path / r) for r in ("straight", "resumed"))
    assert ckpt.state_dict_sha256(a["model"]) == ckpt.state_dict_sha256(b["model"])
    assert ckpt.state_dict_sha256(a["ema"]["model"]) == ckpt.state_dict_sha256(b["ema"]["model"])
    # The prior's weight reaches the loss: another weight trains other weights.
    other = load_config(None, _overrides(tmp_path, tiny_overrides, *PRIOR[:-1], "dreambooth.prior_loss_weight=0",
                                         f"dreambooth.class_dir={tmp_path / 'cls'}"))
    train(other, tmp_path / "other")
    c = ckpt.load_checkpoint(tmp_path / "other")
    assert ckpt.state_dict_sha256(a["model"]) != ckpt.state_dict_sha256(c["model"])


def test_dreambooth_lora_trains_an_adapter(tmp_path, tiny_overrides):
    pytest.importorskip("peft")
    cfg = load_config(None, _overrides(tmp_path, tiny_overrides, *PRIOR, "lora.rank=2", "train.total_steps=2"))
    train(cfg, tmp_path / "run")
    state = ckpt.load_checkpoint(tmp_path / "run")
    assert state["network"]["kind"] == "lora" and all("lora_" in k for k in state["model"])
    assert len(list((tmp_path / "run" / "class_images").glob("*.png"))) == 5


def test_bad_dreambooth_input_is_one_line(tmp_path, tiny_overrides, capsys):
    from difftrain.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    base = _overrides(tmp_path, tiny_overrides)
    cases = [
        ([f"data.path={empty}"], f"{empty} holds 0 images"),
        ([f"dreambooth.class_prompt={INSTANCE}"], "must differ from dreambooth.instance_prompt"),
        (["data.captions=false", "model.text_encoder="], "dreambooth.instance_prompt needs a text model"),
    ]
    for extra, needle in cases:
        args = ["train", "--run-dir", str(tmp_path / "run")]
        for s in base + extra:
            args += ["--set", s]
        assert main(args) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("difftrain ")]
        assert len(err) == 1 and needle in err[0], err
    cfg = load_config(None, _overrides(tmp_path, tiny_overrides, *PRIOR, f"dreambooth.class_dir={tmp_path / 'c2'}",
                                       "train.total_steps=1"))
    train(cfg, tmp_path / "r2")
    changed = load_config(None, _overrides(tmp_path, tiny_overrides, *PRIOR, f"dreambooth.class_dir={tmp_path / 'c2'}",
                                           "dreambooth.class_prompt=a photo of a cat", "train.total_steps=1"))
    with pytest.raises(ValueError, match="holds class images of 'a photo of a dog'"):
        train(changed, tmp_path / "r3")
