"""Each optim.name trains and resumes exactly; another optimizer's checkpoint is refused."""

from __future__ import annotations

import pytest

from difftrain.config import load_config
from difftrain.training.loop import train
from tests.integration.test_train import assert_resume_is_exact

NEW = {"adamw8bit": [], "prodigy": ["optim.lr=1.0"], "adafactor": ["optim.lr=1e-2"],
       "schedulefree": ["optim.lr_schedule=constant"]}


@pytest.mark.parametrize("name", sorted(NEW))
def test_each_optimizer_resumes_bit_exactly(tmp_path, tiny_overrides, name):
    assert_resume_is_exact(tmp_path, tiny_overrides + [f"optim.name={name}", *NEW[name]])


def test_a_checkpoint_of_another_optimizer_is_refused_with_one_line(tmp_path, tiny_overrides):
    train(load_config(None, tiny_overrides + ["train.total_steps=2"]), tmp_path)
    other = load_config(None, tiny_overrides + ["optim.name=adafactor"])
    with pytest.raises(ValueError, match=r"optim\.name='adamw' and this run sets 'adafactor'.*resume with optim\.name='adamw'"):
        train(other, tmp_path)


# About 25 s each on 2 cores: schedule-free (whose weight switch DDP could break) by default.
@pytest.mark.parametrize("name", [n if n == "schedulefree" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(NEW)])
def test_each_optimizer_under_ddp_on_2_ranks_trains_as_one_process(tmp_path, tiny_overrides, name):
    """2 gloo ranks x batch 4 against 1 process x batch 8: the same averaged gradients, so the
    same weights up to float summation order (the schedule-free EMA and checkpoint included)."""
    from multiproc import assert_close_dicts, run_ranks, train_on_rank

    from difftrain.checkpoints import checkpoint as ckpt

    common = tiny_overrides + [f"optim.name={name}", *NEW[name], "train.total_steps=3", "validation.every_steps=0",
                               "train.channels_last=off", "data.num_workers=0"]
    train(load_config(None, common + ["train.batch_size=8"]), tmp_path / "one")
    run_ranks(train_on_rank, 2, str(tmp_path / "two"), common + ["train.batch_size=4"], None)
    one, two = ckpt.load_checkpoint(tmp_path / "one"), ckpt.load_checkpoint(tmp_path / "two")
    assert_close_dicts(one["model"], two["model"], rtol=1e-3, atol=1e-4)
    assert_close_dicts(one["ema"]["model"], two["ema"]["model"], rtol=1e-3, atol=1e-4)
