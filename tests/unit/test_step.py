"""The optimizer step as a unit: the guarded step of every precision, the run state's
checkpoint schema, and the CUDA-graph switch."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_OVERRIDES
from difftrain.config import load_config
from difftrain.diffusion.objective import build_objective
from difftrain.runtime.device import resolve_toggle
from difftrain.runtime.distributed import DistContext
from difftrain.runtime.precision import Precision
from difftrain.checkpoints import checkpoint as ckpt
from difftrain.training.state import RunState
from difftrain.training.step import CapturedStep, StepMetrics, train_step


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_non_finite_gradient_skips_the_step_for_any_optimizer(fused, precision):
    layer = torch.nn.Linear(4, 4)
    before = [p.detach().clone() for p in layer.parameters()]
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1, fused=fused)
    amp = Precision(precision, torch.device("cpu"))
    loss = layer(torch.full((2, 4), float("nan"))).sum()
    amp.backward(loss)
    _, finite = amp.step(opt, layer.parameters(), 1.0, loss.detach())
    assert not bool(finite)
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))
    # and a finite one is taken
    loss = layer(torch.ones(2, 4)).sum()
    amp.backward(loss)
    _, finite = amp.step(opt, layer.parameters(), 1.0, loss.detach())
    assert bool(finite) and not torch.equal(before[0], layer.weight)


def test_train_step_advances_the_state_and_counts_on_the_device():
    cfg = load_config(None, TINY_OVERRIDES + ["train.grad_accum_steps=2", "train.batch_size=4"])
    device = torch.device("cpu")
    state, objective = RunState.build(cfg, 0, device), build_objective(cfg.diffusion)
    metrics = StepMetrics(device)
    batch = (torch.rand(4, 3, 16, 16) * 2 - 1, torch.zeros(4, dtype=torch.long))
    batches = iter([batch] * 4)
    for _ in range(2):
        train_step(state, objective, batches, 1e-3, metrics)
    assert (state.step, state.position, state.ema.num_updates) == (2, 16, 2)
    window = metrics.read(DistContext())
    assert window["steps"] == 2 and window["skipped"] == 0 and window["loss"] > 0
    assert sum(1 for v in window["buckets"] if v > 0) >= 1


def test_cuda_graphs_resolve_off_on_the_cpu_and_refuse_on():
    cpu = torch.device("cpu")
    assert resolve_toggle("auto", cpu, "cuda_graphs") is False
    # Not a default on CUDA either until a GPU measurement shows the captured step right and faster.
    assert resolve_toggle("auto", torch.device("cuda"), "cuda_graphs") is False
    assert resolve_toggle("on", torch.device("cuda"), "cuda_graphs") is True
    with pytest.raises(ValueError, match="train.cuda_graphs"):
        resolve_toggle("on", cpu, "cuda_graphs")
    cfg = load_config(None, TINY_OVERRIDES)
    with pytest.raises(ValueError, match="CUDA"):
        CapturedStep(RunState.build(cfg, 0, cpu), build_objective(cfg.diffusion))


def _saved_state(tmp_path):
    cfg = load_config(None, TINY_OVERRIDES)
    state = RunState.build(cfg, 0, torch.device("cpu"))
    return ckpt.save_checkpoint(state.state_dict(), tmp_path, 0), state


def test_the_schema_names_the_file_and_the_key(tmp_path):
    path, state = _saved_state(tmp_path)
    raw = torch.load(path, weights_only=True)
    for broken, match in [
        ({k: v for k, v in raw.items() if k != "optimizer"}, "no key 'optimizer'"),
        ({**raw, "ema": [1, 2]}, "key 'ema' must be"),
        ({**raw, "step": -3}, "key 'step' must be"),
        ({**raw, "model": {k: v.fill_(float("nan")) if v.is_floating_point() else v
                           for k, v in {k: v.clone() for k, v in raw["model"].items()}.items()}}, "not finite"),
    ]:
        torch.save(broken, tmp_path / "bad.pt")
        with pytest.raises(ckpt.CheckpointError, match=match) as e:
            ckpt.load_checkpoint(tmp_path / "bad.pt")
        assert "bad.pt" in str(e.value)
    # a wrongly shaped weight is named when it is loaded into the model
    name = next(k for k, v in raw["model"].items() if v.ndim == 4)
    torch.save({**raw, "model": {**raw["model"], name: torch.zeros(1, 1, 1, 1)}}, tmp_path / "bad.pt")
    with pytest.raises(ckpt.CheckpointError, match=f"model.{name} has shape"):
        state.load_state_dict(ckpt.load_checkpoint(tmp_path / "bad.pt"))


def test_a_v1_checkpoint_is_upgraded_on_load(tmp_path):
    path, state = _saved_state(tmp_path)
    raw = torch.load(path, weights_only=True)
    v1 = {k: v for k, v in raw.items() if k not in ("skipped_steps",)}
    v1.update(format="difftrain-checkpoint-v1", counters={"skipped_steps": 2}, images_seen=raw["data_position"],
              lr_schedule={"peak_lr": 1e-3}, world_size=1)
    torch.save(v1, tmp_path / "old.pt")
    loaded = ckpt.load_checkpoint(tmp_path / "old.pt")
    assert loaded["skipped_steps"] == 2 and "counters" not in loaded and "lr_schedule" not in loaded
    state.load_state_dict(loaded)
    assert state.skipped_steps == 2


@pytest.mark.gpu
def test_the_captured_step_gives_the_eager_weights():
    """Captured and uncaptured steps on CUDA (bf16, accumulation, labels, dropout, post-hoc power
    EMAs) end with the same weights to bf16 tolerance."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    overrides = TINY_OVERRIDES + ["train.grad_accum_steps=2", "train.batch_size=4", "train.precision=bf16",
                                  "model.dropout=0.1", "train.compile=off", "ema.posthoc_std=[0.05, 0.1]"]
    cfg = load_config(None, overrides)
    g = torch.Generator().manual_seed(0)
    data = [(torch.rand(4, 3, 16, 16, generator=g) * 2 - 1, torch.randint(0, 3, (4,), generator=g)) for _ in range(12)]
    results = []
    for step_fn in ("eager", "captured"):
        state, objective = RunState.build(cfg, 3, device), build_objective(cfg.diffusion).to(device)
        fn = CapturedStep(state, objective) if step_fn == "captured" else train_step
        metrics, batches = StepMetrics(device), iter(data)
        for _ in range(6):
            fn(state, objective, batches, 1e-3, metrics)
        results.append((state.model.state_dict(), state.ema.model.state_dict(),
                        metrics.read(DistContext(device=device)), [m.state_dict() for m in state.posthoc.models]))
    (eager, eager_ema, m_eager, eager_ph), (captured, captured_ema, m_captured, captured_ph) = results
    for k in eager:
        torch.testing.assert_close(captured[k].float(), eager[k].float(), rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(captured_ema[k].float(), eager_ema[k].float(), rtol=2e-2, atol=2e-3)
        for a, b in zip(captured_ph, eager_ph):
            torch.testing.assert_close(a[k].float(), b[k].float(), rtol=2e-2, atol=2e-3)
    assert m_captured["steps"] == m_eager["steps"] == 6
    assert m_captured["loss"] == pytest.approx(m_eager["loss"], rel=2e-2)


def _micro_batch(overrides: list[str], step: int = 5):
    """The micro-batch a tiny run draws at ``step`` for a fixed batch, and its objective."""
    from difftrain.training.step import draw_micro_batch

    cfg = load_config(None, TINY_OVERRIDES + overrides)
    state = RunState.build(cfg, 0, torch.device("cpu"))
    state.step = step
    x0 = torch.rand(8, 3, 16, 16, generator=torch.Generator().manual_seed(1)) * 2 - 1
    return draw_micro_batch(state, build_objective(cfg.diffusion), x0, None, 0, DistContext()), state


def test_noise_offset_adds_one_gaussian_constant_per_sample_and_channel():
    plain, _ = _micro_batch([])
    offset, _ = _micro_batch(["diffusion.noise_offset=0.1"])
    assert torch.equal(plain.levels, offset.levels) and torch.equal(plain.x0, offset.x0)  # drawn after them
    assert plain.input_noise is None and offset.input_noise is None
    shift = offset.noise - plain.noise  # (B, C, H, W), constant over H and W
    per_channel = shift[:, :, :1, :1]
    assert torch.allclose(shift, per_channel.expand_as(shift), atol=1e-6)
    assert 0.05 < float(per_channel.std()) < 0.15 and float(per_channel.abs().min()) > 0  # 0.1 x N(0, 1), B x C draws
    # and the step trains on it: one step from the same weights ends elsewhere
    weights = []
    for overrides in ([], ["diffusion.noise_offset=0.1"]):
        _, state = _micro_batch(overrides, step=0)
        batch = (torch.rand(8, 3, 16, 16, generator=torch.Generator().manual_seed(1)) * 2 - 1, torch.zeros(8).long())
        train_step(state, build_objective(state.cfg.diffusion), iter([batch]), 1e-3, StepMetrics(torch.device("cpu")))
        weights.append(ckpt.state_dict_sha256(state.model.state_dict()))
    assert weights[0] != weights[1]


@pytest.mark.parametrize("prediction", ["epsilon", "v"])
def test_input_perturbation_noises_the_input_and_keeps_the_target(prediction):
    from difftrain.diffusion.process import prediction_target, q_sample

    plain, _ = _micro_batch([f"diffusion.prediction={prediction}"])
    b, state = _micro_batch([f"diffusion.prediction={prediction}", "diffusion.input_perturbation=0.1"])
    assert torch.equal(plain.levels, b.levels) and torch.equal(plain.noise, b.noise)  # drawn after them
    extra = (b.input_noise - b.noise) / 0.1
    assert 0.9 < float(extra.std()) < 1.1 and abs(float(extra.mean())) < 0.05  # a fresh N(0, I) per element
    objective = build_objective(state.cfg.diffusion)
    noised = objective.noised(b.x0, b.levels, b.noise, b.input_noise)
    assert torch.equal(noised.input, q_sample(b.x0, b.levels, b.input_noise, objective.alpha_bar))
    assert torch.equal(noised.target, prediction_target(prediction, b.x0, b.noise, objective.alpha_bar[b.levels]))
    assert not torch.equal(noised.input, objective.noised(b.x0, b.levels, b.noise).input)
    # the step's loss is computed on the perturbed input: the network sees it
    seen = []
    net = lambda x, cond, condition: seen.append(x) or torch.zeros_like(x)  # noqa: E731
    from difftrain.diffusion.objective import per_sample_loss

    per_sample_loss(objective, net, b.x0, None, b.levels, b.noise, None, b.input_noise)
    assert torch.equal(seen[0], noised.input)


def test_noise_offset_and_input_perturbation_both_on_draw_in_a_fixed_order():
    # offset first, then the perturbation, which perturbs the offset noise: a resume redraws both alike
    both, _ = _micro_batch(["diffusion.noise_offset=0.1", "diffusion.input_perturbation=0.1"])
    offset, _ = _micro_batch(["diffusion.noise_offset=0.1"])
    again, _ = _micro_batch(["diffusion.noise_offset=0.1", "diffusion.input_perturbation=0.1"])
    assert torch.equal(both.noise, offset.noise)
    assert torch.equal(both.input_noise, again.input_noise) and not torch.equal(both.input_noise, both.noise)


def test_the_captured_step_copies_each_new_micro_batch_into_its_static_buffers():
    # (CPU-checkable part of the CUDA graph step: the replayed graph reads these buffers.)
    from difftrain.training.step import MicroBatch

    def batch(seed: int, perturbed: bool) -> MicroBatch:
        g = torch.Generator().manual_seed(seed)
        x0, noise = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
        return MicroBatch(x0, None, torch.randint(0, 10, (2,), generator=g), noise, noise + 0.1 if perturbed else None)

    for perturbed in (False, True):
        step = CapturedStep.__new__(CapturedStep)  # no CUDA needed for the copying
        step.static = None
        step._copy_in([batch(0, perturbed)])
        buffers = [t.data_ptr() for t in (step.static[0].x0, step.static[0].noise)]
        step._copy_in([batch(1, perturbed)])
        new = batch(1, perturbed)
        assert [t.data_ptr() for t in (step.static[0].x0, step.static[0].noise)] == buffers
        for name in ("x0", "levels", "noise", "input_noise"):
            ours, want = getattr(step.static[0], name), getattr(new, name)
            assert (ours is None and want is None) or torch.equal(ours, want), name


def test_foreach_lerp_with_a_tensor_weight_equals_the_number_weight():
    """Eagerly a 0-dim tensor weight averages as a number does (the GPU test covers the capture path)."""
    from difftrain.training.ema import foreach_lerp_

    g = torch.Generator().manual_seed(0)
    params = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    by_number = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    by_tensor = [t.clone() for t in by_number]
    foreach_lerp_(by_number, params, 0.01)
    foreach_lerp_(by_tensor, params, torch.tensor(0.01))
    for a, b in zip(by_tensor, by_number):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_schedule_free_step_averages_its_x_without_switching_the_optimizer_or_copying_weights():
    """The EMAs take in schedule-free's average x (as inside ``reading_weights``), but a step
    neither switches the optimizer to eval mode nor keeps a copy of every parameter (issue 39)."""
    cfg = load_config(None, TINY_OVERRIDES + ["optim.name=schedulefree", "optim.lr_schedule=constant",
                                              "ema.posthoc_std=[0.05,0.1]", "ema.update_every_steps=2"])
    device = torch.device("cpu")
    batch = (torch.rand(4, 3, 16, 16) * 2 - 1, torch.zeros(4, dtype=torch.long))

    def run(step):
        torch.manual_seed(0)
        state, objective = RunState.build(cfg, 0, device), build_objective(cfg.diffusion)
        metrics, batches = StepMetrics(device), iter([batch] * 8)
        for _ in range(4):
            step(state, objective, batches, 1e-3, metrics)
        return state

    switches = []
    optimizer_class = type(RunState.build(cfg, 0, device).optimizer)
    eval_mode = optimizer_class.eval
    try:
        optimizer_class.eval = lambda self: (switches.append(1), eval_mode(self))[1]
        state = run(train_step)
    finally:
        optimizer_class.eval = eval_mode
    assert switches == [] and not any("y" in s for s in state.optimizer.state.values())

    def reference_step(state, objective, batches, lr, metrics):
        """The step as before: every parameter switched to x (a copy of y kept) for the averages."""
        ema_update, posthoc_update = state.ema.update, state.posthoc.update

        def in_x(update):
            def wrapped(model, *args, read=None, **kwargs):
                assert read is not None  # the step offers x one tensor at a time
                with state.reading_weights():
                    return update(model, *args, **kwargs)
            return wrapped
        state.ema.update, state.posthoc.update = in_x(ema_update), in_x(posthoc_update)
        try:
            return train_step(state, objective, batches, lr, metrics)
        finally:
            state.ema.update, state.posthoc.update = ema_update, posthoc_update

    reference = run(reference_step)
    for got, want in [(state.model, reference.model), (state.ema.model, reference.ema.model),
                      *zip(state.posthoc.models, reference.posthoc.models)]:
        assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), want.state_dict().values()))
    assert state.ema.num_updates == 2
