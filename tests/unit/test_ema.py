"""EMA: decay 0 copies, decay 1 freezes, warm-up, skipped steps, swap-in."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from difftrain.training.ema import EMA


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


def _perturb(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
        model[1].running_mean.add_(1.0)


def test_decay_zero_copies_weights_and_buffers():
    model = _model()
    ema = EMA(model, decay=0.0, warmup=False)
    _perturb(model)
    ema.update(model)
    for a, b in zip(ema.model.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


def test_decay_one_freezes():
    model = _model()
    ema = EMA(model, decay=1.0, warmup=False)
    before = {k: v.clone() for k, v in ema.model.named_parameters()}
    for _ in range(3):
        _perturb(model)
        ema.update(model)
    for k, v in ema.model.named_parameters():
        assert torch.equal(v, before[k])


def test_update_is_the_convex_combination():
    model = _model()
    ema = EMA(model, decay=0.75, warmup=False)
    old = [p.clone() for p in ema.model.parameters()]
    _perturb(model)
    ema.update(model)
    for e, o, p in zip(ema.model.parameters(), old, model.parameters()):
        torch.testing.assert_close(e, 0.75 * o + 0.25 * p)


def test_warmup_ramps_the_decay():
    ema = EMA(_model(), decay=0.9999, warmup=True)
    decays = []
    for _ in range(5):
        decays.append(ema.current_decay())
        ema.update(_model(1))
    assert decays[0] == 0.1 and all(a < b for a, b in zip(decays, decays[1:]))


def test_apply_zero_leaves_the_average():
    model = _model()
    ema = EMA(model, decay=0.5, warmup=False)
    old = [p.clone() for p in ema.model.parameters()]
    _perturb(model)
    ema.update(model, apply=torch.tensor(0.0))
    assert all(torch.equal(a, b) for a, b in zip(ema.model.parameters(), old))


def test_swapped_into_restores_the_raw_weights():
    model = _model()
    ema = EMA(model, decay=0.0, warmup=False)
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    _perturb(ema.model)
    with ema.swapped_into(model) as m:
        assert torch.equal(m[0].weight, ema.model[0].weight)
    for k, v in model.state_dict().items():
        assert torch.equal(v, raw[k])


def test_state_dict_round_trip():
    model = _model()
    ema = EMA(model, decay=0.9)
    _perturb(model)
    ema.update(model)
    other = EMA(_model(5), decay=0.9)
    other.load_state_dict(ema.state_dict())
    assert other.num_updates == 1
    for a, b in zip(other.model.state_dict().values(), ema.model.state_dict().values()):
        assert torch.equal(a, b)


def test_power_warmup_follows_its_formula():
    ema = EMA(_model(), decay=0.9999, warmup=True, warmup_power=0.75)
    for t in range(4):
        assert abs(ema.current_decay() - min(0.9999, 1 - (1 + t) ** -0.75)) < 1e-12
        ema.update(_model(1))
    assert ema.current_decay() == 1 - 5**-0.75


def test_power_warmup_averages_longer_than_the_ddpm_ramp_late_in_a_short_run():
    # After t updates the DDPM ramp averages over about (10 + t) / 9 updates, the power ramp
    # over about (1 + t) ** 0.75: more at the few hundred steps of a short run.
    ddpm, power = EMA(_model(), warmup=True), EMA(_model(), warmup=True, warmup_power=0.75)
    ddpm.num_updates = power.num_updates = 300
    assert 1 / (1 - power.current_decay()) > 1.5 / (1 - ddpm.current_decay())


def test_power_warmup_is_capped_by_decay_and_saved():
    ema = EMA(_model(), decay=0.99, warmup=True, warmup_power=0.75)
    ema.num_updates = 10**6
    assert ema.current_decay() == 0.99
    assert ema.state_dict()["warmup_power"] == 0.75


def test_config_reaches_the_power_warmup():
    import pytest

    from difftrain.config import ConfigError, load_config

    assert load_config(overrides=["ema.warmup_power=0.75"]).ema.warmup_power == 0.75
    with pytest.raises(ConfigError, match="ema.warmup_power"):
        load_config(overrides=["ema.warmup_power=-1"])


def _own_tensors(ema: EMA, model: nn.Module) -> list[torch.Tensor]:
    """The tensors the EMA object holds whose storage is not one of ``model``'s."""
    shared = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    held = [*ema.model.state_dict().values(), *ema._ema_params, *ema._ema_buffers]
    return [t for t in held if t.untyped_storage().data_ptr() not in shared]


def test_a_view_holds_no_copy_and_reads_the_trained_weights():
    model = _model()
    assert _own_tensors(EMA(model, decay=0.0), model)  # a copy, as before: what the view does without
    ema = EMA(model, decay=0.0, view=True)
    assert _own_tensors(ema, model) == [] and ema.copies() == []
    _perturb(model)
    ema.update(model, apply=torch.tensor(0.0))  # a skipped step: the weights did not move either
    ema.update(model)
    assert ema.num_updates == 2 and ema.current_decay() == 0.0
    for a, b in zip(ema.model.state_dict().values(), model.state_dict().values()):
        assert a is b or torch.equal(a, b)
    with ema.swapped_into(model) as m:
        assert m is model


def test_a_view_saves_the_layout_of_a_copy_and_loads_the_count_alone():
    model = _model()
    copy, view = EMA(model, decay=0.0), EMA(model, decay=0.0, view=True)
    copy.update(model)
    view.update(model)
    saved, mine = copy.state_dict(), view.state_dict()
    assert mine.keys() == saved.keys() and mine["model"].keys() == saved["model"].keys()
    assert all(torch.equal(mine["model"][k], v) for k, v in saved["model"].items())
    other = {k: torch.full_like(v, 7.0) for k, v in saved["model"].items()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    view.load_state_dict({**saved, "model": other, "num_updates": 5})  # never overwrites the trained weights
    assert view.num_updates == 5
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_only_decay_zero_updated_every_step_is_a_view():
    from difftrain.training.ema import is_view

    assert is_view(0.0, 1, "adamw")
    assert not is_view(0.5, 1, "adamw")
    assert not is_view(0.0, 2, "adamw")  # the average lags the weights between updates
    assert not is_view(0.0, 1, "schedulefree")  # its average reads x, not the parameters
    with pytest.raises(ValueError, match="ema.decay = 0"):
        EMA(_model(), decay=0.5, view=True)
