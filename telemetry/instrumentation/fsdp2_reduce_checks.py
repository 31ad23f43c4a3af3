"""Torch FSDP2's grads checked around its reduce-scatter, for a :class:`~.model_watch.ModelWatch`.

``fully_shard`` calls a reduce hook of its own (``ParameterGroup.register_reduce_hook``); torch
FSDP2 has none, so :class:`FSDP2ReduceChecks` puts instance attributes over two of its methods,
each removed by :meth:`FSDP2ReduceChecks.remove`:

- each parameter group's ``post_backward``, which reduces: the unsharded grads it is about to
  reduce are checked first, in the dtype it reduces them in;
- the root state's ``_root_post_backward_final_callback``, which finishes the reduce-scatters:
  each unit's reduced grads are checked after it.

Everything read here is FSDP2's private state (its groups, ``FSDPParam``'s unsharded grads, the
reduce dtype): the Makefile's ``TORCH_RANGE_TESTS`` run it on the oldest supported torch too.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from .. import semconv
from ..diagnostics.origin import WIDE_REDUCE_DTYPES
from ..diagnostics.probes import AFTER, BEFORE, POOL_WHERE, PreparedChecks, ProbeLog, checkable

__all__ = ["FSDP2ReduceChecks", "ReduceLog"]


class ReduceLog(Protocol):
    """Where the checks go: the owner's log of the running iteration, and its record of grads
    checked (a grad checked after the reduce and not written since is not checked again at the
    step)."""

    log: ProbeLog

    def reached(self) -> None: ...

    def seen_grads(self, tensors: Sequence[torch.Tensor]) -> None: ...


class _GradList:
    """A list of torch FSDP2's grads checked every iteration (a unit's before its reduce, every
    unit's after it): new tensors each time for the same parameters, so their probes are made
    again only when which parameters have grads, or their dtypes or sizes, change.

    Args:
        when: ``BEFORE`` or ``AFTER`` the reduce.
        pooled: How far the values may be pooled (:class:`~..diagnostics.prepared_checks.PreparedChecks`).
    """

    def __init__(self, when: str, pooled: str) -> None:
        self._when = when
        self._pooled = pooled
        self._key: tuple[list[str], list[torch.dtype], list[int]] | None = None
        self._prepared: PreparedChecks | None = None

    def prepared(self, wheres: list[str], grads: list[torch.Tensor]) -> PreparedChecks:
        key = (wheres, list(map(_DTYPE, grads)), list(map(torch.Tensor.numel, grads)))
        if self._prepared is not None and key == self._key:
            self._prepared.retarget(grads)
            return self._prepared
        self._key = key
        self._prepared = PreparedChecks(
            semconv.ORIGIN_REDUCE,
            [(where, grad, self._when, "") for where, grad in zip(wheres, grads, strict=True)],
            pooled=self._pooled,
        )
        return self._prepared


_DTYPE = operator.attrgetter("dtype")


class FSDP2ReduceChecks:
    """The reduce checks of one model's FSDP2 units (see the module).

    Args:
        owner: Where the checks go (held weakly: the patched methods check nothing once it is gone).
    """

    def __init__(self, owner: ReduceLog) -> None:
        self._owner_ref = weakref.ref(owner)
        self._patched_groups: list[Any] = []
        self._patched_states: list[Any] = []
        # Read unit by unit (a unit's grads all 0: zeroed_groups), so pooled per unit.
        self._reduced = _GradList(AFTER, POOL_WHERE)
        self._unreduced: dict[int, _GradList] = {}  # per FSDP2 group, by id: its grads before the reduce
        # FSDP2 groups whose grads are reduced in a wide dtype ([Note: the reduce's input in a wide dtype]).
        self._wide_reduces: weakref.WeakSet[Any] = weakref.WeakSet()
        # The units last read after their reduce, their FSDPParams and names (:meth:`_units_params`).
        self._params_of: tuple[Sequence[tuple[str, Any]], list[Any], list[str]] | None = None

    def watch(self, root: nn.Module, units: Sequence[tuple[str, nn.Module]]) -> None:
        """Patch the FSDP2 parameter groups of ``units`` (``(name, unit)``; units ``fully_shard``
        sharded have none) and, where there are any, ``root``'s final callback."""
        fsdp2_units: list[tuple[str, Any]] = []
        for name, unit in units:
            for group in _fsdp2_param_groups(unit):
                self._patch_post_backward(group, name)
                fsdp2_units.append((name, group))
        if fsdp2_units:
            self._patch_final_callback(root, fsdp2_units)

    def remove(self) -> None:
        """Take every patch back (the classes' methods apply again)."""
        for group in self._patched_groups:
            group.__dict__.pop("post_backward", None)
        self._patched_groups.clear()
        for state in self._patched_states:
            state.__dict__.pop("_root_post_backward_final_callback", None)
        self._patched_states.clear()
        self._unreduced.clear()

    def _patch_post_backward(self, group: Any, name: str) -> None:
        """FSDP2 reduces inside its group's ``post_backward``: check the unsharded grads it is about
        to reduce, in the dtype it reduces them in (an instance attribute over the class's method).
        Grads reduced in float32 or wider are not checked here: see [Note: the reduce's input in a
        wide dtype]."""
        original = type(group).post_backward
        checks_ref = weakref.ref(self)

        def post_backward(*args: Any, **kwargs: Any) -> Any:
            checks = checks_ref()
            if checks is not None:
                checks._before_reduce(group, name)
            return original(group, *args, **kwargs)

        group.post_backward = post_backward
        self._patched_groups.append(group)

    def _patch_final_callback(self, root: nn.Module, units: list[tuple[str, Any]]) -> None:
        """FSDP2 finishes its reduce-scatters in the root's final backward callback: check each
        unit's reduced grads after it (an instance attribute over the class's method, which FSDP2
        queues by attribute at each backward)."""
        try:
            from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
        except ImportError:  # pragma: no cover - torch built without distributed
            return
        state = _get_module_fsdp_state(root)
        original = getattr(type(state), "_root_post_backward_final_callback", None)
        if state is None or original is None:
            return
        checks_ref = weakref.ref(self)

        def final_callback(*args: Any, **kwargs: Any) -> Any:
            result = original(state, *args, **kwargs)
            checks = checks_ref()
            if checks is not None:
                checks._after_reduce(units)
            return result

        state.__dict__["_root_post_backward_final_callback"] = final_callback
        self._patched_states.append(state)

    def _before_reduce(self, group: Any, name: str) -> None:
        owner = self._owner_ref()
        if owner is None:
            return
        owner.reached()  # the group's post-backward: this backward is the model's
        if group in self._wide_reduces:
            return
        dtype = getattr(group, "_reduce_dtype", None)
        grads = [g for p in group.fsdp_params if (g := _fsdp2_unsharded_grad(p)) is not None]
        narrow = [
            grad if dtype is None else grad.to(dtype)
            for grad in grads
            if (dtype or grad.dtype) not in WIDE_REDUCE_DTYPES
        ]
        if grads and not narrow:
            # Its dtypes are fixed at FSDP2's lazy initialization: never checked here.
            self._wide_reduces.add(group)
        if not narrow:
            return
        checks = self._unreduced.get(id(group))
        if checks is None:
            checks = self._unreduced[id(group)] = _GradList(BEFORE, "")
        # As a new list would check them (a tensor-parallel grad: its local shard): a retargeted
        # list takes the tensors as they are.
        data = [local for grad in narrow if (local := checkable(grad)) is not None]
        if not data:
            return
        prepared = checks.prepared([name] * len(data), data)
        owner.log.check_prepared(prepared)
        prepared.let_go()  # FSDP2 frees the unsharded grads after the reduce

    def _after_reduce(self, units: Sequence[tuple[str, Any]]) -> None:
        owner = self._owner_ref()
        if owner is None:
            return
        owner.reached()
        # Read in C-level calls: FSDP2 holds a grad per parameter ([Note: FSDP2's grads read
        # without Python per parameter]).
        fsdp_params, names = self._units_params(units)
        grads = list(map(_SHARDED_GRAD, fsdp_params))
        if any(map(_IS_NONE, grads)):
            kept = [(name, grad) for name, grad in zip(names, grads, strict=True) if grad is not None]
            names, grads = [name for name, _ in kept], [grad for _, grad in kept]
        try:
            seen = list(map(_LOCAL_TENSOR, grads))
        except AttributeError:  # a plain tensor among them
            seen = [getattr(grad, "_local_tensor", grad) for grad in grads]
        owner.seen_grads(seen)
        if any(map(_REQUIRES_GRAD, seen)):
            seen = [local.detach() if local.requires_grad else local for local in seen]
        prepared = self._reduced.prepared(names, seen)
        owner.log.check_prepared(prepared)
        prepared.let_go()  # zero_grad frees the grads

    def _units_params(self, units: Sequence[tuple[str, Any]]) -> tuple[list[Any], list[str]]:
        """Every ``FSDPParam`` of ``units``, in order, and its unit's name: fixed once FSDP2 has
        built its groups (their ``sharded_param`` is not: a ``to_empty`` or an ``assign`` load
        replaces it, so it is read at each reduce)."""
        if self._params_of is None or self._params_of[0] is not units:
            fsdp_params = [fsdp_param for _, group in units for fsdp_param in group.fsdp_params]
            names = [name for name, group in units for _ in group.fsdp_params]
            self._params_of = (units, fsdp_params, names)
        return self._params_of[1], self._params_of[2]


# [Note: FSDP2's grads read without Python per parameter]
# FSDP2 keeps a DTensor grad per parameter, new at every iteration that frees them, and its
# reduce-scatter ends them all at once, in the root's final callback. They are read there by
# ``map`` over C-level getters (``sharded_param.grad``, ``_local_tensor``, ``_version``): about
# 0.05 us a parameter, where a Python loop costs about 1 us. A parameter without a grad (frozen,
# unused this iteration) makes the list filtered in Python, as before.
_SHARDED_GRAD = operator.attrgetter("sharded_param.grad")
_IS_NONE = functools.partial(operator.is_, None)
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_LOCAL_TENSOR = operator.attrgetter("_local_tensor")


def _fsdp2_param_groups(unit: nn.Module) -> list[Any]:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
    except ImportError:  # pragma: no cover - torch built without distributed
        return []
    from fsdp_patch.torch_interop.torch_compat import fsdp2_state_param_groups

    state = _get_module_fsdp_state(unit)
    return [] if state is None else fsdp2_state_param_groups(state)


def _fsdp2_unsharded_grad(fsdp_param: Any) -> torch.Tensor | None:
    if not hasattr(fsdp_param, "_unsharded_param"):
        return None
    accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
    if accumulated is not None:
        return accumulated
    return fsdp_param._unsharded_param.grad
