"""difftrain: train image diffusion models (DDPM family) from a folder of images.

The Python API (see the README, "Python API"): ``difftrain.train``, ``difftrain.load``,
``difftrain.generate``, ``difftrain.export``, ``difftrain.make_config`` and ``difftrain.Config``.
They are imported on first use, so ``import difftrain`` stays fast.
"""

import importlib

__version__ = "0.1.0"

# name -> module that defines it, imported on first access (PEP 562).
_LAZY = {
    "train": "difftrain.api",
    "load": "difftrain.api",
    "generate": "difftrain.api",
    "export": "difftrain.api",
    "make_config": "difftrain.api",
    "Config": "difftrain.config",
    "ConfigError": "difftrain.config",
    "load_config": "difftrain.config",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'difftrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
