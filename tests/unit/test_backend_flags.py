"""The CUDA backend flags a run sets (``runtime/device.configure_backends``): ``train.cudnn_attention``. The flags
are process-wide switches that a CPU build of torch also holds, so they are checked here without a GPU."""

from __future__ import annotations

import pytest
import torch

from difftrain.config import ConfigError, load_config
from difftrain.runtime.device import configure_backends


@pytest.fixture
def flags():
    saved = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    yield
    torch.backends.cuda.enable_cudnn_sdp(saved[0])
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved[1:]


def test_cudnn_attention_off_keeps_attention_from_cudnns_kernel_on_cuda(flags):
    configure_backends(torch.device("cuda"), True, cudnn_attention=False)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    configure_backends(torch.device("cuda"), True, cudnn_attention=True)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_a_cpu_run_leaves_the_cuda_flags_as_they_are(flags):
    torch.backends.cuda.enable_cudnn_sdp(True)
    configure_backends(torch.device("cpu"), True, cudnn_attention=False)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_the_option_is_a_config_key_that_takes_a_bool():
    assert load_config(None, ["train.cudnn_attention=false"]).train.cudnn_attention is False
    assert load_config(None, []).train.cudnn_attention is True
    with pytest.raises(ConfigError, match="train.cudnn_attention"):
        load_config(None, ["train.cudnn_attention=sometimes"])
