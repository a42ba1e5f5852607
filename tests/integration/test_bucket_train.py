"""Training on aspect-ratio buckets: an exact resume (digests equal to an uninterrupted run), every rank's
micro-batch from the same bucket on 2 gloo processes, SDXL's real size/crop time_ids for a non-square image,
and the bad inputs (a bucket list the VAE cannot divide, a file list whose sizes were tampered with)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from difftrain.config import load_config
from difftrain.checkpoints import checkpoint as ckpt
from difftrain.training.loop import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _mixed_folder(root: Path, captions: bool = False) -> Path:
    """16 images: 6 landscape 2:1, 6 square, 4 portrait 1:2, and one 1x200 sliver (dropped)."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    sizes = [(32, 16)] * 6 + [(24, 24)] * 6 + [(16, 32)] * 4 + [(1, 200)]
    for i, (w, h) in enumerate(sizes):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"{i:02d}.png")
        if captions:
            (root / f"{i:02d}.txt").write_text("a photo")
    return root


def _digests(run_dir) -> tuple[str, str]:
    state = ckpt.load_checkpoint(run_dir)
    return ckpt.state_dict_sha256(state["model"]), ckpt.state_dict_sha256(state["ema"]["model"])


def test_bucketed_run_resumes_exactly(tmp_path, tiny_overrides):
    data = _mixed_folder(tmp_path / "data")
    cfg = load_config(None, tiny_overrides + [f"data.path={data}", "data.buckets=aspect", "train.batch_size=2",
                                              "train.grad_accum_steps=2", "data.num_workers=1"])
    train(cfg, tmp_path / "straight")
    train(cfg, tmp_path / "resumed", stop_at_step=3)
    saved = json.loads((tmp_path / "resumed" / "data_files.json").read_text())
    assert len(saved["sizes"]) == len(saved["files"]) == 16  # the sliver dropped, the sizes kept for the resume
    assert "bucket: too small: 1x200" in (tmp_path / "resumed" / "bad_images.log").read_text()
    assert train(cfg, tmp_path / "resumed").step == 6
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")


def test_tampered_sizes_in_the_file_list_are_rescanned(tmp_path, tiny_overrides, capsys):
    data = _mixed_folder(tmp_path / "data")
    cfg = load_config(None, tiny_overrides + [f"data.path={data}", "data.buckets=aspect", "train.batch_size=2",
                                              "validation.every_steps=0"])
    train(cfg, tmp_path / "run", stop_at_step=2)
    listed = tmp_path / "run" / "data_files.json"
    saved = json.loads(listed.read_text())
    listed.write_text(json.dumps({**saved, "sizes": [[-1, "x"]] * len(saved["files"])}))
    assert train(cfg, tmp_path / "run", stop_at_step=4).step == 4
    assert "holds no valid image sizes (data.buckets); rescanning" in capsys.readouterr().err
    saved = json.loads(listed.read_text())
    listed.write_text(json.dumps({**saved, "sizes": [[1, 1]] * len(saved["files"])}))  # valid, but lying
    assert train(cfg, tmp_path / "run").step == 6
    assert "put images of the run's first start in no bucket" in capsys.readouterr().err


def test_a_bucket_list_the_unet_cannot_divide_is_one_line(tmp_path, tiny_overrides, capsys):
    from difftrain.cli import main

    data = _mixed_folder(tmp_path / "data")
    args = ["train", "--run-dir", str(tmp_path / "run")]
    for o in tiny_overrides + [f"data.path={data}", "data.buckets=aspect", "data.bucket_resolutions=[16,18]"]:
        args += ["--set", o]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.bucket_resolutions [16, 18]: 18 is not a positive multiple of 4" in err[0]


def _rank_batches(ctx, data: str, steps: int, batch: int = 2):
    from difftrain.data.buckets import BucketSpec, assign_buckets
    from difftrain.data.folder import ImageFolderDataset
    from difftrain.data.loader import build_loader

    ds = ImageFolderDataset(data, resolution=16)
    ds.set_buckets(assign_buckets(ds.sizes(), BucketSpec((16,), 4)).shapes)
    loader = iter(build_loader(ds, batch, seed=4, start=8, num_workers=0, device=torch.device("cpu"),
                               rank=ctx.rank, world_size=ctx.world_size))
    return [next(loader)[0] for _ in range(steps)]


@pytest.mark.slow  # about 60 s on a busy 2-core machine (two spawned processes import torch); the split itself is
# tested in-process by tests/unit/test_buckets.py::test_ranks_split_the_same_global_micro_batch
def test_every_rank_draws_its_micro_batch_from_the_same_bucket(tmp_path):
    """2 gloo processes at batch 2 see, step by step, the rows ``rank::2`` of the one-process batch of 4
    (resumed at image 8 both), so both ranks' micro-batches are one bucket's."""
    from multiproc import run_ranks

    data = _mixed_folder(tmp_path / "data")
    (data / "16.png").unlink()  # the sliver: no bucket
    ranks = run_ranks(_rank_batches, 2, str(data), 6)
    one = _rank_batches(type("Ctx", (), {"rank": 0, "world_size": 1})(), str(data), 6, batch=4)
    assert len({tuple(b.shape) for b in one}) > 1  # more than one bucket over the steps
    for step, global_batch in enumerate(one):
        assert torch.equal(ranks[0][step], global_batch[0::2]) and torch.equal(ranks[1][step], global_batch[1::2])


@pytest.mark.slow  # about 60 s on a busy 2-core machine: torchrun and two processes start
def test_two_processes_train_on_buckets_as_one_at_the_same_global_batch(tmp_path, tiny_overrides):
    """torchrun --nproc-per-node 2 at batch 2 against one process at batch 4, on mixed shapes: the same
    weights to float rounding (each global micro-batch one bucket, split across the ranks)."""
    import os
    import subprocess

    data = _mixed_folder(tmp_path / "data")
    root = Path(__file__).resolve().parents[2]
    runs = {}
    for nproc, batch in ((1, 4), (2, 2)):
        sets = [a for kv in tiny_overrides + [f"data.path={data}", "data.buckets=aspect", f"train.batch_size={batch}",
                                              "train.total_steps=4", "validation.every_steps=0",
                                              "tracking.tensorboard=false", "train.device=cpu"]
                for a in ("--set", kv)]
        run = tmp_path / f"run{nproc}"
        args = ["-m", "difftrain", "train", "--run-dir", str(run), *sets]
        launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if nproc > 1 else []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root / "src")}
        proc = subprocess.run([sys.executable, *launch, *args], capture_output=True, text=True, env=env, timeout=400,
                              check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[nproc] = ckpt.load_checkpoint(run)
    assert runs[1]["data_position"] == runs[2]["data_position"] == 16
    for k, v in runs[1]["model"].items():
        torch.testing.assert_close(runs[2]["model"][k], v, rtol=1e-4, atol=1e-5, msg=k)


pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def sdxl_base(tmp_path_factory) -> Path:
    from tests.family_bases import write_tiny_sdxl_folder

    return write_tiny_sdxl_folder(tmp_path_factory.mktemp("bases") / "sdxl")


def test_sdxl_takes_the_real_size_and_crop_of_a_non_square_image(tmp_path, monkeypatch, sdxl_base):
    from difftrain.data.buckets import BucketSpec, assign_bucket
    from difftrain.data.transforms import crop_geometry
    from difftrain.families import sdxl
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(1)
    for i in range(2):
        Image.fromarray(rng.integers(0, 256, (32, 64, 3), dtype=np.uint8)).save(data / f"{i}.png")  # 64 x 32
        (data / f"{i}.txt").write_text("a wide photo")
    seen = []
    forward = sdxl.SDXLUNet.forward

    def spy(self, x, t, cond):
        seen.append((tuple(x.shape), cond["time_ids"].detach().clone()))
        return forward(self, x, t, cond)

    monkeypatch.setattr(sdxl.SDXLUNet, "forward", spy)
    cfg = load_config(None, [f"model.init_from={sdxl_base}", "lora.rank=4", f"data.path={data}",
                             "data.resolution=32", "data.num_workers=0", "train.batch_size=2", "train.total_steps=1",
                             "validation.every_steps=0", "data.random_flip=false"])
    assert cfg.data.buckets == "aspect"  # a base folder's default
    train(cfg, tmp_path / "run")
    shape, how = assign_bucket(64, 32, BucketSpec((32,), 2))
    assert how == "downscaled" and shape[1] > shape[0]
    geometry = crop_geometry((64, 32), shape)[1]
    expected = torch.tensor([[*geometry, *shape]] * 2, dtype=torch.float32)
    (x_shape, time_ids), = seen
    assert x_shape[2:] == (shape[0] // 2, shape[1] // 2)  # the latents of the bucket
    assert torch.equal(time_ids, expected), (time_ids, expected)
    assert expected[0, :2].tolist() == [32, 64]  # original (height, width), not the square training size


def _masked_folder(root: Path, mask_value: int) -> Path:
    root.mkdir(parents=True)
    rng = np.random.default_rng(2)
    for i in range(2):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(root / f"{i}.png")
        Image.new("L", (32, 32), mask_value).save(root / f"{i}.mask.png")
        (root / f"{i}.txt").write_text("a photo")
    return root


def test_masked_pixels_do_not_move_the_adapter(tmp_path, sdxl_base):
    """SDXL LoRA, 2 steps: with every pixel masked (black NAME.mask.png) the adapter's lora_B stays exactly 0
    (the LoRA adds nothing: the network is the base), with white masks it trains."""
    lora_b = {}
    for value in (0, 255):
        data = _masked_folder(tmp_path / f"data{value}", value)
        cfg = load_config(None, [f"model.init_from={sdxl_base}", "lora.rank=4", f"data.path={data}",
                                 "data.resolution=32", "data.num_workers=0", "train.batch_size=2", "train.total_steps=2",
                                 "validation.every_steps=0", "data.masks=true", "optim.lr=1e-2"])
        train(cfg, tmp_path / f"run{value}")
        state = ckpt.load_checkpoint(tmp_path / f"run{value}")
        lora_b[value] = [t for n, t in state["model"].items() if "lora_B" in n]
    assert lora_b[0] and all(torch.count_nonzero(t) == 0 for t in lora_b[0])
    assert any(torch.count_nonzero(t) > 0 for t in lora_b[255])


def test_prior_preservation_images_are_unmasked(tmp_path, tiny_overrides):
    """DreamBooth LoRA with every instance pixel masked: the class images (no mask file, no alpha) still
    train the adapter; without the prior it stays at lora_B = 0."""
    from tests.text_components import write_tiny_sd_folder

    sd = write_tiny_sd_folder(tmp_path / "sd")
    data = _masked_folder(tmp_path / "instance", 0)
    base = tiny_overrides + [f"data.path={data}", "data.captions=true", f"model.init_from={sd}", "lora.rank=2",
                             "validation.every_steps=0", "train.batch_size=2", "train.total_steps=2", "data.masks=true",
                             "data.resolution=32", "dreambooth.instance_prompt=a photo of sks dog", "optim.lr=1e-2"]
    prior = ["dreambooth.class_prompt=a photo of a dog", "dreambooth.num_class_images=2", "dreambooth.class_steps=2"]
    moved = {}
    for name, extra in (("alone", []), ("prior", prior)):
        train(load_config(None, base + extra), tmp_path / name)
        state = ckpt.load_checkpoint(tmp_path / name)
        moved[name] = any(torch.count_nonzero(t) > 0 for n, t in state["model"].items() if "lora_B" in n)
    assert moved == {"alone": False, "prior": True}
