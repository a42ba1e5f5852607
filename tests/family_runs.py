"""What the base families' training tests share: their tiny bases beside 8 captioned 32 px squares, the ``--set``
lines of a 4-step run of one and of a preset shrunk to it, DreamBooth with prior preservation, the digests of a
run's newest checkpoint that a resumed run must reproduce, and the checks each family's file makes alike (4 steps
straight = 2 + 2 resumed, the preset trains and validates, bad input is one line and exit 2)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from difftrain.checkpoints import checkpoint as ckpt
from difftrain.cli import main
from difftrain.config import Config, load_config
from difftrain.training.loop import train
from tests.integration.test_text_train import _captioned_folder

PRESETS = Path(__file__).resolve().parents[1] / "configs"


def tiny_run(data, base, *extra: str, length: int | None = None) -> list[str]:
    """A 4-step run of the tiny base folder ``base`` on the captioned 32 px squares in ``data`` (2 per step,
    checkpoints at steps 2 and 4, an EMA, no validation); ``length``: ``model.max_sequence_length``; ``extra``
    last (they win)."""
    return ["data.resolution=32", "data.num_workers=0", f"data.path={data}", f"model.init_from={base}",
            *([f"model.max_sequence_length={length}"] if length is not None else []), "optim.lr=1e-3",
            "optim.warmup_steps=1", "train.total_steps=4", "train.batch_size=2", "train.log_every_steps=2",
            "train.progress_bar=false", "ema.decay=0.9", "checkpoint.every_steps=2", "checkpoint.keep_last=2",
            "validation.every_steps=0", *extra]


def preset_run(data, base, *extra: str, length: int | None = None) -> list[str]:
    """The ``--set`` lines that shrink a family's LoRA preset to the tiny base folder ``base`` and the captioned
    squares in ``data``: 2 steps at 32 px in fp32, a checkpoint and a validation grid (2 images of 'a red square',
    2 sampling steps) at step 2; ``length``: ``model.max_sequence_length``; ``extra`` last (they win)."""
    return [f"model.init_from={base}", f"data.path={data}", "data.resolution=32", "data.num_workers=0",
            "train.total_steps=2", "train.grad_accum_steps=1", "train.precision=fp32", "train.progress_bar=false",
            "checkpoint.every_steps=2", "validation.every_steps=2", "validation.steps=2", "validation.num_images=2",
            "validation.prompts=['a red square']",
            *([f"model.max_sequence_length={length}"] if length is not None else []), *extra]


def prior_preservation(class_dir) -> list[str]:
    """The ``--set`` lines of DreamBooth (LoRA, rank 4) with prior preservation: 2 class images of 'a photo of a
    square' made by the base in ``class_dir`` (2 sampling steps, one batch), the instances 'a photo of sks
    square'."""
    return ["dreambooth.instance_prompt=a photo of sks square", "dreambooth.class_prompt=a photo of a square",
            "dreambooth.num_class_images=2", "dreambooth.class_steps=2", "dreambooth.class_batch_size=2",
            f"dreambooth.class_dir={class_dir}", "lora.rank=4"]


@dataclass(frozen=True)
class TinyBase:
    """A family's tiny base folder and the captioned squares it trains on; ``length``: the runs'
    ``model.max_sequence_length`` (None: the base's own)."""

    folder: Path
    data: Path
    length: int | None = None

    def run(self, *extra: str) -> list[str]:
        """``tiny_run`` of this base (``extra`` last)."""
        return tiny_run(self.data, self.folder, *extra, length=self.length)

    def preset_run(self, *extra: str) -> list[str]:
        """``preset_run`` of this base (``extra`` last)."""
        return preset_run(self.data, self.folder, *extra, length=self.length)


def write_tiny_bases(root: Path, writers: dict[str, Callable[[Path], Path]],
                     length: int | None = None) -> dict[str, TinyBase]:
    """8 captioned 32 px squares in ``root/data`` and each writer's tiny base in ``root/<its name>``: the bases by
    name, their runs at ``length``."""
    data = _captioned_folder(root / "data", n=8, size=32)
    return {name: TinyBase(write(root / name), data, length) for name, write in writers.items()}


def run_digests(run_dir) -> tuple[str, str]:
    """(the network's, its EMA's) SHA-256 of the newest checkpoint in ``run_dir``."""
    state = ckpt.load_checkpoint(run_dir)
    return ckpt.state_dict_sha256(state["model"]), ckpt.state_dict_sha256(state["ema"]["model"])


def straight_model(tmp_path) -> dict:
    """The network's state in the newest checkpoint of the straight run, ``tmp_path/straight``."""
    return ckpt.load_checkpoint(tmp_path / "straight")["model"]


def assert_resumed_run_matches(cfg: Config, tmp_path) -> None:
    """``cfg``'s 4 steps as 2, a stop and 2 resumed (``tmp_path/resumed``) end with the digests of the straight run
    already in ``tmp_path/straight``."""
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert run_digests(tmp_path / "straight") == run_digests(tmp_path / "resumed")


def assert_resumes_exactly(cfg: Config, tmp_path) -> None:
    """``cfg``'s 4 steps straight (``tmp_path/straight``) and 2 + 2 resumed (``tmp_path/resumed``): the same
    digests."""
    train(cfg, tmp_path / "straight")
    assert_resumed_run_matches(cfg, tmp_path)


def assert_lora_trained(model: dict) -> list[str]:
    """A LoRA run's saved network ``model`` holds the adapter alone (every name a ``lora_`` one) and some lora_B
    left its zeros (it trained); the names."""
    names = list(model)
    assert names and all("lora_" in n for n in names)
    assert any(t.abs().sum() > 0 for n, t in model.items() if "lora_B" in n)  # it trained
    return names


def assert_two_class_images(class_dir) -> None:
    """DreamBooth's prior preservation made its 2 class images in ``class_dir``."""
    assert sorted(p.name for p in Path(class_dir).glob("*.png")) == ["class_00000.png", "class_00001.png"]


def assert_dreambooth_resumes_exactly(tmp_path, base: TinyBase, *extra: str) -> None:
    """DreamBooth (LoRA) with prior preservation on ``base`` (``extra`` after ``prior_preservation``): its class
    images made once in ``tmp_path/cls`` by the straight run, and 2 + 2 steps resumed equal to 4 straight."""
    cfg = load_config(None, base.run(*prior_preservation(tmp_path / "cls"), *extra))
    train(cfg, tmp_path / "straight")
    assert_two_class_images(tmp_path / "cls")
    assert_resumed_run_matches(cfg, tmp_path)


def cli_train(run_dir, sets: Iterable[str], config=None) -> int:
    """The exit status of ``difftrain train [--config CONFIG] --run-dir RUN_DIR --set S ...`` for each S of
    ``sets``."""
    args = ["train", *(["--config", str(config)] if config is not None else []), "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    return main(args)


def preset_path(name: str) -> Path:
    """The family's LoRA preset, ``configs/<name>-lora.toml``."""
    return PRESETS / f"{name}-lora.toml"


def assert_preset_trains_and_validates(run_dir, name: str, sets: Iterable[str]) -> None:
    """``difftrain train --config configs/<name>-lora.toml --set ...`` (``sets``: a ``preset_run``) exits 0 with
    its checkpoint at step 2 and its validation grid in ``run_dir/samples``."""
    assert cli_train(run_dir, sets, config=preset_path(name)) == 0
    assert ckpt.load_checkpoint(run_dir)["step"] == 2
    assert list((Path(run_dir) / "samples").glob("*.png"))  # the validation grid


def assert_refused(run_dir, sets: Iterable[str], capsys, *needles: str) -> None:
    """``difftrain train --run-dir RUN_DIR --set ...`` exits 2, the last line of its stderr naming each of
    ``needles``."""
    assert cli_train(run_dir, sets) == 2, needles
    err = capsys.readouterr().err.strip().splitlines()
    assert all(n in err[-1] for n in needles), err


def assert_bad_settings_refused(tmp_path, capsys, base: TinyBase, cases: Iterable[tuple[str, str]],
                                *extra: str) -> None:
    """Each (setting, needle) of ``cases``: ``base``'s tiny run with the setting (then ``extra``) exits 2 in one
    line naming the needle and the base's folder (its run in ``tmp_path/<the setting's key>``)."""
    for setting, needle in cases:
        assert_refused(tmp_path / setting.split("=")[0], base.run(setting, *extra), capsys, needle, str(base.folder))
