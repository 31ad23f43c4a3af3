"""Profiler labels: every phase of ``fully_shard`` and of an adapted step, by name in a trace.

A ``torch.profiler`` trace shows torch FSDP2's phases as ``FSDP::all_gather``,
``FSDP::post_backward_reduce``, ...; this package's show as ``fsdp_patch::<phase>`` (the names are
:data:`LABELS`): the all-gather (its copy-in and issue) and its wait (with the copy-out), the
reduce-scatter (its packing and issue) and its wait, HSDP's all-reduce, the compute copy's cast,
the reshard, the grads' finalization, and the adapted step's cast of the grads, inner step,
restore, refresh and precision diagnostics.

A label is a ``torch.profiler.record_function`` opened only while a profiler records
(``torch.autograd.profiler`` says so in one call): a step nobody profiles pays a boolean test per
phase, not a dispatcher call.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["LABELS", "PREFIX", "around", "label", "labelled"]

PREFIX = "fsdp_patch::"
LABELS = (
    "all_gather",
    "all_gather_wait",
    "reduce_scatter",
    "reduce_scatter_wait",
    "all_reduce",
    "cast_compute_weight",
    "reshard",
    "finalize_grads",
    "step.cast_grads",
    "step.inner_step",
    "step.restore_grads",
    "step.refresh",
    "step.precision",
)
"""Every label this package writes, without :data:`PREFIX`."""

_F = TypeVar("_F", bound=Callable[..., Any])


def _recording() -> bool:
    return bool(torch.autograd.profiler._is_profiler_enabled)


def label(name: str) -> contextlib.AbstractContextManager[Any]:
    """``fsdp_patch::<name>`` around a block while a profiler records; nothing otherwise."""
    if _recording():
        return torch.profiler.record_function(PREFIX + name)
    return contextlib.nullcontext()


def labelled(name: str) -> Callable[[_F], _F]:
    """Labels every call of the decorated function ``fsdp_patch::<name>`` while a profiler records."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not _recording():
                return fn(*args, **kwargs)
            with torch.profiler.record_function(PREFIX + name):
                return fn(*args, **kwargs)

        return cast(_F, wrapper)

    return decorate


class _Around:
    """A label around another context manager (entered inside the label, left before it)."""

    __slots__ = ("_label", "_scope")

    def __init__(self, name: str, scope: contextlib.AbstractContextManager[Any]) -> None:
        self._label = torch.profiler.record_function(PREFIX + name)
        self._scope = scope

    def __enter__(self) -> Any:
        self._label.__enter__()
        try:
            return self._scope.__enter__()
        except BaseException:
            self._label.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self._scope.__exit__(*exc)
        finally:
            self._label.__exit__(None, None, None)


def around(name: str, scope: contextlib.AbstractContextManager[Any]) -> contextlib.AbstractContextManager[Any]:
    """``scope`` inside the label ``fsdp_patch::<name>`` while a profiler records; ``scope`` alone otherwise."""
    return _Around(name, scope) if _recording() else scope
