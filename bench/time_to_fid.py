"""Time to FID: train each recipe for the same budget, then FID/KID of its EMA samples.

    # CPU mode, the ranking protocol: the tiny UNet on 16-px CIFAR-10 (bench/make_cifar16.py),
    # 1,564 steps, two recipes at a time on one core each, the best two again on a second seed;
    # 1,000 samples against 2,000 test images. About 25 minutes per pair of recipes on 2 cores.
    python bench/time_to_fid.py --cpu-mode --data /tmp/cifar16 --recipes epsilon v-minsnr edm flow
    # the 60-s smoke version (six ablation recipes, 200 samples; about 13 minutes)
    python bench/time_to_fid.py --smoke --data /tmp/cifar16
    # the issue's H100 comparison (the short preset against diffusers' script), 318 s each;
    # the full command is in docs/quality.md
    python bench/time_to_fid.py --data /tmp/cifar10 --budget 318 --num-samples 10000 \\
        --recipe short=configs/ddpm-cifar10-short.toml --peer diffusers

Each recipe (a name, a config file and ``--set`` overrides) is trained by the real CLI,
``python -m difftrain train``, in a subprocess. The budget counts from the moment the process
is started, start-up included (imports, data scan, model build, compile); at the budget the
process gets SIGTERM, saves a checkpoint and exits 75. From outside, this script polls the run
folder and records when each checkpoint file and each ``metrics.jsonl`` line appears. After
all recipes have trained (so that evaluation never competes with training for the CPU), each
kept checkpoint is sampled from its EMA weights (DDIM, ``--steps``, eta 0, fixed seed) and
compared with reference statistics of ``DATA/test`` through the training preprocessing,
computed once and cached (what ``difftrain fid-ref`` makes). One table per run: recipe,
budget, steps, images seen, time to first step, FID and KID; then FID against minutes.

Time to first step is measured from outside as the moment the training loop began: the
appearance time of the first ``metrics.jsonl`` line minus the span that line's
``images_per_s`` covers (``train.log_every_steps`` steps); so it includes everything before
the loop (imports, data scan, decode cache, model build) and not the first step itself.

``train.total_steps=@reached`` in a recipe's overrides is replaced by the steps that the
first recipe reached in the budget, so that a decaying LR schedule ends when the budget does.
With ``--total-steps N`` the budget is a step count instead (every recipe trains N steps, its
schedule planned over them; a recipe may set its own ``train.total_steps``, for example at
another batch size), and ``--concurrent K`` trains K recipes at a time, each pinned to its own
CPU core with one thread, so that the machine's noise hits them alike. ``--seeds S`` trains the
best two recipes again on ``train.seed`` 1 .. S-1 and prints how far apart their means are
against the spread between seeds: how sure the ranking is.

The diffusers peer (``--peer diffusers``) runs ``train_unconditional.py`` from
``--peer-dir`` (default ``../shared/peers``) through ``accelerate launch`` under ``timeout
BUDGET``, as that folder's README shows; every per-epoch save of its EMA pipeline is copied
as it appears, mapped onto difftrain's UNet (``models/diffusers_export.py``: the same network)
and sampled and scored exactly as difftrain's checkpoints are. It needs torchvision, datasets,
accelerate and diffusers; where one is missing the table says so and the peer is skipped.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import math
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
CPU_CONFIG = REPO / "configs" / "cifar10-16px-cpu.toml"
DATA_ENV = "DIFFTRAIN_BENCH_DATA"  # a folder holding train/ and test/ image folders
PEER_MODULES = ("torchvision", "datasets", "accelerate", "diffusers")

# The ablation: today's preset recipe (constant LR after warm-up, Adam beta1 0.9, no weight
# decay, the DDPM EMA ramp, random flips), then each difference from diffusers' script on its
# own, then all of them together and all but the LR decay.
_COSINE = ("optim.lr_schedule=cosine", "optim.min_lr_ratio=0.0", "train.total_steps=@reached")
_BETA1 = ("optim.betas=[0.95,0.999]",)
_WD = ("optim.weight_decay=1e-6",)
_EMA = ("ema.warmup_power=0.75",)
_NOFLIP = ("data.random_flip=false",)
_CONSTANT = ("optim.lr_schedule=constant",)
ABLATION = {
    "constant-lr": _CONSTANT,
    "lr-decay": _COSINE,
    "beta1-0.95": _CONSTANT + _BETA1,
    "wd-1e-6": _CONSTANT + _WD,
    "ema-power": _CONSTANT + _EMA,
    "no-flip": _CONSTANT + _NOFLIP,
    "all-but-decay": _CONSTANT + _BETA1 + _WD + _EMA + _NOFLIP,
    "diffusers-like": _COSINE + _BETA1 + _WD + _EMA + _NOFLIP,
    # The objectives (diffusion/objective.py), each with the decaying LR and its own ODE sampler.
    "epsilon": _COSINE + ("diffusion.objective=ddpm", "diffusion.schedule=linear", "diffusion.prediction=epsilon"),
    "v-minsnr": _COSINE + ("diffusion.objective=ddpm", "diffusion.schedule=linear", "diffusion.prediction=v",
                           "diffusion.loss_weighting=min_snr"),
    "edm": _COSINE + ("diffusion.objective=edm", "validation.sampler=heun", "evaluation.fid_sampler=heun"),
    "flow": _COSINE + ("diffusion.objective=flow", "validation.sampler=heun", "evaluation.fid_sampler=heun"),
    # EDM at twice the LR, and at half the batch for the same wall clock: one core trained batch 32
    # about 10% slower per image than batch 64, so 2,816 steps (0.9 x 3,128) rather than 3,128.
    "edm-lr2e-3": _COSINE + ("diffusion.objective=edm", "optim.lr=2e-3"),
    "edm-lr2e-3-b32": _COSINE + ("diffusion.objective=edm", "optim.lr=2e-3", "train.batch_size=32",
                                 "train.total_steps=2816", "optim.warmup_steps=200"),
    # Beyond the CPU mode's default set: a higher LR at batch 32, and batch 16 for the same wall
    # clock (one core trains batch 16 about 20% slower per image than batch 64: 5,000 steps).
    "edm-lr3e-3-b32": _COSINE + ("diffusion.objective=edm", "optim.lr=3e-3", "train.batch_size=32",
                                 "train.total_steps=2816", "optim.warmup_steps=200"),
    "edm-lr2e-3-b16": _COSINE + ("diffusion.objective=edm", "optim.lr=2e-3", "train.batch_size=16",
                                 "train.total_steps=5000", "optim.warmup_steps=400"),
    "edm-lr2e-3-b8": _COSINE + ("diffusion.objective=edm", "optim.lr=2e-3", "train.batch_size=8",
                                "train.total_steps=8000", "optim.warmup_steps=600"),
}
# EDM2's pieces (issue 30) on the default (edm-lr2e-3-b32), each alone, then together. Equal wall
# clock by the per-step cost measured in one process, one thread, interleaved (/tmp cost probe in
# docs/quality.md): magnitude-preserving layers x1.18 (2,400 steps), base width 48 x1.66 (1,700).
_B32 = ABLATION["edm-lr2e-3-b32"]
_UW, _PM, _B99 = ("diffusion.uncertainty_weighting=true",), ("diffusion.edm_p_mean=-1.6",), ("optim.betas=[0.9,0.99]",)
_MP = ("model.magnitude_preserving=true", "optim.lr_schedule=inverse_sqrt", "optim.lr=1e-2", "optim.lr_ref_steps=700",
       "train.total_steps=2400")
ABLATION |= {
    "edm-b32-uw": _B32 + _UW,
    "edm-b32-pm1.6": _B32 + _PM,
    "edm-b32-beta99": _B32 + _B99,
    "edm-b32-mp": _B32 + _MP,
    "edm-b32-w48": _B32 + ("model.base_channels=48", "train.total_steps=1700"),
    "edm-b32-uw-pm-beta99": _B32 + _UW + _PM + _B99,
}
# Issue 43 item 1: EDM2's network (model.preset = "edm2-tiny", models/edm2.py) on the default recipe's training keys
# (edm-b32-uw-pm-beta99), with EDM2's inverse-square-root LR at five LRs and three reference steps. Its training
# step costs x1.45 the tiny UNet's (one process, one thread, interleaved), so 1,940 steps (2,816 / 1.45) and 140
# warm-up steps (the default's 200 / 1.45).
_EDM2NET = ABLATION["edm-b32-uw-pm-beta99"] + ("model.preset=edm2-tiny", "optim.lr_schedule=inverse_sqrt",
                                               "train.total_steps=1940", "optim.warmup_steps=140")
ABLATION |= {f"edm2net-lr{lr}-ref{ref}": _EDM2NET + (f"optim.lr={lr}", f"optim.lr_ref_steps={ref}")
             for lr in ("3e-3", "6e-3", "1e-2", "2e-2", "4e-2") for ref in (300, 700, 1500)}
# Issue 43 item 2, a guide that is a smaller, shorter run (bench/small_guide_fid.py): the guide
# (configs/cifar10-16px-cpu-guide.toml: base width 16, 512 steps, x0.513 the default's per-step cost)
# and the main run it guides (the default with post-hoc EMAs, x1.021), 2,500 steps so that main + guide
# = the default's 2,816 steps (CPU time per step, one thread, interleaved: `small_guide_fid.py cost`).
_POSTHOC = ("ema.posthoc_std=[0.05,0.10]",)
ABLATION |= {
    "guide-w16-512": _B32 + _UW + _PM + _B99 + _POSTHOC + (
        "model.base_channels=16", "train.total_steps=512", "optim.warmup_steps=50", "ema.posthoc_every_steps=32"),
    "edm-b32-uw-pm-beta99-posthoc": _B32 + _UW + _PM + _B99 + _POSTHOC + (
        "train.total_steps=2500", "ema.posthoc_every_steps=100"),
}
# Issue 43 item 3 (few-step sampling from scratch): MeanFlow (diffusion/meanflow.py) on the default's keys
# (edm-b32-uw-pm-beta99) but uncertainty weighting, which MeanFlow refuses (its loss has its own adaptive weight),
# and P_mean (EDM's). Its step costs x3.30 the default's (median of 5 interleaved rounds, one process, one
# thread: bench/meanflow_step_cost.py), so 853 steps for the default's 2,816.
ABLATION |= {"meanflow-b32": _B32 + _B99 + ("diffusion.objective=meanflow", "train.total_steps=853")}
# ... and with the share of samples whose r is drawn apart from t at 0.25 (the authors' ImageNet choice) or 0.1
# instead of CIFAR-10's 0.75: more of each batch is plain flow matching, which a short run may learn first.
ABLATION |= {f"meanflow-b32-ratio{r}": ABLATION["meanflow-b32"] + (f"diffusion.meanflow_ratio=0.{r}",) for r in ("25", "10")}
SMOKE_DEFAULT = ("constant-lr", "lr-decay", "diffusers-like", "v-minsnr", "edm", "flow")
# The CPU mode's recipes: the four objectives at the protocol's LR, then EDM's LR and batch.
CPU_DEFAULT = ("epsilon", "v-minsnr", "edm", "flow", "edm-lr2e-3", "edm-lr2e-3-b32")
# The CPU mode's protocol (issue 17): two epochs of 16-px CIFAR-10 at batch 64, LR 1e-3 (a
# recipe may set its own), 100 warm-up steps.
PROTOCOL_STEPS, PROTOCOL_WARMUP, PROTOCOL_LR, PROTOCOL_BATCH = 1564, 100, 1e-3, 64
# The protocol itself, whatever --config: batch, LR, warm-up, one loader worker (the steps:
# --total-steps).
CPU_PROTOCOL = (f"train.batch_size={PROTOCOL_BATCH}", f"optim.lr={PROTOCOL_LR}", f"optim.warmup_steps={PROTOCOL_WARMUP}",
                "data.num_workers=1")
# Every training key of configs/cifar10-16px-cpu.toml as each protocol's tables were measured
# with it, pinned so that later changes of the preset (it became EDM at batch 32 for 2,816
# steps, then took EDM2's uncertainty weighting, P_mean -1.6 and beta2 0.99) leave docs/quality.md reproducible; applied when the recipes build on that preset,
# before the protocol's keys and the recipe's own, which win.
_PRESET_AS_MEASURED = ("model.preset=tiny", "data.resolution=16", "data.random_flip=true", "data.num_workers=1",
                       "diffusion.num_timesteps=1000", "optim.lr_schedule=cosine", "optim.min_lr_ratio=0.0",
                       "optim.grad_clip=1.0", "ema.decay=0.9999", "train.batch_size=64")
PRESET_AS_MEASURED = {
    # --cpu-mode (docs/quality.md, "The CPU mode"): the preset of 2026-11-24, EDM.
    "cpu": _PRESET_AS_MEASURED + ("diffusion.objective=edm", "diffusion.uncertainty_weighting=false",
                                  "diffusion.edm_p_mean=-1.2", "optim.betas=[0.9,0.999]"),
    # --smoke ("Smoke mode" and the sections after it): DDPM epsilon on the linear schedule, LR
    # 1e-3 with 30 warm-up steps, planned over 200 steps.
    "smoke": _PRESET_AS_MEASURED + ("diffusion.objective=ddpm", "diffusion.schedule=linear",
                                    "diffusion.prediction=epsilon", "optim.lr=1e-3", "optim.warmup_steps=30",
                                    "train.total_steps=200"),
}


@dataclass
class Recipe:
    name: str
    config: str | None  # a TOML file; None for the peer
    overrides: list[str] = field(default_factory=list)
    base: str | None = None  # the recipe this one repeats on another seed


@dataclass
class Run:
    recipe: Recipe
    run_dir: Path
    budget_s: float
    exit_code: int | None = None
    wall_s: float = 0.0
    steps: int = 0
    images_seen: int = 0
    first_step_s: float | None = None
    checkpoints: list[tuple[float, int, Path]] = field(default_factory=list)  # (seconds, step, path)
    skipped: str | None = None  # why the recipe did not run
    results: list[dict] = field(default_factory=list)
    steps_per_s: float | None = None  # mean training rate over the metrics lines
    core: int | None = None  # the CPU core it was pinned to


def parse_recipe(text: str) -> Recipe:
    """``NAME=CONFIG[:k=v,...]``; values holding commas (lists) go in brackets, kept whole."""
    if "=" not in text:
        raise SystemExit(f"--recipe expects NAME=CONFIG[:section.key=value,...], got {text!r}")
    name, rest = text.split("=", 1)
    config, _, sets = rest.partition(":")
    overrides, depth, current = [], 0, ""
    for ch in sets:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            overrides.append(current)
            current = ""
        else:
            current += ch
    if current:
        overrides.append(current)
    return Recipe(name, config, overrides)


# ---------------------------------------------------------------------------------------------
# Training a recipe for a wall-clock budget.


def _first_step_seconds(metrics: Path, appeared_s: float, log_every: int, batch: int) -> float | None:
    """When the loop began: the first metrics line's appearance less the span it measures."""
    try:
        line = json.loads(metrics.read_text().splitlines()[0])
    except (FileNotFoundError, IndexError, json.JSONDecodeError):
        return None
    span = log_every * batch / line["images_per_s"] if line.get("images_per_s") else 0.0
    return max(0.0, appeared_s - span)


def _settings(config: str, overrides: list[str]) -> tuple[int, int]:
    """(train.log_every_steps, images per step) of a recipe, read as the CLI reads it."""
    from difftrain.config import load_config

    cfg = load_config(config, overrides)
    return cfg.train.log_every_steps, cfg.train.batch_size * cfg.train.grad_accum_steps


def _steps_per_s(metrics: Path, per_step: int) -> float | None:
    """Mean training steps per second over the metrics lines (each covers log_every steps)."""
    try:
        rates = [json.loads(line).get("images_per_s") for line in metrics.read_text().splitlines()]
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    rates = [r for r in rates if r]
    return sum(rates) / len(rates) / per_step if rates else None


_LIVE: set[subprocess.Popen] = set()  # training processes running now (stopped if this script is)


def train_command(recipe: Recipe, run_dir: Path, python: str = sys.executable) -> list[str]:
    """The CLI command that trains ``recipe`` in ``run_dir`` (with ``src`` on PYTHONPATH, from the repository)."""
    cmd = [python, "-m", "difftrain", "train", "--config", recipe.config, "--run-dir", str(run_dir)]
    for o in recipe.overrides:
        cmd += ["--set", o]
    return cmd


def train_recipe(recipe: Recipe, run_dir: Path, budget_s: float, warm_scan: Path | None, grace_s: float = 300,
                 core: int | None = None) -> Run:
    """Train one recipe through the CLI until it ends or the budget passes (then SIGTERM);
    ``core``: pin the run (and its loader workers) to this CPU core, with one thread."""
    run = Run(recipe, run_dir, budget_s, core=core)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    if warm_scan is not None and warm_scan.is_file():
        shutil.copy(warm_scan, run_dir / warm_scan.name)  # the data scan, done once for all recipes
    log_every, per_step = _settings(recipe.config, recipe.overrides)
    cmd = train_command(recipe, run_dir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    pin = None
    if core is not None:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        pin = lambda: os.sched_setaffinity(0, {core})  # noqa: E731 (runs in the child before exec)
    ckpt_dir, metrics = run_dir / "checkpoints", run_dir / "metrics.jsonl"
    seen: dict[str, float] = {}
    metrics_at = None
    log = open(run_dir / "train.log", "w")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, preexec_fn=pin)
    _LIVE.add(proc)
    signalled = None
    try:
        while True:
            now = time.monotonic() - start
            if ckpt_dir.is_dir():
                for f in ckpt_dir.glob("step_*.pt"):
                    seen.setdefault(f.name, now)
            if metrics_at is None and metrics.is_file() and metrics.stat().st_size > 0:
                metrics_at = now
            if proc.poll() is not None:
                break
            if signalled is None and now >= budget_s:
                proc.send_signal(signal.SIGTERM)  # the run saves a checkpoint at the end of its step
                signalled = now
            if signalled is not None and now - signalled > grace_s:
                proc.kill()
            time.sleep(0.2)
    finally:  # this script stopped (Ctrl-C, SIGTERM): stop the run too
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
        _LIVE.discard(proc)
    run.wall_s = time.monotonic() - start
    run.exit_code = proc.returncode
    log.close()
    for f in sorted(ckpt_dir.glob("step_*.pt")) if ckpt_dir.is_dir() else []:
        step = int(f.stem.split("_")[1])
        run.checkpoints.append((min(seen.get(f.name, run.wall_s), budget_s), step, f))
    if run.checkpoints:
        run.steps = run.checkpoints[-1][1]
        run.images_seen = run.steps * per_step
    if metrics_at is not None:
        run.first_step_s = _first_step_seconds(metrics, metrics_at, log_every, per_step)
    run.steps_per_s = _steps_per_s(metrics, per_step)
    if proc.returncode not in (0, 75):
        run.skipped = f"train exited {proc.returncode}; see {run_dir / 'train.log'}"
    return run


def train_all(recipes: list[Recipe], work: Path, args, scan: Path | None) -> list[Run]:
    """Train ``recipes``: one after another, or ``args.concurrent`` at a time, each on a core
    of its own (a core is handed to the next recipe when its run ends). Runs in recipe order."""
    if args.concurrent <= 1:
        runs, reached = [], None
        for r in recipes:
            if any("@reached" in o for o in r.overrides):
                if reached is None:
                    raise SystemExit(f"recipe {r.name} uses @reached but no earlier recipe reached a step")
                r.overrides = [o.replace("@reached", str(reached)) for o in r.overrides]
            print(f"training {r.name} ({_budget_text(args, r)})", flush=True)
            runs.append(_reported(train_recipe(r, work / r.name, args.budget, scan)))
            reached = reached or (runs[-1].steps or None)
        return runs
    cores = queue.Queue()
    for c in sorted(os.sched_getaffinity(0))[: args.concurrent]:
        cores.put(c)

    def one(r: Recipe) -> Run:
        core = cores.get()
        try:
            sys.stdout.write(f"training {r.name} on core {core} ({_budget_text(args, r)})\n")  # one write: threads
            sys.stdout.flush()
            return _reported(train_recipe(r, work / r.name, args.budget, scan, core=core))
        finally:
            cores.put(core)

    with concurrent.futures.ThreadPoolExecutor(args.concurrent) as pool:
        try:
            return list(pool.map(one, recipes))
        except BaseException:  # Ctrl-C or SIGTERM: stop the runs, which save and exit
            for proc in list(_LIVE):
                proc.send_signal(signal.SIGTERM)
            raise


def _budget_text(args, recipe: Recipe | None = None) -> str:
    """A recipe's budget: its own train.total_steps (the last override) under a step budget."""
    if not args.total_steps:
        return f"{args.budget:.0f} s"
    own = [o.split("=", 1)[1] for o in (recipe.overrides if recipe else []) if o.startswith("train.total_steps=")]
    return f"{int(own[-1]) if own else args.total_steps:,} steps"


def _reported(run: Run) -> Run:
    rate = f", {run.steps_per_s:.2f} steps/s" if run.steps_per_s else ""
    sys.stdout.write(f"  {run.recipe.name}: {run.steps} steps in {run.wall_s:.0f} s, exit {run.exit_code}, first step "
                     f"at {_fmt(run.first_step_s, '.1f')} s{rate}" + (f" ({run.skipped})" if run.skipped else "") + "\n")
    sys.stdout.flush()
    return run


def warm_up(recipe: Recipe, work: Path) -> Path | None:
    """One step of the first recipe outside any budget: builds the decode cache and the data
    scan that every recipe would otherwise redo; returns the scan to copy into each run."""
    run_dir = work / "_warm"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "difftrain", "train", "--config", recipe.config, "--run-dir", str(run_dir),
           "--stop-at-step", "1", *sum((["--set", o] for o in recipe.overrides if "@" not in o), [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(cmd, env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    scan = run_dir / "data_check.json"
    return scan if scan.is_file() else None


# ---------------------------------------------------------------------------------------------
# The diffusers peer.


def peer_missing() -> list[str]:
    """The modules the peer needs that this Python lacks."""
    return [m for m in PEER_MODULES if importlib.util.find_spec(m) is None]


def train_peer(args, work: Path, budget_s: float) -> Run:
    """diffusers' train_unconditional.py under ``timeout BUDGET``; each epoch's save is copied."""
    run = Run(Recipe("diffusers (peer)", None), work / "diffusers", budget_s)
    missing = peer_missing()
    if missing:
        run.skipped = f"skipped: needs {', '.join(missing)} (not installed here)"
        return run
    peers = Path(args.peer_dir)
    out, snaps = run.run_dir / "out", run.run_dir / "snapshots"
    shutil.rmtree(run.run_dir, ignore_errors=True)
    snaps.mkdir(parents=True)
    epochs = max(1, math.ceil(args.peer_epochs))
    cmd = ["timeout", str(int(budget_s)), "accelerate", "launch", "--num_processes", "1",
           "--mixed_precision", "bf16", str(peers / "train_unconditional.py"),
           "--train_data_dir", str(Path(args.data) / "train"), "--cache_dir", str(run.run_dir / "hf"),
           "--resolution", str(args.peer_resolution), "--output_dir", str(out),
           "--model_config_name_or_path", str(peers / "ddpm-cifar10-unet"), "--train_batch_size", "128",
           "--num_epochs", str(epochs), "--learning_rate", "2e-4", "--lr_warmup_steps", "500",
           "--mixed_precision", "bf16", "--dataloader_num_workers", "8", "--use_ema",
           "--save_model_epochs", "1", "--save_images_epochs", "1000", "--checkpointing_steps", "1000000"]
    weights = out / "unet" / "diffusion_pytorch_model.safetensors"
    log = open(run.run_dir / "train.log", "w")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=peers)
    last_mtime, epoch = None, 0
    while True:
        done = proc.poll() is not None
        if weights.is_file() and weights.stat().st_mtime_ns != last_mtime:
            time.sleep(2.0)  # let save_pretrained finish the folder
            last_mtime, epoch = weights.stat().st_mtime_ns, epoch + 1
            dest = snaps / f"epoch_{epoch:03d}"
            shutil.copytree(out / "unet", dest / "unet")
            run.checkpoints.append((time.monotonic() - start, epoch, dest))
        if done:
            break
        time.sleep(0.5)
    run.wall_s, run.exit_code = time.monotonic() - start, proc.returncode
    log.close()
    steps_per_epoch = math.ceil(args.peer_train_images / 128)
    run.checkpoints = [(s, e * steps_per_epoch, p) for s, e, p in run.checkpoints]
    if run.checkpoints:
        run.steps = run.checkpoints[-1][1]
        run.images_seen = run.steps * 128
    else:
        run.skipped = f"no epoch finished in the budget (exit {proc.returncode}); see {run.run_dir / 'train.log'}"
    return run


def load_peer_unet(folder: Path, resolution: int):
    """The peer's saved UNet2DModel weights on difftrain's ``ddpm-cifar10`` UNet (same network)."""
    from safetensors.torch import load_file

    from difftrain.models import build_unet
    from difftrain.models.diffusers_export import diffusers_name

    model = build_unet("ddpm-cifar10", resolution=resolution, in_channels=3)
    theirs = load_file(str(folder / "unet" / "diffusion_pytorch_model.safetensors"))
    model.load_state_dict({name: theirs[diffusers_name(name)] for name in model.state_dict()})
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Evaluation.


def curve_points(checkpoints: list[tuple[float, int, Path]], every_s: float) -> list[tuple[float, int, Path]]:
    """The last checkpoint, plus, every ``every_s`` seconds, the newest one that existed by then."""
    if not checkpoints:
        return []
    chosen = {checkpoints[-1][2]: checkpoints[-1]}
    if every_s > 0:
        mark = every_s
        while mark < checkpoints[-1][0]:
            before = [c for c in checkpoints if c[0] <= mark]
            if before:
                chosen.setdefault(before[-1][2], before[-1])
            mark += every_s
    return sorted(chosen.values(), key=lambda c: c[0])


def evaluate(runs: list[Run], args, reference, inception) -> None:
    """FID/KID of the EMA samples of every chosen checkpoint of every run."""
    from difftrain.diffusion.objective import DDPMObjective
    from difftrain.evaluation.evaluate import fid_result, sample_pixels, sample_statistics
    from difftrain.generation.inference import load_model

    for run in runs:
        for seconds, step, path in curve_points(run.checkpoints, args.curve_every):
            t0 = time.perf_counter()
            if run.recipe.config is None:
                model = load_peer_unet(path, args.peer_resolution)
                objective = DDPMObjective("linear", 1000, "epsilon", "uniform")
                shape, sampler = (3, args.peer_resolution, args.peer_resolution), "ddim"
            else:
                loaded = load_model(path, use_ema=True, device=args.device)
                model, objective = loaded.model, loaded.objective
                d = loaded.cfg.data
                shape = (d.channels, d.resolution, d.resolution)
                # DDPM-family runs: DDIM, eta 0; EDM and flow runs: their own evaluation.fid_sampler.
                sampler = "ddim" if "ddim" in objective.samplers else loaded.cfg.evaluation.fid_sampler
            device = args.device if inception is None else next(inception.parameters()).device
            options = {"eta": 0.0} if sampler == "ddim" else {}
            # About the same network evaluations for every sampler: Heun makes two per step.
            steps = args.steps if objective.sampler_nfe[sampler](args.steps) <= args.steps + 1 else args.steps // 2 + 1
            context = dict(step=step, seconds=round(seconds, 1), sampler=sampler, sampler_steps=steps,
                           nfe=objective.sampler_nfe[sampler](steps))
            drawn = dict(objective=objective.to(device), shape=shape, num=args.num_samples, sampler=sampler,
                         steps=steps, seed=args.seed, batch_size=args.batch_size, **options)
            kept: list | None = [] if args.save_samples else None
            if inception is None:  # --no-fid: the samples only, scored elsewhere (bench/fid_of_samples.py)
                kept = list(sample_pixels(model.to(device), **drawn))
                result = context
            else:
                stats = sample_statistics(model.to(device), inception, keep=kept, **drawn)
                result = fid_result(stats, reference, kid=True, **context)
            result["eval_s"] = round(time.perf_counter() - t0, 1)
            if kept is not None:
                result["samples"] = save_samples(torch.cat(kept), Path(args.save_samples) / f"{run.recipe.name}-step{step}")
            run.results.append(result)
            scores = f"FID {result['fid']:.2f}, KID {result['kid_mean']:.4f}" if "fid" in result else "samples kept"
            print(f"  {run.recipe.name}: step {step} at {seconds:.0f} s: {scores} ({result['eval_s']:.0f} s)",
                  flush=True)


def save_samples(images: torch.Tensor, stem: Path, part: int = 5000) -> list[str]:
    """Write (N, C, H, W) uint8 samples as ``STEM-partK.npz`` files of at most ``part`` images,
    each an ``images`` array (n, H, W, C) uint8 (what bench/fid_of_samples.py reads); the paths."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    array = images.permute(0, 2, 3, 1).numpy()
    paths = []
    for k, start in enumerate(range(0, len(array), part)):
        path = stem.parent / f"{stem.name}-part{k}.npz"
        np.savez_compressed(path, images=array[start : start + part])
        paths.append(str(path))
    return paths


# ---------------------------------------------------------------------------------------------
# Tables.


def _fmt(x, spec: str, missing: str = "n/a") -> str:
    return missing if x is None else format(x, spec)


def best_runs(runs: list[Run], n: int) -> list[Run]:
    """The ``n`` difftrain runs with the lowest final FID."""
    scored = [r for r in runs if r.results and "fid" in r.results[-1] and r.recipe.config is not None]
    return sorted(scored, key=lambda r: r.results[-1]["fid"])[:n]


def seed_groups(runs: list[Run]) -> dict[str, list[float]]:
    """Final FID of every scored run, grouped by recipe (its repeats on other seeds included)."""
    groups: dict[str, list[float]] = {}
    for r in runs:
        if r.results and "fid" in r.results[-1]:
            groups.setdefault(r.recipe.base or r.recipe.name, []).append(r.results[-1]["fid"])
    return groups


def how_sure(groups: dict[str, list[float]]) -> list[str]:
    """The best two recipes with more than one seed: the gap between their mean FIDs against the
    largest spread between one recipe's seeds (training noise and sampling noise together)."""
    repeated = sorted((sum(v) / len(v), k, v) for k, v in groups.items() if len(v) > 1)
    if len(repeated) < 2:
        return []
    (m1, a, va), (m2, b, vb) = repeated[:2]
    spread = max(max(va) - min(va), max(vb) - min(vb))
    verdict = ("apart by more than the spread between seeds" if m2 - m1 > spread
               else "within the spread between seeds: not separated")
    return [f"How sure: `{a}` (mean FID {m1:.2f} over {len(va)} seeds) against `{b}` ({m2:.2f} over {len(vb)}): "
            f"a gap of {m2 - m1:.2f}, where one recipe's seeds differ by up to {spread:.2f}; {verdict}."]


def tables(runs: list[Run], args, ref_count: int) -> str:
    n = args.num_samples
    budget = (f"{args.total_steps:,} steps per recipe (a recipe may set its own)" if args.total_steps
              else "budget counted from process start")
    pinned = f"; {args.concurrent} at a time, one CPU core each" if args.concurrent > 1 else ""
    lines = [f"FID/KID: {n:,} EMA samples (about {args.steps} network evaluations, eta 0, seed {args.seed}) against "
             f"{ref_count:,} reference images; {budget}{pinned}. Confetti: share of samples above the reference "
             "images' 99th percentile of Laplacian energy (1% of real images).", "",
             "| recipe | budget s | wall s | steps | images seen | steps/s | time to first step s | sampler (NFE) "
             "| FID | KID | confetti |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if r.skipped and not r.results:
            lines.append(f"| {r.recipe.name} | {r.budget_s:.0f} | - | - | - | - | - | - | {r.skipped} | - | - |")
            continue
        last = r.results[-1] if r.results else {}
        kid = f"{last['kid_mean']:.4f} ± {last['kid_std']:.4f}" if "kid_mean" in last else "n/a"
        confetti = _fmt(100 * last["confetti_share"] if "confetti_share" in last else None, ".1f") + "%"
        sampler = f"{last['sampler']} {last['sampler_steps']} ({last['nfe']})" if "nfe" in last else "n/a"
        budget_s = "-" if args.total_steps else f"{r.budget_s:.0f}"
        lines.append(f"| {r.recipe.name} | {budget_s} | {r.wall_s:.0f} | {r.steps:,} | {r.images_seen:,} | "
                     f"{_fmt(r.steps_per_s, '.2f')} | {_fmt(r.first_step_s, '.1f')} | {sampler} | "
                     f"{_fmt(last.get('fid'), '.2f')} | {kid} | {confetti} |")
    groups = seed_groups(runs)
    if any(len(v) > 1 for v in groups.values()):
        lines += ["", "| recipe | FID per seed | mean |", "|---|---|---|"]
        for name, fids in sorted(groups.items(), key=lambda kv: sum(kv[1]) / len(kv[1])):
            lines.append(f"| {name} | {' / '.join(f'{f:.2f}' for f in fids)} | {sum(fids) / len(fids):.2f} |")
        lines += [""] + how_sure(groups)
    if args.curve_every > 0:
        lines += ["", "FID against minutes (the newest checkpoint at each point of the budget):", "",
                  "| recipe | minute | step | FID | KID |", "|---|---|---|---|---|"]
        for r in runs:
            for res in r.results:
                lines.append(f"| {r.recipe.name} | {res['seconds'] / 60:.2f} | {res['step']:,} | "
                             f"{_fmt(res.get('fid'), '.2f')} | {_fmt(res.get('kid_mean'), '.4f')} |")
    lines += ["", "Overrides:", ""]
    for r in runs:
        if r.recipe.config:
            rel = os.path.relpath(r.recipe.config, REPO)
            lines.append(f"- `{r.recipe.name}`: `{rel}` " + " ".join(f"`{o}`" for o in r.recipe.overrides))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-mode", action="store_true",
                   help="the ranking protocol: tiny UNet on CIFAR-10 at 16 px (configs/cifar10-16px-cpu.toml), "
                        f"{PROTOCOL_STEPS:,} steps, two at a time on one core each, two seeds of the best two, "
                        "1,000 samples, 2,000 reference images, the CPU_DEFAULT recipes (the objectives)")
    p.add_argument("--smoke", action="store_true",
                   help="the 60-s version of the CPU mode: budget 60 s, 200 samples, 500 reference images, "
                        "one recipe at a time, the SMOKE_DEFAULT recipes")
    p.add_argument("--total-steps", type=int, help="a step budget instead of a wall-clock one (CPU mode: "
                   f"{PROTOCOL_STEPS})")
    p.add_argument("--concurrent", type=int, help="recipes trained at a time, one CPU core each (CPU mode: 2)")
    p.add_argument("--seeds", type=int, help="train the best two recipes again on this many seeds in all "
                   "(CPU mode: 2)")
    p.add_argument("--data", default=os.environ.get(DATA_ENV),
                   help=f"folder with train/ and test/ (default ${DATA_ENV}); data.path = DATA/train")
    p.add_argument("--recipes", nargs="*", help=f"built-in recipes on --config: {', '.join(ABLATION)}")
    p.add_argument("--recipe", action="append", default=[], metavar="NAME=CONFIG[:k=v,...]", help="a recipe")
    p.add_argument("--config", help="the config the built-in recipes override (CPU mode: configs/cifar10-16px-cpu.toml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="an override for every difftrain recipe")
    p.add_argument("--peer", choices=["diffusers"], help="also run diffusers' script from --peer-dir")
    p.add_argument("--peer-dir", default=os.environ.get("DIFFTRAIN_PEERS", str(REPO.parent / "shared" / "peers")))
    p.add_argument("--peer-epochs", type=float, default=7, help="epochs the peer plans its cosine LR over")
    p.add_argument("--peer-resolution", type=int, default=32)
    p.add_argument("--peer-train-images", type=int, default=50_000, help="for its steps per epoch")
    p.add_argument("--budget", type=float, help="wall-clock seconds per recipe, start-up included")
    p.add_argument("--num-samples", type=int, help="samples per FID")
    p.add_argument("--steps", type=int, default=50, help="DDIM steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=100, help="sampling and Inception batch")
    p.add_argument("--ref", help="reference .npz or image folder (default: DATA/test via the training preprocessing)")
    p.add_argument("--ref-num", type=int, help="reference images (default all; CPU mode 500)")
    p.add_argument("--curve-every", type=float, default=None,
                   help="seconds between points of the FID curve (0 = the final checkpoint only; default "
                        "budget / 4, CPU mode 0)")
    p.add_argument("--checkpoint-every-steps", type=int, default=None,
                   help="checkpoint interval while training, for the curve (default 500, CPU mode 50)")
    p.add_argument("--no-warm", action="store_true", help="skip the untimed one-step run that builds the "
                   "decode cache and the data scan once for all recipes")
    p.add_argument("--device", default="auto")
    p.add_argument("--work", default="/tmp/time_to_fid", help="run folders (deleted and remade per recipe)")
    p.add_argument("--out", help="write the tables (markdown) and results (JSON next to it) here")
    p.add_argument("--inception", help="FID Inception TorchScript (default: as difftrain finds it)")
    p.add_argument("--save-samples", metavar="DIR", help="also keep every scored checkpoint's samples in DIR "
                   "(RECIPE-stepN-partK.npz, 5,000 images each; bench/fid_of_samples.py scores them)")
    p.add_argument("--print-commands", action="store_true",
                   help="print each recipe's training command (run folder under --work) and exit: to train them "
                        "elsewhere, or one per core by hand, exactly as this script would")
    p.add_argument("--no-fid", action="store_true", help="sample but do not score (with --save-samples): "
                   "for a machine without the Inception weights")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line with each protocol's defaults filled in."""
    args = _parser().parse_args(argv)
    cpu, smoke = args.cpu_mode, args.smoke
    if cpu and smoke:
        raise SystemExit("--cpu-mode and --smoke are two protocols: choose one")
    if cpu:
        args.total_steps = args.total_steps or PROTOCOL_STEPS
        args.concurrent = args.concurrent or 2
        args.seeds = args.seeds or 2
    args.concurrent, args.seeds = args.concurrent or 1, args.seeds or 1
    if args.total_steps and args.budget is None:
        args.budget = 24 * 3600.0  # a step budget: the wall clock is only a safety stop
    args.budget = args.budget or (60.0 if smoke else 318.0)
    args.num_samples = args.num_samples or (200 if smoke else 1000 if cpu else 10_000)
    args.ref_num = args.ref_num or (500 if smoke else 2000 if cpu else None)
    args.curve_every = args.curve_every if args.curve_every is not None else (
        0.0 if cpu or smoke or args.total_steps else args.budget / 4)
    args.checkpoint_every_steps = args.checkpoint_every_steps or (50 if smoke else 400 if cpu else 500)
    if args.no_fid and not args.save_samples:
        raise SystemExit("--no-fid keeps nothing without --save-samples DIR")
    if args.no_fid and args.seeds > 1:
        raise SystemExit("--seeds ranks by FID: it cannot combine with --no-fid")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def build_recipes(args: argparse.Namespace) -> list[Recipe]:
    """The recipes to train, each with its config file and every override in the order the CLI
    applies them: the run's bookkeeping, the protocol's pinned recipe (``--cpu-mode``,
    ``--smoke``), ``--total-steps``, ``--set``, then the recipe's own."""
    cpu, smoke = args.cpu_mode, args.smoke
    base_config = args.config or (str(CPU_CONFIG) if cpu or smoke else None)
    recipes = [parse_recipe(r) for r in args.recipe]
    defaults = CPU_DEFAULT if cpu else SMOKE_DEFAULT if smoke else ()
    names = args.recipes if args.recipes is not None else (list(defaults) if not recipes else [])
    for name in names:
        if name not in ABLATION:
            raise SystemExit(f"unknown recipe {name!r}; built in: {', '.join(ABLATION)}")
        if base_config is None:
            raise SystemExit("built-in recipes need --config (or --cpu-mode)")
        recipes.append(Recipe(name, base_config, list(ABLATION[name])))
    if not recipes and not args.peer:
        raise SystemExit("nothing to run: name --recipes, --recipe NAME=CONFIG or --peer")
    data_sets = [f"data.path={Path(args.data) / 'train'}"] if args.data else []
    every = args.checkpoint_every_steps
    common = [*data_sets, f"checkpoint.every_steps={every}", f"checkpoint.keep_every_steps={every}",
              "checkpoint.keep_last=1", "train.progress_bar=false"]
    if (cpu or smoke) and args.config is None:  # the preset as the protocol measured it
        common += list(PRESET_AS_MEASURED["cpu" if cpu else "smoke"])
    if cpu:
        common += list(CPU_PROTOCOL)
    if args.total_steps:
        common.append(f"train.total_steps={args.total_steps}")
    for r in recipes:
        r.config = str(Path(r.config).resolve())
        r.overrides = common + list(args.set) + r.overrides
        if args.total_steps:  # a recipe's own step count (set after the common one) wins
            r.overrides = [o.replace("@reached", str(args.total_steps)) for o in r.overrides]
    return recipes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # unwind, stopping the child run
    recipes = build_recipes(args)
    work = Path(args.work)
    if args.print_commands:
        for r in recipes:
            print(shlex.join(train_command(r, work / r.name, python="python")))
        return 0
    work.mkdir(parents=True, exist_ok=True)
    print(f"time_to_fid: {len(recipes)} recipe(s), {_budget_text(args)} each, {args.concurrent} at a time, "
          f"{args.num_samples} samples, device {args.device}, torch {torch.__version__}, {os.cpu_count()} CPU(s)",
          flush=True)

    # Train every recipe first (evaluation would compete for the device).
    scan = None if args.no_warm or not recipes else warm_up(recipes[0], work)
    runs = train_all(recipes, work, args, scan)
    if args.peer:
        print(f"training the diffusers peer for {args.budget:.0f} s", flush=True)
        runs.append(train_peer(args, work, args.budget))

    # Reference statistics (cached), then every run's samples.
    from difftrain.config import load_config
    from difftrain.evaluation.inception import InceptionFeatures
    from difftrain.evaluation.reference import reference_statistics
    from difftrain.evaluation.stats import FeatureStats

    inception = reference = None
    if args.no_fid:
        pass
    elif args.ref and Path(args.ref).is_file():
        inception = InceptionFeatures(args.inception).to(args.device)
        reference = FeatureStats.load(args.ref)
    else:
        source = args.ref or (str(Path(args.data) / "test") if args.data else None)
        if source is None:
            raise SystemExit("no reference: give --ref, or --data with a test/ folder")
        inception = InceptionFeatures(args.inception).to(args.device)
        cfg = load_config(recipes[0].config, [o for o in recipes[0].overrides if "@" not in o]) if recipes else None
        res = cfg.data.resolution if cfg else args.peer_resolution
        ch = cfg.data.channels if cfg else 3
        t0 = time.perf_counter()
        reference, _, cached = reference_statistics(source, inception, resolution=res, channels=ch,
                                                    num=args.ref_num, batch_size=args.batch_size)
        print(f"reference: {reference.count} images of {source} at {res} px"
              f"{' (cached)' if cached else ''} in {time.perf_counter() - t0:.0f} s", flush=True)
    evaluate([r for r in runs if not r.skipped or r.checkpoints], args, reference, inception)
    if args.seeds > 1:  # the best two again on other seeds: how sure is their order?
        again = [Recipe(f"{r.recipe.name}-seed{seed}", r.recipe.config, [*r.recipe.overrides, f"train.seed={seed}"],
                        base=r.recipe.name) for seed in range(1, args.seeds) for r in best_runs(runs, 2)]
        more = train_all(again, work, args, scan)
        evaluate([r for r in more if not r.skipped or r.checkpoints], args, reference, inception)
        runs += more

    text = tables(runs, args, reference.count if reference else 0)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        record = [{"recipe": r.recipe.name, "config": r.recipe.config, "overrides": r.recipe.overrides,
                   "budget_s": r.budget_s, "wall_s": round(r.wall_s, 1), "exit_code": r.exit_code,
                   "steps": r.steps, "images_seen": r.images_seen, "first_step_s": r.first_step_s,
                   "steps_per_s": r.steps_per_s, "core": r.core, "seed_of": r.recipe.base,
                   "skipped": r.skipped, "results": r.results} for r in runs]
        Path(args.out).with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
