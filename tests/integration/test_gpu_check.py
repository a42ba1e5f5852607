"""bench/gpu_check.py (issue 41 item 7), on the CPU: the tiny mode trains every setting and writes the table;
the GPU mode's base writers, narrowed, write folders difftrain trains on; the logs it reads are read right."""

from __future__ import annotations

import json

import pytest

from tests.bench_modules import load_bench


@pytest.fixture(scope="module")
def gc():
    return load_bench("gpu_check")


def test_reading_the_runs_the_script_and_pytest(gc, tmp_path):
    """The peak and median step time from metrics.jsonl (first step left out), tqdm's rate of the peer's bar in
    either unit, pytest's closing counts, and the 10% verdict."""
    rows = [{"step": s, "time": t, "gpu_max_allocated_mib": m}
            for s, t, m in ((1, 100.0, 1024), (2, 101.5, 3072), (3, 102.0, 2048), (4, 102.5, 2048), (5, 103.5, 2048))]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert gc.read_metrics(tmp_path) == (5, 3.0, 0.5)
    assert gc.read_metrics(tmp_path / "none") == (0, None, None)
    bar = "Steps:  50%|#####     | 3/6 [00:04<00:03,  1.60s/it, loss=0.5, lr=0.0001]\r"
    assert gc.peer_rate(bar + "Steps: 100%|##########| 6/6 [00:05<00:00,  2.50it/s, loss=0.4, lr=0.0001]") == 0.4
    assert gc.peer_rate(bar) == 1.6
    assert gc.peer_rate("no bar") is None
    assert gc.pytest_counts("...\n7 passed, 1 failed, 2 skipped, 93 deselected in 40.1s\n") == {
        "passed": 7, "failed": 1, "skipped": 2, "deselected": 93}
    stopped = ("tests/unit/test_step.py::test_a PASSED  [ 10%]\ntests/unit/test_step.py::test_b FAILED  [ 20%]\n"
               "tests/unit/test_step.py::test_c PASSED  [ 30%]\n")
    assert gc.pytest_counts(stopped) == {"passed": 2, "failed": 1}
    assert gc.Row("flux", "bf16 base", peak_gib=10.5, estimate_gib=10.0).ratio() == 1.05
    assert gc.table([gc.Row("flux", "bf16 base", 6, 10.5, 10.0, 0.25, 30.0)], ["head"]).splitlines()[-1] == (
        "| flux | bf16 base | 6 | 10.50 | 10.00 | 1.05 | 0.250 | 30 | ok |")
    assert gc.Row("sdxl", "nf4 base", 6, 11.5, 10.0, notes=["a note"]).verdict() == ["off by more than 10%"]
    assert gc.Row("sdxl", "nf4 base", 6, None, 10.0).verdict() == []


def test_an_estimate_that_fails_is_a_note(gc, tmp_path):
    """The estimates are counted on a thread while the runs go; one that fails gives its row one line."""
    estimates = gc.Estimates()
    estimates.add(("flux", "bf16 base"), "flux", tmp_path / "absent", [f"model.init_from={tmp_path / 'absent'}"])
    assert estimates.get(("flux", "bf16 base"), 60).startswith("estimate failed: ")
    assert estimates.get(("sdxl", "bf16 base"), 0) == "estimate not finished within the budget"


def test_the_gpu_test_files_are_found(gc):
    assert "tests/unit/test_block_swap.py" in gc.gpu_test_files()


@pytest.mark.slow
def test_tiny_mode_trains_each_setting_and_writes_the_table(gc, tmp_path):
    """``--tiny --device cpu``: every setting trains its 2 steps (block swap where training has it wired, else a
    note), the peer is a row (run, or skipped with why), and the table is written to --out."""
    out = tmp_path / "gpu_check.md"
    assert gc.main(["--tiny", "--device", "cpu", "--work", str(tmp_path / "work"), "--out", str(out),
                    "--no-tests"]) == 0
    lines = out.read_text().splitlines()
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in lines
            if line.startswith(("| flux", "| sdxl"))}
    for base in ("flux", "sdxl"):
        for name in gc.SETTINGS:
            row = rows[(base, name)]
            steps = row.split("|")[3].strip()
            if name == "block swap" and gc.swap_wired() is not None:
                assert gc.swap_wired() in row and steps == "-", row
            else:
                assert steps == "2", row
    assert any(key[1].startswith("diffusers train_dreambooth_lora_flux.py") for key in rows)


@pytest.mark.slow
def test_the_gpu_bases_written_narrow_train_in_the_check(gc, tmp_path):
    """The GPU mode's writers (the Flux transformer and the SDXL UNet config, here narrowed to a CPU's size)
    write folders that the check's own path (no --tiny, each run a `python -m difftrain train` process) trains on."""
    import torch

    work = tmp_path / "work"
    cpu = torch.device("cpu")
    gc.write_flux(work / "flux", cpu, heads=2, head_dim=32, t5_width=32, clip_width=16)
    gc.write_sdxl(work / "sdxl", cpu, narrow={
        "block_out_channels": [32, 64, 64], "attention_head_dim": [1, 2, 2], "transformer_layers_per_block": [1, 1, 1],
        "layers_per_block": 1, "cross_attention_dim": 96, "addition_time_embed_dim": 8,
        "projection_class_embeddings_input_dim": 6 * 8 + 64})
    out = tmp_path / "gpu_check.md"
    assert gc.main(["--device", "cpu", "--work", str(work), "--out", str(out), "--resolution", "64", "--steps", "2",
                    "--rank", "4", "--settings", "bf16 base", "--no-tests", "--no-peer", "--runner", "subprocess"]) == 0
    text = out.read_text()
    assert "| flux | bf16 base | 2 |" in text and "| sdxl | bf16 base | 2 |" in text, text
