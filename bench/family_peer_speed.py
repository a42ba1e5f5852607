"""LoRA fine-tuning speed and peak memory of SDXL, SD3 and Flux bases beside diffusers' own scripts
(``train_text_to_image_lora_sdxl.py``, ``train_dreambooth_lora_sd3.py``, ``train_dreambooth_lora_flux.py``,
unchanged, from ../shared/peers): the same base, captioned images, batch, steps, LR plan, rank and fp32,
both at the same time, one core each; steps per second from each one's own log, peak RSS from
``/usr/bin/time``.

    python bench/family_peer_speed.py --peer-python /tmp/peer-venv/bin/python --family sdxl --size tiny
    python bench/family_peer_speed.py ... --family sd3 --size proportioned --cores 1,0   # cores swapped

The families of 2026 (:data:`NEW_FAMILIES`: Z-Image, Qwen-Image, FLUX.2 [klein], Lumina 2, Sana, HiDream, and
FLUX.2 [dev] and Flux Kontext, whose scripts do not run on the tests' bases) beside diffusers' script for each
(``train_dreambooth_lora_z_image.py`` ...), on the tests' tiny base of the family (tests/family_bases_*.py),
``--size tiny`` only; ``--our-set KEY=VALUE`` adds a difftrain ``--set`` (e.g. no gradient checkpointing),
``--peer-arg=ARG`` an argument of the script (e.g. its ``--gradient_checkpointing``, as difftrain's presets):

    python bench/family_peer_speed.py --peer-python /tmp/peer-venv/bin/python --family z-image --steps 600
    python bench/family_peer_speed.py ... --family z-image --steps 600 --peer-arg=--gradient_checkpointing

``--size tiny`` trains bases of about the tests' size; ``--size proportioned`` bases whose text
encoders weigh against the denoiser as the real family's do (SDXL 0.3, SD3 2.8, Flux 0.4), because what the peer repeats at every step (each text
encoder on the batch's captions, the VAE on its images) is where a trainer that computes them once
wins on real models (both from bench/family_bases_sized.py, CLIP encoders 77 tokens long as the
real ones: the peers' SD3 and Flux scripts pad CLIP prompts to 77).

difftrain runs the family's preset (configs/FAMILY-lora.toml) with only what the comparison has to
match set on the command line: data, resolution, batch 1 x accumulation 1 -> ``--batch``, steps,
LR (constant, no warm-up), rank and alpha, fp32, no flips, no validation, workers 0. Everything
else is difftrain's default (its latent cache, its text-encoder cache, its EMA of the adapter). Per
step the peers run the VAE encoder on the batch's images and every text encoder on its captions,
then the denoiser forward and backward; difftrain reads both from its caches and runs the denoiser
(a benchmark, not a test; results go to docs/fine_tuning.md).

``--memory`` (Flux, issue 41 item 1) measures instead the host memory each holds while training per
frozen-base parameter, in bf16: on the proportioned Flux base and on the large one (the same encoders
and VAE, a transformer of about 130M parameters: bench/family_bases_sized.py), each program alone on
one core (``--cores``' first), its resident memory read from /proc every 0.1 s; "held while
training" is the largest reading from step ``--skip`` to its last step (start-up and the final save
left out), and the difference between the two bases divided by the difference in their denoiser's
parameters is the bytes each holds per frozen-base parameter. difftrain runs twice: as shipped (its EMA of the
adapter, float32) and with ``ema.decay = 0`` (no EMA kept, as the script keeps none: the like-for-like
setting; both keep the adapter and AdamW's state, difftrain in float32, the script in bf16). Peak RSS (start-up included) beside it:

    python bench/family_peer_speed.py --peer-python /tmp/peer-venv/bin/python --memory --steps 20 --skip 8
    python bench/family_peer_speed.py ... --memory --steps 20 --skip 8 --resolution 32   # batch 4 (the default)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# diffusers' scripts: ../shared/peers beside the main checkout (a worktree under wt/ has it two levels up)
PEERS = next((p for p in (ROOT.parent / "shared" / "peers", ROOT.parents[1] / "shared" / "peers") if p.is_dir()),
             ROOT.parent / "shared" / "peers")
sys.path.insert(0, str(ROOT / "bench"))

from family_bases_sized import _numel, parameter_counts, write_base  # noqa: E402
from peer_lora_speed import difftrain_times, peer_times, rate, run_pair  # noqa: E402  (the same runner and log readers)

from tests.family_bases_flux2 import TEXT_LENGTH, write_tiny_flux2_folder, write_tiny_flux2_klein_folder  # noqa: E402
from tests.family_bases_flux_kontext import write_tiny_flux_kontext_folder  # noqa: E402
from tests.family_bases_gemma import write_tiny_lumina2_folder, write_tiny_sana_folder  # noqa: E402
from tests.family_bases_hidream import write_tiny_hidream_folder  # noqa: E402
from tests.family_bases_qwen_image import write_tiny_qwen_image_folder  # noqa: E402
from tests.family_bases_z_image import QWEN_LENGTH, write_tiny_z_image_folder  # noqa: E402

SCRIPTS = {"sdxl": "train_text_to_image_lora_sdxl.py", "sd3": "train_dreambooth_lora_sd3.py",
           "flux": "train_dreambooth_lora_flux.py"}
T5_TOKENS = 24  # the bases' T5 tokenizer length (tests/family_bases.T5_LENGTH), passed to the peers as well


@dataclass(frozen=True)
class NewFamily:
    """A family of 2026 beside diffusers' script for it: ``script`` (in ../shared/peers, run unchanged),
    ``write`` the tests' tiny base builder (path -> path), ``tokens`` the text length both are given
    (``--max_sequence_length`` / ``model.max_sequence_length``; None: each one's default, the pipeline's),
    ``extra`` the script's further arguments its tiny base needs (../shared/peers/README.md), ``varied``
    whether the captions get tails of different lengths (:func:`write_data`)."""

    script: str
    write: Callable[[Path], Path]
    tokens: int | None
    extra: tuple[str, ...] = ()
    varied: bool = False


# Only tiny bases (the tests' builders): --size proportioned is for SDXL, SD3 and Flux.
NEW_FAMILIES = {
    "z-image": NewFamily("train_dreambooth_lora_z_image.py", write_tiny_z_image_folder, QWEN_LENGTH),
    # Qwen-Image: the script crashes when a batch's captions all have the same token count (its own bug,
    # ../shared/peers/README.md): captions of different lengths for both.
    "qwen-image": NewFamily("train_dreambooth_lora_qwen_image.py", write_tiny_qwen_image_folder, 32, varied=True),
    # klein's script stacks Mistral's layers 10/20/30 by default; the klein pipeline (and its Qwen3) 9/18/27
    "flux2-klein": NewFamily("train_dreambooth_lora_flux2_klein.py", write_tiny_flux2_klein_folder, TEXT_LENGTH,
                             ("--text_encoder_out_layers", "9", "18", "27")),
    "flux2": NewFamily("train_dreambooth_lora_flux2.py", write_tiny_flux2_folder, TEXT_LENGTH),
    "lumina2": NewFamily("train_dreambooth_lora_lumina2.py", write_tiny_lumina2_folder, None),
    "sana": NewFamily("train_dreambooth_lora_sana.py", write_tiny_sana_folder, None),
    "hidream": NewFamily("train_dreambooth_lora_hidream.py", write_tiny_hidream_folder, None,
                         ("--pretrained_tokenizer_4_name_or_path", "{base}/tokenizer_4",  # default: a hub model
                          "--pretrained_text_encoder_4_name_or_path", "{base}/text_encoder_4")),
    "flux-kontext": NewFamily("train_dreambooth_lora_flux_kontext.py", write_tiny_flux_kontext_folder, T5_TOKENS),
}
for _name, _family in NEW_FAMILIES.items():
    SCRIPTS[_name] = _family.script


def new_family_base(family: str, path: Path) -> Path:
    """The tests' tiny base of a family of 2026 in ``path`` (written once)."""
    if not (path / "model_index.json").is_file():
        NEW_FAMILIES[family].write(path)
    return path


def write_data(folder: Path, images: int, resolution: int, varied: bool = False) -> Path:
    """``images`` built-in shapes as PNGs with a metadata.jsonl of their captions (both read it); ``varied``:
    image i's caption gets a tail of i % 16 more caption words (no four captions of one length)."""
    from PIL import Image

    from difftrain.data.builtin import CAPTION_WORDS, describe_shape, draw_shape, shape_caption

    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(images):
        Image.fromarray(draw_shape(i, resolution)[0]).save(folder / f"{i:05d}.png")
        caption = shape_caption(describe_shape(i, resolution))
        if varied:
            caption = " ".join([caption, *(CAPTION_WORDS[j % len(CAPTION_WORDS)] for j in range(i % 16))])
        lines.append(json.dumps({"file_name": f"{i:05d}.png", "text": caption}))
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def peer_command(family: str, base: Path, data: Path, out: Path, args) -> list[str]:
    common = ["--pretrained_model_name_or_path", str(base), "--resolution", str(args.resolution),
              "--train_batch_size", str(args.batch), "--max_train_steps", str(args.steps),
              "--learning_rate", str(args.lr), "--lr_scheduler", "constant", "--lr_warmup_steps", "0",
              "--rank", str(args.rank), "--output_dir", str(out), "--seed", "0", "--dataloader_num_workers", "0",
              "--checkpointing_steps", "100000", "--caption_column", "text"]
    if family == "sdxl":
        return common + ["--train_data_dir", str(data)]
    captions = common + ["--dataset_name", str(data), "--image_column", "image", "--instance_prompt", "a shape"]
    if family in NEW_FAMILIES:
        new = NEW_FAMILIES[family]
        tokens = [] if new.tokens is None else ["--max_sequence_length", str(new.tokens)]
        return captions + tokens + [a.replace("{base}", str(base)) for a in new.extra]
    return captions + ["--max_sequence_length", str(T5_TOKENS)]


def peer_precision(args) -> list[str]:
    return ["--mixed_precision", args.precision] if args.precision != "fp32" else []


def our_command(family: str, base: Path, data: Path, run_dir: Path, args) -> list[str]:
    cmd = [sys.executable, "-m", "difftrain", "train", "--config", str(ROOT / "configs" / f"{family}-lora.toml"),
           "--run-dir", str(run_dir)]
    for o in [f"model.init_from={base}", f"data.path={data}", f"data.resolution={args.resolution}",
              "data.random_flip=false", "data.num_workers=0", f"lora.rank={args.rank}", f"lora.alpha={args.rank}",
              f"optim.lr={args.lr}", "optim.lr_schedule=constant", "optim.warmup_steps=0",
              f"train.batch_size={args.batch}", "train.grad_accum_steps=1", f"train.total_steps={args.steps}",
              f"train.log_every_steps={1 if args.memory else 5}", f"train.precision={args.precision}", "train.device=cpu", "train.seed=0",
              "train.progress_bar=false", "validation.every_steps=0", f"checkpoint.every_steps={args.steps}",
              f"model.max_sequence_length={_our_tokens(family)}",
              # the scripts' base is float32 (--precision fp32) or bf16: none of the 2026 presets' nf4 / fp8
              *(["model.quantize_base=off"] if family in NEW_FAMILIES else [])]:
        cmd += ["--set", o]
    return cmd


def _our_tokens(family: str) -> int:
    """difftrain's model.max_sequence_length for ``family`` (0: the pipeline's default)."""
    if family in NEW_FAMILIES:
        return NEW_FAMILIES[family].tokens or 0
    return T5_TOKENS if family != "sdxl" else 0


def peak_mib(log: str) -> float:
    """``/usr/bin/time -f 'peak-kib %M'``'s last report, in MiB."""
    return int(re.findall(r"peak-kib (\d+)", log)[-1]) / 1024


def _tail(path: Path, size: int = 4096) -> str:
    """The last ``size`` characters of ``path`` ("" while it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


def peer_step(log: Path) -> int:
    """The peer's last step from its progress bar (0 before the first)."""
    steps = re.findall(r"Steps:[^|]*\|[^|]*\| *(\d+)/\d+", _tail(log))
    return int(steps[-1]) if steps else 0


def our_step(run_dir: Path) -> int:
    """difftrain's last logged step from its metrics.jsonl (0 before the first)."""
    steps = re.findall(r'"step": *(\d+)', _tail(run_dir / "metrics.jsonl"))
    return int(steps[-1]) if steps else 0


def held_while_training(cmd: list[str], log: Path, step: Callable[[], int], first: int, last: int) -> dict:
    """Run ``cmd`` alone (one thread, offline; output to ``log``), its resident memory read from
    /proc every 0.1 s: {"held": the largest reading while ``step()`` is in [first, last) (MiB), "peak": the
    process's peak RSS (MiB, start-up included), "readings": how many readings were in the window}."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    print("$ OMP_NUM_THREADS=1 " + " ".join(cmd), flush=True)
    held, readings = 0, 0
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # usage: the finished process's peak RSS
            if pid:
                break
            kib = re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{proc.pid}/status").read_text())
            if kib and first <= step() < last:
                held, readings = max(held, int(kib.group(1))), readings + 1
            time.sleep(0.1)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{cmd[3]} exited {proc.returncode}: see {log}")
    peak = usage.ru_maxrss
    return {"held": held / 1024, "peak": peak / 1024, "readings": readings}


def memory_main(args) -> int:
    """``--memory``: bytes held while training per frozen-base parameter, difftrain and diffusers' Flux script."""
    core = args.cores.split(",")[0]
    rows = {}
    for size in ("proportioned", "large"):
        work = Path(args.work) / f"flux-{size}"
        base = write_base("flux", size, work / "base")
        data = write_data(work / "data", args.images, args.resolution)
        peer_out, run_dir = work / "peer-out", work / "difftrain-run"
        shutil.rmtree(peer_out, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
        pinned = ["taskset", "-c", core]
        peer = pinned + [args.peer_python, str(PEERS / SCRIPTS["flux"])] + peer_command(
            "flux", base, data, peer_out, args) + peer_precision(args)
        ours = pinned + our_command("flux", base, data, run_dir, args)
        peer_log, ours_log = work / "peer.log", work / "difftrain.log"
        rows[size] = {"params": parameter_counts(base)["denoiser"]}
        rows[size]["peer"] = held_while_training(peer, peer_log, lambda log=peer_log: peer_step(log), args.skip,
                                                 args.steps)
        rows[size]["adapter"] = _adapter_params(peer_out)  # the same targets as difftrain's preset
        rows[size]["ours"] = held_while_training(ours, ours_log, lambda run=run_dir: our_step(run), args.skip,
                                                 args.steps)
        shutil.rmtree(run_dir, ignore_errors=True)  # the same run without an EMA (ema.decay = 0: no copy kept)
        rows[size]["ours-no-ema"] = held_while_training(ours + ["--set", "ema.decay=0"], work / "difftrain-no-ema.log",
                                                        lambda run=run_dir: our_step(run), args.skip, args.steps)
    small, large = rows["proportioned"], rows["large"]
    extra = large["params"] - small["params"]
    print(f"\nFlux bases: transformer {small['params']:,} and {large['params']:,} parameters (+{extra:,}); "
          f"{args.images} images at {args.resolution} px, batch {args.batch}, rank {args.rank}, {args.precision}, "
          f"{args.steps} steps, memory held from step {args.skip} on, core {core}")
    adapter = large["adapter"] - small["adapter"]
    print("\n| program | held while training MiB, proportioned / large | peak RSS MiB, proportioned / large "
          "| bytes per frozen-base parameter (held) | (peak) |\n|---|---|---|---:|---:|")
    for key, name in (("peer", f"diffusers {SCRIPTS['flux']}"), ("ours", "difftrain train --config configs/flux-lora.toml"),
                      ("ours-no-ema", "difftrain ... --set ema.decay=0 (no EMA, as the script)")):
        a, b = small[key], large[key]
        per = (b["held"] - a["held"]) * 2**20 / extra
        per_peak = (b["peak"] - a["peak"]) * 2**20 / extra
        print(f"| {name} | {a['held']:.0f} / {b['held']:.0f} | {a['peak']:.0f} / {b['peak']:.0f} | {per:.2f} "
              f"| {per_peak:.2f} |")
    print(f"\nThe adapter (the same targets in both): +{adapter:,} parameters; each byte held per adapter parameter "
          f"(difftrain: float32 weight, gradient, AdamW's two moments, 16, and its EMA, 4 more as shipped, none at "
          f"ema.decay = 0; the script in bf16: weight, gradient and AdamW's moments in bf16, 8) adds "
          f"{adapter / extra:.4f} bytes per frozen-base parameter")
    return 0


def _adapter_params(peer_out: Path) -> int:
    """Parameters of the adapter the peer saved (``pytorch_lora_weights.safetensors``)."""
    from safetensors import safe_open

    with safe_open(str(peer_out / "pytorch_lora_weights.safetensors"), "pt") as f:
        return sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peer-python", required=True, help="a Python with diffusers, accelerate, peft, datasets")
    p.add_argument("--family", choices=sorted(SCRIPTS), help="required without --memory (which is Flux's)")
    p.add_argument("--memory", action="store_true", help="bytes held per frozen-base parameter (module docstring)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default=None, help="default: fp32, bf16 with --memory")
    p.add_argument("--size", choices=("tiny", "proportioned"), default="tiny")
    p.add_argument("--work", default="/tmp/family-peer-speed")
    p.add_argument("--images", type=int, default=32)
    p.add_argument("--resolution", type=int, default=None, help="default: 32 tiny, 64 proportioned")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--skip", type=int, default=20, help="steps left out of the rate (start-up, first steps)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--cores", default="0,1", help="the peer's core and difftrain's (swap them for a second run)")
    p.add_argument("--our-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a further difftrain --set (e.g. model.gradient_checkpointing=false, as the scripts run)")
    p.add_argument("--peer-arg", action="append", default=[], metavar="ARG",
                   help="a further argument of the script (e.g. --peer-arg=--gradient_checkpointing, as difftrain's "
                        "presets run)")
    args = p.parse_args()
    args.resolution = args.resolution or (32 if args.size == "tiny" and not args.memory else 64)
    args.precision = args.precision or ("bf16" if args.memory else "fp32")
    if args.memory:
        return memory_main(args)
    if args.family is None:
        p.error("--family is required (or --memory)")
    work = Path(args.work) / f"{args.family}-{args.size}"
    if args.family in NEW_FAMILIES:
        if args.size != "tiny":
            p.error(f"--family {args.family}: only --size tiny (the tests' base)")
        base = new_family_base(args.family, work / "base")
    else:
        base = write_base(args.family, args.size, work / "base")
    varied = args.family in NEW_FAMILIES and NEW_FAMILIES[args.family].varied
    data = write_data(work / "data", args.images, args.resolution, varied)
    peer_out, run_dir = work / "peer-out", work / "difftrain-run"
    peer_core, our_core = args.cores.split(",")
    timed = ["/usr/bin/time", "-f", "peak-kib %M", "taskset", "-c"]
    peer = timed + [peer_core, args.peer_python, str(PEERS / SCRIPTS[args.family])] + peer_command(
        args.family, base, data, peer_out, args) + peer_precision(args) + args.peer_arg
    ours = timed + [our_core] + our_command(args.family, base, data, run_dir, args)
    for o in args.our_set:
        ours += ["--set", o]
    if not run_pair(peer, ours, work, run_dir, peer_out):
        return 1
    peer_log, our_log = (work / "peer.log").read_text(), (work / "difftrain.log").read_text()
    peer_sps, p0, p1 = rate(peer_times(peer_log), args.skip)
    ours_sps, o0, o1 = rate(difftrain_times(run_dir), args.skip)
    counts = parameter_counts(base)
    print(f"\n{args.family} {args.size} base: denoiser {counts['denoiser']:,} parameters, text encoders "
          f"{counts['text encoders']:,} (ratio {counts['ratio']:.2f}), VAE {counts['vae']:,}; "
          f"{args.images} images at {args.resolution} px, batch {args.batch}, rank {args.rank}, {args.precision}")
    print("\n| program | core | steps timed | steps / s | peak RSS MiB |\n|---|---|---|---:|---:|")
    print(f"| diffusers {SCRIPTS[args.family]} | {peer_core} | {p0}-{p1} | {peer_sps:.2f} | {peak_mib(peer_log):.0f} |")
    print(f"| difftrain train --config configs/{args.family}-lora.toml | {our_core} | {o0}-{o1} | {ours_sps:.2f} "
          f"| {peak_mib(our_log):.0f} |")
    print(f"difftrain / diffusers: {ours_sps / peer_sps:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
