"""The adapter's cast buffers, who holds them and when they go: several optimizers over one model
(each holding part of the same groups), an optimizer spanning a group another holds, the main grads
released during the step, undo (``remove_fully_shard_optimizer``) releasing the buffers after a
step or a failed one, the ``keep_cast_buffers`` knob and ``cast_buffer_bytes``. Each scenario
trains against a hand-cast reference as ``test_fast_path.py`` describes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_patch import cast_buffer_bytes, keep_cast_buffers, parameter_groups
from fsdp_patch.adapter import remove_fully_shard_optimizer
from tests.optimizer.fast_path_pairs import FP32_BYTES, Pair, adamw, expected_cast_bytes
from tests.optimizer.support import (
    OBSERVERS,
    HandCast,
    O,
    adapt,
    assert_changed,
    assert_compute_fresh,
    assert_grads_original,
    assert_same,
    backward,
    batches,
    build_model,
    fsdp_params,
    grads_snapshot,
    local,
    main_weights,
)


def _several_optimizers(observer: str, keep: bool | None = None) -> None:
    """Three optimizers over one model: alternate parameters, and the head's bias alone. With
    ``keep=False`` the buffers are freed after each step; no optimizer covers a whole group
    then, so none may free the main grads the others still step on."""
    data = batches(4)
    built = {kind: build_model() for kind in ("adapted", "ref")}
    opts: dict[str, list[torch.optim.Optimizer]] = {}
    for kind, model in built.items():
        params = list(model.parameters())
        bias = model.head.bias
        rest = [p for p in params if p is not bias]
        opts[kind] = [adamw(rest[0::2]), adamw(rest[1::2]), O.SGD([bias], lr=0.1)]
    for opt in opts["adapted"]:
        adapt(opt, observer)
        if keep is not None:
            keep_cast_buffers(opt, keep)
    for step, tokens in enumerate(data):
        for model in built.values():
            backward(model, tokens)
        for index, (opt, ref_opt) in enumerate(zip(opts["adapted"], opts["ref"], strict=True)):
            opt.step()
            HandCast(fsdp_params(ref_opt)).step(ref_opt)
            assert_grads_original(opt, f"step {step}, optimizer {index}")
            # Each optimizer zeroes only its own parameters: the next one still finds its grads.
            opt.zero_grad()
            ref_opt.zero_grad()
        assert_same(main_weights(built["adapted"]), main_weights(built["ref"]), f"step {step}: main weights")
        assert_compute_fresh(built["adapted"], f"step {step}")
    if keep is False:
        held = [cast_buffer_bytes(opt) for opt in opts["adapted"]]
        assert held == [0] * len(held), f"freed buffers: cast-buffer bytes after the steps {held}, want 0 each"
        return
    for index, opt in enumerate(opts["adapted"]):
        got, want = cast_buffer_bytes(opt), expected_cast_bytes(fsdp_params(opt))
        assert got == want, f"optimizer {index}: cast buffer of {got} bytes, want {want} (its own parameters' span)"
    whole = sum(g.layout.shard_numel for g in parameter_groups(built["adapted"])) * FP32_BYTES
    sliver = cast_buffer_bytes(opts["adapted"][2])
    assert sliver * 100 < whole, f"the bias-only optimizer's buffer: {sliver} bytes of the model's {whole}"


@pytest.mark.parametrize("keep", (None, False), ids=("buffers default", "buffers freed"))
@pytest.mark.parametrize("observer", OBSERVERS)
def test_several_optimizers_over_one_model(pool2: Any, observer: str, keep: bool | None) -> None:
    pool2.run(_several_optimizers, observer, keep)


class _Planted(RuntimeError):
    pass


def _split_group(observer: str) -> None:
    """Buffers freed; per FSDP group, one optimizer holds every parameter but a middle one, so
    its cast spans the whole buffer, and a second optimizer holds the middle one: the first must
    not free main grads the second steps on after it."""
    data = batches(2)
    built = {kind: build_model() for kind in ("adapted", "ref")}
    opts: dict[str, list[torch.optim.Optimizer]] = {}
    for kind, model in built.items():
        middles = {id(g.params[len(g.params) // 2]) for g in parameter_groups(model) if len(g.params) >= 3}
        params = list(model.parameters())
        opts[kind] = [
            adamw([p for p in params if id(p) not in middles]),
            adamw([p for p in params if id(p) in middles]),
        ]
    for opt in opts["adapted"]:
        adapt(opt, observer)
        keep_cast_buffers(opt, False)
    assert fsdp_params(opts["adapted"][1]), "no FSDP group has a middle parameter"
    fail = {"now": True}

    def planted(opt: Any, args: Any, kwargs: Any) -> None:
        if fail["now"]:
            fail["now"] = False
            raise _Planted("the first optimizer's first step fails after its cast")

    opts["adapted"][0].register_step_pre_hook(planted)
    for step, tokens in enumerate(data):
        for model in built.values():
            backward(model, tokens)
        if step == 0:
            # The failed step has put its grads back when the error arrives: the second
            # optimizer steps next, on the middle parameters' main grads.
            with pytest.raises(_Planted, match="fails after its cast"):
                opts["adapted"][0].step()
            assert_grads_original(opts["adapted"][0], "step 0, optimizer 0 after its failed step")
        # After the failure the second optimizer goes first (its parameters are disjoint from
        # the first's, so the order changes nothing in the reference).
        order = (1, 0) if step == 0 else (0, 1)
        for index in order:
            opt, ref_opt = opts["adapted"][index], opts["ref"][index]
            opt.step()
            HandCast(fsdp_params(ref_opt)).step(ref_opt)
            assert_grads_original(opt, f"step {step}, optimizer {index}")
        assert_same(main_weights(built["adapted"]), main_weights(built["ref"]), f"step {step}: main weights")
        for opt in (*opts["adapted"], *opts["ref"]):
            opt.zero_grad()


@pytest.mark.parametrize("observer", OBSERVERS)
def test_an_optimizer_spanning_a_group_frees_nothing_another_holds(pool2: Any, observer: str) -> None:
    pool2.run(_split_group, observer)


def _main_grads_released_in_step(observer: str) -> None:
    """Buffers freed between steps: while the update runs, the main grads' memory is free (the
    fp32 copies stand in); afterwards they hold exactly what they held before the step, also
    when the step raised after the cast."""
    data = batches(3)
    pair = Pair(observer)
    keep_cast_buffers(pair.opt, False)
    groups = parameter_groups(pair.model)
    during: list[list[int]] = []
    before: dict[int, list[Any]] = {}
    fail = {"now": False}

    def record(opt: Any, args: Any, kwargs: Any) -> None:  # runs after the adapter's cast
        during.append([g.main_grad_storage_bytes() for g in groups])
        if fail["now"]:
            raise _Planted("planted failure inside the step")

    pair.opt.register_step_pre_hook(record)

    def snapshot(model: torch.nn.Module, opt: Any) -> None:
        before[id(model)] = grads_snapshot(model)

    pair.step("released", data[0], zero=None, before_step=snapshot)
    assert during[-1] == [0] * len(groups), f"main-grad bytes per group during the step: {during[-1]}, want 0"
    assert_same(grads_snapshot(pair.model), before[id(pair.model)], "after the step: main grads vs before it")
    back = [g.main_grad_storage_bytes() for g in groups]
    assert all(back), f"main-grad bytes per group after the step: {back}, want all held"
    pair.both(lambda model, opt: opt.zero_grad(set_to_none=True))

    backward(pair.model, data[1])
    want = grads_snapshot(pair.model)
    fail["now"] = True
    with pytest.raises(_Planted, match="planted failure inside the step"):
        pair.opt.step()
    fail["now"] = False
    # The main grads are back at once, holding what they held before the step.
    assert_grads_original(pair.opt, "after the failed step")
    assert_same(grads_snapshot(pair.model), want, "after the failed step: grad values")
    main_weights_before = main_weights(pair.model)
    pair.opt.step()
    assert_same(grads_snapshot(pair.model), want, "after the retried step: main grads")
    assert_changed(main_weights(pair.model), main_weights_before, "the retried step: main weights")
    held = cast_buffer_bytes(pair.opt)
    assert held == 0, f"cast-buffer bytes after the retried step: {held}, want 0 (freed)"


@pytest.mark.parametrize("observer", OBSERVERS)
def test_main_grads_released_during_the_step(pool2: Any, observer: str) -> None:
    pool2.run(_main_grads_released_in_step, observer)


def _undo_releases(observer: str, fail: bool) -> None:
    data = batches(2)
    model = build_model()
    opt = adamw(model.parameters())
    adapt(opt, observer)
    captured: list[torch.Tensor] = []
    opt.register_step_pre_hook(
        lambda o, a, k: captured.append(next(p.grad for p in fsdp_params(o) if p.grad is not None))
    )
    backward(model, data[0])
    opt.step()
    got, want = cast_buffer_bytes(opt), expected_cast_bytes(fsdp_params(opt))
    assert got == want, f"kept on the CPU after a step: {got} bytes, want {want}"
    if fail:
        # An update that raises after the cast: the grads are back, the kept buffer still holds memory.
        def boom(o: Any, a: Any, k: Any) -> None:
            raise RuntimeError("update failed")

        handle = opt.register_step_pre_hook(boom)
        backward(model, data[1])
        with pytest.raises(RuntimeError, match="update failed"):
            opt.step()
        handle.remove()
    view = captured[-1]
    held = local(view).untyped_storage().nbytes()
    assert held > 0, f"the captured cast view holds {held} bytes before the undo, want some"
    remove_fully_shard_optimizer(opt)
    held = local(view).untyped_storage().nbytes()
    assert held == 0, f"undo: the captured cast view still holds {held} bytes"
    assert_grads_original(opt, "undo: grads are the original views")
    with pytest.raises(ValueError, match="unadapted AdamW"):
        cast_buffer_bytes(opt)


@pytest.mark.parametrize("fail", (False, True), ids=("after a step", "after a failed step"))
@pytest.mark.parametrize("observer", OBSERVERS)
def test_undo_releases_the_cast_buffers(pool1: Any, observer: str, fail: bool) -> None:
    pool1.run(_undo_releases, observer, fail)


def _memory_knob(observer: str) -> None:
    data = batches(5)
    pair = Pair(observer)
    want = expected_cast_bytes(fsdp_params(pair.opt))

    def assert_bytes(want: int, what: str) -> None:
        got = cast_buffer_bytes(pair.opt)
        assert got == want, f"{what}: {got} cast-buffer bytes, want {want}"

    assert_bytes(0, "before the first step")
    keep_cast_buffers(pair.opt, False)
    pair.step("freed between steps, step 1", data[0])
    assert_bytes(0, "freed, between steps")
    pair.step("freed between steps, step 2", data[1])
    pair.spy.assert_reused(fsdp_params(pair.opt), "freed: views re-materialized", same_memory=False)
    keep_cast_buffers(pair.opt, True)
    pair.step("kept", data[2])
    assert_bytes(want, "kept, between steps")
    keep_cast_buffers(pair.opt, None)
    pair.step("default (CPU: kept)", data[3])
    assert_bytes(want, "default on the CPU (kept)")
    plain = adamw(build_model().parameters())
    for call, error, names in (
        (lambda: keep_cast_buffers(plain, False), ValueError, "unadapted AdamW"),
        (lambda: cast_buffer_bytes("opt"), ValueError, "'opt'"),
        (lambda: keep_cast_buffers(pair.opt, "no"), TypeError, "'no'"),
    ):
        with pytest.raises(error, match=names):
            call()
    assert_bytes(want, "after the refusals")
    pair.step("after the refusals", data[4])


@pytest.mark.parametrize("observer", OBSERVERS)
def test_keep_cast_buffers_and_their_bytes(pool2: Any, observer: str) -> None:
    pool2.run(_memory_knob, observer)
