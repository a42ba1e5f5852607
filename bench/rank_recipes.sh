#!/usr/bin/env bash
# The recipe ranking of docs/quality.md ("Confetti" and "The objectives at the issue's protocol"):
# the tiny UNet on 16-px CIFAR-10 (bench/make_cifar16.py), batch 64, LR 1e-3 with 100 warm-up
# steps and cosine to zero at 1,564 steps (two epochs), EMA, flips, fp32; each objective on two
# seeds, all runs at once (sized for one GPU: about 3 minutes on an H100; on a CPU run fewer at a
# time). Then 1,000 EMA samples of each (seed 0) with the confetti share per sampler, saved as
# arrays for bench/fid_of_samples.py against 2,000 test images.
#   bench/rank_recipes.sh /tmp/cifar16 /tmp/rank cuda
set -euo pipefail
data=${1:?folder made by bench/make_cifar16.py}; out=${2:?output folder}; device=${3:-cuda}
cd "$(dirname "$0")/.."
common=(--config configs/cifar10-16px-cpu.toml --set data.path="$data/train" --set train.total_steps=1564
        --set optim.warmup_steps=100 --set train.batch_size=64 --set optim.lr=1e-3 --set train.device="$device" --set train.compile=off --set train.cuda_graphs=off
        --set checkpoint.every_steps=400 --set train.log_every_steps=100 --set data.num_workers=1)
eps=(--set diffusion.objective=ddpm --set diffusion.schedule=linear --set diffusion.prediction=epsilon)
v=(--set diffusion.objective=ddpm --set diffusion.schedule=linear --set diffusion.prediction=v --set diffusion.loss_weighting=min_snr)
run() { local name=$1; shift; python -m difftrain train "${common[@]}" "$@" --run-dir "$out/$name" >"$out/$name.log" 2>&1; }
mkdir -p "$out"
for s in 0 1; do
  run "eps-s$s" "${eps[@]}" --set train.seed=$s &
  run "v-s$s" "${v[@]}" --set train.seed=$s &
  run "edm-s$s" --set diffusion.objective=edm --set train.seed=$s &
  run "flow-s$s" --set diffusion.objective=flow --set train.seed=$s &
done
run v-lr2e-3 "${v[@]}" --set optim.lr=2e-3 &
wait
score=(python bench/confetti.py --ref "$data/test" --num 1000 --device "$device" --save "$out/samples")
"${score[@]}" --checkpoint eps="$out/eps-s0" --checkpoint v="$out/v-s0" \
  --case ddim25=ddim:25 --case ddim50=ddim:50 --case ddim100=ddim:100 --case dpm2m25=dpmpp_2m:25 --case dpm2m50=dpmpp_2m:50 \
  --case dpm3m25=dpmpp_3m:25 --case dpm3m50=dpmpp_3m:50 --case heun25=heun:25 --case heun50=heun:50 --case ddpm250=ddpm:250
"${score[@]}" --checkpoint eps1="$out/eps-s1" --checkpoint v1="$out/v-s1" --checkpoint vlr2="$out/v-lr2e-3" --case ddim50=ddim:50
"${score[@]}" --checkpoint edm="$out/edm-s0" --checkpoint edm1="$out/edm-s1" --checkpoint flow="$out/flow-s0" \
  --checkpoint flow1="$out/flow-s1" --case heun25=heun:25 --case euler50=euler:50
python bench/fid_of_samples.py --ref "$data/test" --floor "$data/train" "$out"/samples/*.npz
