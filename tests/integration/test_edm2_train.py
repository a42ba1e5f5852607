"""EDM2's network (model.preset = "edm2-tiny") in a real tiny CPU run: it trains with EDM2's learned loss
weighting and inverse-square-root LR, resumes exactly (EMA and post-hoc EMA included), samples, exports
difftrain's weights file that `difftrain sample` reads, and the diffusers export refuses in one line."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import torch

from conftest import TINY_OVERRIDES
from difftrain import api
from difftrain.checkpoints import checkpoint as ckpt
from difftrain.config import load_config
from difftrain.training.loop import train

EDM2_RUN = TINY_OVERRIDES + [
    "model.preset=edm2-tiny", "model.base_channels=16", "diffusion.objective=edm",
    "diffusion.uncertainty_weighting=true", "optim.betas=[0.9,0.99]", "optim.lr=1e-2", "optim.warmup_steps=0",
    "optim.lr_schedule=inverse_sqrt", "optim.lr_ref_steps=2", "train.log_every_steps=1",
    "ema.posthoc_std=[0.05,0.1]", "ema.posthoc_every_steps=2", "validation.every_steps=0",
]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "difftrain", *args], capture_output=True, text=True, timeout=300)


def _digests(run_dir) -> dict[str, str]:
    state = ckpt.load_checkpoint(run_dir)
    out = {"model": ckpt.state_dict_sha256(state["model"]), "ema": ckpt.state_dict_sha256(state["ema"]["model"]),
           "optimizer": ckpt.state_dict_sha256({k: v for k, v in _flat(state["optimizer"]).items()})}
    for std, tensors in zip(state["posthoc_ema"]["stds"], state["posthoc_ema"]["models"]):
        out[f"posthoc {std}"] = ckpt.state_dict_sha256(tensors)
    return out


def _flat(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a nested dict / list (an optimizer state dict) under dotted names."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    out = {}
    for k, v in items:
        if isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
        else:
            out.update(_flat(v, f"{prefix}{k}."))
    return out


def test_edm2_trains_resumes_exactly_samples_and_exports(tmp_path):
    cfg = load_config(None, EDM2_RUN)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(cfg, straight)
    train(cfg, resumed, stop_at_step=3)
    train(cfg, resumed)
    assert _digests(straight) == _digests(resumed)  # weights, EMA, optimizer, both post-hoc EMAs

    state = ckpt.load_checkpoint(straight)
    assert state["step"] == 6 and not any(k.endswith("bias") for k in state["model"])
    assert state["model"]["out_gain"].abs() > 0  # the zero-started output gain trains
    rows = [t.flatten(1).pow(2).mean(1).sqrt() for k, t in state["model"].items() if k.endswith("weight")]
    torch.testing.assert_close(torch.cat(rows), torch.ones(sum(len(r) for r in rows)), rtol=1e-3, atol=1e-3)
    # EDM2's LR per optimizer step t: lr_ref / sqrt(max(t / t_ref, 1)), logged at every step (t = step - 1)
    lrs = [json.loads(line)["lr"] for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert lrs == [1e-2 / math.sqrt(max(t / 2, 1.0)) for t in range(6)]

    # Sampling: the checkpoint, and difftrain's weights file exported from it, give the same images.
    weights = tmp_path / "edm2.safetensors"
    api.export(straight, weights, format="safetensors")
    from_checkpoint = api.generate(api.load(straight), 4, steps=3, seed=1)
    from_file = api.generate(api.load(weights), 4, steps=3, seed=1)
    assert from_checkpoint.shape == (4, 3, 16, 16) and torch.isfinite(from_checkpoint).all()
    torch.testing.assert_close(from_file, from_checkpoint, rtol=0, atol=0)
    proc = _cli("sample", "--checkpoint", str(weights), "--num", "2", "--steps", "2", "--out", str(tmp_path / "s"))
    assert proc.returncode == 0 and (tmp_path / "s" / "grid.png").is_file(), proc.stderr

    # diffusers has no class that computes EDM2's network: one line, exit 2.
    proc = _cli("export", str(straight), str(tmp_path / "hf"), "--format", "diffusers")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("difftrain ")]  # not libraries' warnings
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "model.preset='edm2-tiny'" in errors[0] and "export --format safetensors" in errors[0]
    assert not (tmp_path / "hf").exists()

    # Post-hoc EMA of another length, read by sample.
    out = tmp_path / "ema_0.08.pt"
    proc = _cli("posthoc-ema", str(straight), "--std", "0.08", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    proc = _cli("sample", "--checkpoint", str(out), "--num", "2", "--steps", "2", "--out", str(tmp_path / "p"))
    assert proc.returncode == 0 and (tmp_path / "p" / "grid.png").is_file(), proc.stderr


def test_a_refused_option_is_one_line_and_exit_2_from_the_command_line(tmp_path):
    run = [o for o in EDM2_RUN if not o.startswith("diffusion.uncertainty")]  # which refuses LoRA on its own
    sets = [a for o in run + ["lora.rank=4"] for a in ("--set", o)]
    proc = _cli("train", *sets, "--run-dir", str(tmp_path / "run"), "--dry-run")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("difftrain ")]
    assert proc.returncode == 2 and len(errors) == 1 and "lora.rank" in errors[0] and "edm2-tiny" in errors[0]
