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
