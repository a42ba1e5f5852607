"""Optional dependencies: imported where first needed, or one line naming the extra to install."""

from __future__ import annotations

import importlib
import types


class MissingDependency(ImportError):
    """An optional package is not installed; the message names the option that needs it and
    the ``pip install 'difftrain[EXTRA]'`` that provides it (the CLI prints it, exit 2)."""


def require(module: str, extra: str, needed_by: str) -> types.ModuleType:
    """Import ``module`` (e.g. "transformers"), or raise :class:`MissingDependency` saying that
    ``needed_by`` (an option or command) needs it and that the extra ``extra`` installs it. An
    installed package that fails to import for another reason keeps its own error."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        if e.name not in (module, top):
            raise
        raise MissingDependency(f"{needed_by} needs the {top} package, which is not installed: "
                                f"pip install 'difftrain[{extra}]'", name=top) from None
