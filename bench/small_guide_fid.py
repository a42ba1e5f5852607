"""A guide that is a smaller, shorter run (issue 43, item 2), on the CPU protocol: its cost in the
budget, then FID-1k of the main run guided by it over a grid of post-hoc EMA lengths of both.

    # 1. the per-step cost of the guide and of the main run (posthoc EMAs on) against the default
    #    recipe's, interleaved in this one process, one thread; prints the main run's steps
    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/small_guide_fid.py cost --data /tmp/cifar16/train
    # 2. train both (the steps from 1.), then the grid
    PYTHONPATH=src python bench/small_guide_fid.py fid --main /tmp/sg/main --guide /tmp/sg/guide \\
        --main-std 0.05 0.10 --guide-std 0.05 0.10 0.15 --weight 1.5 2 2.5 3 --ref /tmp/cifar16/test

The budget (docs/quality.md, "The CPU mode"): the default recipe's 2,816 steps of
``configs/cifar10-16px-cpu.toml`` at its per-step cost. The guide (``configs/cifar10-16px-cpu-guide.toml``)
costs ``guide steps x c_guide``, the main run (the default with post-hoc EMAs tracked)
``c_main`` a step, both measured against the default's ``c_default`` in interleaved rounds, so the
main run gets ``(2816 c_default - guide steps c_guide) / c_main`` steps: main + guide = the
protocol's wall clock. ``fid`` reconstructs each EMA length of each run once
(``training.posthoc.reconstruct``), then samples as ``bench/autoguidance_fid.py`` does: 1,000
samples (seed 0, batch 100) of the main run's sampler (Heun 26: 51 network evaluations unguided,
102 guided) against 2,000 reference images; weight 1 rows are the main run alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
MAIN_CONFIG = REPO / "configs" / "cifar10-16px-cpu.toml"
GUIDE_CONFIG = REPO / "configs" / "cifar10-16px-cpu-guide.toml"
PROTOCOL_STEPS = 2816  # the default recipe's steps: the protocol's wall clock on one core
# The main run: the default recipe with EDM2's two post-hoc EMAs tracked.
MAIN_POSTHOC = ("ema.posthoc_std=[0.05,0.10]", "ema.posthoc_every_steps=100")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("cost", help="per-step cost of the guide and the main run against the default's")
    c.add_argument("--data", required=True, help="the training images (e.g. /tmp/cifar16/train)")
    c.add_argument("--guide-config", default=str(GUIDE_CONFIG))
    c.add_argument("--guide-set", action="append", default=[], help="overrides of the guide's config")
    c.add_argument("--rounds", type=int, default=6)
    c.add_argument("--steps", type=int, default=30, help="steps per round and configuration")
    f = sub.add_parser("fid", help="FID-1k over post-hoc EMA lengths of the main run and the guide, and weights")
    f.add_argument("--main", required=True, help="the main run (trained with ema.posthoc_std)")
    f.add_argument("--guide", required=True, help="the guide run (trained with ema.posthoc_std)")
    f.add_argument("--main-std", type=float, nargs="+", default=[0.05, 0.10], help="sigma_rel of the main's EMA")
    f.add_argument("--guide-std", type=float, nargs="+", default=[0.05, 0.10, 0.15], help="sigma_rel of the guide's")
    f.add_argument("--weight", type=float, nargs="+", default=[1.0, 1.5, 2.0, 2.5, 3.0])
    f.add_argument("--ref", required=True, help="reference image folder (e.g. /tmp/cifar16/test)")
    f.add_argument("--ref-num", type=int, default=2000)
    f.add_argument("--num", type=int, default=1000, help="samples per FID")
    f.add_argument("--steps", type=int, default=26, help="sampler steps (Heun 26: 51 network evaluations)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--batch-size", type=int, default=100)
    f.add_argument("--cost", help="'MAIN_STEPS GUIDE_STEPS SHARE' for the table's columns (from `cost`)")
    f.add_argument("--out", help="also write the table (Markdown) here")
    return p


# ---------------------------------------------------------------------------------------------
# The cost.

def _stepper(config: Path, overrides: list[str], tmp: Path):
    """A function running ``n`` real training steps (``training.step.train_step``) of ``config``."""
    from difftrain.config import load_config
    from difftrain.data import build_loader
    from difftrain.data.prepare import prepare_training_data
    from difftrain.diffusion.objective import build_objective
    from difftrain.runtime.distributed import DistContext
    from difftrain.training.state import RunState
    from difftrain.training.step import StepMetrics, train_step

    cfg = load_config(config, ["validation.every_steps=0", "data.num_workers=0", *overrides])
    device = torch.device("cpu")
    dctx = DistContext(device=device)
    data = prepare_training_data(cfg, tmp)
    state = RunState.build(cfg, data.num_classes, device)
    state.net = state.model
    state.model.train()
    batches = iter(build_loader(data.train, batch_size=cfg.train.batch_size, seed=cfg.train.seed, start=0,
                                num_workers=0, device=device))
    objective = build_objective(cfg.diffusion).to(device)
    metrics = StepMetrics(device)
    lr = cfg.optim.lr
    params = sum(p.numel() for p in state.model.parameters())

    def run(n: int) -> float:
        # CPU time of this one-thread process: other jobs on the machine's cores lengthen the wall
        # clock of whichever configuration they overlap, not its CPU time.
        start = time.process_time()
        for _ in range(n):
            train_step(state, objective, batches, lr, metrics, dctx)
        return (time.process_time() - start) / n

    return run, params, cfg


def cost(args) -> int:
    torch.set_num_threads(1)
    data = [f"data.path={args.data}"]
    with tempfile.TemporaryDirectory() as tmp:
        configs = {"default": (MAIN_CONFIG, data),
                   "main (posthoc EMAs)": (MAIN_CONFIG, data + list(MAIN_POSTHOC)),
                   "guide": (Path(args.guide_config), data + args.guide_set)}
        steppers = {}
        for i, (name, (config, sets)) in enumerate(configs.items()):
            (Path(tmp) / str(i)).mkdir()
            steppers[name] = _stepper(config, sets, Path(tmp) / str(i))
        for run, _, _ in steppers.values():
            run(5)  # warm-up
        times = {name: [] for name in steppers}
        order = list(steppers)
        for r in range(args.rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                times[name].append(steppers[name][0](args.steps))
    med = {name: statistics.median(t) for name, t in times.items()}
    guide_steps = steppers["guide"][2].train.total_steps
    budget = PROTOCOL_STEPS * med["default"]
    guide_cost = guide_steps * med["guide"]
    main_steps = int((budget - guide_cost) / med["main (posthoc EMAs)"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, {args.rounds} interleaved rounds of "
          f"{args.steps} steps each (median of the process's CPU time per step)")
    print("| run | parameters | ms / step | x the default's |")
    print("|---|---|---|---|")
    for name, (_, params, _) in steppers.items():
        print(f"| {name} | {params / 1e6:.3f}M | {1e3 * med[name]:.2f} | {med[name] / med['default']:.3f} |")
    print(f"budget: {PROTOCOL_STEPS} default steps = {budget:.1f} s here; guide {guide_steps} steps = "
          f"{guide_cost:.1f} s ({100 * guide_cost / budget:.1f}%); main run: {main_steps} steps")
    return 0


# ---------------------------------------------------------------------------------------------
# The FID grid.

def _posthoc_model(run: str, std: float):
    """The run's model (a ``LoadedModel``) with its EMA of ``std`` reconstructed post hoc."""
    from difftrain.generation.inference import load_model
    from difftrain.training.posthoc import reconstruct, write_checkpoint

    rec = reconstruct(run, std)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(rec, Path(tmp) / f"ema{std:g}.pt")
        loaded = load_model(path, use_ema=True, device="cpu")
    print(f"{run}: {rec.describe()}", flush=True)
    return loaded


def fid(args) -> int:
    from difftrain.evaluation.evaluate import fid_result, sample_statistics
    from difftrain.evaluation.inception import InceptionFeatures
    from difftrain.evaluation.reference import reference_statistics
    from difftrain.generation.autoguidance import AutoGuided, check_compatible

    inception = InceptionFeatures()
    mains = {s: _posthoc_model(args.main, s) for s in args.main_std}
    guides = {s: _posthoc_model(args.guide, s) for s in args.guide_std}
    first = next(iter(mains.values()))
    for g in guides.values():
        check_compatible(first.cfg.diffusion, first.num_classes, first.conditioning, first.path, g)
    d = first.cfg.data
    reference = None  # read (cached) after the first samples: another process may be making the cache
    sampler = first.cfg.evaluation.fid_sampler
    cases = [(ms, None, 1.0) for ms in args.main_std if 1.0 in args.weight]
    cases += [(ms, gs, w) for ms in args.main_std for gs in args.guide_std for w in args.weight if w != 1.0]
    rows = []
    for ms, gs, w in cases:
        main = mains[ms]
        net = main.model if gs is None else AutoGuided(main.model, guides[gs].model, w).eval()
        nfe = main.objective.sampler_nfe[sampler](args.steps) * (1 if gs is None else 2)
        t0 = time.perf_counter()
        stats = sample_statistics(net, inception, objective=main.objective,
                                  shape=(d.channels, d.resolution, d.resolution), num=args.num, sampler=sampler,
                                  steps=args.steps, seed=args.seed, batch_size=args.batch_size)
        if reference is None:
            reference, _, _ = reference_statistics(args.ref, inception, resolution=d.resolution, channels=d.channels,
                                                   num=args.ref_num, batch_size=args.batch_size)
        r = fid_result(stats, reference, kid=True)
        rows.append((ms, gs, w, nfe, r["fid"], r["kid_mean"]))
        print(f"main sigma_rel {ms:g}, guide sigma_rel {gs if gs is not None else '-'}, weight {w:g}, "
              f"{sampler} {args.steps} ({nfe} NFE): FID {r['fid']:.2f}, KID {r['kid_mean']:.4f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    main_steps, guide_steps, share = (args.cost or "- - -").split()
    lines = [f"FID of {args.num:,} samples (seed {args.seed}) against {reference.count:,} images of {args.ref}; "
             f"main {args.main} (step {first.step}), guide {args.guide} (step {next(iter(guides.values())).step}); "
             f"torch {torch.__version__}", "",
             "| main steps | guide steps | guide's cost share | main sigma_rel | guide sigma_rel | weight | NFE | FID-1k | KID |",
             "|---|---|---|---|---|---|---|---|---|"]
    for ms, gs, w, nfe, f_, k in rows:
        lines.append(f"| {main_steps} | {guide_steps if gs is not None else '-'} | {share if gs is not None else '-'} "
                     f"| {ms:g} | {gs if gs is not None else '-'} | {w:g} | {nfe} | {f_:.2f} | {k:.4f} |")
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return {"cost": cost, "fid": fid}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
