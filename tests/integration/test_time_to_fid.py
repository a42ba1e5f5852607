"""bench/time_to_fid.py end to end on tiny settings: the real CLI, SIGTERM at the budget, the
real FID Inception network (the script's other runs here: a 64-feature stand-in), a handful of
samples; plus its recipe parsing and curve points."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest

from tests.bench_modules import load_bench

REPO = Path(__file__).resolve().parents[2]


def _bench():
    return load_bench("time_to_fid")


@pytest.fixture
def inception_weights():
    from difftrain.evaluation.inception import find_inception_weights

    try:
        return find_inception_weights()
    except FileNotFoundError as e:
        pytest.skip(f"FID Inception weights not available: {e}")


@pytest.fixture
def standin_fid(tmp_path, monkeypatch):
    """The FID stand-in network at 64 features in place of Inception (tests/fid_standin.py), for the
    tests below whose subject is not the network: a 2048x2048 covariance's eigendecomposition per
    FID and Inception's forward passes are much of their work. test_time_to_fid_end_to_end keeps
    the real network."""
    from fid_standin import use_standin, write_standin

    use_standin(monkeypatch, write_standin(tmp_path / "standin.pt", 64), 64, tmp_path / "cache")


def test_parse_recipe_keeps_bracketed_lists_whole():
    recipe = _bench().parse_recipe("short=configs/tiny.toml:optim.betas=[0.95,0.999],optim.lr=2e-4")
    assert recipe.name == "short" and recipe.config == "configs/tiny.toml"
    assert recipe.overrides == ["optim.betas=[0.95,0.999]", "optim.lr=2e-4"]
    assert _bench().parse_recipe("plain=configs/tiny.toml").overrides == []


def test_curve_points_take_the_newest_checkpoint_at_each_mark_and_the_last():
    ckpts = [(10.0, 5, Path("a")), (25.0, 10, Path("b")), (38.0, 15, Path("c")), (50.0, 20, Path("d"))]
    assert [c[1] for c in _bench().curve_points(ckpts, 20.0)] == [5, 15, 20]
    assert [c[1] for c in _bench().curve_points(ckpts, 0.0)] == [20]


class StepClock:
    """Stands in for the script's ``time`` module, so that its wall-clock budget is a step count
    whatever the machine's speed: ``monotonic()`` is the step of the newest checkpoint of the run
    training now (the newest run folder), one "second" per step; the rest is ``time``'s."""

    def __init__(self, work: Path):
        self.work = work

    def monotonic(self) -> float:
        runs = [p for p in self.work.glob("*/") if (p / "train.log").exists()]
        if not runs:
            return 0.0
        run = max(runs, key=lambda p: (p / "train.log").stat().st_mtime_ns)  # opened last
        steps = [int(f.stem.split("_")[1]) for f in (run / "checkpoints").glob("step_*.pt")]
        return float(max(steps, default=0))

    def __getattr__(self, name):
        return getattr(time, name)


def test_time_to_fid_end_to_end(tmp_path, tiny_overrides, inception_weights, monkeypatch):
    """The wall-clock protocol (SIGTERM at the budget, @reached, the FID curve) with the budget
    counted in steps (:class:`StepClock`): 5 "seconds" are 5 steps, however loaded the machine."""
    bench = _bench()
    monkeypatch.setattr(bench, "time", StepClock(tmp_path / "runs"))
    sets = [o for o in tiny_overrides if not o.startswith(("train.total_steps", "checkpoint.", "validation."))]
    sets.append("validation.every_steps=0")
    args = ["--config", str(REPO / "configs" / "tiny.toml"), "--recipes", "constant-lr", "lr-decay", "flow",
            "--set", "data.path=builtin:shapes", "--set", "train.total_steps=100000",
            "--budget", "5", "--num-samples", "4", "--steps", "2", "--batch-size", "4",
            "--ref", "builtin:shapes", "--ref-num", "4", "--checkpoint-every-steps", "2",
            "--curve-every", "3", "--no-warm", "--work", str(tmp_path / "runs"), "--out", str(tmp_path / "t.md")]
    for o in sets:
        args += ["--set", o]
    peer_skipped = bool(bench.peer_missing())
    if peer_skipped:  # where the peer can run it takes minutes: not in the default suite
        args += ["--peer", "diffusers"]
    assert bench.main(args) == 0

    table = (tmp_path / "t.md").read_text()
    assert "| constant-lr | 5 |" in table and "| lr-decay | 5 |" in table and "| flow | 5 |" in table
    assert "FID against minutes" in table
    if peer_skipped:
        assert "| diffusers (peer) | 5 | - | - | - | - | - | - | skipped: needs" in table
    runs = {r["recipe"]: r for r in json.loads((tmp_path / "t.json").read_text())}
    first, second = runs["constant-lr"], runs["lr-decay"]
    assert first["exit_code"] == 75  # stopped by SIGTERM at the budget, checkpoint saved
    assert first["steps"] > 0 and first["images_seen"] == first["steps"] * 8
    assert first["steps"] >= 5 and first["first_step_s"] is not None  # SIGTERM once step 5 had passed
    # @reached: the decaying recipe plans its schedule over the steps the first one reached.
    assert f"train.total_steps={first['steps']}" in second["overrides"]
    assert runs["flow"]["results"][-1]["sampler"] == "heun"  # an objective's own sampler
    for run in (first, second, runs["flow"]):
        final = run["results"][-1]
        assert final["step"] == run["steps"] and final["num_samples"] == 4 and final["num_reference"] == 4
        assert math.isfinite(final["fid"]) and math.isfinite(final["kid_mean"])


def test_step_budget_pairs_on_one_core_each_and_the_best_two_on_a_second_seed(tmp_path, tiny_overrides,
                                                                              standin_fid):
    """The CPU mode's shape on tiny settings: a step budget, two runs at a time pinned to their
    own cores, then the best two again on seed 1, and the line that says how sure the order is."""
    bench = _bench()
    sets = [o for o in tiny_overrides if not o.startswith(("train.total_steps", "checkpoint.", "validation."))]
    args = ["--config", str(REPO / "configs" / "tiny.toml"), "--recipes", "constant-lr", "flow",
            "--set", "data.path=builtin:shapes", "--set", "validation.every_steps=0",
            "--total-steps", "3", "--concurrent", "2", "--seeds", "2", "--num-samples", "4", "--steps", "2",
            "--batch-size", "4", "--ref", "builtin:shapes", "--ref-num", "4", "--no-warm",
            "--work", str(tmp_path / "runs"), "--out", str(tmp_path / "t.md")]
    for o in sets:
        args += ["--set", o]
    assert bench.main(args) == 0

    runs = {r["recipe"]: r for r in json.loads((tmp_path / "t.json").read_text())}
    assert set(runs) == {"constant-lr", "flow", "constant-lr-seed1", "flow-seed1"}
    first = [runs["constant-lr"], runs["flow"]]
    assert {r["core"] for r in first} == set(sorted(__import__("os").sched_getaffinity(0))[:2])
    for name, run in runs.items():
        assert run["exit_code"] == 0 and run["steps"] == 3, name  # ran to its step budget, not stopped
        assert "train.total_steps=3" in run["overrides"] and run["steps_per_s"] > 0
        assert run["results"][-1]["step"] == 3 and math.isfinite(run["results"][-1]["fid"])
    assert "train.seed=1" in runs["flow-seed1"]["overrides"] and runs["flow-seed1"]["seed_of"] == "flow"
    table = (tmp_path / "t.md").read_text()
    assert "| recipe | FID per seed | mean |" in table and "How sure: `" in table
    assert "FID against minutes" not in table  # a step budget has no curve by default


def _doc_rows(heading: str) -> list[dict]:
    """The rows of every table in docs/quality.md's section ``heading`` whose first cell names
    a recipe in backticks: {"label", "name", "steps", "images"}."""
    text = (REPO / "docs" / "quality.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows, columns = [], None
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if not cells:
            columns = None
        elif cells[0] == "recipe":
            columns = cells
        elif columns and "`" in cells[0]:
            row = dict(zip(columns, cells))
            rows.append({"label": cells[0], "name": re.search(r"`([^`]+)`", cells[0]).group(1),
                         "steps": int(row["steps"].replace(",", "")), "images": int(row["images seen"].replace(",", ""))})
    return rows


def _doc_configs(bench, heading: str) -> list[tuple[str, str, object]]:
    """(label, recipe name, Config) of each named row of docs/quality.md's section ``heading``, resolved as
    ``--cpu-mode --recipes NAME`` resolves it today; each row's steps and images seen checked against it."""
    from difftrain.config import load_config

    out = []
    for row in _doc_rows(heading):
        (recipe,) = bench.build_recipes(bench.parse_args(["--cpu-mode", "--recipes", row["name"]]))
        cfg = load_config(recipe.config, recipe.overrides)
        t = cfg.train
        assert t.total_steps == row["steps"], row["label"]
        assert t.batch_size * t.grad_accum_steps * t.total_steps == row["images"], row["label"]
        out.append((row["label"], row["name"], cfg))
    return out


def test_every_cpu_mode_row_of_quality_md_resolves_to_the_recipe_it_was_measured_with():
    """Each named row of docs/quality.md's CPU-mode tables, resolved as ``--cpu-mode --recipes
    NAME`` resolves it today: the steps, images seen (so the batch), LR and objective its label
    and columns say, whatever configs/cifar10-16px-cpu.toml says now (batch 32 since b0da83b)."""
    from difftrain.config import load_config

    bench = _bench()
    rows = _doc_rows("The CPU mode: recipes ranked on this CPU (issue 17)")
    assert {r["name"] for r in rows} >= set(bench.CPU_DEFAULT) | {"edm-lr3e-3-b32", "edm-lr2e-3-b16", "edm-lr2e-3-b8"}
    for row in rows:
        label = row["label"]
        (recipe,) = bench.build_recipes(bench.parse_args(["--cpu-mode", "--recipes", row["name"]]))
        cfg = load_config(recipe.config, recipe.overrides)
        t = cfg.train
        lr = re.search(r"LR ([0-9.e-]+)", label)
        batch = re.search(r"batch (\d+)", label)
        objective = "edm" if "EDM" in label else "flow" if "flow" in label else "ddpm"
        assert t.total_steps == row["steps"], label
        assert t.batch_size * t.grad_accum_steps * t.total_steps == row["images"], label
        assert t.batch_size == (int(batch.group(1)) if batch else bench.PROTOCOL_BATCH), label
        assert cfg.optim.lr == (float(lr.group(1)) if lr else bench.PROTOCOL_LR), label
        assert cfg.diffusion.objective == objective, label
        assert (cfg.model.preset, cfg.data.resolution, cfg.optim.lr_schedule) == ("tiny", 16, "cosine"), label


def test_the_smoke_mode_keeps_the_preset_its_tables_were_measured_with():
    """--smoke's tables (docs/quality.md, "The CPU mode with every objective") trained batch 64,
    DDPM epsilon on the linear schedule unless the recipe names another objective."""
    from difftrain.config import load_config

    bench = _bench()
    for name in bench.SMOKE_DEFAULT:
        (recipe,) = bench.build_recipes(bench.parse_args(["--smoke", "--recipes", name]))
        cfg = load_config(recipe.config, [o.replace("@reached", "200") for o in recipe.overrides])
        assert (cfg.train.batch_size, cfg.train.total_steps, cfg.optim.warmup_steps) == (64, 200, 30), name
        own = {"v-minsnr": "ddpm", "edm": "edm", "flow": "flow"}.get(name, "ddpm")
        assert cfg.diffusion.objective == own, name
        if name not in ("v-minsnr", "edm", "flow"):
            assert (cfg.diffusion.schedule, cfg.diffusion.prediction) == ("linear", "epsilon"), name


def test_every_edm2_row_of_quality_md_resolves_to_the_recipe_it_was_measured_with():
    """docs/quality.md's EDM2 table (issue 30): each named row, resolved as ``--cpu-mode --recipes
    NAME`` resolves it, trains the steps and images its columns say with the piece its label names."""
    rows = _doc_configs(_bench(), "EDM2's pieces on the CPU protocol (issue 30)")
    assert {name for _, name, _ in rows} >= {"edm-b32-uw", "edm-b32-pm1.6", "edm-b32-beta99", "edm-b32-mp",
                                             "edm-b32-w48", "edm-b32-uw-pm-beta99"}
    for label, name, cfg in rows:
        assert cfg.diffusion.objective == "edm" and cfg.model.preset == "tiny", label
        assert cfg.diffusion.uncertainty_weighting == ("uw" in name), label
        assert cfg.diffusion.edm_p_mean == (-1.6 if "pm" in name else -1.2), label
        assert tuple(cfg.optim.betas) == ((0.9, 0.99) if "beta99" in name else (0.9, 0.999)), label
        assert cfg.model.magnitude_preserving == name.endswith("-mp"), label
        assert cfg.optim.lr_schedule == ("inverse_sqrt" if name.endswith("-mp") else "cosine"), label
        assert (cfg.model.base_channels or 32) == (48 if "w48" in name else 32), label


def test_every_round_two_row_of_quality_md_resolves_to_the_recipe_it_was_measured_with():
    """docs/quality.md's issue-43 tables: each named row, resolved as ``--cpu-mode --recipes NAME`` resolves it,
    trains the steps and images its columns say, with the network, objective, LR and guide its name says."""
    rows = _doc_configs(_bench(), "From scratch, round two (issue 43)")
    assert {name for _, name, _ in rows} >= {"edm2net-lr3e-3-ref700", "edm2net-lr1e-2-ref700", "meanflow-b32",
                                             "guide-w16-512", "edm-b32-uw-pm-beta99-posthoc"}
    for label, name, cfg in rows:
        assert cfg.model.preset == ("edm2-tiny" if name.startswith("edm2net") else "tiny"), label
        assert cfg.diffusion.objective == ("meanflow" if name.startswith("meanflow") else "edm"), label
        if name.startswith("edm2net"):
            lr, ref = re.fullmatch(r"edm2net-lr([0-9.e-]+)-ref(\d+)", name).groups()
            assert (cfg.optim.lr, cfg.optim.lr_ref_steps, cfg.optim.lr_schedule) == (float(lr), int(ref), "inverse_sqrt")
        if name.startswith("meanflow"):
            ratio = re.fullmatch(r"meanflow-b32(?:-ratio(\d+))?", name).group(1)
            assert cfg.diffusion.meanflow_ratio == (float(f"0.{ratio}") if ratio else 0.75), label
        assert (cfg.model.base_channels or 32) == (16 if name.startswith("guide") else 32), label
        assert bool(cfg.ema.posthoc_std) == (name.startswith("guide") or name.endswith("-posthoc")), label


def test_save_samples_splits_into_parts_of_at_most_part_images(tmp_path):
    import numpy as np
    import torch

    images = torch.arange(7 * 3 * 2 * 2, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(7, 3, 2, 2)
    paths = _bench().save_samples(images, tmp_path / "out" / "r-step4", part=3)
    assert [Path(p).name for p in paths] == ["r-step4-part0.npz", "r-step4-part1.npz", "r-step4-part2.npz"]
    parts = [np.load(p)["images"] for p in paths]
    assert [len(a) for a in parts] == [3, 3, 1]
    assert np.array_equal(np.concatenate(parts), images.permute(0, 2, 3, 1).numpy())  # (N, H, W, C)


def test_no_fid_keeps_the_samples_that_the_scored_run_sees(tmp_path, tiny_overrides, standin_fid):
    """--save-samples with FID and --no-fid (a machine without the Inception weights) keep the
    same pixels: the samples carried back from a GPU are the ones its FID would have scored."""
    import numpy as np

    bench = _bench()
    sets = [o for o in tiny_overrides if not o.startswith(("train.total_steps", "checkpoint.", "validation."))]
    common = ["--config", str(REPO / "configs" / "tiny.toml"), "--recipes", "lr-decay", "--total-steps", "2",
              "--set", "data.path=builtin:shapes", "--set", "validation.every_steps=0", "--num-samples", "5",
              "--steps", "2", "--batch-size", "3", "--ref", "builtin:shapes", "--ref-num", "4", "--no-warm"]
    for o in sets:
        common += ["--set", o]
    for name, extra in (("scored", []), ("kept", ["--no-fid"])):
        args = common + extra + ["--save-samples", str(tmp_path / name), "--work", str(tmp_path / f"runs-{name}"),
                                 "--out", str(tmp_path / f"{name}.md")]
        assert bench.main(args) == 0
    scored, kept = (json.loads((tmp_path / f"{n}.json").read_text())[0]["results"][-1] for n in ("scored", "kept"))
    assert math.isfinite(scored["fid"]) and "fid" not in kept and kept["step"] == 2
    a, b = (np.load(r["samples"][0])["images"] for r in (scored, kept))
    assert a.shape == (5, 16, 16, 3) and a.dtype == np.uint8 and np.array_equal(a, b)
    assert "| lr-decay | - |" in (tmp_path / "kept.md").read_text() and "| n/a | n/a |" in (tmp_path / "kept.md").read_text()
    with pytest.raises(SystemExit, match="--no-fid keeps nothing"):
        bench.parse_args(["--no-fid", "--recipe", "a=configs/tiny.toml"])


def test_print_commands_prints_the_training_commands_it_would_run(tmp_path, capsys):
    """--print-commands: one line per recipe, the CLI command train_recipe runs (its overrides in order, the run
    folder under --work), and nothing trained."""
    import shlex

    bench = _bench()
    argv = ["--cpu-mode", "--data", str(tmp_path / "data"), "--work", str(tmp_path / "work"),
            "--recipes", "meanflow-b32-ratio25", "edm2net-lr4e-2-ref700", "--set", "train.seed=1"]
    assert bench.main(argv + ["--print-commands"]) == 0
    lines = capsys.readouterr().out.splitlines()
    recipes = bench.build_recipes(bench.parse_args(argv))
    assert [shlex.split(line) for line in lines] == [
        bench.train_command(r, tmp_path / "work" / r.name, python="python") for r in recipes]
    assert "diffusion.meanflow_ratio=0.25" in lines[0] and "train.seed=1" in lines[1]
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())
