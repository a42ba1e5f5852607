"""Run records that are never rewritten: the run's original config and a history of its starts.

``config.toml`` is written at a run's first start and never again: it is the config the run
began with. Every start (the first, each resume, each re-run with other ``--set`` values)
appends one line to ``history.jsonl``: when, the command line, which keys differ from the
original config, the version, the git revision of the working directory if any, the device,
the world size and, under ``torchrun --max-restarts``, which restart of the group this is. A
reader of a run folder sees what it was trained with and what changed when.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path

import torch

from difftrain.config import Config, config_changes, config_to_dict, config_to_toml
from difftrain.runtime.files import atomic_write_bytes

CONFIG_NAME = "config.toml"
HISTORY_NAME = "history.jsonl"


def version() -> str:
    """The installed difftrain version."""
    try:
        return package_version("difftrain")
    except PackageNotFoundError:
        return "unknown"


def git_revision(cwd: Path | None = Path(__file__).parent) -> str | None:
    """The git commit of difftrain's own source (with "+dirty" for local changes), when it runs
    from a git checkout (an editable install); None for an installed wheel."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return rev.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def record_start(run_dir: Path, cfg: Config, device: torch.device, world_size: int, resumed_step: int) -> dict:
    """Write ``config.toml`` if the run has none yet; append this start to ``history.jsonl``.

    Returns the history entry. Its ``changed`` maps each dotted key whose value differs from the
    run's original config to [original, now].
    """
    config_path = run_dir / CONFIG_NAME
    now = config_to_dict(cfg)
    if config_path.is_file():
        try:
            original = tomllib.loads(config_path.read_text())
        except (OSError, ValueError):  # unreadable or damaged: keep it, record against nothing
            original = now
    else:
        atomic_write_bytes(config_path, config_to_toml(cfg).encode())
        original = now
    entry = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": [os.path.basename(sys.argv[0]), *sys.argv[1:]],
        "resumed_at_step": resumed_step,
        "changed": {k: list(v) for k, v in config_changes(original, now).items()},
        "version": version(),
        "git": git_revision(),
        "device": str(device),
        "world_size": world_size,
        "torch": torch.__version__,
    }
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # set by torchrun: 0 at the first start, +1 per restart
        entry["elastic_restart"] = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    path = run_dir / HISTORY_NAME
    try:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    return entry
