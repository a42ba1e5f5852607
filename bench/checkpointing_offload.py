"""What model.gradient_checkpointing and train.fsdp_offload trade: peak memory against step time.

    PYTHONPATH=src python bench/checkpointing_offload.py

1. Gradient checkpointing, one process: difftrain's tiny preset widened to ``--base-channels`` and
   an SD-shaped diffusers UNet2DConditionModel (a family denoiser, ``enable_gradient_checkpointing``)
   at ``--resolution``, batch ``--batch``: a forward and backward of the loss, the peak RSS above the
   resident memory before it (``/proc/self/clear_refs``) and the median time of ``--steps`` steps.
2. FSDP offload, 2 gloo processes: the same UNet sharded, with and without ``train.fsdp_offload``
   (``CPUOffloadPolicy``), steps of forward, backward, AdamW and EMA: rank 0's median step time and
   peak RSS above its start. On a CPU the "device" is the CPU, so offloading moves nothing out of
   it: this measures the policy's cost (copies of each unit's shards per forward and backward);
   the device memory it frees on a GPU (the shards, gradients and AdamW state: about 14 bytes per
   parameter / N) is counted by ``difftrain estimate``, not measured here.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from multiproc import run_ranks  # noqa: E402

MiB = 2**20


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _reset_peak() -> int:
    """Give freed memory back to the system (glibc keeps it resident), then reset the peak to now."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _unet_overrides(base_channels: int, resolution: int, checkpointing: bool) -> list[str]:
    return [f"data.resolution={resolution}", "model.preset=tiny", f"model.base_channels={base_channels}",
            "model.attention_resolutions=[8]", "train.device=cpu", "train.channels_last=off",
            f"model.gradient_checkpointing={str(checkpointing).lower()}"]


def _diffusers_unet(checkpointing: bool):
    import diffusers

    from difftrain.networks.build import build_network
    from difftrain.config import load_config
    from difftrain.networks.conditioning import Conditioning

    torch.manual_seed(0)
    model = diffusers.UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(64, 128, 256),
        norm_num_groups=32, attention_head_dim=8, cross_attention_dim=64,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"))
    record = {"kind": "family", "family": "sd", "config": json.loads(json.dumps(dict(model.config)))}
    cfg = load_config(None, [f"model.gradient_checkpointing={str(checkpointing).lower()}"])
    return build_network(cfg, Conditioning(0, channels=3, resolution=16), network=record)


def checkpointing_row(which: str, checkpointing: bool, args) -> dict:
    from difftrain.networks.conditioning import Conditioning
    from difftrain.config import load_config
    from difftrain.networks.build import build_network

    g = torch.Generator().manual_seed(0)
    if which == "unet":
        cfg = load_config(None, _unet_overrides(args.base_channels, args.resolution, checkpointing))
        net = build_network(cfg, Conditioning(0, channels=3, resolution=args.resolution))
        x, cond = torch.randn(args.batch, 3, args.resolution, args.resolution, generator=g), None
    else:
        net = _diffusers_unet(checkpointing)
        x = torch.randn(args.batch, 4, args.resolution, args.resolution, generator=g)
        cond = {"prompt_embeds": torch.randn(args.batch, 8, 64, generator=g)}
    net.train()
    t = torch.full((args.batch,), 10)
    times, peaks = [], []
    for _ in range(args.steps + 1):
        start = _reset_peak()
        t0 = time.perf_counter()
        out = net(x, t, cond) if cond is not None else net(x, t)
        out.square().mean().backward()
        times.append(time.perf_counter() - t0)
        peaks.append(_status("VmHWM") - start)
        net.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in net.parameters())
    return {"network": "difftrain UNet" if which == "unet" else "diffusers UNet2DConditionModel (sd family)",
            "params_M": params / 1e6, "checkpointing": checkpointing,
            "peak_above_start_mib": statistics.median(peaks[1:]) / MiB, "step_s": statistics.median(times[1:])}


def offload_rank(ctx, offload: bool, args_dict: dict) -> dict:
    from difftrain.config import load_config
    from difftrain.training.state import RunState

    a = argparse.Namespace(**args_dict)
    cfg = load_config(None, _unet_overrides(a.base_channels, a.resolution, False)
                      + ["train.parallel=fsdp", f"train.fsdp_offload={str(offload).lower()}"])
    start = _reset_peak()
    state = RunState.build(cfg, 0, ctx.device, dctx=ctx)
    net = state.parallelize(ctx)
    x = torch.randn(a.batch, 3, a.resolution, a.resolution, generator=torch.Generator().manual_seed(ctx.rank))
    times = []
    for _ in range(a.steps + 1):
        t0 = time.perf_counter()
        net(x, torch.full((a.batch,), 10)).square().mean().backward()
        state.precision.step(state.optimizer, net.parameters(), 1.0, torch.tensor(1.0))
        state.optimizer.zero_grad(set_to_none=True)
        state.ema.update(state.model)
        times.append(time.perf_counter() - t0)
    return {"offload": offload, "peak_above_start_mib": (_status("VmHWM") - start) / MiB,
            "step_s": statistics.median(times[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-channels", type=int, default=128)
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    for which in ("unet", "sd"):
        for checkpointing in (False, True):
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                              for k, v in checkpointing_row(which, checkpointing, args).items()}), flush=True)
    for offload in (False, True):
        rank0 = run_ranks(offload_rank, 2, offload, vars(args), timeout_s=3600)[0]
        print(json.dumps({"fsdp x2": True, **{k: round(v, 3) if isinstance(v, float) else v for k, v in rank0.items()}}),
              flush=True)


if __name__ == "__main__":
    main()
