"""Host memory of a LoRA run's base quantized as it loads (``model.quantize_base``), against the same LoRA
run over the float32 base (``model.quantize_base = "off"``) and the float base loaded whole and quantized
after: each build in a fresh process, its peak RSS above its start (imports done: the same build of a small
base first; ``/proc/self/clear_refs``, freed memory given back with ``malloc_trim`` first), as
``tests/integration/test_quantized_base.py::test_a_base_quantized_as_it_loads_never_holds_the_float_base``
measures it. Prints a markdown table.

    MALLOC_MMAP_THRESHOLD_=131072 OMP_NUM_THREADS=1 PYTHONPATH=src:. python bench/quantize_load_rss.py
    ... --base large       # bench/family_bases_sized.py's large Flux (129.3M transformer parameters)
    ... --base flux        # bench/quantized_base.py's wide Flux transformer (36.4M parameters)
    ... --kinds int8 nf4 fp8

The base by default: the test's attention-heavy UNet2DConditionModel folder (46.7M parameters, 75% in
Linear layers).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests")]  # bench/, tests/multiproc.py

# quantize_base off; loaded whole then quantized; quantized as it loads; diffusers' loader with its own
# quantization_config (networks/quantize.py's library_config; the denoiser alone, no adapter)
MODES = ("float", "whole", "as_it_loads", "library")


def library_peak(base: str, kind: str, small: str) -> dict:
    """In a fresh process: the peak RSS above its start while the base's family loads its denoiser with
    diffusers' ``quantization_config`` for ``kind`` (``library_config``, the unfit layers kept float), after the
    same load of ``small``; {"error": the first line} where diffusers refuses."""
    from multiproc import reset_peak, status_bytes

    from difftrain.families import detect
    from difftrain.networks.quantize import keep_float_modules, library_config

    torch_ = __import__("torch")
    torch_.set_num_threads(1)

    def load(folder):
        family = detect(Path(folder))
        shapes = family.empty_denoiser(Path(folder))[0]  # on the meta device: the layers' shapes
        return family.load_denoiser(Path(folder), library_config(kind, torch_.float32, keep_float_modules(shapes.model, kind)))

    try:
        load(small or base)
    except ValueError as e:
        return {"error": str(e).splitlines()[0]}
    start = reset_peak(give_back=True)
    net = load(base)
    return {"peak": status_bytes("VmHWM") - start, "held": status_bytes("VmRSS") - start, "layers": len(list(net.modules()))}


def child(base: str, kind: str, mode: str, small: str) -> None:
    if mode == "library":
        print(json.dumps(library_peak(base, kind, small)))
        return
    from tests.integration.test_quantized_base import build_peak

    print(json.dumps(build_peak(base, "off" if mode == "float" else kind, mode != "whole", small=small or None)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", choices=("unet", "flux", "large"), default="unet")
    parser.add_argument("--kinds", nargs="+", default=["int8", "nf4"])
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        small = ""
        if args.base == "unet":
            from tests.integration.test_quantized_base import (
                write_attention_unet_folder,
            )

            base = write_attention_unet_folder(Path(tmp) / "unet")
        elif args.base == "flux":
            from quantized_base import write_wide_flux

            base = write_wide_flux(Path(tmp) / "flux", 8, 2, 4)
        else:
            from family_bases_sized import write_base

            base = write_base("flux", "large", Path(tmp) / "large")
            small = str(write_base("flux", "tiny", Path(tmp) / "tiny"))  # the first build's, of the same family
        print("| model.quantize_base | float32 base (MiB) | quantized base (MiB) | peak, float32 base (quantize_base "
              "off) (MiB) | peak, loaded whole then quantized (MiB) | peak, quantized as it loads (MiB) | held after "
              "the build, as it loads (MiB) | peak, diffusers' quantization_config loader (MiB) | held after it (MiB) |")
        print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
        mib = 2 ** 20
        floated = None
        for kind in args.kinds:
            got = {}
            for mode in MODES:
                if mode == "float" and floated is not None:
                    got[mode] = floated
                    continue
                run = subprocess.run([sys.executable, __file__, "--child", str(base), kind, mode, small],
                                     capture_output=True, text=True, check=False)
                if run.returncode:
                    sys.exit(run.stderr)
                got[mode] = json.loads(run.stdout.strip().splitlines()[-1])
            floated = got["float"]
            now, lib = got["as_it_loads"], got["library"]
            library = (f"{lib['peak'] / mib:.0f} | {lib['held'] / mib:.0f}" if "error" not in lib
                       else f"refused: {lib['error'][-60:]} | -")
            print(f"| {kind} | {4 * now['params'] / mib:.1f} | {now['bytes'] / mib:.1f} | {got['float']['peak'] / mib:.0f} "
                  f"| {got['whole']['peak'] / mib:.0f} | {now['peak'] / mib:.0f} | {now['held'] / mib:.0f} | {library} |",
                  flush=True)


if __name__ == "__main__":
    main()
