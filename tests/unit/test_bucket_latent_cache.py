"""The bucketed latent cache: one .npy per bucket and a checked index; items equal a direct encode, flips
as augment flips; hostile files (crafted, truncated, lying about sizes, missing) are refused with one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("diffusers")

from difftrain.data import ImageFolderDataset  # noqa: E402
from difftrain.data.buckets import BucketSpec, assign_buckets  # noqa: E402
from difftrain.data.latents import (  # noqa: E402
    BucketLatentDataset,
    bucket_file,
    flip_of,
    read_bucket_index,
    targets_path,
    with_latent_cache,
)
from difftrain.models.vae import LatentCodec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from text_components import write_tiny_vae  # noqa: E402


@pytest.fixture(scope="module")
def codec(tmp_path_factory) -> LatentCodec:
    return LatentCodec.from_path(str(write_tiny_vae(tmp_path_factory.mktemp("vae") / "vae")))


def _folder(root: Path) -> ImageFolderDataset:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for i, (w, h) in enumerate([(32, 16), (32, 16), (16, 32), (20, 20), (40, 20)]):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"{i}.png")
        (root / f"{i}.txt").write_text(f"caption {i}")
    ds = ImageFolderDataset(root, resolution=16, captions=True, random_flip=True)
    ds.set_buckets(assign_buckets(ds.sizes(), BucketSpec((16,), 2)).shapes)
    return ds


@pytest.fixture
def cached(codec, tmp_path):
    ds = _folder(tmp_path / "images")
    return ds, with_latent_cache(ds, codec=codec, random_flip=True, cache_dir=tmp_path / "cache", batch_size=2)


def test_items_are_a_direct_encode_per_bucket(codec, cached):
    ds, latents = cached
    assert isinstance(latents, BucketLatentDataset) and latents.path.name.endswith(".buckets.json")
    assert np.array_equal(latents.bucket_shapes, ds.bucket_shapes)
    assert len({tuple(s) for s in ds.bucket_shapes.tolist()}) == 3  # landscape, portrait, square
    for i in range(len(ds)):
        x, caption, geometry = ds[i]
        moments, cap, geo = latents[i]
        assert cap == caption and torch.equal(geo, geometry)
        mean, std = codec.encode_moments(x[None])
        torch.testing.assert_close(moments, torch.cat([mean, std], 1)[0], rtol=2e-3, atol=2e-3)
        assert moments.shape[1:] == (x.shape[1] // codec.factor, x.shape[2] // codec.factor)
    seed = next(s for s in range(100) if flip_of(s))
    mean, std = codec.encode_moments(ds[0][0].flip(-1)[None])
    torch.testing.assert_close(latents[(0, seed)][0], torch.cat([mean, std], 1)[0], rtol=2e-3, atol=2e-3)


def test_reused_without_encoding_again(codec, cached, tmp_path, monkeypatch):
    ds, latents = cached
    monkeypatch.setattr(codec, "encode_moments", lambda *a: pytest.fail("encoded again"))
    again = with_latent_cache(ds, codec=codec, random_flip=True, cache_dir=tmp_path / "cache", batch_size=2)
    assert again.path == latents.path and torch.equal(again[3][0], latents[3][0])


def _index(latents) -> dict:
    return json.loads(latents.path.read_text())


@pytest.mark.parametrize("tamper,match", [
    (lambda p, ix: p.write_text(json.dumps(ix)[:40]), "unreadable index"),  # truncated
    (lambda p, ix: p.write_bytes(b"\x80\x04\x95pickle"), "unreadable index"),  # not JSON
    (lambda p, ix: p.write_text(json.dumps({**ix, "format": "other"})), "not a bucketed latent cache"),
    (lambda p, ix: p.write_text(json.dumps({**ix, "version": 99})), "index version 99"),
    (lambda p, ix: p.write_text(json.dumps({**ix, "views": 7})), "views"),
    (lambda p, ix: p.write_text(json.dumps({**ix, "shapes": [[8, 8]] + ix["shapes"][1:]})), "not the dataset"),
    (lambda p, ix: p.write_text(json.dumps({**ix, "shapes": [[-2, 8]] + ix["shapes"][1:]})), "non-negative"),
    (lambda p, ix: p.write_text(json.dumps({**ix, "items": [[9, 0]] + ix["items"][1:]})), "a bucket the index"),
    (lambda p, ix: p.write_text(json.dumps({**ix, "items": [[ix["items"][0][0], 5]] + ix["items"][1:]})), "rows"),
    (lambda p, ix: p.write_text(json.dumps({**ix, "items": ix["items"][:-1]})), "rows, expected"),
    (lambda p, ix: p.write_text(json.dumps({**ix, "geometry": [["a", 1, 2, 3]] + ix["geometry"][1:]})), "geometry"),
    (lambda p, ix: bucket_file(p, 0).unlink(), "bucket file .*b0000.npy"),  # missing
    (lambda p, ix: bucket_file(p, 1).write_bytes(bucket_file(p, 1).read_bytes()[:100]), "b0001.npy"),  # truncated
    (lambda p, ix: np.save(bucket_file(p, 0), np.zeros((1, 2, 8, 4, 4), np.float16)), "the index says"),  # lying
    (lambda p, ix: np.save(bucket_file(p, 0), np.zeros((2, 2, 8, 8, 16), np.float32)), "float32"),
    (lambda p, ix: np.save(bucket_file(p, 0), np.array([{"x": 1}], dtype=object), allow_pickle=True), "b0000"),
])
def test_hostile_cache_files_are_refused_with_one_line(codec, cached, tmp_path, tamper, match):
    ds, latents = cached
    tamper(latents.path, _index(latents))
    with pytest.raises(ValueError, match=match) as e:
        with_latent_cache(ds, codec=codec, random_flip=True, cache_dir=tmp_path / "cache", batch_size=2)
    assert "\n" not in str(e.value) and str(latents.path) in str(e.value) and "rebuild" in str(e.value)


def test_an_index_for_other_shapes_and_bad_targets_are_refused(codec, cached, tmp_path):
    ds, latents = cached
    with pytest.raises(ValueError, match="not the dataset's"):
        read_bucket_index(latents.path, np.full((len(ds), 2), 16))
    targets_path(latents.path).write_text("[1, 2")
    with pytest.raises(ValueError, match="targets.json: unreadable"):
        BucketLatentDataset(ds, latents.path, True)
    targets_path(latents.path).unlink()
    with pytest.raises(ValueError, match="unreadable"):
        BucketLatentDataset(ds, latents.path, True)
