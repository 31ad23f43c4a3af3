"""The process-wide wrappers of ``training_calls`` (``torch.autograd.backward``, ``GradScaler.step``,
``clip_grad_norm_``): a registration made while the garbage collector finalizes an optimizer
collected in a reference cycle (whose finalizer unregisters on the same thread) neither deadlocks
nor takes the wrappers away; a registration whose adding raises leaves everything as it was; each
attribute comes back to what it was, the very same object (torch's original after the last
registration).

Each test runs its registrations in a thread joined with a timeout, so that a deadlock fails the
test instead of hanging the suite.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import wrapt
from fsdp_patch.telemetry.instrumentation import training_calls

WRAPPED = {
    "torch.autograd.backward": lambda: torch.autograd.backward,
    "torch.amp.GradScaler.step": lambda: torch.amp.GradScaler.__dict__["step"],
    "torch.nn.utils.clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_,
    "torch.nn.utils.clip_grad.clip_grad_norm_": lambda: torch.nn.utils.clip_grad.clip_grad_norm_,
}


def _current() -> dict[str, Any]:
    return {name: get() for name, get in WRAPPED.items()}


def _in_thread(body: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = body()
        except BaseException as exc:  # re-raised in the test's thread
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"the registrations did not finish in {timeout_s:.0f} s: deadlocked"
    if "error" in out:
        raise out["error"]
    return out.get("result")


class _Cyclic:
    """An object only the garbage collector frees (it refers to itself), like an optimizer held in
    a reference cycle by a training loop's closure."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _collected() -> None:
    gc.collect()  # an earlier test's optimizers, and the registrations they hold, go first


def test_a_finalizer_that_unregisters_inside_a_registration_neither_deadlocks_nor_removes_the_wrappers() -> None:
    start, originals = training_calls._registrations, _current()

    def body() -> dict[str, Any]:
        # The first registration belongs to an object collected in a cycle, as IterationWatch
        # ties its unregistration to the optimizer (weakref.finalize).
        first = training_calls._registration(lambda: None, lambda: None)
        dead = _Cyclic()
        weakref.finalize(dead, first)
        del dead
        wrapped_before = _current()
        # The second registration's add allocates; the collector runs there, and with it the
        # first's unregistration, on this thread, while the registration holds its lock.
        second = training_calls._registration(gc.collect, lambda: None)
        during = {"registrations": training_calls._registrations, "wrappers": _current()}
        second()
        return {"before": wrapped_before, "during": during, "after": _current(), "left": training_calls._registrations}

    got = _in_thread(body)
    wrapped = sorted(name for name, fn in got["before"].items() if isinstance(fn, wrapt.FunctionWrapper))
    assert wrapped == sorted(WRAPPED), f"wrapped while a registration lives: got {wrapped}, want {sorted(WRAPPED)}"
    assert got["during"]["registrations"] == start + 1, (
        f"registrations once the first was finalized inside the second: got {got['during']['registrations']}, "
        f"want {start + 1}"
    )
    kept = sorted(name for name, fn in got["during"]["wrappers"].items() if fn is got["before"][name])
    assert kept == sorted(WRAPPED), f"wrappers kept while the second registration lives: got {kept}, want all"
    restored = sorted(name for name, fn in got["after"].items() if fn is originals[name])
    assert restored == sorted(WRAPPED), f"as before the test after the last: got {restored}, want {sorted(WRAPPED)}"
    assert got["left"] == start, f"registrations left: got {got['left']}, want {start}"


def test_a_registration_whose_add_raises_leaves_nothing_behind() -> None:
    start, originals = training_calls._registrations, _current()
    removed: list[str] = []

    def add() -> None:
        raise RuntimeError("add failed")

    def body() -> None:
        training_calls._registration(add, lambda: removed.append("remove"))

    with pytest.raises(RuntimeError, match="^add failed$"):
        _in_thread(body)
    changed = sorted(name for name, fn in _current().items() if fn is not originals[name])
    assert changed == [], f"wrappers left after a failed registration: {changed}"
    assert training_calls._registrations == start, (
        f"registrations left: got {training_calls._registrations}, want {start}"
    )
    assert removed == ["remove"], f"what the failed registration took back: got {removed}, want ['remove']"
