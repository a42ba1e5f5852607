"""Captioned datasets: folders (.txt, metadata.jsonl), tar shards, HF datasets, builtin shapes."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from difftrain.config import load_config
from difftrain.data import build_dataset, build_loader
from difftrain.data.builtin import (
    CAPTION_WORDS, COLOUR_NAMES, SHAPE_CLASSES, ShapeDescription, ShapesDataset, colour_name, describe_shape,
    shape_caption,
)
from difftrain.data.cache import CachedImageDataset
from difftrain.data.captions import BadCaption
from difftrain.data.check import BAD_LOG_NAME, prepare_dataset
from difftrain.data.folder import ImageFolderDataset
from difftrain.data.prepare import prepare_training_data

OPTIONS = dict(resolution=8, channels=3, random_flip=True, color_jitter=0.2)


def write_images(root, n: int = 6) -> list[str]:
    """``n`` small random PNGs under ``root`` (half in a subfolder); their relative paths."""
    rng = np.random.default_rng(0)
    names = []
    for i in range(n):
        rel = f"{'sub/' if i % 2 else ''}{i:02d}.png"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(root / rel)
        names.append(rel)
    return sorted(names)


def write_txt(root, names: list[str]) -> dict[str, str]:
    """A .txt caption beside each image: "caption of NAME" with spaces around; the captions."""
    for rel in names:
        (root / rel).with_suffix(".txt").write_text(f"  caption of {rel}\n")
    return {rel: f"caption of {rel}" for rel in names}


def test_txt_captions_give_image_caption_items(tmp_path):
    names = write_images(tmp_path / "d")
    expected = write_txt(tmp_path / "d", names)
    (tmp_path / "d" / names[0]).with_suffix(".txt").write_text(" \n")  # an empty caption is a caption
    expected[names[0]] = ""
    ds = build_dataset(str(tmp_path / "d"), **OPTIONS, captions=True)
    plain = build_dataset(str(tmp_path / "d"), **OPTIONS)
    assert isinstance(ds, ImageFolderDataset) and ds.captions and ds.num_classes == 0
    assert ds.bad_captions == {}
    for i, rel in enumerate(ds.files):
        x, caption, _ = ds[(i, 77)]
        assert caption == expected[rel]
        assert torch.equal(x, plain[(i, 77)][0])


def test_metadata_jsonl_is_the_source_when_present(tmp_path):
    root = tmp_path / "d"
    names = write_images(root)
    write_txt(root, names)  # ignored: the metadata files are the source
    top = [n for n in names if "/" not in n]
    sub = [n for n in names if n.startswith("sub/")]
    lines = [json.dumps({"file_name": n, "text": f" top {n} "}) for n in top] + [""]  # a blank line is fine
    (root / "metadata.jsonl").write_text("\n".join(lines))
    (root / "sub" / "metadata.jsonl").write_text(  # file_name relative to the jsonl's own folder
        "\n".join(json.dumps({"file_name": n.split("/", 1)[1], "text": f"sub {n}", "other": 1}) for n in sub)
    )
    ds = ImageFolderDataset(root, 8, captions=True)
    assert {rel: ds.caption(i) for i, rel in enumerate(ds.files)} == {
        **{n: f"top {n}" for n in top}, **{n: f"sub {n}" for n in sub}}

    # data.caption_column names the key of the caption; a line without it is malformed.
    (root / "sub" / "metadata.jsonl").unlink()
    (root / "metadata.jsonl").write_text("\n".join(json.dumps({"file_name": n, "caption": n.upper()}) for n in names))
    ds = build_dataset(str(root), **OPTIONS, captions=True, caption_column="caption")
    assert [ds.caption(i) for i in range(len(ds))] == [n.upper() for n in ds.files]
    with pytest.raises(ValueError, match=r"metadata\.jsonl line 1: no \"text\" string"):
        ImageFolderDataset(root, 8, captions=True)


@pytest.mark.parametrize("line, reason", [
    ("{not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"text": "x"}', 'no "file_name" string'),
    ('{"file_name": "00.png", "text": null}', 'no "text" string'),
    ('{"file_name": "../x.png", "text": "x"}', r"file_name \.\./x\.png lies outside the folder"),
    ('{"file_name": "00.png", "text": "again"}', r"file_name 00\.png already given on line 1"),
])
def test_a_malformed_metadata_line_names_the_file_and_line(tmp_path, line, reason):
    root = tmp_path / "d"
    write_images(root)
    (root / "metadata.jsonl").write_text('{"file_name": "00.png", "text": "fine"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"d/metadata\.jsonl line 3: {reason}"):
        ImageFolderDataset(root, 8, captions=True)


def broken_caption_folder(tmp_path) -> tuple[object, str, str]:
    """Images with captions, one without its .txt, one whose .txt is not UTF-8."""
    root = tmp_path / "d"
    names = write_images(root)
    write_txt(root, names)
    (root / names[1]).with_suffix(".txt").unlink()
    (root / names[2]).with_suffix(".txt").write_bytes(b"caf\xe9 latin-1")
    return root, names[1], names[2]


def test_a_missing_or_non_utf8_caption_is_skipped_at_start_and_logged(tmp_path):
    root, missing, latin = broken_caption_folder(tmp_path)
    ds = ImageFolderDataset(root, 8, captions=True)
    assert set(ds.bad_captions) == {missing, latin}
    assert "not UTF-8 (byte 0xe9 at offset 3)" in ds.bad_captions[latin]
    with pytest.raises(BadCaption, match=rf"bad caption for {missing}: no caption file"):
        ds[ds.files.index(missing)]  # read without a start scan: fatal, as a bad image is

    prepared = prepare_dataset(ds, "skip", tmp_path / "run")
    assert len(prepared) == 4 and missing not in prepared.files and latin not in prepared.files
    assert all(isinstance(prepared[i][1], str) for i in range(len(prepared)))
    log = (tmp_path / "run" / BAD_LOG_NAME).read_text()
    assert f"start\t{missing}\tcaption: no caption file" in log and f"start\t{latin}\tcaption:" in log


def test_a_named_pipe_in_a_captions_place_does_not_hang(tmp_path):
    root = tmp_path / "d"
    names = write_images(root, n=2)
    write_txt(root, names[1:])
    os.mkfifo((root / names[0]).with_suffix(".txt"))
    ds = ImageFolderDataset(root, 8, captions=True)
    assert ds.bad_captions == {names[0]: "caption 00.txt is not a regular file"}


def test_a_bad_caption_in_fail_mode_stops_before_training(tmp_path):
    root, missing, latin = broken_caption_folder(tmp_path)
    with pytest.raises(ValueError, match=r"2 images with a bad caption") as e:
        prepare_dataset(ImageFolderDataset(root, 8, captions=True), "fail", tmp_path / "run")
    assert f"{missing}: caption: no caption file" in str(e.value) and f"{latin}: caption:" in str(e.value)


def test_captions_are_reread_at_every_start(tmp_path):
    root = tmp_path / "d"
    names = write_images(root)
    write_txt(root, names)
    assert ImageFolderDataset(root, 8, captions=True).caption(0) == f"caption of {names[0]}"
    (root / names[0]).with_suffix(".txt").write_text("edited")
    assert ImageFolderDataset(root, 8, captions=True).caption(0) == "edited"


def test_resume_reuses_the_saved_file_list_with_its_captions(tmp_path):
    root, missing, _ = broken_caption_folder(tmp_path)
    run = tmp_path / "run"
    first = prepare_dataset(ImageFolderDataset(root, 8, captions=True), "skip", run)
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "step_00000002.pt").write_bytes(b"")  # a checkpoint: the next start resumes
    (root / missing).with_suffix(".txt").write_text("late caption")  # not in the run's list: no effect
    again = prepare_dataset(ImageFolderDataset(root, 8, captions=True), "skip", run)
    assert again.files == first.files
    assert [again.caption(i) for i in range(len(again))] == [first.caption(i) for i in range(len(first))]

    # A caption of the run's list that went bad meanwhile: fatal in fail mode, else logged and
    # the sample replaced as read, as an image that went bad is.
    broken = first.files[0]
    (root / broken).with_suffix(".txt").unlink()
    with pytest.raises(ValueError, match=rf"1 samples have a bad caption.*\n  {broken}: no caption file"):
        prepare_dataset(ImageFolderDataset(root, 8, captions=True), "fail", run)
    resumed = prepare_dataset(ImageFolderDataset(root, 8, captions=True), "skip", run)
    assert f"resume\t{broken}\tcaption: no caption file" in (run / BAD_LOG_NAME).read_text()
    assert resumed[(0, 3)][1] == first.caption(1) and torch.equal(resumed[(0, 3)][0], resumed[(1, 3)][0])


def test_loader_batches_hold_caption_lists_and_resume_exactly(tmp_path):
    names = write_images(tmp_path / "d", n=8)
    write_txt(tmp_path / "d", names)
    ds = build_dataset(str(tmp_path / "d"), resolution=8, captions=True)  # no augmentation: items are fixed
    index_of = {ds.caption(i): i for i in range(len(ds))}

    def batches(start: int, count: int, workers: int = 0):
        it = iter(build_loader(ds, 3, seed=5, start=start, num_workers=workers, device=torch.device("cpu")))
        return [next(it) for _ in range(count)]

    full = batches(0, 5)
    for images, captions, _ in full:
        assert images.shape == (3, 3, 8, 8) and isinstance(captions, list) and len(captions) == 3
        for image, caption in zip(images, captions):  # each caption travels with its own image
            assert torch.equal(image, ds[index_of[caption]][0])
    assert [c for _, cs, _ in full for c in cs][:8] != [ds.caption(i) for i in range(8)]  # shuffled
    resumed = batches(2 * 3, 3, workers=1)
    for (xa, ca, _), (xb, cb, _) in zip(full[2:], resumed):
        assert ca == cb and torch.equal(xa, xb)


def test_decode_cache_passes_captions_through(tmp_path):
    names = write_images(tmp_path / "d")
    write_txt(tmp_path / "d", names)
    folder = ImageFolderDataset(tmp_path / "d", 8, random_flip=True, captions=True)
    cached = CachedImageDataset(folder, tmp_path / "cache")
    assert cached.captions and cached.num_classes == 0
    for key in [0, 3, (1, 9), (5, 4)]:
        (xa, ca, ga), (xb, cb, gb) = folder[key], cached[key]
        assert ca == cb and torch.equal(xa, xb) and torch.equal(ga, gb)


def test_heldout_split_of_a_captioned_folder(tmp_path):
    names = write_images(tmp_path / "d", n=10)
    captions = write_txt(tmp_path / "d", names)
    cfg = load_config(None, [f"data.path={tmp_path / 'd'}", "data.resolution=8", "data.captions=true",
                             "model.text_encoder=builtin:tiny-clip", "data.heldout_fraction=0.2",
                             "data.num_workers=0", "train.batch_size=2"])
    data = prepare_training_data(cfg, tmp_path / "run")
    assert data.num_classes == 0 and data.train.captions and data.heldout.captions
    assert len(data.train) == 8 and len(data.heldout) == 2
    seen = [data.train[(i, 3)][1] for i in range(8)] + [data.heldout[i][1] for i in range(2)]
    assert sorted(seen) == sorted(captions.values())


def write_hf(tmp_path, texts: list) -> str:
    """A save_to_disk folder of len(texts) images with their captions in column "caption"."""
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(1)
    images = []
    for _ in texts:
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (9, 9, 3), dtype=np.uint8)).save(buf, format="PNG")
        images.append({"bytes": buf.getvalue(), "path": None})
    features = datasets.Features({"image": datasets.Image(), "caption": datasets.Value("string")})
    datasets.Dataset.from_dict({"image": images, "caption": texts}, features=features).save_to_disk(str(tmp_path / "hf"))
    return str(tmp_path / "hf")


def test_hf_captions_come_from_the_caption_column(tmp_path):
    path = write_hf(tmp_path, [" a cat ", "a dog", None, ""])
    ds = build_dataset(path, **OPTIONS, captions=True, caption_column="caption")
    assert ds.captions and ds.num_classes == 0
    assert [ds[i][1] for i in (0, 1, 3)] == ["a cat", "a dog", ""]
    assert list(ds.bad_captions.values()) == ["data.caption_column 'caption' holds no caption (None)"]
    with pytest.raises(BadCaption, match=r"row 2: data.caption_column 'caption' holds no caption"):
        ds[2]
    prepare_dataset(ds, "skip", tmp_path / "run")  # logged at start, replaced as read
    assert "start\t" in (tmp_path / "run" / BAD_LOG_NAME).read_text()
    x, caption, _ = ds[(2, 5)]
    assert caption == "" and torch.equal(x, ds[(3, 5)][0])
    with pytest.raises(ValueError, match="1 samples have a bad caption"):
        prepare_dataset(build_dataset(path, **OPTIONS, captions=True, caption_column="caption"), "fail", tmp_path / "r2")
    with pytest.raises(ValueError, match=r"data\.caption_column 'text' is not a column.*columns: image, caption"):
        build_dataset(path, **OPTIONS, captions=True)


def write_captioned_shard(tmp_path, captions: dict[str, bytes | None], txt_first: bool = False) -> str:
    """One tar shard of a random image per key, with ``KEY.txt`` = the bytes given (none for None)."""
    rng = np.random.default_rng(2)
    path = tmp_path / "shard.tar"
    with tarfile.open(path, "w") as tar:
        for key, text in captions.items():
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (9, 9, 3), dtype=np.uint8)).save(buf, format="PNG")
            members = [(f"{key}.png", buf.getvalue())] + ([(f"{key}.txt", text)] if text is not None else [])
            for name, data in (members[::-1] if txt_first else members):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


@pytest.mark.parametrize("txt_first", [False, True])
def test_shard_captions_are_the_txt_members(tmp_path, txt_first):
    pattern = write_captioned_shard(
        tmp_path, {"a": b" first \n", "b": None, "c": b"\xff\xfe bad", "d": "caf\u00e9".encode()}, txt_first)
    ds = build_dataset(pattern, **OPTIONS, captions=True)
    assert ds.captions and [ds[i][1] for i in (0, 3)] == ["first", "caf\u00e9"]
    bad = ds.bad_captions
    assert bad == {f"{pattern}:b": "no .txt member (the caption)",
                   f"{pattern}:c": "caption is not UTF-8 (byte 0xff at offset 0)"}
    with pytest.raises(ValueError, match=r"2 samples have a bad caption.*\n.*shard\.tar:b: no \.txt member"):
        prepare_dataset(ds, "fail", tmp_path / "run")
    ds = prepare_dataset(build_dataset(pattern, **OPTIONS, captions=True), "skip", tmp_path / "run")
    x, caption, _ = ds[(1, 8)]  # b and c give way to d
    assert caption == "caf\u00e9" and torch.equal(x, ds[(3, 8)][0])
    assert "shard.tar:c\tcaption: caption is not UTF-8" in (tmp_path / "run" / BAD_LOG_NAME).read_text()
    plain = build_dataset(pattern, **OPTIONS)  # without captions nothing is read or missing
    assert plain.bad_captions == {} and plain[1][1] == 0


def test_builtin_shapes_captions_describe_the_drawn_images():
    plain = ShapesDataset(resolution=16, num_items=60)
    captioned = ShapesDataset(resolution=16, num_items=60, captions=True)
    assert captioned.captions and captioned.num_classes == 0
    seen = set()
    for i in range(60):
        (xa, la), (xb, caption) = plain[(i, 4)], captioned[(i, 4)]
        assert la == 0 and torch.equal(xa, xb)  # the images are those of the uncaptioned dataset
        desc = describe_shape(i, 16, 3)
        assert caption == shape_caption(desc) and desc.shape == SHAPE_CLASSES[i % 3]
        assert set(caption.split()) <= set(CAPTION_WORDS)
        seen.add(desc.colour)
    assert len(seen) >= 6 and seen <= set(COLOUR_NAMES)
    assert shape_caption(ShapeDescription("disc", "red", "dark")) == "a red disc on a dark background"
    assert shape_caption(ShapeDescription("square", "orange", "light")) == "an orange square on a light background"
    assert describe_shape(5, 16, 1).colour == "gray"
    with pytest.raises(ValueError, match="captions or data.class_conditional"):
        ShapesDataset(captions=True, class_conditional=True)


@pytest.mark.parametrize("rgb, name", [
    ((255, 0, 0), "red"), ((220, 20, 60), "red"), ((255, 140, 0), "orange"), ((255, 215, 0), "yellow"),
    ((50, 205, 50), "green"), ((0, 128, 0), "green"), ((0, 255, 255), "cyan"), ((0, 0, 255), "blue"),
    ((30, 144, 255), "blue"), ((128, 0, 255), "purple"), ((148, 0, 211), "purple"), ((255, 0, 255), "pink"),
    ((255, 20, 147), "pink"),
])
def test_colour_names_are_the_ones_people_use(rgb, name):
    assert colour_name(rgb) == name
