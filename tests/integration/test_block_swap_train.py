"""Block swap wired into training (issue 41 items 3 and 8, ``model.swap_blocks``): a LoRA run on a tiny SD base
with its last blocks' frozen weights on the host trains to the adapter of the same run without swap, validates
(sampling under the plan), checkpoints and resumes (also with gradient checkpointing), and leaves the base as it
found it; ``estimate --base`` takes the swapped blocks' bytes off the device figure and shows them as host memory;
what it does not combine with is refused in one line.

The mechanism's own checks (outputs and gradients, blocks resident) are tests/unit/test_block_swap.py's; here a
spy on ``BlockSwap`` makes sure the plan was installed and used (a run that ignored the option would train the
same adapter)."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.checkpoints import checkpoint as ckpt  # noqa: E402
from difftrain.config import ConfigError, load_config  # noqa: E402
from difftrain.networks.block_swap import BlockSwap  # noqa: E402
from difftrain.runtime.fsdp import blocks  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from difftrain.training.state import RunState  # noqa: E402
from tests.integration.test_text_train import _captioned_folder  # noqa: E402
from tests.text_components import write_tiny_sd_folder  # noqa: E402

PROMPT = "a red square on a dark background"
SWAP = 3  # of the tiny SD UNet's blocks (runtime/fsdp.blocks: its ResNet, transformer and resampling modules)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("block-swap-train")
    _captioned_folder(root / "data", n=8, size=16)
    write_tiny_sd_folder(root / "sd")
    return root


def _cfg(root, *extra):
    return load_config(None, _overrides(root, *extra))


def _overrides(root, *extra) -> list[str]:
    """A 4-step LoRA run (checkpoints at 2 and 4) of the tiny SD base, validated at step 2 and 4, with a post-hoc
    EMA."""
    sd = root / "sd"
    return [
        "data.num_workers=0", "optim.warmup_steps=1", "train.total_steps=4", "train.batch_size=2",
        "train.log_every_steps=2", "train.progress_bar=false", "ema.decay=0.9", "checkpoint.every_steps=2",
        "checkpoint.keep_last=2", "text.cache=off", "optim.lr=1e-2", "data.resolution=16", f"data.path={root / 'data'}",
        "data.captions=true", f"model.init_from={sd}", f"model.text_encoder={sd}", f"model.vae={sd}",
        "diffusion.num_timesteps=100", "lora.rank=4", "lora.alpha=4", "ema.posthoc_std=[0.1]", "validation.every_steps=2",
        f"validation.prompts=['{PROMPT}']", "validation.num_images=2", "validation.steps=2", *extra]


@pytest.fixture
def plans(monkeypatch):
    """Every BlockSwap installed, with the most swapped blocks it held on the device at once and its states."""
    seen = []
    install, load = BlockSwap.install, BlockSwap._load

    def spy_install(self):
        self.most = 0
        seen.append(self)
        return install(self)

    def spy_load(self, i, ahead):
        load(self, i, ahead)
        self.most = max(self.most, len(self._copies))

    monkeypatch.setattr(BlockSwap, "install", spy_install)
    monkeypatch.setattr(BlockSwap, "_load", spy_load)
    return seen


@pytest.fixture
def built(monkeypatch):
    """Every RunState the loop builds."""
    states = []
    original = RunState.build.__func__

    def spy(cls, *args, **kwargs):
        states.append(original(cls, *args, **kwargs))
        return states[-1]

    monkeypatch.setattr(RunState, "build", classmethod(spy))
    return states


def _saved(run_dir) -> dict[str, torch.Tensor]:
    """The adapter, its EMA and its post-hoc EMA of a run's last checkpoint, by key."""
    state = ckpt.load_checkpoint(run_dir)
    return {**{f"model.{k}": v for k, v in state["model"].items()},
            **{f"ema.{k}": v for k, v in state["ema"]["model"].items()},
            **{f"posthoc.{k}": v for k, v in state["posthoc_ema"]["models"][0].items()}}


def test_swapped_lora_run_trains_validates_and_resumes_as_without(tmp_path, base, plans, built):
    train(_cfg(base), tmp_path / "plain")
    assert plans == []  # model.swap_blocks = 0: no plan
    reference = _saved(tmp_path / "plain")
    assert any(v.abs().sum() > 0 for k, v in reference.items() if "lora_B" in k)  # it trained

    train(_cfg(base, f"model.swap_blocks={SWAP}"), tmp_path / "swapped")
    plan, state = plans[-1], built[-1]
    assert plan.n == SWAP and plan.swapped == blocks(state.model)[-SWAP:]
    assert plan.loads > 4 * SWAP  # every swapped block loaded at each step (forward and backward) and in sampling
    assert 1 <= plan.most <= 2  # the one running and the one prefetched
    assert plan.twins == [blocks(state.ema.model), blocks(state.posthoc.models[0])]  # sharing the base: following it
    assert state.swap is None and not plan._slots and not plan._handles  # removed at the end: the base as it was
    assert list((tmp_path / "swapped").rglob("*.png"))  # validation grids sampled under the plan
    got = _saved(tmp_path / "swapped")
    assert got.keys() == reference.keys()
    for k in reference:  # the same ops on the same values: equal up to float32's last bits, on any CPU
        torch.testing.assert_close(got[k], reference[k], rtol=1e-5, atol=1e-6, msg=k)

    # Stopped at step 2 and resumed under swap, with gradient checkpointing (the recompute brings blocks back).
    resumed = _cfg(base, f"model.swap_blocks={SWAP}", "model.gradient_checkpointing=true")
    train(resumed, tmp_path / "resumed", stop_at_step=2)
    assert train(resumed, tmp_path / "resumed").step == 4
    assert len(plans) == 3 and plans[-1].loads > 0
    got = _saved(tmp_path / "resumed")
    for k in reference:
        torch.testing.assert_close(got[k], reference[k], rtol=1e-5, atol=1e-6, msg=k)



def test_a_swapped_run_without_an_ema_copy_trains_as_without_swap(tmp_path, base, plans, built):
    """``ema.decay = 0`` keeps no EMA copy (the EMA is the trained network itself): the plan follows the post-hoc
    EMA alone, never the network a second time, and the run trains to the adapter of the same run without swap."""
    train(_cfg(base, "ema.decay=0"), tmp_path / "plain")
    reference = _saved(tmp_path / "plain")
    train(_cfg(base, "ema.decay=0", f"model.swap_blocks={SWAP}"), tmp_path / "swapped")
    plan, state = plans[-1], built[-1]
    assert state.ema.model is state.model
    assert plan.twins == [blocks(state.posthoc.models[0])]
    got = _saved(tmp_path / "swapped")
    for k in reference:
        torch.testing.assert_close(got[k], reference[k], rtol=1e-5, atol=1e-6, msg=k)

def test_more_blocks_than_the_base_has_is_refused_in_one_line(tmp_path, base, capsys):
    """A count above the base's blocks: found where the base is built, one line naming the option, the count and
    the base's blocks, exit 2 as a config error; no step taken."""
    from difftrain.cli import main

    sets = [a for o in _overrides(base, "model.swap_blocks=99") for a in ("--set", o)]
    assert main(["train", "--run-dir", str(tmp_path / "run"), *sets]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "swap_blocks" in line]
    assert len(err) == 1 and re.fullmatch(r"difftrain train: error: model.swap_blocks = 99 is more than the (\d+) "
                                          r"blocks of the base \(\w+\): set it to at most \1", err[0].rstrip()), err
    assert not list((tmp_path / "run").rglob("*.pt"))


@pytest.mark.parametrize("extra, words", [
    (["lora.rank=0"], "model.swap_blocks=2 swaps a LoRA run's frozen base; full fine-tuning (lora.rank=0)"),
    (["model.quantize_base=int8"], "model.swap_blocks=2 does not combine with model.quantize_base='int8'"),
    (["train.parallel=fsdp"], ("model.swap_blocks=2 does not combine with train.parallel='fsdp' (train.fsdp_offload is "
                               "FSDP's own offload)")),
    (["train.cuda_graphs=on"], "model.swap_blocks=2 moves weights between steps, which a CUDA graph cannot"),
    (["train.compile=on"], "model.swap_blocks=2 runs eager"),
], ids=["full", "quantized", "fsdp", "cuda-graphs", "compile"])
def test_what_block_swap_does_not_combine_with_is_refused_in_one_line(tmp_path, base, extra, words):
    """Checked with the config (before any data or weight is read), on a LoRA over difftrain's own UNet (a base
    family's step refuses train.cuda_graphs='on' for its own reason)."""
    from conftest import TINY_OVERRIDES

    with pytest.raises(ConfigError) as err:
        load_config(None, [*TINY_OVERRIDES, f"model.init_from={tmp_path / 'base.pt'}", "lora.rank=4",
                           "model.swap_blocks=2", *extra])
    line = str(err.value)
    assert "\n" not in line and line.startswith(words), line
    assert line.rstrip().endswith(("model.swap_blocks=0", "'auto' or 'off'")), line  # the way out


def test_estimate_takes_the_swapped_blocks_off_the_device(base):
    """``estimate --base``: the configured setting with N blocks swapped holds the frozen bytes of the base's
    blocks less those of the N swapped but the largest two neighbours (the running and the prefetched), and shows
    the N blocks' bytes as host memory; every other part as without swap. Counted on the meta device, from the
    tiny SD base's shapes, the base held in bf16 (2 bytes a weight)."""
    import itertools

    from difftrain.families import family_named
    from difftrain.tools.base_memory import count_base, denoiser_config, format_base

    folder = base / "sd"
    with torch.device("meta"):
        units = blocks(family_named("sd").denoiser_from_record({"config": denoiser_config(folder)}))
    sizes = [sum(t.numel() for t in [*b.parameters(), *b.buffers()]) * 2 for b in units]

    def counted(n):
        cfg = load_config(None, ["data.resolution=16", "data.path=/nonexistent", f"model.init_from={folder}",
                                 "train.batch_size=2", "lora.rank=4", "train.precision=bf16", "validation.every_steps=0",
                                 f"model.swap_blocks={n}"])
        return count_base(cfg, str(folder), ranks=1)

    with pytest.raises(ValueError, match=f"^model.swap_blocks = {len(units) + 1} is more than the {len(units)} blocks"):
        counted(len(units) + 1)
    r = counted(len(units) - 1)
    own = r["rows"][0]  # the configured setting; the same without swap is one of the table's rows
    plain = next(row for row in r["rows"][1:] if row["lora"] and row["optimizer"] == own["optimizer"] and
                 row["checkpointing"] == own["checkpointing"] and row["quantize_base"] == "off")
    swapped = sizes[1:]
    saved = sum(swapped) - max(a + b for a, b in itertools.pairwise(swapped))
    assert len(units) >= 4 and saved > 0 and plain["swap_blocks"] == plain["host_swapped"] == 0
    assert own["swap_blocks"] == len(units) - 1 and own["host_swapped"] == sum(swapped)
    assert plain["weights"] - own["weights"] == saved and plain["total"] - own["total"] == saved
    assert all(own[k] == plain[k] for k in ("grads", "optimizer_state", "ema", "activations", "buffers"))
    assert f"{len(units) - 1} blocks swapped" in own["setting"] and "host (block swap)" in format_base(r)
