"""How many of a shapes run's samples are clean, per main checkpoint, guide checkpoint and
guidance weight: the table behind docs/quickstart_shapes.md's choices.

For each combination it draws ``--num`` samples (Heun, ``--steps``, noise seed ``--seed``) from
the main checkpoint's EMA weights, autoguided (Karras et al. 2024) by the guide checkpoint at
that weight (weight 1: unguided), as ``difftrain sample --guide-step G --guide-weight W`` does,
and judges them with bench/shape_checker.py. It prints one markdown row per combination: the
clean count, the first 64's (the quickstart's grid), the share with its binomial standard
error, and the reasons of the rest.

    python bench/shape_sweep.py runs/quickstart --main 3200 --guide 1600 --weights 2,2.5,3,3.5 --num 256
    python bench/shape_sweep.py RUN --guide 800 --guide-run OTHER_RUN   # a guide from another run
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections import Counter
from pathlib import Path

from shape_checker import clean_rate


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",")]


def _floats(s: str) -> list[float]:
    return [float(v) for v in s.split(",")]


def _checkpoint(run: Path, step: int | None) -> Path:
    """The run's checkpoint of ``step`` (None: the run itself, its latest)."""
    if step is None:
        return run
    path = run / "checkpoints" / f"step_{step:08d}.pt"
    if not path.is_file():
        raise SystemExit(f"{path}: no checkpoint of step {step} (checkpoint.keep_every_steps keeps them)")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a run directory of a shapes run")
    p.add_argument("--main", type=_ints, default=[None], help="main checkpoint steps, comma-separated (default: latest)")
    p.add_argument("--guide", type=_ints, required=True, help="guide checkpoint steps, comma-separated")
    p.add_argument("--guide-run", type=Path, help="the run the guide checkpoints come from (default: the same run)")
    p.add_argument("--weights", type=_floats, default=[3.0], help="guidance weights, comma-separated (1: unguided)")
    p.add_argument("--raw-guide", action="store_true", help="the guide's raw weights instead of its EMA")
    p.add_argument("--num", type=int, default=256, help="samples per combination")
    p.add_argument("--steps", type=int, default=25, help="Heun steps (2 x steps - 1 evaluations per network)")
    p.add_argument("--seed", type=int, default=0, help="noise seed of the samples")
    args = p.parse_args(argv)

    from difftrain import api
    from difftrain.generation.autoguidance import with_guide
    from difftrain.generation.sampling import to_uint8

    guide_run = args.guide_run or args.run
    print(f"| main step | guide step | weight | clean of {args.num} | first 64 | share (+- s.e.) | why not | s |")
    print("|---|---|---|---|---|---|---|---|")
    for main_step, guide_step, weight in itertools.product(args.main, args.guide, args.weights):
        start = time.perf_counter()
        model = api.load(_checkpoint(args.run, main_step))
        if weight != 1:
            model = with_guide(model, _checkpoint(guide_run, guide_step), weight, use_ema=not args.raw_guide)
        images = to_uint8(api.generate(model, args.num, sampler="heun", steps=args.steps, seed=args.seed))
        share, verdicts = clean_rate(images)
        first = sum(v.clean for v in verdicts[:64])
        why = Counter(v.reason for v in verdicts if not v.clean)
        se = (share * (1 - share) / args.num) ** 0.5
        print(f"| {model.step} | {guide_step if weight != 1 else '-'} | {weight:g} | {round(share * args.num)} | "
              f"{first} | {100 * share:.1f}% (+-{100 * se:.1f}) | "
              + "; ".join(f"{r} {n}" for r, n in why.most_common()) + f" | {time.perf_counter() - start:.0f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
