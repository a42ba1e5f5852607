"""Power-function EMAs and the post-hoc reconstruction (EDM2): closed forms against numerical
integration, sigma_rel <-> gamma round trips, the discrete update against its profile, and the
reconstruction error against the bound the profile fit gives."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from difftrain.config import ConfigError, load_config
from difftrain.checkpoints import checkpoint as ckpt
from difftrain.training.power_ema import (
    PowerEMA,
    gamma_to_std,
    power_beta,
    profile_dot,
    profile_weights,
    solve_coefficients,
    std_to_gamma,
)


def _profile(tau: np.ndarray, t: float, gamma: float) -> np.ndarray:
    """p_t(tau) = (gamma + 1) / t^(gamma + 1) tau^gamma on [0, t] (EDM2 eq. 3)."""
    return np.where(tau <= t, (gamma + 1) / t ** (gamma + 1) * tau**gamma, 0.0)


def _integrate(f, a: float, b: float, pieces: int = 64) -> float:
    """Gauss-Legendre, 50 nodes on each of ``pieces`` sub-intervals, graded towards ``a`` (where
    tau ** gamma is singular for gamma < 0)."""
    nodes, weights = np.polynomial.legendre.leggauss(50)
    edges = a + (b - a) * np.linspace(0.0, 1.0, pieces + 1) ** 4
    total = 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        x = (hi - lo) / 2 * nodes + (hi + lo) / 2
        total += (hi - lo) / 2 * float(weights @ f(x))
    return total


@pytest.mark.parametrize("t_a, g_a, t_b, g_b", [
    (100, 6.94, 100, 6.94), (40, 16.97, 100, 6.94), (100, 6.94, 40, 16.97), (7, 0.0, 3, 2.5), (5e6, 9.45, 2e6, 1.83),
])
def test_profile_inner_product_matches_numerical_integration(t_a, g_a, t_b, g_b):
    closed = float(profile_dot(t_a, g_a, t_b, g_b))
    numeric = _integrate(lambda x: _profile(x, t_a, g_a) * _profile(x, t_b, g_b), 0.0, min(t_a, t_b))
    assert closed == pytest.approx(numeric, rel=1e-9)
    assert closed == pytest.approx(float(profile_dot(t_b, g_b, t_a, g_a)), rel=1e-12)  # symmetric


@pytest.mark.parametrize("std", [0.01, 0.05, 0.08, 0.10, 0.2, 0.28, 0.299])
def test_sigma_rel_gamma_round_trip_and_the_profile_std(std):
    gamma = std_to_gamma(std)
    assert gamma > -0.5 and gamma_to_std(gamma) == pytest.approx(std, rel=1e-10)
    # sigma_rel is the standard deviation of the profile relative to its length t (EDM2 eq. 4)
    t = 250.0
    mean = _integrate(lambda x: x * _profile(x, t, gamma), 0.0, t)
    var = _integrate(lambda x: (x - mean) ** 2 * _profile(x, t, gamma), 0.0, t)
    assert math.sqrt(var) / t == pytest.approx(std, rel=1e-8)


def test_known_exponents():
    assert std_to_gamma(gamma_to_std(0.0)) == pytest.approx(0.0, abs=1e-9)  # the plain running mean
    assert gamma_to_std(0.0) == pytest.approx(12**-0.5)
    assert std_to_gamma(0.05) == pytest.approx(16.97, abs=0.01)  # EDM2 sec. 3.1
    assert std_to_gamma(0.10) == pytest.approx(6.94, abs=0.01)
    for bad in (0.0, -0.1, 0.3, 0.5):
        with pytest.raises(ValueError, match="sigma_rel"):
            std_to_gamma(bad)


def _trajectory(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    """(n, dim) weights theta_1 .. theta_n: a random walk with drift, as training moves."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.randn(n, dim, generator=g, dtype=torch.float64) * 0.1 + 0.05
    return 3.0 + steps.cumsum(0)


def _run(trajectory: torch.Tensor, stds, every: int) -> tuple[PowerEMA, dict]:
    """A PowerEMA over ``trajectory`` (float64, one Linear weight row); snapshots every ``every``."""
    model = torch.nn.Linear(trajectory.shape[1], 1, bias=False).double()
    ema = PowerEMA(model, stds)
    snaps = {}
    for t, theta in enumerate(trajectory, start=1):
        with torch.no_grad():
            model.weight.copy_(theta[None])
        ema.update(model, t)
        if t % every == 0 or t == len(trajectory):
            for s, m in zip(ema.stds, ema.models):
                snaps[(s, t)] = m.weight.detach().clone()[0]
    return ema, snaps


def test_the_discrete_update_puts_the_integrated_profile_on_each_step():
    """Fed one-hot weights theta_tau = e_tau, the average at step t is the weight vector itself."""
    n = 25
    ema, snaps = _run(torch.eye(n, dtype=torch.float64), [0.05, 0.1, 0.2], every=5)
    for (std, t), weights in snaps.items():
        np.testing.assert_allclose(weights.numpy(), profile_weights(t, std_to_gamma(std), n), rtol=1e-10, atol=1e-15)
    assert power_beta(1, 5.0) == 0.0  # the first update copies the weights


def test_tensor_weights_filled_as_a_captured_step_does_give_the_same_averages():
    """``CapturedStep`` fills a (K,) device tensor before each replay instead of passing floats."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    eager, captured = PowerEMA(model, [0.05, 0.1]), PowerEMA(model, [0.05, 0.1])
    weights = torch.zeros(2)
    for t in range(1, 8):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        eager.update(model, t)
        for k, w in enumerate(captured.weights(t)):
            weights[k].fill_(w)
        captured.lerp_(model, weights)
    for a, b in zip(eager.tensors(), captured.tensors()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_reconstruction_error_is_within_the_bound_of_the_profile_fit():
    """Reconstruct sigma_rel 0.08 from snapshots of 0.05 and 0.10 and compare with 0.08 tracked directly.

    With e the discrete weight error (fit minus target, over theta_1..theta_N, sum 0 by the
    sum-to-one constraint): ||rec - direct|| = ||sum_tau e_tau (theta_tau - theta_N)|| <=
    ||e||_1 max_tau ||theta_tau - theta_N||; and ||e||_2 <= the absolute L2 residual of the profiles.
    """
    n, every = 40, 4
    traj = _trajectory(n, 64)
    ema, snaps = _run(traj, [0.05, 0.08, 0.10], every)
    direct = ema.models[1].weight.detach()[0]
    used = [(s, t) for (s, t) in snaps if s != 0.08]
    gammas = [std_to_gamma(s) for s, _ in used]
    target_gamma = std_to_gamma(0.08)
    x, residual = solve_coefficients([t for _, t in used], gammas, n, target_gamma)
    rec = sum(float(c) * snaps[k] for c, k in zip(x, used))

    e = sum(c * profile_weights(t, g, n) for c, (_, t), g in zip(x, used, gammas)) - profile_weights(n, target_gamma, n)
    assert abs(e.sum()) < 1e-10 and sum(x) == pytest.approx(1.0, abs=1e-10)
    target_norm = math.sqrt(float(profile_dot(n, target_gamma, n, target_gamma)))
    assert np.linalg.norm(e) <= residual * target_norm * (1 + 1e-6)
    bound = np.abs(e).sum() * float((traj - traj[-1]).norm(dim=1).max())
    error = float((rec - direct).norm())
    assert error <= bound
    nearest = min(float((snaps[(s, n)] - direct).norm()) for s in (0.05, 0.10))
    assert error < 0.1 * nearest, (error, nearest)
    assert residual < 0.05


def test_the_sum_to_one_constraint_costs_little_residual():
    steps = [t for t in range(3, 31, 3) for _ in (0, 1)]
    gammas = [std_to_gamma(s) for _ in range(3, 31, 3) for s in (0.05, 0.10)]
    free, r_free = solve_coefficients(steps, gammas, 30, std_to_gamma(0.08), sum_to_one=False)
    fixed, r_fixed = solve_coefficients(steps, gammas, 30, std_to_gamma(0.08))
    assert r_free <= r_fixed < r_free * 1.01 + 1e-4
    assert fixed.sum() == pytest.approx(1.0) and free.sum() != pytest.approx(1.0, abs=1e-6)


def test_posthoc_config_is_validated_naming_the_key():
    assert load_config(None, []).ema.posthoc_std == ()
    assert load_config(None, ["ema.posthoc_std=[0.05, 0.1]"]).ema.posthoc_std == (0.05, 0.1)
    for bad in ("[0.3]", "[0]", "[-0.1]", "[0.05, 0.05]"):
        with pytest.raises(ConfigError, match="ema.posthoc_std"):
            load_config(None, [f"ema.posthoc_std={bad}"])
    with pytest.raises(ConfigError, match="ema.posthoc_every_steps"):
        load_config(None, ["ema.posthoc_every_steps=-1"])


def test_a_v2_checkpoint_loads_with_no_posthoc_ema(tmp_path):
    w = {"w": torch.ones(3)}
    v2 = {"format": "difftrain-checkpoint-v2", "step": 1, "data_position": 8, "skipped_steps": 0, "num_classes": 0,
          "config": {"train": {"seed": 0}}, "model": w, "ema": {"model": dict(w), "num_updates": 1},
          "optimizer": {"state": {}, "param_groups": []}, "scaler": {}, "rng": {"torch": torch.get_rng_state()}}
    torch.save(v2, tmp_path / "old.pt")
    loaded = ckpt.load_checkpoint(tmp_path / "old.pt")
    assert loaded["format"] == ckpt.FORMAT and loaded["posthoc_ema"]["stds"] == [] and loaded["posthoc_ema"]["models"] == []


def test_a_checkpoint_with_nonfinite_posthoc_weights_is_refused(tmp_path):
    w = {"w": torch.ones(3)}
    state = {"step": 1, "data_position": 8, "skipped_steps": 0, "num_classes": 0, "config": {"train": {"seed": 0}},
             "model": w, "ema": {"model": dict(w), "num_updates": 1}, "optimizer": {"state": {}, "param_groups": []},
             "scaler": {}, "rng": {"torch": torch.get_rng_state()},
             "posthoc_ema": {"stds": [0.1], "gammas": [6.94], "models": [{"w": torch.tensor([1.0, math.nan, 0.0])}]}}
    with pytest.raises(ckpt.NonFiniteWeights, match=r"posthoc_ema\[0.1\] weight w"):
        ckpt.save_checkpoint(state, tmp_path, 1)
