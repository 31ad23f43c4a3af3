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
    assert_all,
    backward,
    batches,
    build_model,
    compute_is_fresh,
    fsdp_params,
    grads_are_original,
    grads_snapshot,
    main_weights,
    make_closure,
    optimizer_state,
    same,
)

CONTINUATIONS = ("step", "zero_grad", "zero_grad_keep", "accumulate", "undo")


def _any_cast(model: torch.nn.Module) -> bool:
    return any(cast_in_flight(g) for g in parameter_groups(model))


def _failing_update(attachment: str, continuation: str) -> dict[str, bool]:
    data = batches(3)
    model, ref = build_model(), build_model()
    opt, ropt = OPTIMIZERS["adamw"](model.parameters()), OPTIMIZERS["adamw"](ref.parameters())
    adapt(opt, attachment)
    hand = HandCast(fsdp_params(ref))
    checks: dict[str, bool] = {}

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
    try:
        opt.step()
        checks["step raised"] = False
    except RuntimeError as exc:
        checks["step raised"] = "boom" in str(exc)
    failing["on"] = False
    checks["failed step changed no weights"] = same(main_weights(model), weights)
    checks["failed step changed no state"] = same(optimizer_state(opt), state)
    if attachment == "wrapt":
        checks["wrapt: original grads back at once"] = grads_are_original(opt) is None
        checks["wrapt: same grad values"] = same(grads_snapshot(model), grads)
    else:
        checks["hooks: grads stay cast until repaired (documented)"] = _any_cast(model)

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
        checks["repaired by backward"] = grads_are_original(opt) is None
        checks["grads after backward == reference"] = same(grads_snapshot(model), grads_snapshot(ref))
        opt.step()
        hand.step(ropt)
    elif continuation == "undo":
        remove_fully_shard_optimizer(opt)
        checks["undo repaired"] = grads_are_original(opt) is None and not _any_cast(model)
        checks["undo: same grad values"] = same(grads_snapshot(model), grads)
        return checks
    checks["next step works: grads original"] = grads_are_original(opt) is None
    checks["next step: weights == reference"] = same(main_weights(model), main_weights(ref))
    checks["next step: state == reference"] = same(optimizer_state(opt), optimizer_state(ropt))
    checks["next step: compute copy fresh"] = compute_is_fresh(model)
    return checks


@pytest.mark.parametrize("continuation", CONTINUATIONS)
@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_failing_update_then_continue(pool1: Any, attachment: str, continuation: str) -> None:
    assert_all(pool1.run(_failing_update, attachment, continuation))


def _real_update_error(attachment: str) -> dict[str, bool]:
    """AdamW itself raises mid-update (lr=None): grads are repaired, the next step runs."""
    data = batches(2)
    model = build_model()
    opt = OPTIMIZERS["adamw"](model.parameters())
    adapt(opt, attachment)
    backward(model, data[0])
    grads = grads_snapshot(model)
    lr = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = None
    checks: dict[str, bool] = {}
    try:
        opt.step()
        checks["AdamW raised"] = False
    except TypeError:
        checks["AdamW raised"] = True
    opt.param_groups[0]["lr"] = lr
    if attachment == "wrapt":
        checks["original grads back at once"] = grads_are_original(opt) is None and same(grads_snapshot(model), grads)
    opt.step()
    checks["next step: grads original"] = grads_are_original(opt) is None and same(grads_snapshot(model), grads)
    checks["next step: compute copy fresh"] = compute_is_fresh(model)
    opt.zero_grad()
    backward(model, data[1])
    opt.step()
    checks["training goes on: weights finite"] = all(torch.isfinite(w).all() for w in main_weights(model))
    return checks


@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_real_update_error(pool1: Any, attachment: str) -> None:
    assert_all(pool1.run(_real_update_error, attachment))


def _closure_error(attachment: str) -> dict[str, bool]:
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

    checks: dict[str, bool] = {}
    try:
        opt.step(closure)
        checks["step raised"] = False
    except RuntimeError as exc:
        checks["step raised"] = "closure boom" in str(exc)
    checks["closure ran once before failing"] = calls["n"] == 2
    checks["original grads back at once"] = grads_are_original(opt) is None and not _any_cast(model)
    # torch's LBFGS keeps half-updated bookkeeping (n_iter without prev_flat_grad) after a
    # failure inside its step and cannot take another one from there; start it over.
    opt.state.clear()
    loss = opt.step(make_closure(model, opt, data[1]))
    checks["next step works"] = bool(torch.isfinite(torch.as_tensor(loss)))
    checks["next step: grads original"] = grads_are_original(opt) is None
    checks["next step: compute copy fresh"] = compute_is_fresh(model)
    return checks


@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_closure_error(pool1: Any, attachment: str) -> None:
    assert_all(pool1.run(_closure_error, attachment))
