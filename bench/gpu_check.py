"""The GPU check of issue 41 item 7: one command, one table, at most 8 minutes on one H100/H200.

For two bases with random weights, written here as local pipeline folders (nothing is downloaded):

- a Flux-shaped base: diffusers' ``FluxTransformer2DModel`` at the real width (24 heads of 128, T5 width 4096,
  CLIP width 768) with fewer blocks (:data:`FLUX_BLOCKS`: 4 double + 6 single, about 2.2B parameters), built
  on the device in bf16; its text encoders (one-layer CLIP-L and T5 at the real widths) and 16-channel VAE
  (factor 8) are tiny;
- the SDXL UNet at its real size (``bench/sdxl_unet_config.json``, 2.6B parameters), two one-layer CLIPs of the
  real widths (768 and 1280, the second projected), a tiny 4-channel VAE of factor 8;

each setting (:data:`SETTINGS`: a bf16 base, an nf4 base, an fp8 base, checkpointing off (the presets have it on), block swap of
half the base's blocks through ``model.swap_blocks``) trains a rank-16 LoRA for ``--steps`` steps through
difftrain's own entry (``python -m difftrain train`` with the family's preset and ``--set`` overrides, one
process per setting on CUDA), and the table gives for each: the peak device memory difftrain records in the
run folder's ``metrics.jsonl`` (``gpu_max_allocated_mib``: ``torch.cuda.max_memory_allocated`` of the run's
process) against ``difftrain estimate``'s figure for that setting (``tools/base_memory.count_base`` on the
folder, the setting's own row, counted on a thread while the runs go; within 10% = ok), and the median step
time (from the steps' timestamps in ``metrics.jsonl``, the first step left out). Then diffusers'
``train_dreambooth_lora_flux.py`` (``--peer-script``; ../shared/peers) on the same Flux folder, images,
resolution, batch, rank and bf16, with its prompt embeddings and latents computed once as difftrain's caches
do (its step time from its progress bar's rate), where its packages import; and the ``gpu``-marked tests
(``pytest -m gpu`` on the files that mark some), their pass / fail / skip counts. Whatever cannot run is a
row with a note (a library missing, the block swap not wired yet, a phase that would overrun the budget: each
setting's run is stopped at ``--setting-budget`` seconds and skipped when less than 1.25 x the longest run so
far is left before the ``--budget`` deadline, keeping the peer's and the tests' reserves). ``train.compile``
is off in every run (the estimate counts the eager step; compiling a 2B model would take most of the budget).

On a lent H200 (the device has PyTorch with CUDA, transformers, peft, accelerate, torchvision, safetensors,
tensorboard and pytest, no package registry): once, here, wheels of what its image lacks, and a copy of the
peer script, both in folders git ignores::

    echo /.whl/ >> .git/info/exclude; echo /.peers/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \\
      -d .whl diffusers==0.42.1 bitsandbytes==0.50.2 torchao==0.18.0 importlib_metadata tomli_w
    mkdir -p .peers && cp ../shared/peers/train_dreambooth_lora_flux.py .peers/

then one device run, carrying ``.whl`` and ``.peers`` (53 MB of wheels; ``scripts/setup.sh dev`` cannot run
there: it installs from a registry the device cannot reach)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \\
    PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 python3 bench/gpu_check.py \\
      --peer-script .peers/train_dreambooth_lora_flux.py --out $OUT/gpu_check.md

On the CPU, ``--tiny --device cpu`` runs the same phases on the tests' tiny Flux and SDXL folders
(``tests/family_bases.py``) at 32 px for 2 steps, each setting in this process (``--runner inprocess``: the
same ``difftrain train`` argument list through ``difftrain.cli.main``, without a new interpreter's start-up):
no memory comparison (no device peak), only that the table is produced and each setting trains
(tests/integration/test_gpu_check.py)::

    python bench/gpu_check.py --tiny --device cpu --out /tmp/gpu_check.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import itertools
import json
import os
import queue
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import difftrain.training  # noqa: E402  (swap_wired reads its modules)
from difftrain.cli import main as cli_main  # noqa: E402
from difftrain.config import ModelConfig, load_config  # noqa: E402
from difftrain.families import detect  # noqa: E402
from difftrain.models.text import BOS, EOS  # noqa: E402
from difftrain.runtime.fsdp import blocks  # noqa: E402
from difftrain.tools.base_memory import count_base, denoiser_config  # noqa: E402
from family_peer_speed import T5_TOKENS, write_data  # noqa: E402  (the benchmarks' captioned images)
from tests import family_bases as fb  # noqa: E402
from tests.text_components import write_tiny_tokenizer  # noqa: E402

GiB = 2**30
CLIP_TOKENS = 77  # the real CLIP encoders' positions (diffusers' Flux script pads CLIP prompts to 77)
FLUX_BLOCKS = (4, 6)  # double, single transformer blocks of the Flux-shaped base (the real Flux.1: 19, 38)
RANK = 16  # the presets' LoRA rank (--rank; tiny: 4, the tiny SDXL UNet's narrowest layer being 8 wide)
TOLERANCE = 0.10  # measured peak within 10% of the estimate: ok
# name -> the --set lines that make the setting (every one a rank-16 LoRA in bf16 over the family's preset);
# "{swap}": half the base's blocks
# The presets have gradient checkpointing on and Flux's an fp8 base: each setting names its base's storage.
SETTINGS = {
    "bf16 base": ["model.quantize_base=off"],
    "nf4 base": ["model.quantize_base=nf4"],
    "fp8 base": ["model.quantize_base=fp8"],
    "no checkpointing": ["model.quantize_base=off", "model.gradient_checkpointing=false"],
    "block swap": ["model.quantize_base=off", "model.swap_blocks={swap}"],
}
NEEDS = {"nf4 base": "bitsandbytes", "fp8 base": "torchao"}  # the library a setting quantizes with
PEER_MODULES = ("diffusers", "accelerate", "peft", "transformers", "torchvision", "huggingface_hub")
PEER_NAME = "train_dreambooth_lora_flux.py"


# ---------------------------------------------------------------------------------------------
# The bases.

def _clip(vocab: dict, width: int, seed: int, projection: bool):
    """A one-layer CLIP text model ``width`` wide (projected to ``width`` with ``projection``), 77 positions."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection  # the text extra

    config = CLIPTextConfig(vocab_size=len(vocab), hidden_size=width, intermediate_size=256, num_hidden_layers=1,
                            num_attention_heads=4, max_position_embeddings=CLIP_TOKENS, projection_dim=width,
                            bos_token_id=vocab[BOS], eos_token_id=vocab[EOS], pad_token_id=vocab[EOS])
    return fb.seeded(seed, lambda: (CLIPTextModelWithProjection if projection else CLIPTextModel)(config))


def _t5(vocab_size: int, width: int, seed: int):
    """A one-layer T5 encoder ``width`` wide with a narrow inside (4 heads of 16, feed-forward 256)."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=vocab_size, d_model=width, d_kv=16, d_ff=256, num_layers=1, num_heads=4,
                      relative_attention_num_buckets=8, relative_attention_max_distance=32, pad_token_id=0,
                      eos_token_id=1, decoder_start_token_id=0)
    return fb.seeded(seed, lambda: T5EncoderModel(config))


def _vae(latent_channels: int, seed: int, **factors):
    """A tiny AutoencoderKL of factor 8 (four levels of 8 / 16 channels), as the real bases' VAEs downsample."""
    from diffusers import AutoencoderKL

    return fb.seeded(seed, lambda: AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels, layers_per_block=1, norm_num_groups=4,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16), sample_size=64, **factors))


def _on_device(build, device: torch.device, seed: int):
    """``build()`` made on ``device`` (its random initialisation there: seconds for billions of weights on a
    GPU), then held in bf16 as it is written."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            return build().to(torch.bfloat16)


def write_flux(path: Path, device: torch.device, heads: int = 24, head_dim: int = 128, t5_width: int = 4096,
               clip_width: int = 768) -> Path:
    """A FluxPipeline folder: the transformer at the real width (``heads`` x ``head_dim``, Flux.1's 24 x 128;
    the T5 and CLIP widths its inputs take) with :data:`FLUX_BLOCKS` blocks (bf16), tiny encoders at those
    widths and a tiny VAE; CLIP tokenizer 77 tokens, the tests' T5 tokenizer. Narrower arguments: the same
    folder small enough for a CPU (tests/integration/test_gpu_check.py)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    path.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab = fb.clip_tokenizer(path / "tokenizer")
    t5_tokenizer = fb.tiny_t5_tokenizer()
    double, single = FLUX_BLOCKS
    transformer = _on_device(lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=4 * fb.LATENT_CHANNELS, num_layers=double, num_single_layers=single,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=t5_width,
        pooled_projection_dim=clip_width, guidance_embeds=True,
        axes_dims_rope=(head_dim // 8, 7 * head_dim // 16, 7 * head_dim // 16)), device, 0)  # Flux.1's (16, 56, 56)
    pipe = FluxPipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**fb.FLUX_SCHEDULER),
        vae=_vae(fb.LATENT_CHANNELS, 0, **fb.FLUX_VAE), text_encoder=_clip(vocab, clip_width, 1, projection=False),
        tokenizer=tokenizer, text_encoder_2=_t5(len(t5_tokenizer), t5_width, 3), tokenizer_2=t5_tokenizer)
    pipe.save_pretrained(path)
    fb.restore_clip_tokenizers(path, "tokenizer")
    write_tiny_tokenizer(path / "tokenizer", max_length=CLIP_TOKENS)
    return path


def write_sdxl(path: Path, device: torch.device, narrow: dict | None = None) -> Path:
    """A StableDiffusionXLPipeline folder: the UNet of bench/sdxl_unet_config.json (bf16; ``narrow``: keys of
    that config replaced, to make it small enough for a CPU), one-layer CLIPs whose widths add up to its
    cross-attention width (768 and 1280 in SDXL; the second projected: the UNet's pooled input), a tiny VAE;
    CLIP tokenizers 77 tokens."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    path.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab = fb.clip_tokenizer(path / "tokenizer")
    config = json.loads((ROOT / "bench" / "sdxl_unet_config.json").read_text()) | (narrow or {})
    pooled = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]  # 1280
    first = config["cross_attention_dim"] - pooled  # 768
    unet = _on_device(lambda: UNet2DConditionModel.from_config(config), device, 0)
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       num_train_timesteps=1000, steps_offset=1, timestep_spacing="leading")
    pipe = StableDiffusionXLPipeline(
        vae=_vae(4, 0, scaling_factor=0.13025), text_encoder=_clip(vocab, first, 1, projection=False),
        text_encoder_2=_clip(vocab, pooled, 2, projection=True), tokenizer=tokenizer, tokenizer_2=tokenizer,
        unet=unet, scheduler=scheduler)
    pipe.save_pretrained(path)
    fb.restore_clip_tokenizers(path, "tokenizer", "tokenizer_2")
    for name in ("tokenizer", "tokenizer_2"):
        write_tiny_tokenizer(path / name, max_length=CLIP_TOKENS)
    return path


def write_bases(work: Path, tiny: bool, device: torch.device, families: list[str]) -> dict[str, Path]:
    """{family: folder} under ``work`` for ``families`` of "flux", "sdxl" (kept: a folder already written is used
    again); tiny: the tests' folders (tests/family_bases.py, the Flux one 64 wide so that nf4 takes its layers)."""
    folders = {f: work / (f"{f}-tiny" if tiny else f) for f in families}
    writers = ({"flux": lambda p: fb.write_tiny_flux_folder(p, head_dim=32), "sdxl": fb.write_tiny_sdxl_folder}
               if tiny else {"flux": lambda p: write_flux(p, device), "sdxl": lambda p: write_sdxl(p, device)})
    for family, folder in folders.items():
        if not (folder / "model_index.json").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            writers[family](folder)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return folders


def denoiser_facts(folder: Path) -> tuple[int, int]:
    """(parameters of the folder's denoiser, its blocks: what ``model.swap_blocks`` counts), built on meta."""
    with torch.device("meta"):
        denoiser = detect(folder).denoiser_from_record({"config": denoiser_config(folder)})
    return sum(p.numel() for p in denoiser.parameters()), len(blocks(denoiser))


# ---------------------------------------------------------------------------------------------
# What each setting needs.

def swap_wired() -> str | None:
    """None when ``model.swap_blocks`` is an option and training reads it, else why not (one line). Training
    reads it when a module of difftrain's training package names it (the option's wiring, issue 41 item 3)."""
    if "swap_blocks" not in getattr(ModelConfig, "__dataclass_fields__", {}):
        return "model.swap_blocks is not an option of this difftrain"
    package = Path(difftrain.training.__file__).parent
    if not any("swap_blocks" in f.read_text() for f in package.glob("*.py")):
        return "model.swap_blocks is not wired into training yet (issue 41 item 3)"
    return None


def missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


def setting_refusal(name: str, device: torch.device) -> str | None:
    """Why setting ``name`` cannot run here (one line), or None."""
    if name in NEEDS and missing(NEEDS[name]):
        return f"{NEEDS[name]} is not installed (pip install 'difftrain[quant]')"
    if name == "block swap":
        return swap_wired()
    if name == "fp8 base" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return "fp8 needs a GPU of compute capability 8.9 or more"
    return None


# ---------------------------------------------------------------------------------------------
# One training run.

@dataclass
class Row:
    base: str
    setting: str
    steps: int | None = None
    peak_gib: float | None = None  # the run's peak device memory (metrics.jsonl's gpu_max_allocated_mib)
    estimate_gib: float | None = None  # difftrain estimate's figure for the setting
    step_s: float | None = None  # median step time, the first step left out
    wall_s: float | None = None  # the run's whole time, start-up included
    notes: list[str] = field(default_factory=list)

    def ratio(self) -> float | None:
        return self.peak_gib / self.estimate_gib if self.peak_gib and self.estimate_gib else None

    def verdict(self) -> list[str]:
        """["ok"] when the measured peak is within :data:`TOLERANCE` of the estimate, a note when it is not, []
        without both figures."""
        ratio = self.ratio()
        if ratio is None:
            return []
        return ["ok" if abs(ratio - 1) <= TOLERANCE else f"off by more than {TOLERANCE:.0%}"]


def overrides(family: str, folder: Path, data: Path, args, extra: list[str]) -> list[str]:
    """The --set lines of one run: the family preset's LoRA with the check's data, size, steps and device."""
    sets = [f"model.init_from={folder}", f"data.path={data}", f"data.resolution={args.resolution}",
            "data.buckets=off", "data.random_flip=false", "data.num_workers=0", f"lora.rank={args.rank}",
            f"lora.alpha={args.rank}", "optim.lr=1e-4", "optim.lr_schedule=constant", "optim.warmup_steps=0",
            "train.batch_size=1", "train.grad_accum_steps=1", f"train.total_steps={args.steps}",
            "train.log_every_steps=1", "train.precision=bf16", f"train.device={args.device}", "train.seed=0",
            "train.progress_bar=false", "train.compile=off", "validation.every_steps=0",
            f"checkpoint.every_steps={args.steps}", "checkpoint.keep_last=1"]
    if family == "flux":
        sets.append(f"model.max_sequence_length={T5_TOKENS}")
    return sets + extra


def train_argv(family: str, run_dir: Path, sets: list[str]) -> list[str]:
    """``difftrain train``'s arguments (after ``python -m difftrain``): the family's shipped preset, then ``sets``."""
    argv = ["train", "--config", str(ROOT / "configs" / f"{family}-lora.toml"), "--run-dir", str(run_dir)]
    for s in sets:
        argv += ["--set", s]
    return argv


def run_subprocess(argv: list[str], log: Path, timeout: float) -> str | None:
    """``python -m difftrain ARGV`` in a process of its own (its device memory its own), output to ``log``;
    None, or why it failed (one line)."""
    with open(log, "w") as out:
        try:
            proc = subprocess.run([sys.executable, "-m", "difftrain", *argv], stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout, env=dict(os.environ, HF_HUB_OFFLINE="1"), check=False)
        except subprocess.TimeoutExpired:
            return f"stopped after its {timeout:.0f} s budget"
    return None if proc.returncode == 0 else f"exit {proc.returncode}: {last_line(log)}"


def run_inprocess(argv: list[str], log: Path, device: torch.device) -> str | None:
    """The same arguments through ``difftrain.cli.main`` in this process, output to ``log`` (device memory
    freed and its peak reset first); None, or why it failed (one line)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = cli_main(argv)
        except SystemExit as e:  # argparse's refusal
            code = e.code
    gc.collect()
    return None if code == 0 else f"exit {code}: {last_line(log)}"


def last_line(log: Path) -> str:
    """The log's last line that says what went wrong (difftrain's one-line errors first), at most 160 characters."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    said = [ln for ln in lines if "error" in ln.lower()] or lines or ["no output"]
    return said[-1][:160]


def read_metrics(run_dir: Path) -> tuple[int, float | None, float | None]:
    """(steps logged, peak device memory GiB or None, median step time s or None) from ``metrics.jsonl``."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []
    rows = [r for r in rows if "step" in r and "time" in r]
    peaks = [r["gpu_max_allocated_mib"] for r in rows if "gpu_max_allocated_mib" in r]
    times = {r["step"]: r["time"] for r in rows}
    steps = sorted(times)
    gaps = [(times[b] - times[a]) / (b - a) for a, b in itertools.pairwise(steps[1:])]  # from the first step's end
    if not gaps and len(steps) == 2:
        gaps = [times[steps[1]] - times[steps[0]]]
    return (steps[-1] if steps else 0, max(peaks) / 1024 if peaks else None,
            statistics.median(gaps) if gaps else None)


def estimate_gib(family: str, folder: Path, sets: list[str]) -> float:
    """``difftrain estimate --base FOLDER --config PRESET --set ...``'s figure for the setting itself (its first
    row), one rank, in GiB."""
    cfg = load_config(str(ROOT / "configs" / f"{family}-lora.toml"), sets)
    return count_base(cfg, str(folder), ranks=1)["rows"][0]["total"] / GiB


class Estimates:
    """``difftrain estimate``'s figures of the settings, counted one after another on a daemon thread while the
    runs go (on the meta device: no device memory, one CPU core). On the real-size bases each takes seconds to
    most of a minute (the SDXL UNet's: 40 s on the loaded 2-core machine here), which counted between the runs
    would take a large share of the budget."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._results: dict[tuple[str, str], float | str] = {}
        self._done = threading.Condition()
        threading.Thread(target=self._work, daemon=True, name="gpu_check-estimates").start()

    def add(self, key: tuple[str, str], family: str, folder: Path, sets: list[str]) -> None:
        self._jobs.put((key, family, folder, sets))

    def _work(self) -> None:
        while True:
            key, family, folder, sets = self._jobs.get()
            try:
                value: float | str = estimate_gib(family, folder, sets)
            except Exception as e:  # noqa: BLE001 - the estimate's failure is the row's note; the check goes on
                value = f"estimate failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            with self._done:
                self._results[key] = value
                self._done.notify_all()

    def get(self, key: tuple[str, str], timeout: float) -> float | str:
        """The figure in GiB, or why there is none (one line), waiting at most ``timeout`` seconds for it."""
        with self._done:
            self._done.wait_for(lambda: key in self._results, timeout=max(timeout, 0))
            return self._results.get(key, "estimate not finished within the budget")


class Clock:
    """The check's deadline: ``budget`` seconds from its start."""

    def __init__(self, budget: float):
        self.start, self.budget = time.monotonic(), budget

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)


def run_setting(family: str, data: Path, name: str, sets: list[str], args, clock: Clock, reserve: float,
                needed: float) -> Row:
    """One setting on one base: its run, its figures, or the note why it did not run. It runs when ``needed``
    seconds (what the runs so far suggest) are left before the ``reserve`` kept for the later phases, and is
    stopped at ``--setting-budget`` seconds or at that reserve, whichever comes first."""
    row = Row(family, name)
    device = torch.device(args.device)
    why = setting_refusal(name, device)
    timeout = min(args.setting_budget, clock.left() - reserve)
    if why is None and timeout < needed:
        why = (f"skipped: {max(timeout, 0):.0f} s of the budget left for the settings, a run takes about "
               f"{needed:.0f} s")
    if why:
        row.notes.append(why)
        return row
    run_dir = Path(args.work) / "runs" / f"{family}-{name.replace(' ', '-')}"
    shutil.rmtree(run_dir, ignore_errors=True)
    log = Path(args.work) / "logs" / f"{family}-{name.replace(' ', '-')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    argv = train_argv(family, run_dir, sets)
    began = time.monotonic()
    failed = (run_subprocess(argv, log, timeout) if args.runner == "subprocess"
              else run_inprocess(argv, log, device))
    row.wall_s = time.monotonic() - began
    row.steps, row.peak_gib, row.step_s = read_metrics(run_dir)
    if failed:
        row.notes.append(failed)
    elif row.steps < args.steps:
        row.notes.append(f"trained {row.steps} of {args.steps} steps")
    row.notes += [s for s in sets if s.startswith("model.swap_blocks=")]
    print(f"gpu_check: {family} {name}: {row.steps} steps in {row.wall_s:.0f} s; {'; '.join(row.notes)}", flush=True)
    return row


# ---------------------------------------------------------------------------------------------
# diffusers' Flux script and the gpu-marked tests.

def peer_script(given: str | None) -> Path | None:
    """The Flux LoRA script: ``given``, else ../shared/peers beside the checkout (a worktree's two levels up)."""
    if given:
        return Path(given)
    for peers in (ROOT.parent / "shared" / "peers", ROOT.parents[1] / "shared" / "peers", ROOT / "shared" / "peers"):
        if (peers / PEER_NAME).is_file():
            return peers / PEER_NAME
    return None


def peer_rate(log: str) -> float | None:
    """Seconds per step from the last rate of the script's ``Steps`` progress bar (tqdm's smoothed rate)."""
    rates = re.findall(r"Steps:[^\r\n]*?\d+/\d+ \[[^\]]*?([\d.]+)(it/s|s/it)", log)
    if not rates:
        return None
    value, unit = float(rates[-1][0]), rates[-1][1]
    return 1 / value if unit == "it/s" else value


def run_peer(folder: Path, data: Path, args, clock: Clock, reserve: float) -> Row:
    """diffusers' Flux LoRA script on the Flux folder, matched to the bf16 setting; its step time."""
    row = Row("flux", f"diffusers {PEER_NAME}, bf16")
    script = peer_script(args.peer_script)
    python = args.peer_python or sys.executable
    if script is None or not script.is_file():
        row.notes.append(f"skipped: {PEER_NAME} not found (--peer-script; ../shared/peers)")
        return row
    code = f"import importlib.util as u; print(' '.join(m for m in {PEER_MODULES!r} if u.find_spec(m) is None))"
    probe = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    if probe.returncode or probe.stdout.strip():
        absent = probe.stdout.strip() or probe.stderr[-120:]
        row.notes.append(f"skipped: the script's packages do not import here ({absent})")
        return row
    budget = min(args.peer_budget, clock.left() - reserve)
    if budget < args.peer_budget:
        row.notes.append(f"skipped: {max(budget, 0):.0f} s of the budget left, the script is given "
                         f"{args.peer_budget:.0f} s")
        return row
    images = Path(args.work) / "peer-images"  # the same images without metadata.jsonl (the script opens every file)
    images.mkdir(parents=True, exist_ok=True)
    for f in data.glob("*.png"):
        shutil.copy(f, images / f.name)
    out = Path(args.work) / "peer-out"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [python, str(script), "--pretrained_model_name_or_path", str(folder), "--instance_data_dir", str(images),
           "--instance_prompt", "a shape", "--resolution", str(args.resolution), "--train_batch_size", "1",
           "--max_train_steps", str(args.steps), "--learning_rate", "1e-4", "--lr_scheduler", "constant",
           "--lr_warmup_steps", "0", "--rank", str(args.rank), "--output_dir", str(out), "--seed", "0",
           "--dataloader_num_workers", "0", "--checkpointing_steps", "100000", "--mixed_precision", "bf16",
           "--max_sequence_length", str(T5_TOKENS), "--cache_latents"]
    log = Path(args.work) / "logs" / "peer.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=budget, check=False,
                                  env=dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"))
            failed = f"exit {proc.returncode}: {last_line(log)}" if proc.returncode else None
        except subprocess.TimeoutExpired:
            failed = f"stopped after its {budget:.0f} s budget"
    row.wall_s = time.monotonic() - began
    row.step_s = peer_rate(log.read_text(errors="replace"))
    row.steps = args.steps if not failed else None
    row.notes.append(failed or "step time: tqdm's smoothed rate; prompt embeddings and latents computed once")
    print(f"gpu_check: peer: {'; '.join(row.notes)}", flush=True)
    return row


def gpu_test_files() -> list[str]:
    """The test files that mark a test ``gpu``."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text(errors="replace"))


def run_gpu_tests(args, clock: Clock) -> Row:
    """``pytest -m gpu`` on the files that mark some (verbose: a run stopped at its budget still counts the tests
    it finished); the counts of its closing line, or of its per-test lines."""
    row = Row("tests", "pytest -m gpu")
    budget = min(args.tests_budget, clock.left())
    if budget < 20:
        row.notes.append(f"skipped: {max(budget, 0):.0f} s of the budget left")
        return row
    files = gpu_test_files()
    log = Path(args.work) / "logs" / "gpu-tests.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        try:
            xdist = [] if missing("xdist") else ["-n", "0"]  # one process (scripts/test.sh runs two workers)
            subprocess.run([sys.executable, "-m", "pytest", "-v", "-m", "gpu", *xdist, "-p", "no:cacheprovider",
                            *files], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=budget, check=False)
        except subprocess.TimeoutExpired:
            row.notes.append(f"stopped after its {budget:.0f} s budget")
    counts = pytest_counts(log.read_text(errors="replace"))
    row.notes.insert(0, ", ".join(f"{n} {k}" for k, n in counts.items()) if counts else
                     f"no summary line: {last_line(log)}")
    print(f"gpu_check: gpu tests: {'; '.join(row.notes)}", flush=True)
    return row


def pytest_counts(text: str) -> dict[str, int]:
    """{"passed": n, "failed": n, ...} from pytest's closing line (the last that counts anything), or, without
    one (a run stopped), from its verbose per-test lines (``path::test PASSED``)."""
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|deselected|error)", ln)]
    if not lines:
        outcomes = re.findall(r"::\S+ (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", text)
        return {k.lower(): outcomes.count(k) for k in dict.fromkeys(outcomes)}
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)",
                                             lines[-1])}


# ---------------------------------------------------------------------------------------------
# The table.

def _f(x: float | None, fmt: str) -> str:
    """``x`` in ``fmt``; a GiB figure below 0.1 (a tiny base's) with four decimals; "-" for None."""
    if x is None:
        return "-"
    return format(x, ".4f" if fmt == ".2f" and abs(x) < 0.1 else fmt)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def table(rows: list[Row], head: list[str]) -> str:
    """The markdown: the facts of the run, then one row per setting, the peer and the tests."""
    header = ("| base | setting | steps | peak device GiB | estimate GiB | measured / estimate | step s (median) "
              "| run s | note |")
    lines = [*head, "", header, "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ratio = r.ratio()
        lines.append(f"| {r.base} | {r.setting} | {_f(r.steps, 'd')} | {_f(r.peak_gib, '.2f')} "
                     f"| {_f(r.estimate_gib, '.2f')} | {_f(ratio, '.2f')} | {_f(r.step_s, '.3f')} "
                     f"| {_f(r.wall_s, '.0f')} | {'; '.join(r.notes + r.verdict()).replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=False)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=False).stdout.strip()
        return (out.stdout.strip() or "unknown") + (" (with uncommitted changes)" if dirty else "")
    except OSError:
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name}, {p.total_memory / GiB:.0f} GiB"
    return f"cpu ({os.cpu_count()} cores)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (with --tiny)")
    p.add_argument("--tiny", action="store_true", help="the tests' tiny bases at 32 px, 2 steps: the code path only")
    p.add_argument("--out", help="also write the table here as markdown")
    p.add_argument("--work", default=None, help="bases, images, runs and logs (default /tmp/gpu-check[-tiny])")
    p.add_argument("--steps", type=int, default=None, help="training steps per setting (default 6; tiny 2)")
    p.add_argument("--resolution", type=int, default=None, help="image side in pixels (default 512; tiny 32)")
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--rank", type=int, default=None, help=f"LoRA rank (default {RANK}; tiny 4)")
    p.add_argument("--runner", choices=("subprocess", "inprocess"), default=None,
                   help="each setting in a process of its own (default on CUDA) or in this one (default on the CPU)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, of: " + ", ".join(SETTINGS))
    p.add_argument("--bases", default="flux,sdxl", help="comma-separated, of: flux, sdxl")
    p.add_argument("--budget", type=float, default=450, help="seconds for the whole check (default 450)")
    p.add_argument("--setting-budget", type=float, default=75,
                   help="seconds one setting's run may take (a run is skipped when less than 1.25 x the longest "
                        "so far is left)")
    p.add_argument("--peer-budget", type=float, default=90)
    p.add_argument("--tests-budget", type=float, default=75)
    p.add_argument("--peer-script", help=f"diffusers' {PEER_NAME} (default: ../shared/peers)")
    p.add_argument("--peer-python", help="the Python to run it with (default this one)")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--no-tests", action="store_true")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; --tiny --device cpu runs the code path on the CPU", file=sys.stderr)
        return 2
    args.steps = args.steps or (2 if args.tiny else 6)
    args.resolution = args.resolution or (32 if args.tiny else 512)
    args.rank = args.rank or (4 if args.tiny else RANK)
    args.runner = args.runner or ("subprocess" if device.type == "cuda" else "inprocess")
    args.work = args.work or ("/tmp/gpu-check-tiny" if args.tiny else "/tmp/gpu-check")
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        p.error(f"--settings: unknown {', '.join(unknown)} (known: {', '.join(SETTINGS)})")
    if any(b.strip() not in ("flux", "sdxl") for b in args.bases.split(",") if b.strip()):
        p.error(f"--bases: {args.bases!r} names a base other than flux and sdxl")
    clock = Clock(args.budget)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DIFFTRAIN_CACHE", str(work / "cache"))  # the text and latent caches of this check
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    began = time.monotonic()
    bases = [b.strip() for b in args.bases.split(",") if b.strip()]
    folders = write_bases(work, args.tiny, device, bases)
    data = write_data(work / f"data-{args.resolution}", args.images, args.resolution)
    written_s = time.monotonic() - began
    facts = {b: denoiser_facts(folders[b]) for b in bases}
    cuda = f" CUDA {torch.version.cuda}" if torch.version.cuda else ""
    when = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    counted = "; ".join(f"{b} {_count(n)} denoiser parameters, {k} blocks" for b, (n, k) in facts.items())
    machine = f"GPU check: {device_name(device)}; torch {torch.version.__version__}{cuda}; difftrain at {commit()}"
    how = (f"Bases (random weights, written in {written_s:.0f} s): {counted}. Each setting: LoRA rank {args.rank} "
           f"over the family's preset, bf16, {args.resolution} px, batch 1, {args.steps} steps, train.compile off, "
           f"{args.runner}. Peak: metrics.jsonl's gpu_max_allocated_mib; estimate: `difftrain estimate --base "
           f"FOLDER --config configs/FAMILY-lora.toml --set ...` (within {TOLERANCE:.0%} = ok).")
    head = [f"{machine}; {when}", "", how]
    if device.type != "cuda":
        head.append("On the CPU: no device peak, so no memory comparison; this checks that each setting trains.")
    reserve = (0 if args.no_peer else args.peer_budget) + (0 if args.no_tests else args.tests_budget)
    plan = {(family, name): overrides(family, folders[family], data, args,
                                      [s.format(swap=max(1, facts[family][1] // 2)) for s in SETTINGS[name]])
            for family in bases for name in names}
    estimates = Estimates()
    for (family, name), sets in plan.items():
        if setting_refusal(name, device) is None:
            estimates.add((family, name), family, folders[family], sets)
    rows, longest = [], 0.0
    for (family, name), sets in plan.items():
        needed = min(args.setting_budget, max(30.0, 1.25 * longest))  # a first run is given the whole budget
        rows.append(run_setting(family, data, name, sets, args, clock, reserve,
                                args.setting_budget if not longest else needed))
        longest = max(longest, rows[-1].wall_s or 0.0)
    if "flux" in bases and not args.no_peer:
        rows.append(run_peer(folders["flux"], data, args, clock, 0 if args.no_tests else args.tests_budget))
        ours = next((r for r in rows if r.base == "flux" and r.setting == "bf16 base"), None)
        if ours and ours.step_s and rows[-1].step_s:
            rows[-1].notes.append(f"difftrain's bf16 step / the script's: {ours.step_s / rows[-1].step_s:.2f}")
    if not args.no_tests:
        rows.append(run_gpu_tests(args, clock))
    for row in rows:  # the estimates, counted meanwhile (a skipped setting keeps its figure)
        if (row.base, row.setting) in plan and setting_refusal(row.setting, device) is None:
            value = estimates.get((row.base, row.setting), max(clock.left(), 10.0))
            if isinstance(value, str):
                row.notes.append(value)
            else:
                row.estimate_gib = value
    whole = f"Whole check: {time.monotonic() - clock.start:.0f} s of a {args.budget:.0f} s budget."
    text = table(rows, [*head, "", whole])
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
