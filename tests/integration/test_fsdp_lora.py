"""LoRA under train.parallel='fsdp' on 2 gloo CPU processes: the adapter DDP trains (frozen base
and adapter sharded together; tests/unit/test_fsdp_ranks.py checks the base stays as it was), a
resume on 1 process and on 2, and the adapter's export."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from conftest import TINY_OVERRIDES  # noqa: E402
from multiproc import assert_close_dicts, run_ranks, train_on_rank  # noqa: E402

from difftrain.config import load_config  # noqa: E402
from difftrain.checkpoints import checkpoint as ckpt  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.integration.test_lora import PROMPT, _sd_overrides  # noqa: E402

# 2 processes x batch 2 x 2 micro-batches, clipped, validated at the end (the gathered copy of a
# sharded LoRA network, base and adapter), a post-hoc EMA of the adapter snapshotted at the end, on
# the tiny Stable Diffusion UNet and its captioned squares.
RUN = ["train.total_steps=4", "train.device=cpu", "train.batch_size=2", "train.grad_accum_steps=2",
       "train.channels_last=off", "optim.grad_clip=0.05", "validation.every_steps=4", "validation.num_images=2",
       "validation.steps=2", f"validation.prompts=['{PROMPT}']", "tracking.tensorboard=false",
       "ema.posthoc_std=[0.1]"]


@pytest.fixture(scope="module")
def runs():
    """DDP to step 4, and FSDP stopped at step 2 (``half``). About 25 s on a 2-core machine."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ddp = _sd_overrides(root, list(TINY_OVERRIDES), *RUN)
        fsdp = [*ddp, "train.parallel=fsdp"]
        run_ranks(train_on_rank, 2, str(root / "ddp"), ddp, None)
        run_ranks(train_on_rank, 2, str(root / "half"), fsdp, 2)
        yield root, fsdp


def test_fsdp_lora_resumes_on_one_process_as_ddp_trains_and_exports_the_same_adapter(runs, tmp_path):
    """2 sharded steps, then 2 more on one process from the sharded checkpoint: DDP's adapter and
    EMA to float rounding, the checkpoint holding the adapter alone, the same exported file."""
    from safetensors.torch import load_file

    from difftrain.api import export
    from difftrain.training.power_ema import load_snapshot

    root, fsdp = runs
    half = ckpt.load_checkpoint(root / "half")
    assert half["path"].endswith("step_00000002.dcp") and half["network"]["kind"] == "lora"
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in half["model"])
    assert len(half["optimizer"]["state"]) == len(half["model"])  # AdamW's moments: the adapter's alone
    shutil.copytree(root / "half", tmp_path / "one")
    assert train(load_config(None, [*fsdp, "train.batch_size=4"]), tmp_path / "one").step == 4  # the same global batch
    ddp, one = ckpt.load_checkpoint(root / "ddp"), ckpt.load_checkpoint(tmp_path / "one")
    assert_close_dicts(ddp["model"], one["model"])
    assert_close_dicts(ddp["ema"]["model"], one["ema"]["model"])
    assert any(t.abs().max() > 1e-3 for k, t in one["model"].items() if "lora_B" in k)  # B starts at 0: it trained
    snapshot = "ema_snapshots/ema_0.1_00000004.pt"  # the adapter's post-hoc EMA, carried in the sharded checkpoint
    assert_close_dicts(load_snapshot(root / "ddp" / snapshot)["model"], load_snapshot(tmp_path / "one" / snapshot)["model"])
    files = [load_file(export(run, tmp_path / run.name, format="lora") / "pytorch_lora_weights.safetensors")
             for run in (root / "ddp", tmp_path / "one")]
    assert files[0] and all(k.startswith("lora_unet_") for k in files[0])  # the default layout: kohya's
    assert_close_dicts(*files)


@pytest.mark.slow  # about 30 s: two more 2-rank runs
def test_fsdp_lora_resume_on_two_ranks_is_exact_and_equals_ddp(runs, tmp_path):
    """Resumed at step 2 on 2 ranks: bit for bit the uninterrupted FSDP run, DDP's to float
    rounding (its post-hoc EMA snapshot too), and validated on the gathered network (base and adapter)."""
    from difftrain.training.power_ema import load_snapshot

    root, fsdp = runs
    shutil.copytree(root / "half", tmp_path / "resumed")
    run_ranks(train_on_rank, 2, str(tmp_path / "resumed"), fsdp, None)
    run_ranks(train_on_rank, 2, str(tmp_path / "straight"), fsdp, None)
    straight, resumed = ckpt.load_checkpoint(tmp_path / "straight"), ckpt.load_checkpoint(tmp_path / "resumed")
    for a, b in ((straight["model"], resumed["model"]), (straight["ema"]["model"], resumed["ema"]["model"])):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert_close_dicts(ckpt.load_checkpoint(root / "ddp")["model"], resumed["model"])
    snapshot = "ema_snapshots/ema_0.1_00000004.pt"  # gathered whole from the adapter's shards by rank 0
    assert_close_dicts(load_snapshot(root / "ddp" / snapshot)["model"], load_snapshot(tmp_path / "resumed" / snapshot)["model"])
    assert (tmp_path / "resumed" / "samples" / "step_00000004.png").is_file()


def test_bf16_lora_under_ddp_and_fsdp_trains_and_validates(tmp_path):
    """train.precision=bf16 on 2 ranks: DDP with the frozen base held in bf16 (networks/frozen_dtype.py), FSDP with
    its frozen shards float32 gathered in bf16; both train to the end and sample their validation grid outside the
    step's autocast (the LoRA network runs under one: FSDP's bf16-gathered weights failed there before)."""
    ddp = _sd_overrides(tmp_path, list(TINY_OVERRIDES), *RUN, "train.precision=bf16")
    for name, overrides in (("ddp", ddp), ("fsdp", [*ddp, "train.parallel=fsdp"])):
        assert run_ranks(train_on_rank, 2, str(tmp_path / name), overrides, None) == [4, 4]
        assert (tmp_path / name / "samples" / "step_00000004.png").is_file()
        assert all(t.dtype == torch.float32 for t in ckpt.load_checkpoint(tmp_path / name)["model"].values())
