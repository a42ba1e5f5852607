"""The warnings of a run going wrong: they fire on an over-fitting sequence of metrics, naming the
step it started and what to try, and stay quiet on a healthy one."""

from __future__ import annotations

import json

from difftrain.config import load_config
from difftrain.training.trackers import JSONLTracker, Trackers
from difftrain.training.warnings import RunWarnings, WatchedTrackers


def _feed(rows: list[tuple[int, dict]]) -> list[str]:
    w = RunWarnings(load_config(None, []).validation)
    return [line for step, metrics in rows for line in w.observe(step, metrics)]


def _run(losses, heldout, fids, shares, diversity) -> list[tuple[int, dict]]:
    """Validation every 100 steps with the training loss logged at 50 and 100 of each interval."""
    rows = []
    for i in range(len(heldout)):
        step = 100 * (i + 1)
        rows.append((step - 50, {"loss": losses[i]}))
        rows.append((step, {"loss": losses[i]}))
        rows.append((step, {"heldout/loss": heldout[i], "memorization/near_copy_share": shares[i],
                            "memorization/median_ratio": 1.0 - shares[i], "diversity/ratio": diversity[i]}))
        rows.append((step, {"fid": fids[i]}))
    return rows


HEALTHY = _run(losses=[0.30, 0.20, 0.15, 0.12, 0.11, 0.10, 0.10, 0.09],
               heldout=[0.31, 0.21, 0.16, 0.13, 0.125, 0.12, 0.121, 0.119],
               fids=[300, 200, 120, 90, 80, 78, 79, 77],
               shares=[0.0, 0.0, 0.02, 0.0, 0.03, 0.0, 0.02, 0.03],
               diversity=[2.6, 1.8, 1.4, 1.2, 1.1, 1.0, 0.95, 0.97])
OVERFIT = _run(losses=[0.30, 0.20, 0.15, 0.10, 0.07, 0.05, 0.03, 0.02],
               heldout=[0.31, 0.21, 0.16, 0.17, 0.19, 0.22, 0.26, 0.30],
               fids=[300, 200, 120, 130, 150, 170, 200, 230],
               shares=[0.0, 0.0, 0.02, 0.05, 0.15, 0.4, 0.7, 0.9],
               diversity=[2.8, 1.8, 1.5, 1.2, 0.8, 0.45, 0.3, 0.2])


def test_a_healthy_run_gets_no_warning():
    # Early samples (noise) are more varied than the data: the diversity ratio starts above 1 and falls to
    # about 1; a few near-copies by chance, a FID that wobbles once and a flat held-out loss warn of nothing.
    assert _feed(HEALTHY) == []


def test_the_levels_are_the_configs():
    strict = RunWarnings(load_config(None, ["validation.warn_near_copy_share=0.01", "validation.warn_fid_rises=1"]).validation)
    fired = [line for step, metrics in HEALTHY for line in strict.observe(step, metrics)]
    assert any("near-copies" in line for line in fired) and any("FID has risen" in line for line in fired)


def test_an_overfitting_run_warns_once_per_condition_with_the_step_it_started_and_what_to_try():
    lines = _feed(OVERFIT[4:])
    by_kind = {kind: [line for line in lines if kind in line] for kind in ("near-copies", "diversity", "FID", "held-out")}
    assert all(len(v) == 1 for v in by_kind.values()), lines
    assert by_kind["near-copies"][0].startswith("step 500:") and "more data or augmentation" in by_kind["near-copies"][0]
    assert by_kind["diversity"][0].startswith("step 600:")
    # FID rose at 400, 500, 600: the third rise in a row warns, naming where the rise began (300).
    assert by_kind["FID"][0].startswith("step 600:") and "since step 300" in by_kind["FID"][0]
    assert "best checkpoint" in by_kind["FID"][0] or "RUN/best" in by_kind["FID"][0]
    held = by_kind["held-out"][0]
    assert held.startswith("step 600:") and "since step 300" in held and "training loss fell" in held
    assert "lower optim.lr" in held


def test_a_condition_that_clears_and_returns_warns_again():
    w = RunWarnings(load_config(None, ["validation.warn_near_copy_share=0.2"]).validation)
    fired = [w.observe(s, {"memorization/near_copy_share": v}) for s, v in ((1, 0.5), (2, 0.6), (3, 0.1), (4, 0.3))]
    assert [bool(f) for f in fired] == [True, False, False, True]


def test_held_out_loss_rising_with_the_training_loss_rising_too_is_not_overfitting():
    rows = _run(losses=[0.1, 0.12, 0.15, 0.2, 0.3], heldout=[0.1, 0.12, 0.15, 0.2, 0.3],
                fids=[10, 9, 8, 7, 6], shares=[0] * 5, diversity=[1] * 5)
    assert not [line for line in _feed(rows) if "held-out" in line]


def test_watched_trackers_print_one_line_and_log_the_warning(tmp_path, capsys):
    trackers = WatchedTrackers(Trackers([JSONLTracker(tmp_path / "metrics.jsonl")]), RunWarnings(load_config(None, []).validation))
    for step, metrics in OVERFIT[4:]:
        trackers.log(step, metrics)
    trackers.close()
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 4 and all(line.startswith("difftrain: warning: step ") for line in err)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "warning" in r] == [s for s, _ in trackers.fired]


def test_a_resumed_run_replays_its_metrics_up_to_the_checkpoint_and_does_not_warn_twice(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with open(path, "w") as f:
        for step, metrics in OVERFIT[4:]:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
    cfg = load_config(None, [])
    # Resumed at step 500: the rises of FID and held-out loss since 300 count, the near-copy warning was given.
    w = RunWarnings.resumed(cfg.validation, path, 500)
    assert w.active == {"near_copy": 500}
    lines = w.observe(600, {"fid": 170.0, "heldout/loss": 0.22, "memorization/near_copy_share": 0.4})
    assert [line.split(":")[1].strip().split()[0] for line in lines] == ["FID"]  # held-out needs the training loss
    assert RunWarnings.resumed(cfg.validation, tmp_path / "missing.jsonl", 500).active == {}
