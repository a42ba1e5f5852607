"""The run report in a real browser (headless Chromium): it loads offline, renders its plots
and grids, logs nothing to the console, and can be screenshot."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from PIL import Image

from difftrain.config import load_config
from difftrain.report import build_report
from difftrain.report.browser import find_chromium, render
from difftrain.training.loop import train

if find_chromium() is None:  # scripts/test.sh installs it; say so loudly when that failed
    pytest.skip("SKIPPED: no Chromium on this machine (apt-get install chromium); the report was not "
                "checked in a browser", allow_module_level=True)


def test_report_renders_in_chromium(tmp_path, tiny_overrides):
    run_dir = tmp_path / "run"
    train(load_config(None, tiny_overrides + ["data.heldout_fraction=0.01"]), run_dir)
    page = build_report(run_dir)
    shot = tmp_path / "report.png"
    dom, console = render(page, screenshot=shot, size=(1200, 900))
    assert console == [], console
    rendered = re.search(r'data-rendered="series=(\d+);grids=(\d+)"', dom)
    assert rendered, "the page's script did not run"
    series, grids = map(int, rendered.groups())
    assert grids == 2  # validation grids at steps 3 and 6 decoded from their data URIs
    assert series >= 1 + 2 + 10 + 10 + 1 + 1 + 1 + 1  # loss, held-out (EMA, raw, train), buckets, ...
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    assert pixels.shape[:2] == (900, 1200)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # drawn, not a blank page


def test_a_text_runs_report_shows_its_scores_with_their_counts(tmp_path, tiny_overrides):
    pytest.importorskip("transformers")
    from difftrain.evaluation.inception_score import InceptionClassifier
    from tests.text_components import write_tiny_clip_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.save(InceptionClassifier().state_dict(), tmp_path / "pt_inception.pth")
    run_dir = tmp_path / "run"
    train(load_config(None, tiny_overrides + [
        "data.captions=true", "model.text_encoder=builtin:tiny-clip", "validation.prompts=['a red disc', 'a blue square']",
        f"evaluation.clip_model={write_tiny_clip_model(tmp_path / 'clip')}",
        f"evaluation.is_inception_path={tmp_path / 'pt_inception.pth'}"]), run_dir)
    page = build_report(run_dir)
    text = page.read_text()
    assert "CLIP score of the validation images (higher is better), 4 images" in text
    assert "Inception Score of the validation images (higher is better), 4 images" in text
    dom, console = render(page)
    assert console == [], console
    rendered = re.search(r'data-rendered="series=(\d+);grids=(\d+)"', dom)
    assert rendered and int(rendered.group(2)) == 2  # the captioned grids decode too


def test_a_broken_script_is_caught(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text("<html><body><script>undefinedFunction();</script></body></html>")
    _, console = render(page)
    assert console, "a console error went unnoticed"


def test_the_fid_panel_names_its_sample_count_and_conditioning(tmp_path):
    import json

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": s, "loss": 0.1, "fid": f, "fid_num_samples": 500, "fid_conditioned_on": "labels uniform over 3 classes"}
            for s, f in ((100, 90.0), (200, 70.0))]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = build_report(run_dir).read_text()
    assert "FID of the EMA weights (lower is better), 500 images; conditioned on labels uniform over 3 classes" in text
    assert "CLIP score" not in text  # no panel for what the run did not log
