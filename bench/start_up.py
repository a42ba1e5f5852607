"""Start-up of a LoRA run on the proportioned bases (issue 41 item 5): time to the first step and the peak host
memory until then, difftrain before and after the base's digest was taken from its files as stored (and
cached), beside diffusers' own scripts.

    PYTHONPATH=src python bench/start_up.py --old-src /tmp/old/src --peer-python /tmp/peer-venv/bin/python

For each base of ``bench/family_bases_sized.py`` (SDXL, SD3 and Flux proportioned, and the large Flux: its
transformer about 130M parameters), a LoRA run of the family's preset (``family_peer_speed.our_command``: bf16,
batch ``--batch``, workers 0), started as a new process, its resident memory read from /proc every 0.05 s: the
time from the process's start until its first step is logged (metrics.jsonl, every step) and its peak RSS
(``VmHWM``) then; the process is then stopped. One untimed run first fills difftrain's latent and text caches
(in ``--work``/cache: ``DIFFTRAIN_CACHE``), so that every timed run starts from them and the figures differ by
the base's digest alone:

- "before": ``--old-src`` (the code at START, ``git archive START src | tar -x -C /tmp/old``): the whole base
  hashed upcast to float32 at every start;
- "after, first start": the digest of the files as stored, its cache emptied first;
- "after, next starts": read from the cache (the files unchanged).

Beside them diffusers' script (``family_peer_speed.SCRIPTS``, unchanged, from ../shared/peers) to its first
step (its progress bar), ``--mixed_precision bf16``: it takes no digest and no caches.

``--digest-only``: the base's digest alone, in this process on one thread, for the large Flux base's transformer
as written (float32 files) and a copy of it stored in bf16 (as real Flux ships): CPU seconds of the digest
taken before (``models.text.tensors_digest`` of each tensor read and upcast to float32, as START took it of the
loaded base), of the stored digest's first take, and of its cached read; and the bytes each hashes.

    PYTHONPATH=src python bench/start_up.py --digest-only --work /tmp/start-up-digest
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from family_bases_sized import parameter_counts, write_base  # noqa: E402
from family_peer_speed import PEERS, SCRIPTS, our_command, our_step, peer_command, peer_step, write_data  # noqa: E402


def to_first_step(cmd: list[str], env: dict, log: Path, step) -> dict:
    """Run ``cmd`` until ``step()`` says its first step is done: {"seconds": from its start, "peak": its
    peak RSS then (MiB)}; then stop it."""
    print("$ " + " ".join(cmd), flush=True)
    peak = 0
    with open(log, "w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            while True:
                if proc.poll() is not None and step() < 1:
                    raise SystemExit(f"{cmd[1]} exited {proc.returncode} before its first step: see {log}")
                try:
                    kib = re.search(r"VmHWM:\s+(\d+)", Path(f"/proc/{proc.pid}/status").read_text())
                    peak = max(peak, int(kib.group(1))) if kib else peak
                except OSError:
                    pass
                if step() >= 1:
                    return {"seconds": time.perf_counter() - start, "peak": peak / 1024}
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def digest_only(work: Path) -> int:
    """``--digest-only`` (module docstring)."""
    import torch
    from safetensors.torch import load_file, save_file

    from difftrain.models.text import tensors_digest
    from difftrain.runtime import stored_digest
    from difftrain.runtime.tensor_source import TensorSource

    torch.set_num_threads(1)
    os.environ["DIFFTRAIN_CACHE"] = str(work / "digest-cache")
    shutil.rmtree(work / "digest-cache", ignore_errors=True)
    base = write_base("flux", "large", work / "flux-large" / "base")
    f32 = base / "transformer" / "diffusion_pytorch_model.safetensors"
    bf16 = work / "flux-large-bf16" / "diffusion_pytorch_model.safetensors"
    if not bf16.is_file():
        bf16.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(f32).items()}, bf16)
    print("| transformer file | before: float32 upcast, CPU s (bytes hashed) | stored, first start | stored, cached |")
    print("|---|---:|---:|---:|")
    for label, file in (("float32", f32), ("bf16", bf16)):
        source = TensorSource.of_files([file])
        names = sorted(source.names())
        t = time.process_time()
        tensors_digest((n, source.read(n)) for n in names)
        before = time.process_time() - t
        upcast = 4 * sum(source.read_stored(n).numel() for n in names)
        hashed = []
        t = time.process_time()
        value = stored_digest.compute(source, on_read=hashed.append)
        first = time.process_time() - t
        stored_digest.stored_digest(source)  # the cache written
        t = time.process_time()
        assert stored_digest.stored_digest(source) == value
        cached = time.process_time() - t
        print(f"| {label}, {len(names)} tensors | {before:.2f} ({upcast / 2**20:.0f} MiB) | {first:.2f} "
              f"({sum(hashed) / 2**20:.0f} MiB) | {cached:.4f} (0) |", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old-src", default="", help="difftrain's src/ at START (before), to compare (required but "
                   "with --digest-only)")
    p.add_argument("--peer-python", default="", help="a Python with diffusers, accelerate, peft, datasets ('' : no peer)")
    p.add_argument("--work", default="/tmp/start-up-bench")
    p.add_argument("--bases", default="sdxl,sd3,flux,flux-large")
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--digest-only", action="store_true", help="the base's digest alone (module docstring)")
    args = p.parse_args()
    if args.digest_only:
        return digest_only(Path(args.work))
    if not args.old_src:
        p.error("--old-src is required (the code at START: git archive START src | tar -x -C /tmp/old)")
    args.memory, args.steps, args.rank, args.lr, args.precision = True, 20, 4, 1e-4, "bf16"
    work = Path(args.work)
    cache = work / "cache"
    rows = []
    for name in args.bases.split(","):
        family, size = ("flux", "large") if name == "flux-large" else (name, "proportioned")
        base = write_base(family, size, work / name / "base")
        data = write_data(work / name / "data", args.images, args.resolution)
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   DIFFTRAIN_CACHE=str(cache))
        new_env = dict(env, PYTHONPATH=f"{ROOT / 'src'}:{ROOT}")
        old_env = dict(env, PYTHONPATH=f"{Path(args.old_src).resolve()}:{ROOT}")

        def ours(label: str, run_env: dict, name=name, family=family, base=base, data=data) -> dict:
            run_dir = work / name / f"run-{label}"
            shutil.rmtree(run_dir, ignore_errors=True)
            return to_first_step(our_command(family, base, data, run_dir, args), run_env,
                                 work / name / f"{label}.log", lambda: our_step(run_dir))

        ours("warm-up", new_env)  # the latent and text caches filled, untimed
        row = {"base": name, "params": parameter_counts(base)["denoiser"], "before": ours("before", old_env)}
        shutil.rmtree(cache / "digests", ignore_errors=True)
        row["first"] = ours("first", new_env)
        row["next"] = ours("next", new_env)
        if args.peer_python:
            out = work / name / "peer-out"
            shutil.rmtree(out, ignore_errors=True)
            log = work / name / "peer.log"
            cmd = [args.peer_python, str(PEERS / SCRIPTS[family])] + peer_command(family, base, data, out, args) + [
                "--mixed_precision", "bf16"]
            row["peer"] = to_first_step(cmd, env, log, lambda log=log: peer_step(log))
        rows.append(row)
        print(row, flush=True)
    print(f"\nLoRA (rank {args.rank}, bf16, batch {args.batch}, {args.resolution} px), one process each, "
          "one thread; seconds to the first step / peak RSS until then (MiB)\n")
    print("| base (denoiser parameters) | difftrain before | after, first start | after, next starts | diffusers' script |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        cells = [f"{r[k]['seconds']:.1f} s / {r[k]['peak']:.0f}" if k in r else "-" for k in ("before", "first", "next", "peer")]
        print(f"| {r['base']} ({r['params'] / 1e6:.1f}M) | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
