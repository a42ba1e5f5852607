"""Optional dependencies: imported where first needed, or one line naming the extra to install.

diffusers, transformers and peft import bitsandbytes and torchao as they load, whenever those are
installed, whether or not a run quantizes (diffusers' and transformers' quantizer registries,
peft's helpers); difftrain imports them itself only where a run uses them (``networks/quantize.py``,
``training/optimizers.py``). Those imports log lines that are not about the run, before its own:
:func:`require` imports these three libraries, and the parts of them that import bitsandbytes and
torchao, under :func:`quiet_imports`, which drops exactly those lines while it lasts.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import types
from collections.abc import Iterator

# logger -> a part of the one message of it dropped while a library imports, and why it is noise.
IMPORT_NOISE = {
    # bitsandbytes, on a CPU with AVX-512 BF16: an optional faster nf4 kernel from the `kernels` package
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward",
    # torchao: its CUDA-only extensions (mxfp8, cutlass) on a CPU build of torch
    "torchao": "Failed to load ",
    # torchao registers its enums as pytree constants, which torch 2.13 deprecates (torchao's to change)
    "torch.utils._pytree": "is an Enum subclass and is now natively supported by torch.compile",
    # diffusers' torchao quantizer, for class names the installed torchao no longer has
    "diffusers.quantizers.torchao.torchao_quantizer": "Unable to import `torchao` Tensor objects",
    # transformers, when diffusers' pipeline modules import image processors without torchvision
    "transformers.utils.import_utils": "requires torchvision (not installed); falling back to",
}
# library -> its modules that import bitsandbytes and torchao when first touched (diffusers and
# transformers load lazily: otherwise the first model class touched would, outside require)
_IMPORTS_QUANTIZERS = {"diffusers": ("diffusers.quantizers",), "transformers": ("transformers.quantizers",)}


class _DropNoise(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """While it lasts, the loggers of :data:`IMPORT_NOISE` drop their one message each (and only it)."""
    filters = [(logging.getLogger(name), _DropNoise(text)) for name, text in IMPORT_NOISE.items()]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)


class MissingDependency(ImportError):
    """An optional package is not installed; the message names the option that needs it and
    the ``pip install 'difftrain[EXTRA]'`` that provides it (the CLI prints it, exit 2)."""


def require(module: str, extra: str, needed_by: str) -> types.ModuleType:
    """Import ``module`` (e.g. "transformers"), or raise :class:`MissingDependency` saying that
    ``needed_by`` (an option or command) needs it and that the extra ``extra`` installs it. An
    installed package that fails to import for another reason keeps its own error."""
    try:
        with quiet_imports():
            library = importlib.import_module(module)
            for part in _IMPORTS_QUANTIZERS.get(module, ()):
                with contextlib.suppress(ModuleNotFoundError):  # a version without it
                    importlib.import_module(part)
            return library
    except ImportError as e:
        top = module.split(".")[0]
        if e.name not in (module, top):
            raise
        raise MissingDependency(f"{needed_by} needs the {top} package, which is not installed: "
                                f"pip install 'difftrain[{extra}]'", name=top) from None


def diffusers_pipeline(name: str) -> type:
    """diffusers' pipeline class ``name`` (e.g. "StableDiffusionXLPipeline"), its module imported under
    :func:`quiet_imports`: a pipeline module imports transformers' image processors, which say, without
    torchvision, that they fall back to PIL (a pipeline's LoRA and save functions use none)."""
    with quiet_imports():
        return getattr(require("diffusers", "text", f"diffusers' {name}"), name)
