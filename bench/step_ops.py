"""The ATen ops one training step dispatches, and where its copies come from (CPU profile).

    python bench/step_ops.py --presets tiny ddpm-cifar10 --batch 8 --precision fp32 bf16 --channels-last on off
    python bench/step_ops.py --presets tiny --precision bf16 --channels-last on --detail   # every copy's source

Builds the run state and objective as the trainer does (``RunState.build``, ``build_objective``,
``StepMetrics``), runs ``--warmup`` eager steps of ``train_step`` (compile and CUDA graphs off)
on a fixed batch, then profiles ONE step with ``torch.profiler`` (``record_shapes``, ``with_stack``).

Counted per step:

- ops: ATen calls made from Python or by the autograd engine (the top level; an op's own
  sub-calls are not counted again); of those, the ones that run a kernel (not a view, a
  metadata read, or a cast or reshape that returned its input); and all ATen calls with the
  nested ones;
- copies: ``aten::copy_`` calls, nested ones included (each one a copy kernel: on a GPU, a
  launch), and the top-level casts and layout changes (``aten::to``, ``_to_copy``,
  ``contiguous``, ``clone``) that issue them;
- where each copy comes from: the autograd node (backward), else the nearest Python frame of
  difftrain (or torch's optimizer, clipping and scaler), the ATen op around it, its dtypes and
  whether it is a weight (a parameter's shape), an activation, or a Python number (an int or
  float operand that the CPU wraps as a 0-dim tensor and casts: a host-side copy that launches
  no kernel on a GPU).

The op counts do not depend on the machine; the step time printed beside them (``--time-steps``)
does.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import re
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _steps import bench_config, median  # noqa: E402

from difftrain.diffusion.objective import build_objective  # noqa: E402
from difftrain.runtime.distributed import DistContext  # noqa: E402
from difftrain.training.state import RunState  # noqa: E402
from difftrain.training.step import StepMetrics, train_step  # noqa: E402

COPY_OPS = ("aten::to", "aten::_to_copy", "aten::contiguous", "aten::clone")
# Ops that only make a view or read metadata (no kernel), and ops that copy only when they must.
VIEW_OPS = {"aten::" + n for n in ("detach", "view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "expand",
                                  "as_strided", "narrow", "flatten", "permute", "select", "slice", "alias", "unbind",
                                  "split", "resolve_conj", "resolve_neg", "empty", "empty_like", "empty_strided",
                                  "promote_types", "result_type", "is_nonzero", "size", "stride", "numel")}
MAYBE_COPY_OPS = {"aten::to", "aten::contiguous", "aten::reshape", "aten::type_as", "aten::expand_as"}
DTYPE_SHORT = {"float": "f32", "double": "f64", "c10::BFloat16": "bf16", "c10::Half": "f16", "long int": "i64",
               "bool": "bool", "int": "i32"}
# Python frames of torch that name a phase of the step (the nearest one wins over a deeper torch frame).
TORCH_PHASES = {
    "torch/nn/utils/clip_grad.py": "clip_grad_norm_",
    "torch/optim/": "optimizer step",
    "torch/amp/grad_scaler.py": "GradScaler",
    "torch/_tensor.py(": "Tensor.backward",
}
FRAME = re.compile(r"(difftrain/[\w/]+\.py)\(\d+\): (\w+)")


def build_step(preset: str, batch: int, precision: str, channels_last: str, device: torch.device):
    """(step(), model) for the trainer's own step on a fixed batch, as bench/_steps.py builds it."""
    cfg = bench_config(preset, batch, precision, "off", channels_last)
    state = RunState.build(cfg, 0, device)
    objective = build_objective(cfg.diffusion).to(device)
    metrics = StepMetrics(device)
    r = cfg.data.resolution
    g = torch.Generator().manual_seed(0)
    fixed = (torch.rand(batch, cfg.data.channels, r, r, generator=g) * 2 - 1, torch.zeros(batch, dtype=torch.long))
    batches = itertools.repeat(fixed)
    dctx = DistContext(device=device)

    def step():
        train_step(state, objective, batches, cfg.optim.lr, metrics, dctx)

    return step, state.model


def _ancestors(e):
    q = e.cpu_parent
    while q is not None:
        yield q
        q = q.cpu_parent


def _is_aten(e) -> bool:
    return e.name.startswith("aten::")


def _does_work(e) -> bool:
    """A top-level op that runs a kernel: not a view or metadata op, nor a cast or reshape that
    returned its input (no copy_ below it)."""
    if e.name in VIEW_OPS:
        return False
    if e.name in MAYBE_COPY_OPS:
        stack = list(e.cpu_children)
        while stack:
            c = stack.pop()
            if c.name == "aten::copy_":
                return True
            stack.extend(c.cpu_children)
        return False
    return True


def _dtypes(e) -> str:
    """'src->dst' of a copy_ (its inputs are (dst, src, non_blocking))."""
    d = [DTYPE_SHORT.get(x, x) for x in (e.input_dtypes or [])]
    return f"{d[1]}->{d[0]}" if len(d) >= 2 else "?"


def copy_source(e, param_shapes: set[tuple[int, ...]]) -> str:
    """Where an ``aten::copy_`` comes from: 'phase | frame | op chain | dtypes | weight/activation'."""
    chain, frame, node = [], None, None
    for a in _ancestors(e):
        if a.name.startswith("autograd::engine::evaluate_function: "):
            node = a.name.split(": ", 1)[1]
            break
        if _is_aten(a):
            chain.append(a.name.removeprefix("aten::"))
        elif frame is None:
            m = FRAME.search(a.name)
            if m:
                frame = f"{m.group(1).removeprefix('difftrain/')}:{m.group(2)}"
            else:
                frame = next((v for k, v in TORCH_PHASES.items() if k in a.name), None)
    shape = tuple(e.input_shapes[0]) if e.input_shapes else ()
    src = _dtypes(e).split("->")[0]
    if shape == () and src in ("i64", "f64") and len(chain) >= 3 and chain[:2] == ["_to_copy", "to"]:
        kind = "Python number"  # a wrapped int/float operand of chain[2]: a host copy, no device kernel
    else:
        kind = "weight" if shape in param_shapes else "activation"
    ops = " < ".join(chain[:3]) or "copy_"
    if node is not None:
        return f"backward | {node} | {ops} | {_dtypes(e)} | {kind}"
    return f"forward/step | {frame or '?'} | {ops} | {_dtypes(e)} | {kind}"


def profile_step(step, model, trace_op: str | None = None) -> dict:
    """Profile one call of ``step``; return its op counts and the sources of its copies."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
        step()
    events = [e for e in prof.events() if _is_aten(e)]
    top = [e for e in events if not any(_is_aten(a) for a in _ancestors(e))]
    param_shapes = {tuple(p.shape) for p in model.parameters()}
    copies = [e for e in events if e.name == "aten::copy_"]
    if trace_op:
        for e in events:
            if e.name == trace_op:
                print(trace_op, e.input_shapes, e.input_dtypes, "<", [a.name[:90] for a in _ancestors(e)][:8])
    return dict(
        ops_top=len(top),
        ops_work=sum(_does_work(e) for e in top),
        ops_all=len(events),
        copies=len(copies),
        casts_top={name: sum(e.name == name for e in top) for name in COPY_OPS},
        top_by_name=collections.Counter(e.name for e in top),
        sources=collections.Counter(copy_source(e, param_shapes) for e in copies),
    )


def time_step(step, n: int) -> float:
    """Median seconds of ``n`` steps."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "ddpm-cifar10"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    p.add_argument("--channels-last", nargs="+", default=["on", "off"], choices=["on", "off"])
    p.add_argument("--warmup", type=int, default=2, help="eager steps before the profiled one")
    p.add_argument("--time-steps", type=int, default=0, help="also time this many steps (median)")
    p.add_argument("--detail", action="store_true", help="print every copy source and the top-level ops by name")
    p.add_argument("--top", type=int, default=25, help="top-level ops by name to list with --detail")
    p.add_argument("--trace-op", help="print the parents of every call of this ATen op (debugging)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()

    device = torch.device(args.device)
    print(f"device: {device}, {torch.get_num_threads()} threads; torch {torch.__version__}; batch {args.batch}; "
          f"{args.warmup} warm-up steps, then one profiled step; eager (compile off)")
    rows = []
    for preset, precision, cl in itertools.product(args.presets, args.precision, args.channels_last):
        step, model = build_step(preset, args.batch, precision, cl, device)
        for _ in range(args.warmup):
            step()
        r = profile_step(step, model, args.trace_op)
        r.update(preset=preset, precision=precision, channels_last=cl,
                 params=sum(1 for _ in model.parameters()),
                 step_s=time_step(step, args.time_steps) if args.time_steps else None)
        rows.append(r)
        if args.detail:
            print(f"\n## {preset} {precision} channels_last={cl}: {r['copies']} copy_ calls by source "
                  f"(phase | frame | ATen ops around it | dtypes | weight or activation)\n")
            print("| count | source |\n|---|---|")
            for src, n in r["sources"].most_common():
                print(f"| {n} | {src} |")
            print(f"\ntop-level ops by name (first {args.top}):\n")
            print("| count | op |\n|---|---|")
            for name, n in r["top_by_name"].most_common(args.top):
                print(f"| {n} | {name} |")

    print("\n| preset | precision | channels_last | parameters | top-level ops | of which run a kernel | all ATen ops "
          "| copy_ | to | _to_copy | contiguous | clone | step s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["casts_top"]
        step_s = f"{r['step_s']:.3f}" if r["step_s"] else "-"
        print(f"| {r['preset']} | {r['precision']} | {r['channels_last']} | {r['params']} | {r['ops_top']} | {r['ops_work']} | {r['ops_all']} "
              f"| {r['copies']} | {c['aten::to']} | {c['aten::_to_copy']} | {c['aten::contiguous']} | {c['aten::clone']} "
              f"| {step_s} |")

    # The copies of every case, grouped by phase and frame (the dtypes and ops folded in).
    groups = sorted({_group(s) for r in rows for s in r["sources"]})
    print("\ncopy_ calls per step by where they come from:\n")
    print("| source | " + " | ".join(f"{r['preset']} {r['precision']} cl={r['channels_last']}" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for g in groups:
        counts = [sum(n for s, n in r["sources"].items() if _group(s) == g) for r in rows]
        print(f"| {g} | " + " | ".join(str(n) for n in counts) + " |")
    if args.json:
        for r in rows:
            r["top_by_name"], r["sources"] = dict(r["top_by_name"]), dict(r["sources"])
        Path(args.json).write_text(json.dumps(rows, indent=1))


def _group(source: str) -> str:
    """A copy source without its op chain: 'phase | frame-or-node | dtypes | kind'."""
    phase, where, ops, dtypes, kind = source.split(" | ")
    if phase == "backward":
        return f"backward: {where} ({dtypes}, {kind})"
    return f"{where} < {ops.split(' < ')[-1]} ({dtypes}, {kind})"


if __name__ == "__main__":
    main()
