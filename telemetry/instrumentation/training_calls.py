"""Process-wide wrappers on torch's training calls, through which model watches and observers see
what no hook of the model or the optimizer shows.

- ``torch.autograd.backward`` (``Tensor.backward`` calls it): each registered
  :class:`~.model_watch.ModelWatch` checks the loss before the pass and counts it after, where the
  pass proves its model's; the listeners of :func:`listen_before_backward` (the late adaptation's
  pending optimizers) run first.
- ``torch.amp.GradScaler.step``: a registered optimizer's observer is told the loss was scaled,
  and of a step the scaler skipped (with the scale).
- ``torch.nn.utils.clip_grad_norm_`` (and ``torch.nn.utils.clip_grad``'s, through which callers
  may reach it too): the total norm it returns is checked by the watch of the model whose
  parameters it clipped (its first parameter decides).

The wrappers go in with the first registration (:func:`watch_optimizer_steps`,
:func:`listen_before_backward`) and are removed, exactly, with the last; ``process_wide.CHANGES``
lists them.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import wrapt

from .. import semconv
from ..diagnostics.probes import CLIP
from .model_watch import ModelWatch

__all__ = ["listen_before_backward", "watch_optimizer_steps"]

_watches: weakref.WeakSet[ModelWatch] = weakref.WeakSet()
_observers: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()
_installed: dict[str, tuple[Any, str, Any]] = {}
# Re-entrant: a registration allocates while holding it, and any allocation may run the garbage
# collector, whose finalizers (an optimizer collected in a reference cycle) unregister on this
# thread; a plain lock deadlocks the process there.
_install_lock = threading.RLock()
# Called before each backward, ahead of the watches (the late adaptation's pending optimizers).
_backward_listeners: list[Callable[[], None]] = []


def _on_backward(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensors = args[0] if args else kwargs.get("tensors")
    for listener in list(_backward_listeners):
        listener()  # may adapt an optimizer: its watches, registered now, check this backward too
    watches = list(_watches)
    for watch in watches:
        watch.before_backward(tensors)
    try:
        return wrapped(*args, **kwargs)
    finally:
        for watch in watches:
            watch.after_backward()


def _on_scaler_step(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    optimizer = args[0] if args else kwargs.get("optimizer")
    observer = _observers.get(optimizer) if optimizer is not None else None
    if observer is None:
        return wrapped(*args, **kwargs)
    observer.loss_scaled()
    steps = observer.step_count
    result = wrapped(*args, **kwargs)
    if observer.step_count == steps:
        observer.step_skipped(_scale(instance))
    return result


def _on_clip(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    parameters = args[0] if args else kwargs.get("parameters")
    if parameters is not None and not isinstance(parameters, torch.Tensor):
        parameters = list(parameters)  # a generator is read here once, and clipped as this list
        if args:
            args = (parameters, *args[1:])
        else:
            kwargs = {**kwargs, "parameters": parameters}
    clipped = [parameters] if isinstance(parameters, torch.Tensor) else parameters or []
    watches = [watch for watch in list(_watches) if watch.parameters.hold_any(clipped)]
    max_norm = args[1] if len(args) > 1 else kwargs.get("max_norm")
    positive = isinstance(max_norm, int | float) and math.isfinite(max_norm) and max_norm > 0
    params = [watch.parameters.listed() for watch in watches]
    unmoved = [positive and not w.checked_grads.moved(p) for w, p in zip(watches, params, strict=True)]
    total_norm = wrapped(*args, **kwargs)
    if isinstance(total_norm, torch.Tensor):
        for watch, listed, kept in zip(watches, params, unmoved, strict=True):
            watch.log.check(semconv.ORIGIN_GRAD_WRITE, CLIP, total_norm)
            # [Note: a clip that zeroes the grads]: none checked after one that may; as the backward
            # left them after one by a positive factor, where nothing else wrote them before it.
            if not positive:
                watch.checked_grads.clear()
            elif kept:
                watch.checked_grads.snapshot(listed)
    return total_norm


def _scale(scaler: Any) -> float:
    try:
        scale = float(scaler.get_scale())
    except Exception:  # pragma: no cover - a scaler of another shape
        return math.nan
    return scale


def _install(key: str, owner: Any, attribute: str, wrapper: Callable[..., Any]) -> None:
    original = getattr(owner, attribute)
    setattr(owner, attribute, wrapt.FunctionWrapper(original, wrapper))
    _installed[key] = (owner, attribute, original)


def _uninstall(key: str) -> None:
    owner, attribute, original = _installed.pop(key)
    current = getattr(owner, attribute)
    if getattr(current, "__wrapped__", None) is original:
        setattr(owner, attribute, original)


_registrations = 0


def _registration(add: Callable[[], None], remove: Callable[[], None]) -> Callable[[], None]:
    """Run ``add`` as one more registration (the wrappers go in with the first); returns the function
    that runs ``remove`` once and takes the registration back (the wrappers go with the last)."""
    global _registrations
    with _install_lock:
        # Counted before anything allocates: a finalizer's unregister run from in here (see
        # _install_lock) then never brings the count to 0 and takes the wrappers away.
        _registrations += 1
        try:
            if _registrations == 1:
                _install("backward", torch.autograd, "backward", _on_backward)
                _install("scaler", torch.amp.GradScaler, "step", _on_scaler_step)
                # Callers reach it through either module at call time (torch.nn.utils re-exports it).
                _install("clip", torch.nn.utils, "clip_grad_norm_", _on_clip)
                _install("clip_module", torch.nn.utils.clip_grad, "clip_grad_norm_", _on_clip)
            add()
        except BaseException:
            remove()  # whatever add() did before it raised (removing is safe where nothing was added)
            _release_one()
            raise
    done = False

    def unregister() -> None:
        nonlocal done
        with _install_lock:
            if done:
                return
            done = True
            remove()
            _release_one()

    return unregister


def _release_one() -> None:
    """One registration taken back (under ``_install_lock``); the wrappers go with the last."""
    global _registrations
    _registrations -= 1
    if _registrations == 0:
        for key in list(_installed):
            _uninstall(key)


def watch_optimizer_steps(
    watches: Sequence[ModelWatch], optimizer: torch.optim.Optimizer, observer: Any
) -> Callable[[], None]:
    """Register ``watches`` (their backward passes) and ``observer`` (its optimizer's skipped
    steps) with the process-wide wrappers, installing them for the first registration.

    Returns:
        A function that unregisters both (once) and removes the wrappers after the last
        registration.
    """
    optimizer_ref = weakref.ref(optimizer)

    def add() -> None:
        for watch in watches:
            _watches.add(watch)
        _observers[optimizer] = observer

    def remove() -> None:
        for watch in watches:
            _watches.discard(watch)
        held = optimizer_ref()
        if held is not None and _observers.get(held) is observer:
            del _observers[held]

    return _registration(add, remove)


def listen_before_backward(listener: Callable[[], None]) -> Callable[[], None]:
    """Call ``listener`` before each backward (``torch.autograd.backward``) through the same
    process-wide wrapper as the watches, installed while any registration lives: one wrapper, so
    registrations may come and go in any order and the original comes back exactly.

    Returns:
        A function that unregisters it (once; safe from inside the listener).
    """
    return _registration(lambda: _backward_listeners.append(listener), lambda: _backward_listeners.remove(listener))
