"""The start of a run is difftrain's own lines (issue 39): diffusers, transformers and peft import
bitsandbytes and torchao whenever those are installed, and those imports log lines that are not about
the run (``runtime/optional.py``'s ``IMPORT_NOISE``), which difftrain drops while it imports them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from tests.integration.test_text_train import _captioned_folder  # noqa: E402
from tests.text_components import write_tiny_sd_folder  # noqa: E402

# What a family run printed before difftrain's lines, with model.quantize_base = "off" (on an Intel Xeon with
# AVX-512 BF16, bitsandbytes, torchao and torch 2.13 installed, torchvision not).
NOISE = ["Failed to load CPU gemm_4bit_forward", "Failed to load ", "is an Enum subclass",
         "Unable to import `torchao` Tensor objects", "requires torchvision (not installed)", "_pytree"]


def _run(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run([sys.executable, "-m", "difftrain", *args], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)


def test_a_family_run_starts_with_difftrains_own_lines(tmp_path):
    sd = write_tiny_sd_folder(tmp_path / "sd")
    data = _captioned_folder(tmp_path / "data")
    sets = [f"model.init_from={sd}", "lora.rank=4", f"data.path={data}", "model.quantize_base=off",
            "data.resolution=16", "data.num_workers=0", "train.total_steps=1", "train.batch_size=2",
            "validation.every_steps=0", "checkpoint.every_steps=1", "train.progress_bar=false"]
    proc = _run(["train", "--run-dir", str(tmp_path / "run"), *[a for s in sets for a in ("--set", s)]], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = (proc.stderr + proc.stdout).splitlines()
    assert not [line for line in lines if any(n in line for n in NOISE)]
    start = proc.stdout.split("difftrain: first step")[0].splitlines() + proc.stderr.splitlines()
    assert start and all(line.startswith("difftrain: ") for line in start), start


def test_difftrain_imports_no_quantization_library_for_a_run_that_does_not_quantize(tmp_path):
    """difftrain's own modules (the CLI, the loop, the quantizer, the optimizers) and a network built for a
    run without model.quantize_base import neither bitsandbytes nor torchao (diffusers and peft do, as they
    load: a family run has them loaded, quietly)."""
    code = ("import sys, torch\n"
            "import difftrain.cli, difftrain.training.loop, difftrain.networks.quantize, difftrain.training.optimizers\n"
            "from difftrain.config import load_config\n"
            "from difftrain.networks.conditioning import Conditioning\n"
            "from difftrain.networks.build import build_network\n"
            "from difftrain.training.optimizers import build_optimizer\n"
            "cfg = load_config(None, ['model.preset=tiny', 'data.resolution=16'])\n"
            "net = build_network(cfg, Conditioning.from_config(cfg, 0))\n"
            "build_optimizer(cfg.optim, net, torch.device('cpu'))\n"
            "print(sorted(m for m in ('bitsandbytes', 'torchao') if m in sys.modules))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
