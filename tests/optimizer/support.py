"""Rank-side helpers of the optimizer adapter tests.

Everything here runs inside the gloo pool workers (``tests.distributed_pool``): build the
bf16 FSDP model, adapt an optimizer with telemetry off or with a recording observer, step a
hand-cast reference, and compare tensors bit for bit. The rank bodies sit beside their tests and assert on the
ranks; ``assert_same`` says where two values differ and what each holds.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_patch import parameter_group_of, parameter_groups
from fsdp_patch.adapter import adapt_optimizer
from fsdp_patch.adapter.events import GroupCast, MismatchAction, Phase, StepPlanned
from fsdp_patch.adapter.grad_cast import cast_in_flight
from fsdp_patch.optimizer import fully_shard_optimizer

# Comparisons live in tests.comparison; the adapter tests import them from here with the rest.
from tests.comparison import assert_same as assert_same
from tests.comparison import bits as bits
from tests.comparison import difference as difference
from tests.comparison import local as local
from tests.comparison import same as same
from tests.models import lm_loss, make_batches, rank_slice, sharded_model

O = torch.optim  # noqa: E741 - the adapter tests import this short name
BF16, FP32 = torch.bfloat16, torch.float32

# The optimizers of torch.optim the adapter is tested with. Hyperparameters switch on the
# branches that touch state or grads (weight decay, momentum, nesterov, centered, decoupled
# decay) so that a wrong grad dtype or a stale state shows up in the bits.
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda p: O.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "sgd_nesterov": lambda p: O.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda p: O.Adam(p, lr=1e-2, weight_decay=0.01, amsgrad=True),
    "adamw": lambda p: O.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw_foreach": lambda p: O.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
    "adagrad": lambda p: O.Adagrad(p, lr=0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1),
    "rmsprop": lambda p: O.RMSprop(p, lr=1e-3, momentum=0.5, centered=True, weight_decay=0.01),
    "adamax": lambda p: O.Adamax(p, lr=1e-2, weight_decay=0.01),
    "nadam": lambda p: O.NAdam(p, lr=1e-2, weight_decay=0.01),
    "radam": lambda p: O.RAdam(p, lr=1e-2, weight_decay=0.01, decoupled_weight_decay=True),
    "adadelta": lambda p: O.Adadelta(p, lr=1.0, weight_decay=0.01),
    "lbfgs": lambda p: O.LBFGS(p, lr=0.5, max_iter=3, history_size=3),
}
CLOSURE_OPTIMIZERS = {"lbfgs"}
# What an adapted optimizer reports to (see ``adapt``): ``null``, telemetry off; ``recording``, a
# RecordingObserver where telemetry's observer would be. The attachment is the same.
OBSERVERS = ("null", "recording")


# ----------------------------------------------------------------------------- environment
@contextlib.contextmanager
def env(**values: str | None) -> Iterator[None]:
    """Sets (or with ``None`` unsets) environment variables in this worker, then restores them."""
    old = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ----------------------------------------------------------------------------- observer
class StepRecord:
    """What a :class:`RecordingObserver` saw of one step (the object ``step()`` yields)."""

    def __init__(self, step_number: int) -> None:
        self.step_number = step_number
        self.planned: list[StepPlanned] = []
        self.phases: list[Phase] = []
        self.error: str | None = None


class RecordingObserver:
    """A StepObserver (``fsdp_patch.adapter.StepObserver``) that only records.

    Args:
        precision_every: Steps on which ``precision_due`` answers True (0: never).
    """

    def __init__(self, precision_every: int = 0) -> None:
        self.precision_every = precision_every
        self.steps: list[StepRecord] = []
        self.current: StepRecord | None = None
        self.zero_grads: list[bool] = []
        # (event method, source dtype, target dtype, bytes) per grads_cast / weights_refreshed
        self.casts: list[tuple[str, torch.dtype, torch.dtype, int]] = []
        self.mismatches: list[tuple[torch.dtype, torch.dtype, MismatchAction, int]] = []
        self.precision: list[tuple[int, bool]] = []
        # Grad dtypes when the inner step begins (non-closure steps: what the update sees).
        self.grad_dtypes_in_inner_step: list[set[torch.dtype]] = []
        self.optimizer_ref: Callable[[], torch.optim.Optimizer | None] = lambda: None

    @property
    def step_count(self) -> int:
        return len(self.steps)

    @property
    def collective_settings(self) -> tuple[bool, int]:
        return (True, self.precision_every)

    @contextlib.contextmanager
    def step(self) -> Iterator[StepRecord]:
        record = StepRecord(len(self.steps) + 1)
        self.steps.append(record)
        self.current = record
        try:
            yield record
        except BaseException as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.current = None

    def step_planned(self, event: StepPlanned) -> None:
        if self.current is not None:
            self.current.planned.append(event)
        self.mismatches.extend((m.param_dtype, m.grad_dtype, m.action, m.count) for m in event.mismatches)

    def grads_cast(self, event: GroupCast) -> None:
        self.casts.append(("grads_cast", event.source, event.target, event.nbytes))

    def weights_refreshed(self, event: GroupCast) -> None:
        self.casts.append(("weights_refreshed", event.source, event.target, event.nbytes))

    @contextlib.contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        if self.current is not None:
            self.current.phases.append(phase)
        optimizer = self.optimizer_ref()
        if phase is Phase.INNER_STEP and optimizer is not None:
            self.grad_dtypes_in_inner_step.append(grad_dtypes(optimizer))
        yield

    @contextlib.contextmanager
    def zero_grad(self, set_to_none: bool) -> Iterator[None]:
        self.zero_grads.append(set_to_none)
        yield

    def precision_due(self, step_number: int) -> bool:
        return bool(self.precision_every) and step_number % self.precision_every == 0

    def precision_begin(self, groups: Any) -> Any:
        return [g.main_weight.clone() for g in groups]

    def precision_end(self, snapshot: Any, groups: Any) -> None:
        changed = any(not torch.equal(s, g.main_weight) for s, g in zip(snapshot, groups, strict=True))
        self.precision.append((len(self.steps), changed))


def adapt(
    optimizer: torch.optim.Optimizer, observer: str, *, precision_aware: bool = False
) -> RecordingObserver | None:
    """Adapts ``optimizer``: ``null`` through the public entry point with telemetry off (its
    steps report to a ``NullObserver``; returns ``None``), ``recording`` through
    ``adapt_optimizer`` with a :class:`RecordingObserver` (returned)."""
    if observer == "null":
        with env(FSDP_PATCH_TELEMETRY=None):
            fully_shard_optimizer(optimizer, precision_aware=precision_aware)
        return None
    if observer == "recording":
        recording = RecordingObserver()
        recording.optimizer_ref = weakref.ref(optimizer)  # weakly, like telemetry's observer
        adapt_optimizer(optimizer, precision_aware=precision_aware, observer_factory=lambda: recording)
        return recording
    raise ValueError(observer)


def grad_dtypes(optimizer: torch.optim.Optimizer) -> set[torch.dtype]:
    return {p.grad.dtype for g in optimizer.param_groups for p in g["params"] if p.grad is not None}


# ----------------------------------------------------------------------------- model
build_model = sharded_model  # the adapter tests' name for it


def batches(steps: int, seed: int = 1, vocab: int = 37, seq: int = 7) -> list[torch.Tensor]:
    return make_batches(steps, batch=8, seq=seq, vocab=vocab, seed=seed)


# LBFGS flattens every grad (``p.grad.view(-1)``), which DTensor refuses for an unevenly
# sharded dim 0; this size of the model shards evenly on 1, 2 and 4 ranks.
EVEN = {"vocab": 40, "seq": 8}


def local_tokens(tokens: torch.Tensor) -> torch.Tensor:
    return rank_slice(tokens, dist.get_rank(), dist.get_world_size())


def backward(model: nn.Module, tokens: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    loss = lm_loss(model, local_tokens(tokens))
    (loss * scale).backward()
    return loss.detach()


def make_closure(
    model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor
) -> Callable[[], torch.Tensor]:
    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        return backward(model, tokens)

    return closure


# ----------------------------------------------------------------------------- reference
def fsdp_params(model_or_optimizer: Any) -> list[nn.Parameter]:
    if isinstance(model_or_optimizer, torch.optim.Optimizer):
        params = [p for g in model_or_optimizer.param_groups for p in g["params"]]
    else:
        params = list(model_or_optimizer.parameters())
    return [p for p in params if parameter_group_of(p) is not None]


class HandCast:
    """The reference: an unadapted optimizer whose FSDP grads are cast to fp32 by hand."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.saved: list[tuple[nn.Parameter, torch.Tensor, torch.dtype | None]] = []

    def cast(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            grad, grad_dtype = p.grad, p.grad_dtype
            self.saved.append((p, grad, grad_dtype))
            p.grad = None
            p.grad_dtype = p.dtype
            p.grad = grad.to(p.dtype)

    def restore(self) -> None:
        for p, grad, grad_dtype in self.saved:
            p.grad = None
            p.grad_dtype = grad_dtype
            p.grad = grad
        self.saved.clear()

    def refresh(self) -> None:
        """Refreshes every group's compute copy by hand, as the adapter would."""
        groups = {id(g): g for g in map(parameter_group_of, self.params)}
        with torch.no_grad():
            for group in groups.values():
                group.compute_weight.copy_(group.main_weight)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.cast()
        try:
            optimizer.step()
        finally:
            self.restore()
        self.refresh()

    def step_with_closure(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any]) -> Any:
        def casting_closure() -> Any:
            self.restore()
            loss = closure()
            self.cast()
            return loss

        try:
            return optimizer.step(casting_closure)
        finally:
            self.restore()
            self.refresh()


# ----------------------------------------------------------------------------- comparisons
def assert_changed(got: Any, before: Any, what: str) -> None:
    """Asserts that ``got`` is no longer ``same`` as ``before``."""
    assert not same(got, before), f"{what}: bitwise unchanged"


def assert_grads_original(optimizer: torch.optim.Optimizer, what: str) -> None:
    """Asserts :func:`grads_are_original`, with what is wrong."""
    wrong = grads_are_original(optimizer)
    assert wrong is None, f"{what}: {wrong}"


def main_weights(model: nn.Module) -> list[torch.Tensor]:
    return [g.main_weight.detach().clone() for g in parameter_groups(model)]


def compute_is_fresh(model: nn.Module) -> bool:
    """Every group's compute copy equals its main weights cast to the compute dtype."""
    return all(same(g.compute_weight, g.main_weight.to(g.compute_dtype)) for g in parameter_groups(model))


def assert_compute_fresh(model: nn.Module, what: str) -> None:
    """Asserts :func:`compute_is_fresh`, naming the first stale group and where it differs."""
    for index, g in enumerate(parameter_groups(model)):
        want = g.main_weight.to(g.compute_dtype)
        assert_same(g.compute_weight, want, f"{what}: group {index}'s compute copy vs {g.compute_dtype}(main weights)")


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The per-parameter state in param-group order (tensors cloned)."""
    out = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            state = optimizer.state.get(p, {})
            out.append({k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()})
    return out


def lbfgs_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    state = optimizer.state[optimizer.param_groups[0]["params"][0]]
    return {k: v for k, v in state.items() if k in ("d", "t", "n_iter", "func_evals", "prev_flat_grad", "old_dirs")}


def grads_are_original(optimizer: torch.optim.Optimizer) -> str | None:
    """``None`` when every FSDP param's grad is a bf16 DTensor view of its group's main-grad
    buffer with ``grad_dtype`` bf16 and no group holds a cast copy; else what is wrong."""
    for p in fsdp_params(optimizer):
        group = parameter_group_of(p)
        if cast_in_flight(group):
            return "a group still holds cast grads"
        if p.grad_dtype != group.grads_dtype:
            return f"grad_dtype {p.grad_dtype}, expected {group.grads_dtype}"
        if p.grad is None:
            continue
        if not isinstance(p.grad, DTensor) or p.grad.dtype != group.grads_dtype:
            return f"grad is {type(p.grad).__name__} {p.grad.dtype}"
        if local(p.grad).untyped_storage().data_ptr() != group.main_grad.untyped_storage().data_ptr():
            return "grad is not a view of the group's main-grad buffer"
    return None


def grads_snapshot(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else local(p.grad).detach().clone() for p in model.parameters()]


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (DTensors gathered), detached on CPU."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
