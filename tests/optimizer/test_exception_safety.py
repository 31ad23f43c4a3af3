"""A step or closure that raises leaves the original grads and a working optimizer.

What each attachment promises (``fsdp_patch/adapter/hook_attachment.py``):

- wrapt: the original grads (bf16 DTensor views of the main-grad buffer, ``grad_dtype``
  bf16) are back as soon as ``step`` raises, and no cast copy is left;
- hooks: a closure error is handled at once too; an error raised after the cast by the
  update itself (here: a step pre-hook registered after the adaptation, or a real error in
  AdamW's update) leaves the cast grads until the next ``step``, backward or undo, which
  repair first and keep what the user did meanwhile.

After the failure, each way of carrying on (step again, ``zero_grad()`` then backward,
``zero_grad(set_to_none=False)`` then backward, backward without zeroing) gives bitwise
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
    ATTACHMENTS,
    EVEN,
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
    grads_snapshot,
    main_weights,
    make_closure,
    optimizer_state,
)

CONTINUATIONS = ("step", "zero_grad", "zero_grad_keep", "accumulate", "undo")


def _any_cast(model: torch.nn.Module) -> bool:
    return any(cast_in_flight(g) for g in parameter_groups(model))


def _failing_update(attachment: str, continuation: str) -> None:
    data = batches(3)
    model, ref = build_model(), build_model()
    opt, ropt = OPTIMIZERS["adamw"](model.parameters()), OPTIMIZERS["adamw"](ref.parameters())
    adapt(opt, attachment)
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

    def boom(*_: Any) -> None:
        if failing["on"]:
            raise RuntimeError("boom inside the step")

    opt.register_step_pre_hook(boom)  # after the adaptation's: runs once grads are cast
    with pytest.raises(RuntimeError, match="boom inside the step"):
        opt.step()
    failing["on"] = False
    assert_same(main_weights(model), weights, "failed step: main weights")
    assert_same(optimizer_state(opt), state, "failed step: optimizer state")
    if attachment == "wrapt":
        assert_grads_original(opt, "wrapt: original grads back at once")
        assert_same(grads_snapshot(model), grads, "wrapt: grad values after the failed step")
    else:
        assert _any_cast(model), "hooks: grads stay cast until repaired (documented), yet no group holds a cast"

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
        assert_grads_original(opt, "repaired by backward")
        assert_same(grads_snapshot(model), grads_snapshot(ref), "grads after backward vs reference")
        opt.step()
        hand.step(ropt)
    elif continuation == "undo":
        remove_fully_shard_optimizer(opt)
        assert_grads_original(opt, "undo repaired")
        assert not _any_cast(model), "undo: a group still holds cast grads"
        assert_same(grads_snapshot(model), grads, "undo: grad values")
        return
    assert_grads_original(opt, "next step: grads")
    assert_same(main_weights(model), main_weights(ref), "next step: main weights vs reference")
    assert_same(optimizer_state(opt), optimizer_state(ropt), "next step: optimizer state vs reference")
    assert_compute_fresh(model, "next step")


@pytest.mark.parametrize("continuation", CONTINUATIONS)
@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_failing_update_then_continue(pool1: Any, attachment: str, continuation: str) -> None:
    pool1.run(_failing_update, attachment, continuation)


def _real_update_error(attachment: str) -> None:
    """AdamW itself raises mid-update (lr=None): grads are repaired, the next step runs."""
    data = batches(2)
    model = build_model()
    opt = OPTIMIZERS["adamw"](model.parameters())
    adapt(opt, attachment)
    backward(model, data[0])
    grads = grads_snapshot(model)
    lr = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = None
    # AdamW multiplies by the learning rate: None there is torch's own TypeError.
    with pytest.raises(TypeError, match="NoneType"):
        opt.step()
    opt.param_groups[0]["lr"] = lr
    if attachment == "wrapt":
        assert_grads_original(opt, "original grads back at once")
        assert_same(grads_snapshot(model), grads, "grad values right after the failure")
    opt.step()
    assert_grads_original(opt, "next step: grads")
    assert_same(grads_snapshot(model), grads, "next step: grad values")
    assert_compute_fresh(model, "next step")
    opt.zero_grad()
    backward(model, data[1])
    opt.step()
    nonfinite = [i for i, w in enumerate(main_weights(model)) if not torch.isfinite(w).all()]
    assert not nonfinite, f"training goes on: groups {nonfinite} hold non-finite main weights"


@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_real_update_error(pool1: Any, attachment: str) -> None:
    pool1.run(_real_update_error, attachment)


def _closure_error(attachment: str) -> None:
    """LBFGS's second closure evaluation raises (the first one's grads were cast): nothing
    stays cast; the next step works."""
    data = batches(2, **EVEN)
    model = build_model(**EVEN)
    opt = OPTIMIZERS["lbfgs"](model.parameters())
    adapt(opt, attachment)
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


@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_closure_error(pool1: Any, attachment: str) -> None:
    pool1.run(_closure_error, attachment)
