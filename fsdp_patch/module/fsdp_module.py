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

import warnings
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
from torch import nn

from ..sharding import ParameterGroup
from ..sharding.placement import separate_group
from .compile_boundary import outside_dynamo
from .conversion import inside_conversion, sharded_parameters_kept
from .unit import UnitState

__all__ = ["FSDPModule", "UnshardHandle", "fsdp_class", "owned_modules", "share_comm_ctx"]


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
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gathers this unit's parameters ahead of use (they stay sharded in the module until
        its forward, which uses what was gathered). Not recursive, as FSDP2's.

        Args:
            async_op: ``True`` returns an :class:`UnshardHandle` at once, the all-gathers in
                flight; its ``wait()`` completes them, and the unit's forward waits for them if
                nobody did. ``False`` waits here and returns ``None``.
        """
        if not isinstance(async_op, bool):
            raise TypeError(f"unshard expected async_op to be a bool, got {async_op!r}")
        state = self._fsdp_state
        for group in state.groups:
            group.invalidate_compute_copy()  # as the root's forward does: unshard may come first
            group.start_unshard()
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    @outside_dynamo
    def reshard(self) -> None:
        """Frees this unit's unsharded parameters and puts the sharded ones back into its
        modules (where a forward without resharding left the unsharded ones). Not recursive."""
        self._fsdp_state.reshard_by_hand()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Skips (``False``) or resumes the reduce-scatter of grads in backward.

        While skipped, unsharded grads accumulate locally over microbatches; the next backward
        with sync reduce-scatters their sum, like FSDP2's method of the same name.
        """
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"requires_gradient_sync must be a bool, got {requires_gradient_sync!r}")
        for module in _units(self, recurse):
            module._fsdp_state.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """FSDP2's switch for the all-reduce across replicas of HSDP. On a 1-D mesh there is no
        such all-reduce: the setting is kept and changes nothing, as in FSDP2."""
        _check_bool("set_requires_all_reduce", "requires_all_reduce", requires_all_reduce)
        for module in _units(self, recurse):
            module._fsdp_state.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the unit frees its unsharded parameters after forward, from the next forward
        on (FSDP2's method: the ``reshard_after_forward`` argument, changed at run time; the
        root's default ``False`` included).

        Raises:
            ValueError: ``reshard_after_forward`` is not a bool (FSDP2 raises the same).
        """
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for module in _units(self, recurse):
            state = module._fsdp_state
            state.reshard_after_forward_setting = reshard_after_forward
            state.reshard_after_forward = reshard_after_forward
            for group in state.groups:
                group.unsharding.post_forward_group = None  # an int given to fully_shard no longer applies

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False`` keeps the unsharded parameters' storage after a backward without gradient
        sync, so that the next microbatch's forward does not all-gather again (FSDP2's method,
        for gradient accumulation). After a backward with sync they are freed whatever this
        says: the optimizer step that follows changes the weights they hold, and FSDP2's next
        forward would compute with the weights from before the step."""
        _check_bool("set_reshard_after_backward", "reshard_after_backward", reshard_after_backward)
        for module in _units(self, recurse):
            module._fsdp_state.reshard_after_backward = reshard_after_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: backward needs none of this unit's parameter values (an embedding, whose
        weight grad reads only the indices), so the unit is not all-gathered for backward; its
        grads are reduced as usual (FSDP2's method). A unit whose backward reads its weights
        must keep the default ``True``."""
        _check_bool("set_unshard_in_backward", "unshard_in_backward", unshard_in_backward)
        self._fsdp_state.unshard_in_backward = unshard_in_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2's hint that the next backward is (not) the last of an iteration, accepted and
        checked: every backward here completes its reduce-scatters before it returns (what
        FSDP2 does on the last one), so there is nothing for it to change."""
        _check_bool("set_is_last_backward", "is_last_backward", is_last_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Grads are summed over ranks and divided by ``factor`` instead of averaged (FSDP2's
        method). Not recursive, as FSDP2's."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"set_gradient_divide_factor expected a positive number, got {factor!r}")
        for group in self._fsdp_state.groups:
            group.grad_reduce.reduction.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of :meth:`set_gradient_divide_factor`, as in FSDP2."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor",
            DeprecationWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """``True``: the reduce-scatter only sums, and the division by the ranks (or the divide
        factor) is a separate step (FSDP2's method). Not recursive, as FSDP2's."""
        _check_bool("set_force_sum_reduction_for_comms", "enable", enable)
        for group in self._fsdp_state.groups:
            group.grad_reduce.reduction.force_sum = enable

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Runs ``hook(reduce_output)`` on this rank's reduced grad shard (the reduce-scatter's
        output, in the main-grad dtype, after the division) before it is added into the main
        grads; the hook may change it in place, an all-reduce over another process group for
        instance (FSDP2's method).

        Raises:
            ValueError: ``stream`` is given: the hook runs where the reduce-scatter is waited
                for, on the current stream.
        """
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook expected a callable, got {hook!r}")
        if stream is not None:
            raise ValueError(
                "set_all_reduce_hook: fully_shard runs the hook on the current stream, where it waits for the "
                "reduce-scatter; stream= is not supported (leave it None)"
            )
        for group in self._fsdp_state.groups:
            group.grad_reduce.all_reduce_hook = hook

    def set_custom_all_gather(self, comm: Any) -> None:
        """All-gathers go through ``comm``, FSDP2's ``AllGather`` interface: ``comm.allocate``
        gives the output buffer (the unsharded size, flat) and ``comm(output, input, group,
        async_op=True)`` runs the collective (FSDP2's method)."""
        _check_comm("set_custom_all_gather", comm)
        for group in self._fsdp_state.groups:
            group.unsharding.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce-scatters go through ``comm``, FSDP2's ``ReduceScatter`` interface:
        ``comm.allocate`` gives the output buffer and ``comm(output, input, group, op,
        async_op=True)`` runs the collective with a summing ``op``; the division by the ranks
        follows it (FSDP2's method)."""
        _check_comm("set_custom_reduce_scatter", comm)
        for group in self._fsdp_state.groups:
            group.grad_reduce.reduction.comm = comm

    def set_post_optim_event(self, event: Any) -> None:
        """An event recorded after the optimizer step that the next forward's all-gathers wait
        for (FSDP2's method); used once. The all-gathers here are issued on the current
        stream, so the next forward makes the current stream wait for it."""
        if not hasattr(event, "wait"):
            raise TypeError(f"set_post_optim_event expected a torch.Event, got {type(event).__name__}")
        state = self._fsdp_state
        state.post_optim_event = event

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """FSDP2's switch for reducing zeros for parameters without a grad. Here a group's
        reduce-scatter always carries every parameter (zeros and a presence flag where a rank
        has no grad), so ranks whose control flow differs stay in step whatever this says."""
        _check_bool("set_reduce_scatter_unused_params", "reduce_scatter_unused_params", reduce_scatter_unused_params)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """``True``: reduce-scatters run on a process group of their own over the same ranks, so
        that they can progress beside the all-gathers; ``False`` goes back to the mesh's group
        (FSDP2's method). Creating the group is collective: call it on every rank alike."""
        _check_bool("set_separate_reduce_scatter_group", "enable", enable)
        for module in _units(self, recurse):
            for group in module._fsdp_state.groups:
                group.grad_reduce.reduction.process_group = separate_group(group.process_group) if enable else None

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Refused when enabled: fully_shard allocates its communication buffers itself.

        Raises:
            NotImplementedError: ``enable`` is ``True`` (FSDP2 then takes staging buffers from
                the process group's allocator, NCCL's zero-copy transfers over SHARP).
        """
        _check_bool("set_allocate_memory_from_process_group_for_comm", "enable", enable)
        if enable:
            raise NotImplementedError(
                "set_allocate_memory_from_process_group_for_comm(True): fully_shard allocates its all-gather and "
                "reduce-scatter buffers with the device's caching allocator, not the process group's; a custom "
                "allocation goes through set_custom_all_gather / set_custom_reduce_scatter (their allocate())"
            )

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Refused: fully_shard does not allocate all-gather buffers in symmetric memory.

        Raises:
            NotImplementedError: Always; FSDP2's symmetric-memory all-gather needs NCCL and a
                symmetric-memory allocation, which a custom all-gather can provide
                (``set_custom_all_gather``).
        """
        raise NotImplementedError(
            f"set_symm_mem_for_comm({backend!r}): fully_shard's all-gathers do not use symmetric memory; a custom "
            "all-gather that allocates its output there can be set with set_custom_all_gather"
        )

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many reduce-scatters (each holding its packed grads) may be in flight, the one a
        unit issues included: ``set_overlap_limits(reduce_scatters_in_flight=...)`` under
        FSDP2's name (its default, 1, is ours)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int) or max_input_buffers < 1:
            raise ValueError(f"set_reduce_scatter_max_input_buffers expected an int >= 1, got {max_input_buffers!r}")
        for module in _units(self, recurse):
            module._fsdp_state.reduces_in_flight = max_input_buffers

    def set_overlap_limits(
        self,
        *,
        forward_prefetch: int = 1,
        backward_prefetch: int = 1,
        reduce_scatters_in_flight: int = 1,
        recurse: bool = True,
    ) -> None:
        """Bounds the communication that overlaps computation.

        In forward, each unit issues the all-gathers of the next ``forward_prefetch`` units (in
        the order the last forward entered them) before it computes; in backward, of the
        ``backward_prefetch`` units before it. At most that many units are gathered ahead of the
        one computing. ``reduce_scatters_in_flight`` bounds the reduce-scatters running while
        backward goes on, the one a unit issues included (each holds its unit's packed grads
        until it completes): before a unit packs its grads, the oldest complete until fewer
        remain, as FSDP2's ``set_reduce_scatter_max_input_buffers`` (default 1: each runs while
        the next unit's backward computes); all complete before backward ends. 0 turns each off:
        collectives then block as they run, except HSDP's all-reduces over the replicas, which
        run until backward ends.

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
        found = [m._fsdp_state for m in self.modules() if isinstance(m, FSDPModule)] if recurse else [self._fsdp_state]  # type: ignore[attr-defined]
        units = list({id(unit): unit for unit in found}.values())  # a unit over several modules once
        with sharded_parameters_kept(units, fn):
            return super()._apply(fn, recurse)  # type: ignore[misc]

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        raise TypeError(_NO_COPY)

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError(_NO_COPY)


class UnshardHandle:
    """The all-gathers ``unshard(async_op=True)`` issued (FSDP2's ``UnshardHandle``)."""

    def __init__(self, state: UnitState) -> None:
        self._state = state

    def wait(self) -> None:
        """Completes the all-gathers into the unsharded parameters; the unit's forward would
        otherwise wait for them itself."""
        for group in self._state.groups:
            group.wait_unshard()


def _check_bool(method: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{method} expected {name} to be a bool, got {value!r}")


def _check_comm(method: str, comm: Any) -> None:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{method} expected an object with FSDP2's Comm interface (allocate(size, *, dtype, device) and "
            f"__call__), got {type(comm).__name__}"
        )


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """FSDP2's function that makes several roots share their communication streams (pipeline
    stages). fully_shard issues every collective on the current stream, so there are no
    streams of its own to share; the modules are checked as FSDP2 checks them.

    Raises:
        ValueError: An element is not a module ``fully_shard`` was applied to.
    """
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")


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
