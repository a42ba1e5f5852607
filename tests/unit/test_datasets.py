"""Tar shards and Hugging Face datasets: the same images give the same items as a folder."""

from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from difftrain.config import ConfigError, load_config
from difftrain.data import build_dataset, build_loader
from difftrain.data import shards as shards_module
from difftrain.data.hf import HFImageDataset
from difftrain.data.shards import TarShardDataset, expand_braces, sample_key
from difftrain.data.transforms import BadImage

OPTIONS = dict(resolution=8, channels=3, random_flip=True, color_jitter=0.3)
CLASSES = ("cat", "dog")


def write_folder(root, n: int = 12) -> list[str]:
    """``n`` small images in class subfolders (PNG and JPEG, a few sizes); their relative paths."""
    rng = np.random.default_rng(0)
    names = []
    for i in range(n):
        rel = f"{CLASSES[i % 2]}/{i:03d}.{'jpg' if i % 3 == 0 else 'png'}"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        size = (10 + i % 3 * 7, 12 + i % 2 * 5)
        Image.fromarray(rng.integers(0, 256, (*size[::-1], 3), dtype=np.uint8)).save(root / rel)
        names.append(rel)
    return sorted(names)


def write_shards(root, out, names: list[str], per_shard: int = 5, cls_first: bool = False) -> str:
    """The images ``names`` under ``root`` as WebDataset tar shards in ``out``; the brace pattern."""
    out.mkdir(parents=True, exist_ok=True)
    shards = [names[k : k + per_shard] for k in range(0, len(names), per_shard)]
    for s, part in enumerate(shards):
        with tarfile.open(out / f"train-{s:04d}.tar", "w") as tar:
            for rel in part:
                key, ext = os.path.splitext(rel)
                members = [(rel, (root / rel).read_bytes()), (key + ".cls", rel.split("/")[0].encode()),
                           (key + ".txt", b"a caption")]
                for name, data in (members[1:2] + members[:1] + members[2:]) if cls_first else members:
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(out / f"train-{{0000..{len(shards) - 1:04d}}}.tar")


def assert_same_items(a, b, keys) -> None:
    assert len(a) == len(b)
    for key in keys:
        (xa, la, ga), (xb, lb, gb) = a[key], b[key]
        assert la == lb
        assert torch.equal(xa, xb), key
        assert torch.equal(ga, gb), key  # the same original size and crop (SDXL's size conditioning)


def keys_of(n: int) -> list:
    return list(range(n)) + [(i, 1000 + i) for i in range(n)]


def test_brace_expansion_and_sample_keys():
    assert expand_braces("s-{08..11}.tar") == ["s-08.tar", "s-09.tar", "s-10.tar", "s-11.tar"]
    assert expand_braces("{a,b}/x-{1..2}.tar") == ["a/x-1.tar", "a/x-2.tar", "b/x-1.tar", "b/x-2.tar"]
    assert expand_braces("plain.tar") == ["plain.tar"]
    assert sample_key("dir/img.001.seg.png") == ("dir/img", "001.seg.png")
    assert sample_key("a/b.PNG") == ("a/b", "png")


@pytest.mark.parametrize("cls_first", [False, True])
def test_shards_give_the_folder_items(tmp_path, cls_first):
    names = write_folder(tmp_path / "folder")
    pattern = write_shards(tmp_path / "folder", tmp_path / f"shards{cls_first}", names, cls_first=cls_first)
    folder = build_dataset(str(tmp_path / "folder"), **OPTIONS, class_conditional=True)
    shards = build_dataset(pattern, **OPTIONS, class_conditional=True)
    assert isinstance(shards, TarShardDataset) and len(shards.shards) == 3
    assert shards.classes == folder.classes == list(CLASSES)
    assert_same_items(folder, shards, keys_of(len(names)))
    unconditional = build_dataset(pattern, **OPTIONS)
    assert unconditional.num_classes == 0 and set(unconditional.labels) == {0}
    globbed = build_dataset(str(tmp_path / f"shards{cls_first}" / "*.tar"), **OPTIONS, class_conditional=True)
    assert_same_items(shards, globbed, [(3, 7), 11])


def test_shard_index_is_built_once_and_rebuilt_when_a_shard_changes(tmp_path, monkeypatch):
    names = write_folder(tmp_path / "folder", n=6)
    pattern = write_shards(tmp_path / "folder", tmp_path / "shards", names, per_shard=3)
    first = build_dataset(pattern, **OPTIONS)
    calls = []
    real = shards_module.index_shard
    monkeypatch.setattr(shards_module, "index_shard", lambda p: calls.append(p) or real(p))
    again = build_dataset(pattern, **OPTIONS)
    assert calls == []  # from the cache folder
    assert_same_items(first, again, [0, (5, 3)])
    shard = tmp_path / "shards" / "train-0001.tar"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    build_dataset(pattern, **OPTIONS)
    assert len(calls) == 2  # a changed shard: the whole set indexed again


def test_shard_errors_name_the_path(tmp_path):
    with pytest.raises(ValueError, match=r"data\.path .*: shard .*train-0000\.tar does not exist"):
        build_dataset(str(tmp_path / "train-{0000..0001}.tar"), **OPTIONS)
    (tmp_path / "x.tar").write_bytes(b"\x1f\x8b" + bytes(1000))  # gzip, not a plain tar
    with pytest.raises(ValueError, match="uncompressed tar"):
        build_dataset(str(tmp_path / "x.tar"), **OPTIONS)
    names = write_folder(tmp_path / "folder", n=2)
    with tarfile.open(tmp_path / "nolabel.tar", "w") as tar:
        tar.add(tmp_path / "folder" / names[0], arcname="a.png")
    with pytest.raises(ValueError, match=r"KEY\.cls member.*nolabel\.tar:a"):
        build_dataset(str(tmp_path / "nolabel.tar"), **OPTIONS, class_conditional=True)


def test_a_bad_shard_member_is_skipped_and_logged_or_fatal(tmp_path):
    names = write_folder(tmp_path / "folder", n=4)
    (tmp_path / "folder" / names[1]).write_bytes(b"not an image")
    pattern = write_shards(tmp_path / "folder", tmp_path / "shards", names, per_shard=4)
    dataset = build_dataset(pattern, **OPTIONS)
    with pytest.raises(BadImage, match=r"train-0000\.tar:cat/002: cannot identify image file$"):
        dataset[1]
    dataset.on_bad_image, dataset.bad_log = "skip", tmp_path / "bad.log"
    assert_same_items(dataset, build_dataset(pattern, **OPTIONS), [2])
    x, *_ = dataset[(1, 5)]
    assert torch.equal(x, dataset[(2, 5)][0])  # the next good sample, with this position's seed
    assert "mid-run\t" in (tmp_path / "bad.log").read_text() and "cat/002" in (tmp_path / "bad.log").read_text()


def test_two_ranks_split_a_global_batch_of_shard_samples(tmp_path):
    names = write_folder(tmp_path / "folder", n=10)
    pattern = write_shards(tmp_path / "folder", tmp_path / "shards", names, per_shard=4)
    dataset = build_dataset(pattern, **OPTIONS, class_conditional=True)
    cpu = torch.device("cpu")
    whole = next(iter(build_loader(dataset, 8, seed=3, start=8, num_workers=0, device=cpu)))
    ranks = [next(iter(build_loader(dataset, 4, seed=3, start=8, num_workers=w, device=cpu, rank=r, world_size=2)))
             for r, w in ((0, 0), (1, 2))]  # rank 1 reads in two worker processes
    assert torch.equal(whole[0][0::2], ranks[0][0]) and torch.equal(whole[0][1::2], ranks[1][0])
    assert torch.equal(whole[1][0::2], ranks[0][1]) and torch.equal(whole[1][1::2], ranks[1][1])
    assert not any(torch.equal(a, b) for a in ranks[0][0] for b in ranks[1][0])  # disjoint halves


try:
    import datasets
except ImportError:  # the hf extra is not installed: its tests skip
    datasets = None
needs_hf = pytest.mark.skipif(datasets is None, reason="needs the datasets package: pip install 'difftrain[hf]'")


def hf_dataset(root, names: list[str], pil: bool = False):
    """The images ``names`` under ``root`` as a datasets.Dataset: the file bytes (or decoded
    PIL images), with a ClassLabel column "label" and an integer column "number"."""
    images = [Image.open(root / n) if pil else {"bytes": (root / n).read_bytes(), "path": n} for n in names]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(CLASSES)),
                                  "number": datasets.Value("int64")})
    labels = [CLASSES.index(n.split("/")[0]) for n in names]
    return datasets.Dataset.from_dict({"image": images, "label": labels, "number": labels}, features=features)


@needs_hf
def test_a_saved_hf_dataset_gives_the_folder_items(tmp_path):
    names = write_folder(tmp_path / "folder")
    hf_dataset(tmp_path / "folder", names).save_to_disk(str(tmp_path / "saved"))
    folder = build_dataset(str(tmp_path / "folder"), **OPTIONS, class_conditional=True)
    saved = build_dataset(str(tmp_path / "saved"), **OPTIONS, class_conditional=True, label_column="label")
    assert isinstance(saved, HFImageDataset) and saved.classes == folder.classes
    assert_same_items(folder, saved, keys_of(len(names)))
    numbers = build_dataset(str(tmp_path / "saved"), **OPTIONS, class_conditional=True, label_column="number")
    assert numbers.labels == folder.labels and numbers.classes == ["0", "1"]
    unconditional = build_dataset(str(tmp_path / "saved"), **OPTIONS)
    assert unconditional.num_classes == 0 and set(unconditional.labels) == {0}


@needs_hf
def test_parquet_files_and_pil_images_give_the_folder_items(tmp_path):
    names = write_folder(tmp_path / "folder")
    png = [n for n in names if n.endswith(".png")]  # PIL images are stored re-encoded: PNG is lossless
    ds = hf_dataset(tmp_path / "folder", png, pil=True)
    ds.select(range(4)).to_parquet(str(tmp_path / "p" / "part-0.parquet"))
    ds.select(range(4, len(png))).to_parquet(str(tmp_path / "p" / "part-1.parquet"))
    only_png = tmp_path / "png"
    for n in png:
        (only_png / n).parent.mkdir(parents=True, exist_ok=True)
        (only_png / n).write_bytes((tmp_path / "folder" / n).read_bytes())
    folder = build_dataset(str(only_png), **OPTIONS, class_conditional=True)
    parquet = build_dataset(str(tmp_path / "p" / "*.parquet"), **OPTIONS, class_conditional=True, label_column="label")
    assert_same_items(folder, parquet, keys_of(len(png)))


@needs_hf
def test_hf_errors_name_the_key(tmp_path):
    names = write_folder(tmp_path / "folder", n=2)
    hf_dataset(tmp_path / "folder", names).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match=r"data\.image_column 'img' is not a column .*image, label, number"):
        build_dataset(str(tmp_path / "saved"), **OPTIONS, image_column="img")
    with pytest.raises(ValueError, match=r"data\.label_column 'cls' is not a column"):
        build_dataset(str(tmp_path / "saved"), **OPTIONS, label_column="cls")
    with pytest.raises(ValueError, match=r"data\.class_conditional .* needs data\.label_column"):
        build_dataset(str(tmp_path / "saved"), **OPTIONS, class_conditional=True)
    with pytest.raises(ValueError, match=r"data\.path .*no parquet file"):
        build_dataset(str(tmp_path / "missing.parquet"), **OPTIONS)
    with pytest.raises(ConfigError, match=r"data\.image_column"):
        load_config(None, ["data.image_column="])
