"""A guide that is a smaller, shorter run (issue 43, item 2; Karras et al. 2024's XS guide): the
shipped guide preset beside configs/cifar10-16px-cpu.toml, and `sample` with both EMA lengths
chosen post hoc (--ema-std, --guide-ema-std) from the two runs' snapshots."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from difftrain import cli
from difftrain.config import load_config
from difftrain.generation.autoguidance import PARAMETERIZATION_KEYS
from difftrain.models import build_unet
from difftrain.training.loop import train

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
POSTHOC = ["diffusion.objective=edm", "validation.every_steps=0", "ema.posthoc_std=[0.05, 0.10]",
           "ema.posthoc_every_steps=2"]


def _parameters(cfg) -> int:
    m = cfg.model
    overrides = {k: getattr(m, k) for k in ("base_channels", "channel_mult", "num_res_blocks", "attention_resolutions")
                 if getattr(m, k) is not None}
    net = build_unet(m.preset, resolution=cfg.data.resolution, in_channels=cfg.data.channels, **overrides)
    return sum(p.numel() for p in net.parameters())


def test_the_guide_preset_is_a_smaller_shorter_run_of_the_cpu_presets_task():
    main = load_config(CONFIGS / "cifar10-16px-cpu.toml", [])
    guide = load_config(CONFIGS / "cifar10-16px-cpu-guide.toml", [])
    # the same task: the whole diffusion section (objective, parameterization, noise, weighting) and the data
    assert dataclasses.asdict(guide.diffusion) == dataclasses.asdict(main.diffusion)
    assert all(getattr(guide.diffusion, k) == getattr(main.diffusion, k)
               for k in ("objective", *PARAMETERIZATION_KEYS[main.diffusion.objective]))
    assert (guide.data.resolution, guide.data.channels) == (main.data.resolution, main.data.channels)
    assert guide.train.batch_size == main.train.batch_size
    # smaller and shorter (their XS guide: a quarter to a sixteenth of the main's training), snapshots on
    assert _parameters(guide) <= _parameters(main) / 3
    assert main.train.total_steps / 8 <= guide.train.total_steps <= main.train.total_steps / 4
    assert len(guide.ema.posthoc_std) >= 2 and guide.ema.posthoc_every_steps > 0
    assert guide.train.total_steps % guide.ema.posthoc_every_steps == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny main run (6 steps) and a smaller, shorter guide (base width 8, 4 steps), both with
    post-hoc EMA snapshots every 2 steps."""
    from conftest import TINY_OVERRIDES

    root = tmp_path_factory.mktemp("small_guide")
    train(load_config(None, TINY_OVERRIDES + POSTHOC), root / "main")
    train(load_config(None, TINY_OVERRIDES + POSTHOC + ["model.base_channels=8", "train.total_steps=4"]),
          root / "guide")
    return root / "main", root / "guide"


SAMPLE = ["--num", "2", "--steps", "2", "--sampler", "euler", "--seed", "3"]


def test_sample_guided_with_both_ema_lengths_chosen_post_hoc(runs, tmp_path, capsys):
    main, guide = runs
    out = tmp_path / "posthoc"
    assert cli.main(["sample", "--checkpoint", str(main), "--ema-std", "0.08", "--guide", str(guide),
                     "--guide-ema-std", "0.12", "--guide-weight", "2", *SAMPLE, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "sigma_rel 0.08 (gamma" in said and "guide " in said and "sigma_rel 0.12 (gamma" in said
    assert f"images from {main} (post hoc EMA sigma_rel 0.08) (step 6" in said
    assert f"autoguided by {guide} (post hoc EMA sigma_rel 0.12) (step 4), weight 2" in said
    # the same images as from the two EMAs written by `difftrain posthoc-ema` and given as files
    files = tmp_path / "files"
    assert cli.main(["posthoc-ema", str(main), "--std", "0.08", "--out", str(files / "main.pt")]) == 0
    assert cli.main(["posthoc-ema", str(guide), "--std", "0.12", "--out", str(files / "guide.pt")]) == 0
    by_files = tmp_path / "by_files"
    assert cli.main(["sample", "--checkpoint", str(files / "main.pt"), "--guide", str(files / "guide.pt"),
                     "--guide-weight", "2", *SAMPLE, "--out", str(by_files)]) == 0
    for name in ("000000.png", "000001.png"):
        assert (out / name).read_bytes() == (by_files / name).read_bytes()
    # and other EMA lengths give other images
    other = tmp_path / "other"
    assert cli.main(["sample", "--checkpoint", str(main), "--ema-std", "0.08", "--guide", str(guide),
                     "--guide-ema-std", "0.05", "--guide-weight", "2", *SAMPLE, "--out", str(other)]) == 0
    assert (other / "000000.png").read_bytes() != (out / "000000.png").read_bytes()


def test_the_guide_ema_at_a_guide_step_of_the_main_run(runs, tmp_path, capsys):
    main, _ = runs
    assert cli.main(["sample", "--checkpoint", str(main), "--guide-step", "4", "--guide-ema-std", "0.10",
                     *SAMPLE, "--out", str(tmp_path / "s")]) == 0
    assert "at step 4 from" in capsys.readouterr().out


def test_post_hoc_ema_options_refuse_what_does_not_combine_in_one_line(runs, tmp_path, capsys):
    from conftest import TINY_OVERRIDES

    main, guide = runs
    plain = tmp_path / "plain"  # no snapshots
    train(load_config(None, TINY_OVERRIDES + ["diffusion.objective=edm", "validation.every_steps=0",
                                              "train.total_steps=2"]), plain)
    small = tmp_path / "small"  # another resolution
    train(load_config(None, TINY_OVERRIDES + POSTHOC + ["data.resolution=8", "model.attention_resolutions=[4]",
                                                        "train.total_steps=2"]), small)
    capsys.readouterr()  # the two trainings' warnings
    cases = [
        (["--checkpoint", str(main), "--guide-ema-std", "0.1"], "--guide-ema-std is the guide's EMA length"),
        (["--checkpoint", str(main), "--ema-std", "0.1", "--no-ema"], "--no-ema samples the raw weights"),
        (["--checkpoint", str(plain), "--ema-std", "0.1"], "no post-hoc EMA snapshots in"),
        (["--checkpoint", str(main), "--guide", str(plain), "--guide-ema-std", "0.1"], "no post-hoc EMA snapshots in"),
        (["--checkpoint", str(main), "--guide", str(small), "--guide-ema-std", "0.1"],
         "has image shape (channels, resolution) (3, 8)"),
        (["--checkpoint", str(main), "--guide", str(guide), "--guide-step", "3", "--guide-ema-std", "0.1"],
         "--step 3: "),
    ]
    for options, message in cases:
        assert cli.main(["sample", *options, *SAMPLE, "--out", str(tmp_path / "x")]) == 2, options
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (options, err)


def test_the_bench_recipes_are_the_guide_preset_and_the_main_run_as_measured():
    """time_to_fid.py's two rows of item 2 resolve (``--cpu-mode --recipes NAME``) to what was
    trained: the guide preset, and the CPU preset with post-hoc EMAs for the steps left to it."""
    from bench_modules import load_bench

    bench, small = load_bench("time_to_fid"), load_bench("small_guide_fid")
    trained = {"guide-w16-512": load_config(CONFIGS / "cifar10-16px-cpu-guide.toml", []),
               "edm-b32-uw-pm-beta99-posthoc": load_config(CONFIGS / "cifar10-16px-cpu.toml",
                                                           [*small.MAIN_POSTHOC, "train.total_steps=2500"])}
    for name, want in trained.items():
        (recipe,) = bench.build_recipes(bench.parse_args(["--cpu-mode", "--recipes", name]))
        got = load_config(recipe.config, recipe.overrides)
        for section in ("model", "diffusion", "optim", "ema"):
            assert dataclasses.asdict(getattr(got, section)) == dataclasses.asdict(getattr(want, section)), (name, section)
        for key in ("total_steps", "batch_size", "grad_accum_steps", "seed"):
            assert getattr(got.train, key) == getattr(want.train, key), (name, key)
        for key in ("resolution", "random_flip"):
            assert getattr(got.data, key) == getattr(want.data, key), (name, key)
