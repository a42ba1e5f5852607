"""A LoRA run without an EMA (``ema.decay = 0``, as diffusers' scripts): no copy of the adapter is
kept, the run trains, saves and resumes as one that kept a decay-0 copy did (issue 41 item 1)."""

from __future__ import annotations

import torch
from torch import nn

from difftrain.checkpoints import checkpoint as ckpt
from difftrain.cli import main
from difftrain.config import load_config
from difftrain.training import state as state_module
from difftrain.training.ema import EMA
from difftrain.training.loop import train
from tests.integration.test_lora import PROMPT, _digests, _sd_overrides


def _own_tensors(ema: EMA, model: nn.Module) -> list[torch.Tensor]:
    """The tensors the EMA object holds (its model's parameters and buffers) whose storage is not one
    of the trained model's: what an EMA costs the process."""
    shared = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    held = [*ema.model.parameters(), *ema.model.buffers()]
    return [t for t in held if t.untyped_storage().data_ptr() not in shared]


def _recording(monkeypatch) -> list[tuple[EMA, nn.Module]]:
    """Every (EMA, the model it averages) the runs of this test build."""
    made = []

    class Recorded(EMA):
        def __init__(self, model, *args, **kwargs):
            super().__init__(model, *args, **kwargs)
            made.append((self, model))

    monkeypatch.setattr(state_module, "EMA", Recorded)
    return made


def _overrides(tmp_path, tiny_overrides):
    return _sd_overrides(tmp_path, tiny_overrides, "ema.decay=0", "lora.dropout=0.1", "validation.every_steps=3",
                         f"validation.prompts=['{PROMPT}']", "data.heldout_fraction=0.1")


def test_a_decay_zero_lora_run_keeps_no_ema_copy_and_trains_saves_as_with_one(tmp_path, tiny_overrides, monkeypatch):
    cfg = load_config(None, _overrides(tmp_path, tiny_overrides))
    made = _recording(monkeypatch)
    train(cfg, tmp_path / "view")
    (ema, model), = made
    assert _own_tensors(ema, model) == []  # no tensor of its own: the EMA is the trained weights
    # The same run keeping a decay-0 copy, as every run did before: the check sees its tensors.
    monkeypatch.setattr(state_module, "ema_is_view", lambda *_: False)
    train(cfg, tmp_path / "copy")
    ema, model = made[1]
    trained = sum(p.requires_grad for p in model.parameters())
    assert sum(isinstance(t, nn.Parameter) for t in _own_tensors(ema, model)) == trained > 0  # the adapter's copy
    view, copy = ckpt.load_checkpoint(tmp_path / "view"), ckpt.load_checkpoint(tmp_path / "copy")
    assert view.keys() == copy.keys() and view["ema"].keys() == copy["ema"].keys()
    assert list(view["model"]) == list(copy["model"]) == list(view["ema"]["model"]) == list(copy["ema"]["model"])
    assert view["ema"]["num_updates"] == copy["ema"]["num_updates"] == 6
    assert any(t.abs().sum() > 0 for n, t in view["model"].items() if "lora_B" in n)  # it trained
    for name, weights in copy["model"].items():  # the same adapter, bit for bit, and the EMA entry equals it
        assert torch.equal(view["model"][name], weights) and torch.equal(copy["ema"]["model"][name], weights)
        assert torch.equal(view["ema"]["model"][name], weights)
    # Held-out loss on the "ema" weights reads the trained weights: the raw loss, as the copy's was.
    heldout = [(r["heldout/loss"], r["heldout_raw/loss"]) for r in _metrics(tmp_path / "view") if "heldout/loss" in r]
    assert heldout and all(ema == raw for ema, raw in heldout)
    assert heldout == [(r["heldout/loss"], r["heldout_raw/loss"]) for r in _metrics(tmp_path / "copy") if "heldout/loss" in r]
    grids = sorted(p.relative_to(tmp_path / "view") for p in (tmp_path / "view" / "samples").rglob("*.png"))
    assert grids and all((tmp_path / "view" / g).read_bytes() == (tmp_path / "copy" / g).read_bytes() for g in grids)
    assert main(["inspect", str(tmp_path / "view")]) == 0


def _metrics(run_dir) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_a_decay_zero_run_resumes_exactly_from_its_own_checkpoint_and_from_a_copys(tmp_path, tiny_overrides,
                                                                                   monkeypatch):
    cfg = load_config(None, _overrides(tmp_path, tiny_overrides))
    made = _recording(monkeypatch)
    train(cfg, tmp_path / "straight")
    train(cfg, tmp_path / "resumed", stop_at_step=3)
    assert train(cfg, tmp_path / "resumed").step == 6
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")
    assert all(_own_tensors(ema, model) == [] for ema, model in made)
    # A checkpoint of a run that kept a decay-0 copy (before) resumes without one, to the same weights.
    with monkeypatch.context() as m:
        m.setattr(state_module, "ema_is_view", lambda *_: False)
        train(cfg, tmp_path / "older", stop_at_step=3)
    assert train(cfg, tmp_path / "older").step == 6
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "older")


def test_a_decay_zero_lora_run_under_fsdp_trains_resumes_on_two_ranks_as_ddp(tmp_path):
    """Sharded (2 gloo CPU processes), no EMA copy laid out as shards: stopped at step 2 and resumed on 2
    ranks, its adapter is DDP's to float rounding and its checkpoint's ema entry the adapter itself."""
    from tests.conftest import TINY_OVERRIDES
    from tests.multiproc import assert_close_dicts, run_ranks, train_on_rank

    ddp = _sd_overrides(tmp_path, list(TINY_OVERRIDES), "ema.decay=0", "train.total_steps=4", "train.device=cpu",
                        "train.batch_size=2", "train.channels_last=off", "tracking.tensorboard=false")
    fsdp = [*ddp, "train.parallel=fsdp"]
    run_ranks(train_on_rank, 2, str(tmp_path / "ddp"), ddp, None)
    run_ranks(train_on_rank, 2, str(tmp_path / "fsdp"), fsdp, 2)
    half = ckpt.load_checkpoint(tmp_path / "fsdp")
    assert half["path"].endswith("step_00000002.dcp") and half["ema"]["model"].keys() == half["model"].keys()
    run_ranks(train_on_rank, 2, str(tmp_path / "fsdp"), fsdp, None)
    ours, theirs = ckpt.load_checkpoint(tmp_path / "fsdp"), ckpt.load_checkpoint(tmp_path / "ddp")
    assert ours["step"] == 4 and ours["ema"]["num_updates"] == theirs["ema"]["num_updates"] == 4
    assert all(torch.equal(ours["ema"]["model"][k], t) for k, t in ours["model"].items())
    assert_close_dicts(theirs["model"], ours["model"])
    assert any(t.abs().max() > 1e-4 for k, t in ours["model"].items() if "lora_B" in k)  # it trained
