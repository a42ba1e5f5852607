#!/usr/bin/env bash
# Make the images of docs/monitoring.md with the project's own commands: a short real run of
# the tiny preset on builtin:shapes, its report (screenshot in headless Chromium) and an LR
# range test. About 15 minutes on 2 busy CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
DT=${DT:-.venv/bin/difftrain}
RUN=${RUN:-runs/monitoring-demo}
"$DT" train --config configs/tiny.toml --run-dir "$RUN" \
  --set train.total_steps=160 --set train.batch_size=16 --set optim.warmup_steps=20 \
  --set data.heldout_fraction=0.005 --set data.num_workers=0 --set train.log_every_steps=5 \
  --set validation.every_steps=40 --set validation.num_images=16 --set validation.steps=10 \
  --set checkpoint.every_steps=80
"$DT" report "$RUN" --screenshot docs/images/report.png --window-size 1300,1250
"$DT" lr-find --config configs/tiny.toml --set train.batch_size=16 --set data.num_workers=0 \
  --num-steps 60 --start-lr 1e-6 --end-lr 1 --out "$RUN/lr-find"
cp "$RUN/lr-find/lr_find.png" docs/images/lr-find.png
"$DT" diagnose --checkpoint "$RUN" --out "$RUN/diagnose"
cp "$RUN/diagnose/trajectory.png" docs/images/trajectory.png
