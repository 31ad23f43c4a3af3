"""The optimizer adapter's machinery; the public entry points are in :mod:`fsdp_patch.optimizer`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .copying import CopySupport
from .events import NullObserver, StepObserver
from .replaced_params import refuse_replaced_parameters
from .state_init import init_optimizer_state
from .step_sequence import StepSequence
from .wrapt_attachment import WraptAttachment

__all__ = [
    "adapt_optimizer",
    "adaptation_of",
    "cast_buffer_bytes",
    "init_optimizer_state",
    "keep_cast_buffers",
    "remove_fully_shard_optimizer",
    "Adaptation",
    "NullObserver",
    "StepObserver",
    "adaptations",
]


class Adaptation:
    """An optimizer's adaptation: its step sequence, the wrapper attaching it, and copy support.

    Everything that can fail (validation of the param groups, the observer factory) runs
    before the optimizer instance is touched; a failure while attaching undoes what was
    attached, so an error never leaves the optimizer half-adapted.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        precision_aware: bool,
        observer_factory: Callable[[], StepObserver] | None = None,
        implicit: bool = False,
    ) -> None:
        self.precision_aware = precision_aware
        # Made by the telemetry instrumentor rather than by a fully_shard_optimizer call: an
        # explicit call with other settings replaces it instead of failing.
        self.implicit = implicit
        refuse_replaced_parameters(optimizer)  # before any change, as every check here
        self.sequence = StepSequence(optimizer, precision_aware)  # TypeError for a non-Parameter, before any change
        observer = NullObserver() if observer_factory is None else observer_factory()
        self.copy_support = CopySupport(optimizer)
        try:
            self.attachment = WraptAttachment(optimizer, self.sequence, observer)
        except BaseException:
            self.copy_support.detach(optimizer)
            raise

    @property
    def observer(self) -> StepObserver:
        """The observer steps report to: a :class:`NullObserver` while telemetry is off."""
        return self.attachment.observer

    @observer.setter
    def observer(self, observer: StepObserver) -> None:
        self.attachment.observer = observer

    def detach(self, optimizer: torch.optim.Optimizer) -> None:
        self.sequence.detach()
        self.attachment.detach(optimizer)
        self.copy_support.detach(optimizer)


# Keyed by identity and held weakly (nothing in an adaptation holds its optimizer strongly), so
# an adapted optimizer is freed like any other. A copy or an unpickled optimizer (whose
# __getstate__ keeps only defaults, state and param_groups) is a plain optimizer again: see
# .copying.
_ADAPTATIONS: torch.utils.weak.WeakIdKeyDictionary = torch.utils.weak.WeakIdKeyDictionary()


def adaptation_of(optimizer: torch.optim.Optimizer) -> Adaptation | None:
    """The adaptation of ``optimizer``, or ``None`` if it is not adapted."""
    return _ADAPTATIONS.get(optimizer)


def adaptations() -> list[tuple[torch.optim.Optimizer, Adaptation]]:
    """Every live adapted optimizer with its adaptation (telemetry turns observers on and off)."""
    return list(_ADAPTATIONS.items())


def adapt_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    precision_aware: bool,
    observer_factory: Callable[[], StepObserver] | None = None,
    implicit: bool = False,
) -> Adaptation:
    """Adapts ``optimizer`` in place; idempotent for an equal ``precision_aware``.

    ``observer_factory`` makes the observer its steps report to (``None``: a
    :class:`NullObserver`, telemetry off); an adaptation that exists keeps its observer, which
    telemetry's instrumentor replaces to turn telemetry on or off. ``implicit`` marks an
    adaptation the telemetry instrumentor made on its own; an explicit call keeps it when the
    settings are equal (it becomes explicit) and replaces it otherwise.

    Raises:
        TypeError: ``optimizer`` is not an Optimizer, ``precision_aware`` not a bool, or a
            param group holds something that is not an ``nn.Parameter`` (the message names
            the group and the index).
        ValueError: ``optimizer`` is already adapted with another ``precision_aware``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fully_shard_optimizer expected a torch.optim.Optimizer instance, got {type(optimizer)!r}")
    if not isinstance(precision_aware, bool):
        raise TypeError(f"fully_shard_optimizer expected precision_aware to be a bool, got {precision_aware!r}")
    existing = _ADAPTATIONS.get(optimizer)
    if existing is not None and existing.implicit and not implicit:
        if existing.precision_aware == precision_aware:
            existing.implicit = False
            return existing
        remove_fully_shard_optimizer(optimizer)
        existing = None
    if existing is not None:
        if existing.precision_aware != precision_aware:
            raise ValueError(
                "fully_shard_optimizer was already applied to this optimizer with "
                f"precision_aware={existing.precision_aware}; got precision_aware={precision_aware}. Call "
                "fsdp_patch.remove_fully_shard_optimizer(optimizer) first to change it"
            )
        return existing
    adaptation = Adaptation(optimizer, precision_aware, observer_factory, implicit)
    _ADAPTATIONS[optimizer] = adaptation
    return adaptation


def remove_fully_shard_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Undoes ``fully_shard_optimizer``: the wrapper removed, instance attributes restored.

    Any grads still cast are put back first, and the cast buffers' memory is freed. Afterwards the instance's ``__dict__`` holds the same keys and values as before the adaptation, unless an LR
    scheduler created after the adaptation has wrapped ``step`` (its wrapper stays, and ours
    inside it passes calls through). A no-op on an optimizer that is not adapted.
    """
    adaptation = _ADAPTATIONS.pop(optimizer, None)
    if adaptation is not None:
        adaptation.detach(optimizer)


def _adaptation(optimizer: torch.optim.Optimizer, caller: str) -> Adaptation:
    adaptation = _ADAPTATIONS.get(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else None
    if adaptation is None:
        raise ValueError(
            f"{caller} expected an optimizer adapted by fully_shard_optimizer, got "
            f"{'an unadapted ' + type(optimizer).__name__ if isinstance(optimizer, torch.optim.Optimizer) else repr(optimizer)}"
        )
    return adaptation


def cast_buffer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the adapter's grad-cast buffers hold for ``optimizer`` now.

    Each FSDP group whose main grads are narrower than its main weights gets a buffer in the
    main-weight dtype spanning the optimizer's parameters of the group (4 bytes per element
    for fp32 main weights), allocated at the first step that casts.

    Raises:
        ValueError: ``optimizer`` is not adapted.
    """
    return _adaptation(optimizer, "cast_buffer_bytes").sequence.buffer_bytes()


def keep_cast_buffers(optimizer: torch.optim.Optimizer, keep: bool | None) -> None:
    """Whether ``optimizer``'s grad-cast buffers persist between steps.

    ``True``: kept (no allocation per step; their DTensor views are built once either way).
    ``False``: freed now and at the end of every step, so that between steps the adapter
    holds no memory (the next step allocates them again: on the CPU that costs page faults,
    on CUDA the caching allocator hands the block back); during the step the main grads of
    every group the optimizer holds whole are freed too while their fp32 copies stand in
    (cast back afterwards). ``None``: the default, kept when every cast group lives on the CPU
    and keeps a persistent compute copy, freed otherwise (``compute_copy="per_gather"`` asks
    for FSDP2's memory). ``remove_fully_shard_optimizer`` frees them in any case.

    Alternatives considered:
        - An environment variable: memory is a per-job decision usually, but a per-optimizer
          call costs nothing more and composes (two optimizers, one kept).
        - A keyword of ``fully_shard_optimizer``: its signature is Megatron-FSDP's API.

    Raises:
        ValueError: ``optimizer`` is not adapted.
        TypeError: ``keep`` is not a bool or ``None``.
    """
    adaptation = _adaptation(optimizer, "keep_cast_buffers")
    if keep is not None and not isinstance(keep, bool):
        raise TypeError(f"keep_cast_buffers expected keep to be True, False or None, got {keep!r}")
    adaptation.sequence.keep_buffers(keep)
