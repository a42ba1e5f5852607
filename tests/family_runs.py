"""What the base families' training tests share: the ``--set`` lines of a 4-step run of a tiny base, and the
digests of a run's newest checkpoint that a resumed run must reproduce."""

from __future__ import annotations

from difftrain.checkpoints import checkpoint as ckpt


def tiny_run(data, base, *extra: str, length: int | None = None) -> list[str]:
    """A 4-step run of the tiny base folder ``base`` on the captioned 32 px squares in ``data`` (2 per step,
    checkpoints at steps 2 and 4, an EMA, no validation); ``length``: ``model.max_sequence_length``; ``extra``
    last (they win)."""
    return ["data.resolution=32", "data.num_workers=0", f"data.path={data}", f"model.init_from={base}",
            *([f"model.max_sequence_length={length}"] if length is not None else []), "optim.lr=1e-3",
            "optim.warmup_steps=1", "train.total_steps=4", "train.batch_size=2", "train.log_every_steps=2",
            "train.progress_bar=false", "ema.decay=0.9", "checkpoint.every_steps=2", "checkpoint.keep_last=2",
            "validation.every_steps=0", *extra]


def run_digests(run_dir) -> tuple[str, str]:
    """(the network's, its EMA's) SHA-256 of the newest checkpoint in ``run_dir``."""
    state = ckpt.load_checkpoint(run_dir)
    return ckpt.state_dict_sha256(state["model"]), ckpt.state_dict_sha256(state["ema"]["model"])
