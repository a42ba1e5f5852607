"""Host memory of a LoRA run's base quantized as it loads (``model.quantize_base``), against the float base
loaded whole and quantized after: each build in a fresh process, its peak RSS above its start (imports done;
``/proc/self/clear_refs``, freed memory given back with ``malloc_trim`` first), as
``tests/integration/test_quantized_base.py::test_a_base_quantized_as_it_loads_never_holds_the_float_base``
measures it. Prints a markdown table.

    MALLOC_MMAP_THRESHOLD_=131072 OMP_NUM_THREADS=1 PYTHONPATH=src:. python bench/quantize_load_rss.py
    ... --base flux        # bench/quantized_base.py's wide Flux transformer (36.4M parameters) instead

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


def child(base: str, kind: str, as_it_loads: bool) -> None:
    from tests.integration.test_quantized_base import build_peak

    print(json.dumps(build_peak(base, kind, as_it_loads)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", choices=("unet", "flux"), default="unet")
    parser.add_argument("--kinds", nargs="+", default=["int8", "nf4"])
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.child[2] == "1")
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.base == "unet":
            from tests.integration.test_quantized_base import (
                write_attention_unet_folder,
            )

            base = write_attention_unet_folder(Path(tmp) / "unet")
        else:
            from quantized_base import write_wide_flux

            base = write_wide_flux(Path(tmp) / "flux", 8, 2, 4)
        print("| model.quantize_base | float32 base (MiB) | quantized base (MiB) | peak, loaded whole then quantized "
              "(MiB) | peak, quantized as it loads (MiB) | held after the build, as it loads (MiB) |")
        print("|---|--:|--:|--:|--:|--:|")
        for kind in args.kinds:
            got = {}
            for as_it_loads in (False, True):
                run = subprocess.run([sys.executable, __file__, "--child", str(base), kind, str(int(as_it_loads))],
                                     capture_output=True, text=True, check=False)
                if run.returncode:
                    sys.exit(run.stderr)
                got[as_it_loads] = json.loads(run.stdout.strip().splitlines()[-1])
            mib = 2 ** 20
            print(f"| {kind} | {4 * got[True]['params'] / mib:.1f} | {got[True]['bytes'] / mib:.1f} | "
                  f"{got[False]['peak'] / mib:.0f} | {got[True]['peak'] / mib:.0f} | {got[True]['held'] / mib:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
