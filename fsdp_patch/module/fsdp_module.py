"""``FSDPModule``: the class a sharded module becomes, with the unit's methods.

``fully_shard`` swaps the module's class for a subclass of :class:`FSDPModule` and the module's
own class (:func:`fsdp_class`), as FSDP2 does, so that the module stays itself for everything
that reads it (parameter names, ``isinstance``, its own methods). The methods set what a unit
overlaps and whether it syncs grads, gather and free by hand, and recover from an aborted
iteration; the unit's state itself is :class:`~.unit.UnitState`. ``Module._apply`` keeps the
sharded parameters (:mod:`.module_conversion`); deep copies and pickling are refused.

Alternatives considered:
    - Wrapping the module in a new object (FSDP1): changes parameter names; swapping the
      class keeps the FQNs of the unwrapped model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
from torch import nn

from ..sharding import ParameterGroup
from .compile_boundary import outside_dynamo
from .conversion import inside_conversion, sharded_parameters_kept
from .unit import UnitState

__all__ = ["FSDPModule", "fsdp_class", "owned_modules"]


class FSDPModule:
    """Mixin added to the class of every module ``fully_shard`` was applied to."""

    _fsdp_state: UnitState

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Forward hooks do not run when forward raises: undo the pre-forward here, so that a
        # failed forward (say, out of memory on a long batch) leaves the sharded parameters in
        # the module and nothing gathered.
        try:
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        except BaseException:
            self._fsdp_state.abort_forward()
            raise

    @outside_dynamo
    def unshard(self) -> None:
        """All-gathers this unit's parameters ahead of use (they stay sharded in the module)."""
        for group in self._fsdp_state.groups:
            group.invalidate_compute_copy()  # as the root's forward does: unshard may come first
        self._fsdp_state.unshard()

    @outside_dynamo
    def reshard(self) -> None:
        """Frees this unit's unsharded parameters."""
        self._fsdp_state.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Skips (``False``) or resumes the reduce-scatter of grads in backward.

        While skipped, unsharded grads accumulate locally over microbatches; the next backward
        with sync reduce-scatters their sum, like FSDP2's method of the same name.
        """
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"requires_gradient_sync must be a bool, got {requires_gradient_sync!r}")
        for module in _units(self, recurse):
            module._fsdp_state.requires_gradient_sync = requires_gradient_sync

    def set_overlap_limits(
        self,
        *,
        forward_prefetch: int = 1,
        backward_prefetch: int = 1,
        reduce_scatters_in_flight: int = 2,
        recurse: bool = True,
    ) -> None:
        """Bounds the communication that overlaps computation.

        In forward, each unit issues the all-gathers of the next ``forward_prefetch`` units (in
        the order the last forward entered them) before it computes; in backward, of the
        ``backward_prefetch`` units before it. At most that many units are gathered ahead of the
        one computing. ``reduce_scatters_in_flight`` bounds the reduce-scatters left running
        while backward goes on (each holds its unit's packed grads until it completes); all
        complete before backward ends. 0 turns each off: collectives then block as they run.

        Raises:
            TypeError: A limit is not a non-negative int (bool is refused).
        """
        for name, value in (
            ("forward_prefetch", forward_prefetch),
            ("backward_prefetch", backward_prefetch),
            ("reduce_scatters_in_flight", reduce_scatters_in_flight),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise TypeError(f"set_overlap_limits expected {name} to be an int >= 0, got {value!r}")
        for module in _units(self, recurse):
            state = module._fsdp_state
            state.prefetch_depth = {1: forward_prefetch, -1: backward_prefetch}
            state.reduces_in_flight = reduce_scatters_in_flight

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Units whose all-gathers this unit issues when its forward starts (FSDP2's method
        of the same name); overrides the learned order for this unit. ``[]`` prefetches none."""
        self._fsdp_state.explicit_prefetch[1] = _prefetch_targets(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Units whose all-gathers this unit issues when its backward starts (FSDP2's method
        of the same name); overrides the learned order for this unit. ``[]`` prefetches none."""
        self._fsdp_state.explicit_prefetch[-1] = _prefetch_targets(modules, "set_modules_to_backward_prefetch")

    def reset_iter_state(self) -> None:
        """Recovers from an exception that aborted a forward or backward, like FSDP2's method.

        Puts the sharded parameters back into the modules, frees unsharded storage and drops
        the aborted iteration's gradients: unsharded grads, grads accumulated with gradient
        sync off, and the ``.grad`` of groups the aborted backward had partly reduced into
        (those become ``None``). Applies to every unit under this unit's root. The root's next
        forward does this by itself when it finds an aborted iteration; call it to inspect or
        checkpoint the module in between.
        """
        context = self._fsdp_state.context
        if context is None:
            self._fsdp_state.reset()
        else:
            context.reset()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``Module.zero_grad``, after recovering from an aborted backward if there was one.

        A backward that raised leaves units in mid-backward with their unsharded parameters in
        the modules; resetting first makes ``zero_grad`` reach the sharded parameters, as it
        would have without the exception. Between a forward and its backward, units that keep
        their unsharded parameters after forward put the sharded ones back first, for the same
        reason.
        """
        context = self._fsdp_state.context
        if context is not None and torch._C._current_graph_task_id() == -1 and context.interrupted():
            context.reset()
        for module in _units(self, recurse=True):
            module._fsdp_state.release_kept_parameters()
        super().zero_grad(set_to_none)  # type: ignore[misc]

    @property
    def fsdp_parameter_groups(self) -> list[ParameterGroup]:
        """This unit's own parameter groups (not those of FSDP children)."""
        return list(self._fsdp_state.groups)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FSDPModule:
        """``Module.to``/``.float()``/``.cpu()``/``.to_empty`` and the rest, for a sharded module.

        A conversion that keeps every sharded parameter's dtype and device converts the
        buffers as usual and leaves the sharded parameters (the main weights in their flat
        buffers) as they are; ``to_empty`` thus keeps their values, which its contract allows.
        A conversion that would change one is refused before anything is converted (see
        :mod:`.module_conversion`).

        Raises:
            ValueError: The conversion would change a sharded parameter's dtype or device.
        """
        if inside_conversion():
            return super()._apply(fn, recurse)  # type: ignore[misc]
        units = [m._fsdp_state for m in self.modules() if isinstance(m, FSDPModule)] if recurse else [self._fsdp_state]  # type: ignore[attr-defined]
        with sharded_parameters_kept(units, fn):
            return super()._apply(fn, recurse)  # type: ignore[misc]

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        raise TypeError(_NO_COPY)

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError(_NO_COPY)


def _units(module: FSDPModule, recurse: bool) -> list[FSDPModule]:
    if not recurse:
        return [module]
    return [m for m in module.modules() if isinstance(m, FSDPModule)]  # type: ignore[attr-defined]


def _prefetch_targets(modules: Any, method: str) -> list[UnitState]:
    if not isinstance(modules, (list, tuple)) or not all(isinstance(m, FSDPModule) for m in modules):
        got = type(modules).__name__ if not isinstance(modules, (list, tuple)) else [type(m).__name__ for m in modules]
        raise TypeError(f"{method} expected a list of modules fully_shard was applied to, got {got}")
    return [m._fsdp_state for m in modules]


_NO_COPY = (
    "fully_shard: an FSDP module cannot be deep-copied or pickled: its parameters are shards in "
    "flat buffers tied to a process group (FSDP2 refuses deepcopy too). To copy the weights, read "
    "torch.distributed.checkpoint.state_dict.get_model_state_dict(model) (full_state_dict=True for "
    "unsharded tensors) and load them into a new model, or save with torch.distributed.checkpoint. "
    "For an average of the weights (torch.optim.swa_utils.AveragedModel deep-copies its model), "
    "build the averaged model before fully_shard and shard its .module the same way."
)


_FSDP_CLASSES: dict[type, type] = {}


def fsdp_class(cls: type) -> type:
    """The class a module of class ``cls`` gets from ``fully_shard``: ``FSDP<cls>``, made once per class."""
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
    return _FSDP_CLASSES[cls]


def owned_modules(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``module`` and its descendants, not descending into FSDP children, with their paths
    (``prefix``, then ``prefix + "name."`` and so on): what one unit owns."""
    yield prefix, module
    for name, child in module._modules.items():
        if child is None or isinstance(child, FSDPModule):
            continue
        yield from owned_modules(child, f"{prefix}{name}.")
