"""Step time and peak memory of LoRA fine-tuning with and without the text-embedding cache
(``text.cache``), on the tiny SD, SDXL, SD3 and Flux bases the tests build (offline, random weights).

    PYTHONPATH=src:. python bench/text_cache.py [--steps 40] [--repeats 2] [--families sd sdxl sd3 flux]

Each measurement is its own process (so its peak RSS is its own) running difftrain's training loop
(``training.loop.train``) on a generated folder of captioned 32 px images, batch 4, LoRA rank 4.
"off": the encoders run on every batch's captions. "on, built": the first run with the cache (it
loads the encoders, encodes every caption once, releases them). "on, complete": a later run, which
never loads them. Step time: the median over the log windows after the first (10 steps each) of
batch / images_per_s; peak memory: the process's max RSS as the loop logs it (the CPU has no
allocator statistics). A second table times the text condition of one batch alone (the family's
encoders against the cache, in this process), which the busy machine's noise hides less. Prints
Markdown tables.

    PYTHONPATH=src:. python bench/text_cache.py --scale [--entries 400] [--families sd3 flux] [--steps 40]

``--scale`` (issue 41 item 4): a store of ``--entries`` synthetic entries of a real base's size (Flux:
T5 512 x 4096 + pooled 768; SD3: 333 x 4096 + 2048), written once, then, in this process, with whichever
difftrain is on ``PYTHONPATH`` (run it with START's sources to compare): the start-up check of the complete
store (``CachedPromptEncoder.ensure``, nothing in memory, warm page cache: median of 3) and the training
thread's time per step to get one batch's text condition (batch 4, captions drawn at random, a loader with
2 workers; each step's compute stood in for by a 100 ms sleep that frees the CPU, not counted): with
START it reads the entries past the 256 MiB memory budget itself, after item 4 the workers bring them.
Entries are float32 (``--dtype fp32``, START's only kind) or bf16 (``--dtype bf16``, a bf16 run's).

    PYTHONPATH=src:. python bench/text_cache.py --fill-peak [--families sd3 flux] [--captions 64] [--t5-width 1024]
                                                [--root DIR]

``--fill-peak`` (issue 41 item 4): the host memory of the text cache's first fill in a bf16 run, on the
proportioned SD3 / Flux bases of ``bench/family_bases_sized.py`` (written once into ``--root``), each fill in
its own process with whichever difftrain is on ``PYTHONPATH`` (START's sources to compare): the text encoders
behind the cache as training makes them (``Family.run_prompt_encoder`` with ``cached_prompt_encoder``), then
``ensure`` of ``--captions`` captions. Columns: the encoder models' weights held on the host at once at the
worst moment (every ``load_part`` spied: the bytes of the models alive when one is loaded; START loads them
all in float32, then casts each part in turn), and the process's max RSS growth over the fill (ru_maxrss
after minus before, MiB: weights, activations and the allocator's slack). The proportioned bases' encoders are
a few MB, under the process's own noise: ``--t5-width W`` writes a copy whose T5 is W wide and 8 layers deep
(1024: about 150M parameters, 0.6 GB in float32), the share of the encoders that T5-XXL is in the real bases
(only the fill reads it: the copy is for this measurement).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BATCH = 4


def one(family: str, mode: str, root: Path, steps: int, run: str) -> dict:
    """One training run in this process; returns its step time and peak RSS."""
    from difftrain.config import load_config
    from difftrain.training.loop import train

    overrides = [f"model.init_from={root / family}", "lora.rank=4", f"data.path={root / 'data'}", "data.resolution=32",
                 "data.num_workers=0", f"train.batch_size={BATCH}", f"train.total_steps={steps}",
                 "train.log_every_steps=10", "train.progress_bar=false", "validation.every_steps=0",
                 f"data.cache_dir={root / 'cache'}", f"text.cache={mode}",
                 "tracking.tensorboard=false"]
    train(load_config(None, overrides), root / run)
    rows = [json.loads(line) for line in (root / run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "images_per_s" in r]
    step_s = statistics.median(BATCH / r["images_per_s"] for r in rows[1:])
    return {"step_ms": 1000 * step_s, "rss_mib": max(r.get("cpu_max_rss_mib", 0) for r in rows)}


def setup(root: Path) -> None:
    from tests.family_bases import write_tiny_flux_folder, write_tiny_sd3_folder, write_tiny_sdxl_folder
    from tests.integration.test_text_train import _captioned_folder
    from tests.text_components import write_tiny_sd_folder

    for family, write in (("sd", write_tiny_sd_folder), ("sdxl", write_tiny_sdxl_folder),
                          ("sd3", write_tiny_sd3_folder), ("flux", write_tiny_flux_folder)):
        write(root / family)
    _captioned_folder(root / "data", n=32, size=32)


def condition_ms(family: str, root: Path, repeats: int = 200) -> tuple[float, float]:
    """Milliseconds to make one batch's text condition (BATCH distinct captions): the family's
    encoders against the cache (median of 5 blocks of ``repeats // 5`` calls each)."""
    import time

    from difftrain.data.text_cache import CachedPromptEncoder, TextCache
    from difftrain.families import detect

    folder, captions = root / family, [f"a red square on a dark background {i}" for i in range(BATCH)]
    encoder = detect(folder).load_prompt_encoder(folder)
    cached = CachedPromptEncoder(TextCache.for_encoder(folder, family, {}, root / "micro"), lambda: encoder)
    cached.ensure(captions)
    out = []
    for source in (encoder, cached):
        blocks = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(repeats // 5):
                source.encode(captions, "cpu")
            blocks.append((time.perf_counter() - t) / (repeats // 5) * 1000)
        out.append(statistics.median(blocks))
    return out[0], out[1]


def interleaved_ms(family: str, root: Path, steps: int) -> dict[str, float]:
    """The training step (``training.step.train_step``, LoRA rank 4, batch 4, fixed batches of the folder's
    cached latents and captions) with the family's encoders and with the cache, alternated step by step
    on one run state, so that a busy machine's slow spells hit both alike: median and min step times (ms)
    of each, and the median of the paired differences."""
    import itertools
    import time

    import torch

    from difftrain.networks.conditioning import Conditioning
    from difftrain.config import load_config
    from difftrain.data import build_loader
    from difftrain.data.prepare import prepare_training_data
    from difftrain.data.text_cache import CachedPromptEncoder, TextCache, run_captions
    from difftrain.diffusion.objective import build_objective
    from difftrain.families import detect
    from difftrain.runtime.distributed import DistContext
    from difftrain.data.latents import with_latents
    from difftrain.training.state import RunState
    from difftrain.training.step import StepMetrics, train_step

    device = torch.device("cpu")
    cfg = load_config(None, [f"model.init_from={root / family}", "lora.rank=4", f"data.path={root / 'data'}",
                             "data.resolution=32", "data.num_workers=0", f"train.batch_size={BATCH}",
                             f"data.cache_dir={root / 'cache'}", "text.cache=off"])
    dctx = DistContext(device=device)
    data = prepare_training_data(cfg, root / f"{family}-steps")
    conditioning = Conditioning.from_config(cfg, 0, device)
    data = with_latents(data, conditioning.codec, cfg.data, cfg.validation.heldout_batch_size, dctx)
    encoders = conditioning.text
    folder = root / family
    cached = CachedPromptEncoder(TextCache.for_encoder(folder, detect(folder).name, {}, root / "micro"), lambda: encoders)
    cached.ensure(run_captions(data, cfg.validation))
    state = RunState.build(cfg, 0, device, conditioning=conditioning)
    objective = build_objective(cfg.diffusion).to(device)
    loader = iter(build_loader(data.train, batch_size=BATCH, seed=0, start=0, num_workers=0, device=device))
    batches = [next(loader) for _ in range(8)]
    metrics, times = StepMetrics(device), {"encoders": [], "cache": []}
    for k, batch in zip(range(2 * steps + 4), itertools.cycle(batches)):
        mode = ("encoders", "cache")[(k + k // 2) % 2]  # the order alternates too: E C C E E C ...
        conditioning.text = encoders if mode == "encoders" else cached
        start = time.perf_counter()
        train_step(state, objective, iter([batch]), cfg.optim.lr, metrics, dctx)
        if k >= 4:  # warm-up steps left out
            times[mode].append(1000 * (time.perf_counter() - start))
    paired = [e - c for e, c in zip(times["encoders"], times["cache"])]
    return {**{f"{m}_median": statistics.median(t) for m, t in times.items()},
            **{f"{m}_min": min(t) for m, t in times.items()}, "saved_median": statistics.median(paired)}


# --scale: entries of real bases' sizes (T5 tokens x width, pooled width).
SCALE_SHAPES = {"flux": {"prompt_embeds": (512, 4096), "pooled": (768,)},
                "sd3": {"prompt_embeds": (333, 4096), "pooled": (2048,)}}


class _Captions:
    """A captioned dataset of ``captions``: items (x (1,), caption), as the loader reads them."""

    def __init__(self, captions: list[str]):
        self.captions = captions

    def __len__(self) -> int:
        return len(self.captions)

    def __getitem__(self, index):
        import torch

        index = index[0] if isinstance(index, tuple) else index
        return torch.zeros(1), self.captions[index]


def _scale_store(family: str, root: Path, dtype: str):
    """The store of a stand-in base folder (its text encoders' files: one config) in ``dtype``, as this
    difftrain keys it (START: float32 only)."""
    import inspect

    import torch

    from difftrain.data.text_cache import TextCache

    folder = root / f"{family}-base"
    if not (folder / "text_encoder" / "config.json").is_file():  # once: the key follows the files' times
        (folder / "text_encoder").mkdir(parents=True, exist_ok=True)
        (folder / "model_index.json").write_text('{"_class_name": "bench"}')
        (folder / "text_encoder" / "config.json").write_text('{"bench": 1}')
    options = {"max_sequence_length": SCALE_SHAPES[family]["prompt_embeds"][0]}
    if "dtype" in inspect.signature(TextCache.for_encoder).parameters:
        return TextCache.for_encoder(folder, family, options, root / "cache", dtype=getattr(torch, dtype))
    if dtype != "float32":
        sys.exit("bench/text_cache.py: this difftrain stores float32 entries only: --dtype fp32")
    return TextCache.for_encoder(folder, family, options, root / "cache")


def scale_write(family: str, root: Path, entries: int, dtype: str) -> list[str]:
    """Write ``entries`` random entries (and the null, the manifest) of ``family``'s size; their captions."""
    import torch

    from difftrain.data.text_cache import MANIFEST, NULL_ENTRY, entry_name

    store = _scale_store(family, root, dtype)
    captions = [f"a photo of thing {i}, in a bench of text-cache entries" for i in range(entries)]
    if (store.folder / MANIFEST).is_file() and len(list(store.folder.glob("*.safetensors"))) == entries + 1:
        return captions  # written by an earlier run on this --root (START's and this difftrain's float32 keys agree)
    store.folder.mkdir(parents=True, exist_ok=True)
    shapes = SCALE_SHAPES[family]
    manifest = {"key": store.key, "version": 2, "family": family, "source": store.source, "options": store.options,
                "digest": "bench", "dim": 4096, "shapes": {k: list(v) for k, v in shapes.items()}}
    if dtype != "float32":
        manifest["dtype"] = dtype
    (store.folder / MANIFEST).write_text(json.dumps(manifest))
    store.manifest = store.read_manifest()
    gen = torch.Generator().manual_seed(0)
    for name, caption in [(NULL_ENTRY, "")] + [(entry_name(c), c) for c in captions]:
        store.write(name, caption, {k: torch.randn(1, *s, generator=gen) for k, s in shapes.items()})
    return captions


def scale_measure(family: str, root: Path, captions: list[str], dtype: str, steps: int) -> dict:
    """Start-up check (s) of the complete store and the training thread's text condition per step (ms)."""
    import random
    import time

    import torch

    from difftrain.data import build_loader, text_cache

    def fresh():
        def load():
            raise RuntimeError("bench: the text encoders were loaded: the store is incomplete")
        return text_cache.CachedPromptEncoder(_scale_store(family, root, dtype), load)

    starts = []
    for _ in range(3):
        text = fresh()
        t = time.perf_counter()
        assert text.ensure(captions) == 0
        starts.append(time.perf_counter() - t)
    text = fresh()
    dataset = _Captions(captions)
    try:  # item 4 moved it to its own module; START kept it in text_cache (and before that had none)
        from difftrain.data.cached_conditions import CachedConditions as wrap
    except ImportError:
        wrap = getattr(text_cache, "CachedConditions", None)
    dataset = wrap(dataset, text.store) if wrap is not None else dataset
    loader = iter(build_loader(dataset, batch_size=BATCH, seed=random.randrange(1 << 30), start=0, num_workers=2,
                               device=torch.device("cpu")))
    times = []
    for k in range(steps + 5):
        t = time.perf_counter()
        _, batch = next(loader)
        cond = text.encode(batch, "cpu")
        assert cond["prompt_embeds"].shape == (BATCH, *SCALE_SHAPES[family]["prompt_embeds"])
        if k >= 5:  # the workers' start left out
            times.append(1000 * (time.perf_counter() - t))
        time.sleep(0.1)  # the step's compute (frees the CPU for the workers, as a device step does)
    del loader
    return {"start_s": statistics.median(starts), "step_ms": statistics.median(times),
            "entry_mb": sum(torch.Size(s).numel() for s in SCALE_SHAPES[family].values())
            * (4 if dtype == "float32" else 2) / 1e6}


def scale(args) -> None:
    """``--scale``: the table of start-up and per-step times at ``--entries`` entries per family."""
    import subprocess as sp

    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="difftrain-text-scale-"))
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[args.dtype]
    print(f"| base | entries ({args.dtype}) | entry (MB) | start-up check (s) | per 10,000 (s, scaled) "
          "| text condition on the training thread per step (ms, median) |")
    print("|---|---|---|---|---|---|")
    for family in args.families:
        captions = scale_write(family, root, args.entries, dtype)
        r = scale_measure(family, root, captions, dtype, args.steps)
        print(f"| {family} | {args.entries} | {r['entry_mb']:.1f} | {r['start_s']:.2f} | "
              f"{r['start_s'] * 10_000 / args.entries:.0f} | {r['step_ms']:.2f} |", flush=True)
        if not args.root:
            sp.run(["rm", "-rf", str(root / "cache")], check=True)
    if not args.root:
        sp.run(["rm", "-rf", str(root)], check=True)


def fill_peak_one(family: str, root: Path, captions: int) -> dict:
    """One fill of ``family``'s proportioned base's text cache in this process (see ``--fill-peak``)."""
    import gc
    import resource
    import weakref
    from types import SimpleNamespace

    import torch

    from difftrain.data.text_cache import CachedPromptEncoder, cached_prompt_encoder
    from difftrain.families import base as family_base
    from difftrain.families import detect

    live: list = []
    held = {"peak": 0, "loads": []}
    real = family_base.load_part

    def nbytes(module) -> int:
        return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))

    def spy(folder, sub, cls, what, dtype=torch.float32, **kwargs):
        part = real(folder, sub, cls, what, dtype=dtype, **kwargs)
        if isinstance(part, torch.nn.Module):
            gc.collect()
            live.append(weakref.ref(part))
            now = sum(nbytes(m) for m in (r() for r in live) if m is not None)
            held["peak"] = max(held["peak"], now)
            held["loads"].append(f"{sub}:{str(dtype).removeprefix('torch.')}")
        return part

    family_base.load_part = spy
    folder = root / family
    cfg = SimpleNamespace(model=SimpleNamespace(text_encoder=str(folder), max_sequence_length=0),
                          text=SimpleNamespace(cache="on", shuffle_tags=False, tag_dropout=0.0),
                          data=SimpleNamespace(cache_dir=str(root / "cache")), train=SimpleNamespace(precision="bf16"))
    text = detect(folder).run_prompt_encoder(cfg, "cpu", cached_prompt_encoder)
    assert isinstance(text, CachedPromptEncoder)
    lines = [f"a photo of a red square number {i} on a dark background" for i in range(captions)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    text.ensure(lines, batch_size=32)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"held_mib": held["peak"] / 2**20, "rss_mib": (after - before) / 1024, "loads": held["loads"]}


def fill_peak(args) -> None:
    """``--fill-peak``: the table (one row per family, each fill in a fresh process and a fresh store)."""
    from bench.family_bases_sized import parameter_counts, write_base

    import shutil

    from bench.family_bases_sized import _t5

    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="difftrain-fill-peak-"))
    print("| base (proportioned) | text encoders (M parameters, float32 MiB) | encoder weights held at once (MiB) "
          "| max RSS growth over the fill (MiB) | loads (part:dtype) |")
    print("|---|---|---|---|---|")
    for family in args.families:
        folder = write_base(family, "proportioned", root / family)
        if args.t5_width:  # the T5 made wider and deeper, so that the weights stand out of the process's own memory
            wide = root / f"{family}-t5-{args.t5_width}"
            if not wide.is_dir():
                shutil.copytree(folder, wide)
                sub = "text_encoder_3" if family == "sd3" else "text_encoder_2"
                vocab = json.loads((wide / sub / "config.json").read_text())["vocab_size"]
                shutil.rmtree(wide / sub)
                _t5(vocab, args.t5_width, 8, 3).save_pretrained(str(wide / sub))
            folder = wide
        n = parameter_counts(folder)["text encoders"]
        subprocess.run(["rm", "-rf", str(root / "cache")], check=True)
        out = subprocess.run([sys.executable, __file__, "--fill-peak-one", folder.name, str(root), str(args.captions)],
                             capture_output=True, text=True, check=False)
        if out.returncode:
            sys.exit(f"bench/text_cache.py: the {family} fill failed:\n{out.stderr[-3000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {folder.name} | {n / 1e6:.1f} ({n * 4 / 2**20:.0f}) | {r['held_mib']:.1f} | {r['rss_mib']:.0f} | "
              f"{', '.join(r['loads'])} |", flush=True)
    if not args.root:
        subprocess.run(["rm", "-rf", str(root)], check=True)


def measure(family: str, mode: str, root: Path, steps: int, run: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", family, mode, str(root), str(steps), run],
                         capture_output=True, text=True, check=False)
    if out.returncode:
        sys.exit(f"bench/text_cache.py: the {family} run with text.cache={mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--families", nargs="+", default=["sd", "sdxl", "sd3", "flux"])
    parser.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--scale", action="store_true", help="start-up and per-step times at real entry sizes")
    parser.add_argument("--entries", type=int, default=400, help="--scale: entries per family")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="--scale: the entries' dtype")
    parser.add_argument("--root", default="", help="--scale: keep the stores in this folder (default: removed)")
    parser.add_argument("--fill-peak", action="store_true", help="host memory of the text cache's first fill")
    parser.add_argument("--captions", type=int, default=64, help="--fill-peak: captions filled")
    parser.add_argument("--t5-width", type=int, default=0,
                        help="--fill-peak: the base's T5 replaced by one this wide, 8 layers (0: the proportioned one)")
    parser.add_argument("--fill-peak-one", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fill_peak_one:
        family, root, captions = args.fill_peak_one
        print(json.dumps(fill_peak_one(family, Path(root), int(captions))))
        return
    if args.fill_peak:
        fill_peak(args)
        return
    if args.scale:
        scale(args)
        return
    if args.one:
        family, mode, root, steps, run = args.one
        print(json.dumps(one(family, mode, Path(root), int(steps), run)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        setup(root)
        print("| base | text encoders | step (ms, median) | peak RSS (MiB) |")
        print("|---|---|---|---|")
        for family in args.families:
            results: dict[str, list[dict]] = {"off": [], "on, built": [], "on, complete": []}
            for k in range(args.repeats):  # alternated, so a busy machine's slow spell hits both
                results["off"].append(measure(family, "off", root, args.steps, f"{family}-off-{k}"))
                for cache in root.glob("cache/text-*"):
                    subprocess.run(["rm", "-rf", str(cache)], check=True)
                results["on, built"].append(measure(family, "on", root, args.steps, f"{family}-built-{k}"))
                results["on, complete"].append(measure(family, "on", root, args.steps, f"{family}-on-{k}"))
            for label, runs in results.items():
                step = statistics.median(r["step_ms"] for r in runs)
                rss = statistics.median(r["rss_mib"] for r in runs)
                text = {"off": "run per step", "on, built": "cache built in this run",
                        "on, complete": "cache complete: never loaded"}[label]
                print(f"| {family} | {text} | {step:.1f} | {rss:.0f} |")
        print()
        print("| base | step with the encoders (ms, median / min) | step with the cache (ms, median / min) "
              "| saved per step (ms, median of pairs) |")
        print("|---|---|---|---|")
        for family in args.families:
            r = interleaved_ms(family, root, args.steps)
            print(f"| {family} | {r['encoders_median']:.1f} / {r['encoders_min']:.1f} | {r['cache_median']:.1f} / "
                  f"{r['cache_min']:.1f} | {r['saved_median']:.1f} |")
        print()
        print(f"| base | one batch's text condition ({BATCH} captions): encoders (ms) | from the cache (ms) |")
        print("|---|---|---|")
        for family in args.families:
            encoders, cache = condition_ms(family, root)
            print(f"| {family} | {encoders:.2f} | {cache:.3f} |")


if __name__ == "__main__":
    main()
