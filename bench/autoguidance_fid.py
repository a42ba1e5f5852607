"""FID of autoguided samples on the CPU protocol (issue 30): each run guided by an earlier
checkpoint of itself (or another run), at several weights, beside its unguided FID.

    PYTHONPATH=src python bench/autoguidance_fid.py --run /tmp/ttf2/runs/edm-b32-uw \\
        --guide-step 400 800 --weight 1 1.5 2 2.5 --ref /tmp/cifar16/test --out /tmp/ag.md

The protocol is time_to_fid.py's: 1,000 EMA samples (seed 0, batch 100) of the run's own sampler
(its ``evaluation.fid_sampler``), against 2,000 reference images at the run's resolution
(``reference_statistics``, cached). Weight 1 is the unguided model (the guide is not run). A
guided step evaluates both networks: ``--steps`` sampler steps cost twice the network
evaluations of the unguided row (which weight 1 in ``--weight`` adds); ``--equal-nfe`` halves the guided rows' steps instead, so
every row spends about the same network evaluations per image.

Without ``--guide-step`` only the unguided rows run; ``--steps`` takes several step counts, one row
each: a few-step model's FID at 1, 2 and 4 network evaluations from one trained run (issue 43):

    PYTHONPATH=src python bench/autoguidance_fid.py --run /tmp/ttf/runs/meanflow-b32 --steps 1 2 4 \\
        --ref /tmp/cifar16/test
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", action="append", required=True, help="a run directory or checkpoint (repeat)")
    p.add_argument("--guide", help="the guide run (default: each run itself, at --guide-step)")
    p.add_argument("--guide-step", type=int, nargs="+", default=[],
                   help="the guide's checkpoint step(s); none: the unguided rows only")
    p.add_argument("--weight", type=float, nargs="+", default=[1.0, 1.5, 2.0, 2.5], help="autoguidance weights")
    p.add_argument("--ref", required=True, help="reference image folder (e.g. /tmp/cifar16/test)")
    p.add_argument("--ref-num", type=int, default=2000)
    p.add_argument("--num", type=int, default=1000, help="samples per FID")
    p.add_argument("--steps", type=int, nargs="+", default=[26],
                   help="sampler steps, one row each (Heun 26: 51 network evaluations)")
    p.add_argument("--equal-nfe", action="store_true", help="guided rows take half the steps (equal cost)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--out", help="also write the table (Markdown) here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from difftrain.generation.autoguidance import with_guide
    from difftrain.evaluation.evaluate import fid_result, sample_statistics
    from difftrain.evaluation.inception import InceptionFeatures
    from difftrain.evaluation.reference import reference_statistics
    from difftrain.generation.inference import load_model

    inception = InceptionFeatures()
    rows = []
    reference = None
    for run in args.run:
        loaded = load_model(run, use_ema=True, device="cpu")
        d = loaded.cfg.data
        if reference is None:
            reference, _, _ = reference_statistics(args.ref, inception, resolution=d.resolution, channels=d.channels,
                                                   num=args.ref_num, batch_size=args.batch_size)
        sampler = loaded.cfg.evaluation.fid_sampler
        cases = ([(None, 1.0)] if 1.0 in args.weight or not args.guide_step else []) + \
            [(s, w) for s in args.guide_step for w in args.weight if w != 1.0]
        for (guide_step, weight), sampler_steps in ((case, n) for case in cases for n in args.steps):
            model = loaded if guide_step is None else with_guide(loaded, args.guide, weight, guide_step=guide_step)
            steps = sampler_steps // 2 + 1 if guide_step is not None and args.equal_nfe else sampler_steps
            nfe = loaded.objective.sampler_nfe[sampler](steps) * (1 if guide_step is None else 2)
            t0 = time.perf_counter()
            stats = sample_statistics(model.model, inception, objective=loaded.objective,
                                      shape=(d.channels, d.resolution, d.resolution), num=args.num, sampler=sampler,
                                      steps=steps, seed=args.seed, batch_size=args.batch_size)
            r = fid_result(stats, reference, kid=True)
            rows.append((Path(loaded.path).parent.parent.name if Path(loaded.path).is_file() else Path(run).name,
                         loaded.step, guide_step, weight, f"{sampler} {steps}", nfe, r["fid"], r["kid_mean"],
                         time.perf_counter() - t0))
            print(f"{rows[-1][0]} step {loaded.step}: guide step {guide_step or '-'} weight {weight:g}, "
                  f"{sampler} {steps} ({nfe} NFE): FID {r['fid']:.2f}, KID {r['kid_mean']:.4f} "
                  f"({rows[-1][-1]:.0f} s)", flush=True)
    lines = [f"FID of {args.num:,} EMA samples (seed {args.seed}) against {reference.count:,} images of "
             f"{args.ref}; torch {torch.__version__}", "",
             "| run | step | guide step | weight | sampler | NFE | FID | KID |", "|---|---|---|---|---|---|---|---|"]
    for name, step, gs, w, sampler, nfe, fid, kid, _ in rows:
        lines.append(f"| {name} | {step:,} | {gs if gs is not None else '-'} | {w:g} | {sampler} | {nfe} | "
                     f"{fid:.2f} | {kid:.4f} |")
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
