"""A step or closure that raises leaves the original grads and a working optimizer.

The promise (``fsdp_patch/adapter/wrapt_attachment.py``), telemetry off (a ``NullObserver``) as
with an observer: the original grads (bf16 DTensor views of the main-grad buffer,
``grad_dtype`` bf16) are back as soon as ``step`` raises, and no cast copy is left, whether the
error came after the cast from the update itself (here: a step pre-hook registered after the
adaptation, or a real error in AdamW's update) or from a closure.

After the failure, each way of carrying on (step again, ``zero_grad()`` then backward,
``zero_grad(set_to_none=False)`` then backward, backward without zeroing, undo) gives bitwise
the grads and weights of a reference that never failed and did the same.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_patch import parameter_groups
from fsdp_patch.adapter import remove_fully_shard_optimizer
from fsdp_patch.adapter.grad_cast import cast_in_flight
from tests.optimizer.support import (
    EVEN,
    FP32,
    OBSERVERS,
    OPTIMIZERS,
    HandCast,
    adapt,
    assert_compute_fresh,
    assert_grads_original,
    assert_same,
    backward,
    batches,
    build_model,
    fsdp_params,
    grad_dtypes,
    grads_snapshot,
    main_weights,
    make_closure,
    optimizer_state,
)

CONTINUATIONS = ("step", "zero_grad", "zero_grad_keep", "accumulate", "undo")


def _any_cast(model: torch.nn.Module) -> bool:
    return any(cast_in_flight(g) for g in parameter_groups(model))


def _failing_update(observer: str, continuation: str) -> None:
    data = batches(3)
    model, ref = build_model(), build_model()
    opt, ropt = OPTIMIZERS["adamw"](model.parameters()), OPTIMIZERS["adamw"](ref.parameters())
    adapt(opt, observer)
    hand = HandCast(fsdp_params(ref))

    for m in (model, ref):
        backward(m, data[0])
    opt.step()
    hand.step(ropt)
    opt.zero_grad()
    ropt.zero_grad()

    for m in (model, ref):
        backward(m, data[1])
    grads, weights, state = grads_snapshot(model), main_weights(model), optimizer_state(opt)
    failing = {"on": True}
    seen: list[set[torch.dtype]] = []

    def boom(o: torch.optim.Optimizer, *_: Any) -> None:
        if failing["on"]:
            seen.append(grad_dtypes(o))
            raise RuntimeError("boom inside the step")

    opt.register_step_pre_hook(boom)  # runs inside the wrapped step, once grads are cast
    with pytest.raises(RuntimeError, match="boom inside the step"):
        opt.step()
    failing["on"] = False
    assert seen == [{FP32}], f"{observer}: grad dtypes when the step raised: got {seen}, want [{{{FP32}}}] (cast)"
    assert_same(main_weights(model), weights, "failed step: main weights")
    assert_same(optimizer_state(opt), state, "failed step: optimizer state")
    assert_grads_original(opt, f"{observer}: original grads back at once")
    assert not _any_cast(model), f"{observer}: a group still holds cast grads after the failed step"
    assert_same(grads_snapshot(model), grads, f"{observer}: grad values after the failed step")

    if continuation == "step":
        opt.step()
        hand.step(ropt)
    elif continuation in ("zero_grad", "zero_grad_keep", "accumulate"):
        if continuation != "accumulate":
            set_to_none = continuation == "zero_grad"
            opt.zero_grad(set_to_none=set_to_none)
            ropt.zero_grad(set_to_none=set_to_none)
        for m in (model, ref):
            backward(m, data[2])
        assert_grads_original(opt, "after backward")
        assert_same(grads_snapshot(model), grads_snapshot(ref), "grads after backward vs reference")
        opt.step()
        hand.step(ropt)
    elif continuation == "undo":
        remove_fully_shard_optimizer(opt)
        assert_grads_original(opt, "undo")
        assert not _any_cast(model), "undo: a group still holds cast grads"
        assert_same(grads_snapshot(model), grads, "undo: grad values")
        return
    assert_grads_original(opt, "next step: grads")
    assert_same(main_weights(model), main_weights(ref), "next step: main weights vs reference")
    assert_same(optimizer_state(opt), optimizer_state(ropt), "next step: optimizer state vs reference")
    assert_compute_fresh(model, "next step")


@pytest.mark.parametrize("continuation", CONTINUATIONS)
@pytest.mark.parametrize("observer", OBSERVERS)
def test_failing_update_then_continue(pool1: Any, observer: str, continuation: str) -> None:
    pool1.run(_failing_update, observer, continuation)


def _real_update_error(observer: str) -> None:
    """AdamW itself raises mid-update (lr=None): the original grads are back when the error
    arrives, telemetry off as with an observer; the next step runs."""
    data = batches(2)
    model = build_model()
    opt = OPTIMIZERS["adamw"](model.parameters())
    adapt(opt, observer)
    backward(model, data[0])
    grads = grads_snapshot(model)
    lr = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = None
    seen: list[set[torch.dtype]] = []
    handle = opt.register_step_pre_hook(lambda o, a, k: seen.append(grad_dtypes(o)))
    # AdamW multiplies by the learning rate: None there is torch's own TypeError.
    with pytest.raises(TypeError, match="NoneType"):
        opt.step()
    handle.remove()
    opt.param_groups[0]["lr"] = lr
    assert seen == [{FP32}], f"{observer}: grad dtypes the failing update got: {seen}, want [{{{FP32}}}] (cast)"
    assert_grads_original(opt, f"{observer}: original grads back at once")
    assert_same(grads_snapshot(model), grads, f"{observer}: grad values right after the failure")
    opt.step()
    assert_grads_original(opt, "next step: grads")
    assert_same(grads_snapshot(model), grads, "next step: grad values")
    assert_compute_fresh(model, "next step")
    opt.zero_grad()
    backward(model, data[1])
    opt.step()
    nonfinite = [i for i, w in enumerate(main_weights(model)) if not torch.isfinite(w).all()]
    assert not nonfinite, f"training goes on: groups {nonfinite} hold non-finite main weights"


@pytest.mark.parametrize("observer", OBSERVERS)
def test_real_update_error_restores_grads_at_once(pool1: Any, observer: str) -> None:
    pool1.run(_real_update_error, observer)


def _closure_error(observer: str) -> None:
    """LBFGS's second closure evaluation raises (the first one's grads were cast): nothing
    stays cast; the next step works."""
    data = batches(2, **EVEN)
    model = build_model(**EVEN)
    opt = OPTIMIZERS["lbfgs"](model.parameters())
    adapt(opt, observer)
    calls = {"n": 0}
    inner = make_closure(model, opt, data[0])

    def closure() -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("closure boom")
        return inner()

    with pytest.raises(RuntimeError, match="closure boom"):
        opt.step(closure)
    assert calls["n"] == 2, f"closure calls before the failure: got {calls['n']}, want 2"
    assert_grads_original(opt, "original grads back at once")
    assert not _any_cast(model), "a group still holds cast grads after the closure failed"
    # torch's LBFGS keeps half-updated bookkeeping (n_iter without prev_flat_grad) after a
    # failure inside its step and cannot take another one from there; start it over.
    opt.state.clear()
    loss = opt.step(make_closure(model, opt, data[1]))
    assert bool(torch.isfinite(torch.as_tensor(loss))), f"next step: loss {loss}, want finite"
    assert_grads_original(opt, "next step: grads")
    assert_compute_fresh(model, "next step")


@pytest.mark.parametrize("observer", OBSERVERS)
def test_closure_error(pool1: Any, observer: str) -> None:
    pool1.run(_closure_error, observer)
