"""Peak resident memory (RSS) per rank of real training runs on 2 gloo CPU processes: FSDP (built
sharded, never whole: a fresh start with steps, validation and a sharded checkpoint, then a resume),
against DDP's whole replica, and against what ``difftrain estimate --parallel fsdp`` counts.

    PYTHONPATH=src python bench/fsdp_peak_rss.py --base-channels 256     # difftrain's tiny preset widened
    PYTHONPATH=src python bench/fsdp_peak_rss.py --base-channels 192 --start-up-only
    PYTHONPATH=src python bench/fsdp_peak_rss.py --sd-unet-channels 192   # a base's denoiser and LoRA

``--start-up-only``: the phases of ``tests/integration/test_fsdp_meta.py::_start_and_resume`` (build
the sharded state, one step, a sharded checkpoint; then, freed memory given back, a resume from it),
now and with the whole-then-shard start-up and consolidated resume this replaced (``builds_sharded``
forced False).

``--sd-unet-channels C``: the start-up (build + shard) of a run from a base's files, an SD-shaped
UNet2DConditionModel folder of C and 2C channels (``tests/integration/test_fsdp_meta_bases.py``'s
``start_up_peaks``: 39.0M parameters at 192), in full and with LoRA (rank 4), read from the files one
tensor at a time and, before, loaded whole and then sharded.

``--init-from-sharded``: the start-up (build + shard) of a run whose ``model.init_from`` is a sharded
checkpoint's folder (``step_N.dcp``, written by the same 2 ranks first: weights, EMA, AdamW's moments and a
post-hoc EMA), each rank reading its part of the EMA weights into its shards (``sharded.load_part``),
and, before, the checkpoint read consolidated (whole, every tensor of it) while the shards were filled
(``networks.init_from._sharded_checkpoint_source`` forced to find none).

Each rank resets its peak (``/proc/self/clear_refs``) after joining the group with difftrain's
training modules imported, then runs ``training.loop.train``; the figure is its peak RSS above that
start, in MiB (the start itself is printed too). "estimate" is ``tools/parallel_memory.counted_memory``
of the same config on the meta device: the training state a rank holds at steady state (weights,
gradients, AdamW's moments, the EMA and each post-hoc EMA), without activations, buffers or the
allocator's slack.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from multiproc import run_ranks  # noqa: E402

from difftrain.networks.conditioning import Conditioning  # noqa: E402
from difftrain.config import load_config  # noqa: E402

MiB = 2**20


def overrides(base_channels: int, parallel: str, steps: int, validate: bool = True) -> list[str]:
    return ["data.resolution=16", "data.num_workers=0", "model.preset=tiny", "model.attention_resolutions=[8]",
            f"model.base_channels={base_channels}", "diffusion.num_timesteps=100", f"train.total_steps={steps}",
            "train.device=cpu", "train.batch_size=2", "train.channels_last=off", "train.log_every_steps=1",
            "checkpoint.every_steps=1000", f"validation.every_steps={2 if validate else 0}", "validation.num_images=2", "validation.steps=2",
            "tracking.tensorboard=false", "ema.posthoc_std=[0.1]", "train.progress_bar=false",
            f"train.parallel={parallel}"]


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_run(ctx, run_dir: str, cfg_overrides: list[str], stop_at_step: int | None, gathered: bool = False) -> dict:
    from difftrain.training.loop import train
    from difftrain.training.state import RunState

    if gathered:  # evaluation on whole copies gathered onto every rank, as before it ran in lockstep
        RunState.evaluation_models = RunState.gathered_models

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS now
    start = _rss("VmRSS")
    t0 = time.perf_counter()
    step = train(load_config(None, cfg_overrides), run_dir, stop_at_step=stop_at_step).step
    return {"rank": ctx.rank, "step": step, "start_mib": start / MiB, "peak_above_start_mib": (_rss("VmHWM") - start) / MiB,
            "seconds": time.perf_counter() - t0}


def phases(ctx, run_dir: str, cfg_overrides: list[str], old: bool) -> dict:
    """``_start_and_resume`` of the test, on the sharded build or (``old``) the whole-then-shard one."""
    import difftrain.training.state as state_module
    from integration.test_fsdp_meta import _start_and_resume

    if old:
        state_module.builds_sharded = lambda *args, **kwargs: False
    return {"rank": ctx.rank, **{k: v / MiB if k in ("built", "resumed") else v
                                 for k, v in _start_and_resume(ctx, run_dir, cfg_overrides).items()}}


def init_from_sharded(ctx, run_dir: str, cfg_overrides: list[str]) -> dict:
    """This rank's peak RSS above its start while a run starts from a sharded checkpoint's folder
    (``model.init_from``): each rank reading its part (``now``), then the consolidated read (``before``)."""
    from difftrain.networks import init_from
    from difftrain.checkpoints import sharded as sharded
    from difftrain.training.state import RunState
    from multiproc import reset_peak, status_bytes

    cfg = load_config(None, cfg_overrides)
    state = RunState.build(cfg, 0, ctx.device, dctx=ctx)
    state.parallelize(ctx)
    c = cfg.checkpoint
    folder = sharded.save_or_report(state, state.state_dict(), Path(run_dir) / "checkpoints", 1, c.keep_last,
                                    c.keep_every_steps, "stop", ctx)
    del state
    cfg = load_config(None, [*cfg_overrides, f"model.init_from={folder}"])
    out, deferred = {"rank": ctx.rank}, init_from._sharded_checkpoint_source
    for name in ("now", "before"):
        if name == "before":
            init_from._sharded_checkpoint_source = lambda *args: (None, None)
        start = reset_peak(give_back=True)
        state = RunState.build(cfg, 0, ctx.device, dctx=ctx)
        state.parallelize(ctx)
        out[name] = (status_bytes("VmHWM") - start) / MiB
        del state
    init_from._sharded_checkpoint_source = deferred
    return out


def counted(base_channels: int, parallel: str, world: int) -> dict:
    from difftrain.tools.parallel_memory import counted_memory
    from difftrain.networks.build import build_network

    cfg = load_config(None, overrides(base_channels, parallel, 3))
    with torch.device("meta"):
        model = build_network(cfg, Conditioning(0, channels=3, resolution=16))
    m = counted_memory(model, cfg, parallel, world)
    return {"params": sum(p.numel() for p in model.parameters()), "state_mib": (m.total - m.transient) / MiB,
            "total_mib": m.total / MiB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-channels", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--start-up-only", action="store_true", help="start-up and resume phases, now and before")
    parser.add_argument("--sd-unet-channels", type=int, default=0,
                        help="start-up from an SD-shaped UNet2DConditionModel folder of this width (full and LoRA)")
    parser.add_argument("--init-from-sharded", action="store_true",
                        help="start-up from a sharded checkpoint's folder (model.init_from), now and before")
    parser.add_argument("--gathered-evaluation", action="store_true",
                        help="evaluate on whole copies gathered onto every rank (as before lockstep evaluation)")
    parser.add_argument("--no-validation", action="store_true", help="FSDP runs without validation (no DDP run)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.sd_unet_channels:
        from integration.test_fsdp_meta_bases import BUILD, start_up_peaks, write_sd_unet_folder

        with tempfile.TemporaryDirectory() as tmp:
            unet = write_sd_unet_folder(Path(tmp) / "unet", args.sd_unet_channels)
            runs = [[*BUILD, f"model.init_from={unet}"], [*BUILD, f"model.init_from={unet}", "lora.rank=4"]]
            result = run_ranks(start_up_peaks, 2, runs, timeout_s=3600)
        for rank, peaks in enumerate(result):
            for name, p in zip(("full", "LoRA"), peaks):
                print(f"rank {rank} {name} ({p['params'] / 1e6:.1f}M parameters): " + ", ".join(
                    f"{k} {p[k] / MiB:.0f} MiB ({p[k] / p['params']:.1f} B/param)" for k in ("sharded", "whole")),
                    flush=True)
        return
    rows = []
    whole, fsdp2 = counted(args.base_channels, "ddp", 1), counted(args.base_channels, "fsdp", 2)
    print(f"{whole['params'] / 1e6:.1f}M parameters; counted training state: whole {whole['state_mib']:.0f} MiB, "
          f"FSDP x2 per rank {fsdp2['state_mib']:.0f} MiB (+ transient: {fsdp2['total_mib']:.0f})", flush=True)
    if args.init_from_sharded:
        with tempfile.TemporaryDirectory() as tmp:
            result = run_ranks(init_from_sharded, 2, tmp, overrides(args.base_channels, "fsdp", 3), timeout_s=3600)
        print("model.init_from a sharded checkpoint, start-up peak above start (MiB)",
              json.dumps([{k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()} for r in result]),
              flush=True)
        return
    if args.start_up_only:
        for old in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                result = run_ranks(phases, 2, tmp, overrides(args.base_channels, "fsdp", 3), old, timeout_s=3600)
            print("before (whole, then shard)" if old else "now (sharded build)",
                  json.dumps([{k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()} for r in result]),
                  flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        runs = (("FSDP fresh: start-up, 2 steps, validation, checkpoint", "fsdp", 2),
                ("FSDP resume: sharded checkpoint, 1 step, validation, checkpoint", "fsdp", None),
                ("DDP fresh: start-up, 2 steps, validation, checkpoint", "ddp", 2))
        if args.no_validation:
            runs = tuple((name.replace(" validation,", ""), parallel, stop) for name, parallel, stop in runs[:2])
        for name, parallel, stop in runs:
            run = Path(tmp) / parallel
            result = run_ranks(rank_run, 2, str(run), overrides(args.base_channels, parallel, 3, not args.no_validation),
                               stop, args.gathered_evaluation, timeout_s=3600)
            rows.append({"run": name, **{f"rank{r['rank']}": r for r in result}})
            print(name, json.dumps([{k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()} for r in result]),
                  flush=True)
    if args.out:
        args.out.write_text(json.dumps({"whole": whole, "fsdp2": fsdp2, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
