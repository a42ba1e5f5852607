"""Which attention kernel trains a Flux-shaped transformer on this GPU: one process per setting.

The GPU check (bench/gpu_check.py, 2026-11-28, H200, torch 2.11.0+cu130) found every step of a bf16 Flux-shaped
LoRA run failing: an illegal memory access, or non-finite losses where no error was raised; diffusers' own Flux
script failed the same way on the same base. With ``CUDA_LAUNCH_BLOCKING=1`` the failure is cuDNN's attention
kernel (``mha_graph.execute(...).is_good()``), which ``scaled_dot_product_attention`` picked by default. This
script trains the transformer of that check (diffusers' ``FluxTransformer2DModel`` at Flux.1's width, 4 double
and 6 single blocks, bf16 weights, 512 px: 1,024 image and 512 text tokens) for three forward and backward
passes per setting, each in its own process (a failed kernel poisons the process): PyTorch's choice, each of
its four kernels alone (set with the process-wide ``torch.backends.cuda.enable_*_sdp`` switches, so that
gradient checkpointing's recomputation uses the same one), and PyTorch's choice without cuDNN's (what
``train.cudnn_attention = false`` sets). It prints one line per setting: whether the passes ran and their losses
and gradients were finite, and the median pass time.

    CUDA_LAUNCH_BLOCKING=1 python bench/attention_check.py     # on a GPU; about 2 minutes on an H200
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

KERNELS = ("flash", "efficient", "math", "cudnn")
SETTINGS = {"default": None, **{k: (k,) for k in KERNELS}, "no-cudnn": ("flash", "efficient", "math")}


def _allow(kernels: tuple[str, ...] | None) -> None:
    """Leave PyTorch's choice (None), or allow only ``kernels``."""
    if kernels is None:
        return
    for k in KERNELS:
        getattr(torch.backends.cuda, f"enable_{'mem_efficient' if k == 'efficient' else k}_sdp")(k in kernels)


def one(setting: str, checkpointing: bool, passes: int = 3) -> None:
    """Train the Flux-shaped transformer for ``passes`` forward and backward passes under ``setting``."""
    from diffusers import FluxTransformer2DModel

    _allow(SETTINGS[setting])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=4, num_single_layers=6,
                                       attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                       pooled_projection_dim=768, guidance_embeds=True,
                                       axes_dims_rope=(16, 56, 56)).to(torch.bfloat16)
    model.requires_grad_(False)
    if checkpointing:
        model.enable_gradient_checkpointing()
    g = torch.Generator("cuda").manual_seed(0)
    side = torch.arange(32, device="cuda", dtype=torch.float32)
    img_ids = torch.stack([torch.zeros(32, 32, device="cuda"), side[:, None].expand(32, 32),
                           side[None].expand(32, 32)], -1).reshape(-1, 3)
    times = []
    for i in range(passes):
        x = torch.randn(1, 1024, 64, device="cuda", generator=g, requires_grad=True)
        text = torch.randn(1, 512, 4096, device="cuda", generator=g)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16):
            out = model(hidden_states=x, timestep=torch.full((1,), 0.5, device="cuda"),
                        guidance=torch.full((1,), 3.5, device="cuda"),
                        pooled_projections=torch.randn(1, 768, device="cuda", generator=g),
                        encoder_hidden_states=text, txt_ids=text.new_zeros(512, 3), img_ids=img_ids,
                        return_dict=False)[0]
        loss = out.float().square().mean()
        loss.backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        finite = bool(torch.isfinite(loss)) and bool(torch.isfinite(x.grad).all())
        print(f"pass {i}: loss {loss.item():.4g}, finite {finite}", flush=True)
    print(f"median pass {sorted(times)[len(times) // 2]:.3f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--one", choices=list(SETTINGS), help="run one setting in this process (what the driver calls)")
    p.add_argument("--checkpointing", action="store_true")
    args = p.parse_args()
    if args.one:
        one(args.one, args.checkpointing)
        return
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; cuDNN {torch.backends.cudnn.version()}")
    print("| attention | checkpointing | result | median pass s |\n|---|---|---|---:|")
    for setting in SETTINGS:
        for checkpointing in (True, False):
            cmd = [sys.executable, __file__, "--one", setting] + (["--checkpointing"] if checkpointing else [])
            done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, env=os.environ)
            lines = done.stdout.splitlines()
            errors = [line for line in done.stderr.splitlines() if "Error" in line][-1:]
            ok = done.returncode == 0 and all("finite True" in line for line in lines if line.startswith("pass"))
            median = next((line.split()[2] for line in lines if line.startswith("median")), "-")
            result = "ok" if ok else (errors[0][:120] if errors else "non-finite" if done.returncode == 0 else
                                      f"exit {done.returncode}")
            print(f"| {setting} | {'on' if checkpointing else 'off'} | {result} | {median} |", flush=True)


if __name__ == "__main__":
    main()
