"""Networks built without their weights (on the meta device), filled later one tensor at a time.

FSDP (``runtime/fsdp.py``) shards a network before any rank holds its weights. :func:`recorded_build`
builds it with every parameter on the meta device (accelerate's ``init_empty_weights``: buffers
stay real) while a ``TorchFunctionMode`` records, in order, each initialisation call made on a
parameter (``nn.init.xavier_uniform_``, ``Tensor.zero_``, ...), which on the meta device computes
nothing and draws no random number. :func:`replay` then makes each parameter whole once, alone, on
the CPU, by running its recorded calls in the recorded order with the global CPU generator, and
hands it to ``fill`` (which keeps this rank's shard and drops the rest). The values, and the
random numbers drawn, are those of an ordinary CPU build from the same seed, bit for bit, while
the peak is one parameter: a call made before a parameter's last overwriting one (the ``reset_parameters``
of its constructor, before the network's own init) runs on a scratch tensor freed at once, only
so that it draws the same numbers.

A build that draws random numbers for anything else while it runs (a parameter made by
``torch.randn`` in a constructor), or initialises a parameter through something the record cannot
replay, is refused with :class:`NotReplayable` (one line naming the parameter or the call).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# Tensor methods that write a parameter's values in place; the first ones overwrite all of them.
_OVERWRITING = {"uniform_", "normal_", "zero_", "fill_", "random_", "bernoulli_", "exponential_", "geometric_",
                "log_normal_", "cauchy_", "copy_"}
_WRITING = _OVERWRITING | {"mul_", "add_", "sub_", "div_", "clamp_", "clamp_min_", "clamp_max_", "erfinv_",
                           "fill_diagonal_", "masked_fill_", "addcmul_", "addcdiv_", "sqrt_", "neg_"}
# nn.init's functions that leave a tensor's values wholly their own (every one of them does).
_INIT_FUNCTIONS = {getattr(nn.init, n) for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")}


class NotReplayable(RuntimeError):
    """The recorded build cannot be replayed exactly (the caller builds the network whole)."""


class _Recorder(TorchFunctionMode):
    """Records each in-place write of a meta tensor (``calls``: (func, args, kwargs)) instead of running it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Callable, tuple, dict]] = []
        self.paused = False  # inside empty_build: nothing recorded

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = _target(args, kwargs)
        if not self.paused and isinstance(target, torch.Tensor) and target.is_meta and _writes(func):
            self.calls.append((func, args, kwargs))
            return target  # on the meta device the write computes nothing
        return func(*args, **kwargs)


def _target(args: tuple, kwargs: dict):
    """The tensor a call writes: its first argument (nn.init passes it as ``tensor=``)."""
    return args[0] if args else kwargs.get("tensor")


def _run(func: Callable, args: tuple, kwargs: dict, tensor: torch.Tensor) -> None:
    """The recorded call with ``tensor`` in place of the meta tensor it wrote."""
    if args:
        func(tensor, *args[1:], **kwargs)
    else:
        func(**{**kwargs, "tensor": tensor})


def _writes(func: Callable) -> bool:
    return func in _INIT_FUNCTIONS or getattr(func, "__name__", "") in _WRITING


def _overwrites(func: Callable, others: tuple) -> bool:
    name = getattr(func, "__name__", "")
    return func in _INIT_FUNCTIONS or name in _OVERWRITING  # copy_ from a real tensor (a meta one is refused)


class Recording:
    """What :func:`recorded_build` saw: the calls, and the CPU generator's state the build started from."""

    def __init__(self) -> None:
        self.recorder = _Recorder()
        self.rng = torch.random.get_rng_state()
        self.params: dict[int, tuple[str, torch.Size, torch.dtype]] = {}
        self.drew = False

    def bind(self, model: nn.Module) -> None:
        """Name the recorded tensors after ``model``'s parameters, before anything (FSDP) replaces them."""
        self.params = {id(p): (name, p.shape, p.dtype) for name, p in model.named_parameters()}


@contextlib.contextmanager
def recorded_build() -> Iterator[Recording]:
    """A context in which modules are built with their parameters on the meta device and every
    initialisation call on a parameter is recorded (``replay`` runs them); ``drew`` says whether
    the build drew from the global CPU generator besides (then ``replay`` refuses)."""
    from accelerate import init_empty_weights  # inside: accelerate is optional (see available())

    recording = Recording()
    _ACTIVE.append(recording.recorder)
    try:
        with init_empty_weights(include_buffers=False), recording.recorder:
            yield recording
    finally:
        _ACTIVE.pop()
    recording.drew = not torch.equal(torch.random.get_rng_state(), recording.rng)


_ACTIVE: list[_Recorder] = []  # the recorders of the recorded_build contexts open now, innermost last


@contextlib.contextmanager
def empty_build() -> Iterator[None]:
    """A context in which modules are built with their parameters on the meta device and nothing
    recorded, as diffusers' ``from_pretrained`` builds a model before loading its weights (its
    initialisation computes nothing and draws no random number); inside :func:`recorded_build` too, whose
    recording then leaves these parameters out (their values come from files: ``runtime/tensor_source.py``)."""
    from accelerate import init_empty_weights  # inside: accelerate is optional (see available())

    recorder = _ACTIVE[-1] if _ACTIVE else None
    paused = recorder is not None and recorder.paused
    if recorder is not None:
        recorder.paused = True
    try:
        with init_empty_weights(include_buffers=False):
            yield
    finally:
        if recorder is not None:
            recorder.paused = paused


def stand_in_weights(module: nn.Module) -> None:
    """Give every meta parameter of ``module`` (built by :func:`empty_build`) a real stand-in of its shape
    and dtype on the CPU holding no memory: one zero, expanded (stride 0). For a network whose weights do
    not matter but must not be meta (peft's layers, put on it, follow their base layer's device)."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(sub, name, nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape), requires_grad=False))


def available() -> bool:
    """Whether :func:`recorded_build` can run here (it needs accelerate's ``init_empty_weights``)."""
    try:
        import accelerate  # noqa: F401 - inside: the optional package whose presence this asks
    except ImportError:
        return False
    return True


def check(recording: Recording, names: set[str] | None = None) -> None:
    """Raise :class:`NotReplayable` if :func:`replay` could not replay this recording exactly
    (call it before sharding: the caller can still build the network whole)."""
    _plan(recording, names)


def _plan(recording: Recording, names: set[str] | None):
    """(wanted names, each name's last call, each name's last overwriting call) of a replayable recording."""
    by_id = recording.params
    wanted = {name for name, _, _ in by_id.values()} if names is None else set(names)
    last_call: dict[str, int] = {}
    last_overwrite: dict[str, int] = {}
    for k, (func, args, kwargs) in enumerate(recording.recorder.calls):
        entry = by_id.get(id(_target(args, kwargs)))
        if entry is None:
            raise NotReplayable(f"{getattr(func, '__name__', func)} initialises a tensor that is not a parameter")
        others = (*args[1:], *(v for key, v in kwargs.items() if not (key == "tensor" and not args)))
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in others):
            raise NotReplayable(f"{getattr(func, '__name__', func)} of {entry[0]} reads another meta tensor")
        last_call[entry[0]] = k
        if _overwrites(func, others):
            last_overwrite[entry[0]] = k
    if recording.drew:
        raise NotReplayable("the network's constructor draws random numbers outside its parameters' initialisation")
    missing = sorted(n for n in wanted if n not in last_overwrite)
    if missing:
        raise NotReplayable(f"parameter {missing[0]} has no initialisation the build recorded")
    return wanted, last_call, last_overwrite


@torch.no_grad()
def replay(recording: Recording, fill: Callable[[str, torch.Tensor], None], names: set[str] | None = None) -> None:
    """Run the recorded initialisation of the model built under ``recording`` (and named by its
    :meth:`Recording.bind`) on the CPU: each
    parameter is made whole once, alone, and passed to ``fill(name, tensor)`` (float, on the CPU)
    after its last recorded call. ``names``: the parameters whose values are wanted (default all);
    the calls on the others still run, on scratch tensors, so the random numbers drawn are the
    build's. The global CPU generator ends where the ordinary build would leave it.

    Raises :class:`NotReplayable` when a wanted parameter has no recorded initialisation or a call
    names a tensor that is not one of ``model``'s parameters (a view, another meta tensor)."""
    by_id = recording.params
    wanted, last_call, last_overwrite = _plan(recording, names)
    torch.random.set_rng_state(recording.rng)
    live: dict[str, torch.Tensor] = {}
    for k, (func, args, kwargs) in enumerate(recording.recorder.calls):
        name, shape, dtype = by_id[id(_target(args, kwargs))]
        if name not in wanted or k < last_overwrite[name]:  # drawn for the random numbers alone
            _run(func, args, kwargs, torch.empty(shape, dtype=dtype))
            continue
        t = live.setdefault(name, torch.empty(shape, dtype=dtype))
        _run(func, args, kwargs, t)
        if k == last_call[name]:
            fill(name, live.pop(name))
