"""SDXL's size and crop conditioning on square crops (``data.buckets = "off"``): the time_ids the UNet gets
are each image's real (orig_h, orig_w, crop_top, crop_left, R, R), as diffusers' SDXL training script makes
them, through the latent cache, the decode cache and the held-out split; a JPEG decoded at a reduced scale
still reports its file's size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.config import load_config  # noqa: E402
from difftrain.data.transforms import crop_geometry  # noqa: E402
from difftrain.families import sdxl  # noqa: E402
from difftrain.training import loop  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.family_bases import write_tiny_sdxl_folder  # noqa: E402

RES = 32
SIZES = [(64, 32), (32, 48), (48, 40), (96, 36)]  # (W, H) of each file: every one cropped differently


def expected_row(size: tuple[int, int]) -> tuple[float, ...]:
    """(orig_h, orig_w, crop_top, crop_left, R, R) of a file of ``size`` (W, H) centre-cropped to R x R."""
    return tuple(float(v) for v in (*crop_geometry(size, (RES, RES))[1], RES, RES))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sdxl_geometry")
    write_tiny_sdxl_folder(root / "sdxl")
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate(SIZES):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(data / f"{i}.png")
        (data / f"{i}.txt").write_text("a red square")
    return root


@pytest.mark.parametrize("cache", [False, True], ids=["latent-cache", "decode-cache"])
def test_square_crops_condition_on_each_images_real_size_and_crop(root, tmp_path, monkeypatch, cache):
    """One step on 3 of the 4 images (the fourth held out): the step's time_ids are those three images'
    rows and the held-out loss's condition the fourth's; before the fix every row was (32, 32, 0, 0, 32, 32)."""
    seen, held = [], []
    forward = sdxl.SDXLUNet.forward

    def spy(self, x, t, cond):
        seen.append(cond["time_ids"].detach().clone())
        return forward(self, x, t, cond)

    build_heldout = loop.build_heldout

    def keep(*args, **kwargs):
        held.append(build_heldout(*args, **kwargs))
        return held[-1]

    monkeypatch.setattr(sdxl.SDXLUNet, "forward", spy)
    monkeypatch.setattr(loop, "build_heldout", keep)
    cfg = load_config(None, [f"model.init_from={root / 'sdxl'}", "lora.rank=4", f"data.path={root / 'data'}",
                             f"data.resolution={RES}", "data.buckets=off", "data.num_workers=0",
                             "train.batch_size=3", "train.total_steps=1", "validation.every_steps=0",
                             "data.random_flip=false", "data.heldout_fraction=0.25", f"data.cache={str(cache).lower()}",
                             f"data.cache_dir={tmp_path / 'cache'}"])
    train(cfg, tmp_path / "run")
    rows = {tuple(r) for r in seen[0].tolist()}
    (heldout,) = held
    heldout_rows = {tuple(r) for r in heldout.condition["time_ids"].tolist()}
    assert len(rows) == 3 and len(heldout_rows) == 1 and rows.isdisjoint(heldout_rows)
    assert rows | heldout_rows == {expected_row(s) for s in SIZES}, (rows, heldout_rows)


def test_a_reduced_jpeg_decode_reports_its_files_size(tmp_path):
    """A 256 x 128 JPEG read for 16 px is decoded at 1/4 scale (64 x 32); its geometry is the file's size,
    (128, 256), and the crop of it resized to 32 x 16 (left 8), not the reduced decode's (32, 64)."""
    from difftrain.data.folder import ImageFolderDataset

    folder = tmp_path / "jpeg"
    folder.mkdir()
    Image.fromarray(np.zeros((128, 256, 3), dtype=np.uint8)).save(folder / "wide.jpg", quality=90)
    x, _, geometry = ImageFolderDataset(folder, 16)[0]
    assert x.shape == (3, 16, 16)
    assert geometry.tolist() == list(crop_geometry((256, 128), (16, 16))[1]) == [128, 256, 0, 8]


def test_a_dataset_without_sizes_is_warned_once(root, capsys):
    """A batch without geometry (a dataset of the API's own making) conditions uncropped at the batch's
    size and says so once, in one line."""
    from difftrain.networks.conditioning import Conditioning

    cfg = load_config(None, [f"model.init_from={root / 'sdxl'}", f"data.resolution={RES}"])
    c = Conditioning.from_config(cfg, 0)
    for _ in range(2):
        cond = c.condition(["a red square"] * 2, None, torch.device("cpu"), None, (RES, RES))
    assert cond["time_ids"].tolist() == [[RES, RES, 0, 0, RES, RES]] * 2
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and len(err.strip().splitlines()) == 1 and "no original size" in err
