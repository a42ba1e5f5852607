#!/usr/bin/env bash
# Set up (scripts/setup.sh), train the tiny preset on the built-in shapes data, then sample.
# Runs again safely: a finished run is left as it is, an interrupted one resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
RUN_DIR=${RUN_DIR:-runs/quickstart}
start=$(date +%s)
.venv/bin/difftrain train --config configs/tiny.toml --run-dir "$RUN_DIR" "$@"
.venv/bin/difftrain sample --checkpoint "$RUN_DIR" --num 64 --sampler heun --steps 25 --seed 0 \
    --guide-step 1600 --guide-weight 3 --out "$RUN_DIR/final-samples"   # autoguidance: its own step-1,600 checkpoint (half the run)
echo "quickstart: done in $(( $(date +%s) - start )) s; look at $RUN_DIR/final-samples/grid.png"
