"""The adapter's fast path (cached plan, reused cast buffer and DTensor views) stays correct.

Each scenario trains an adapted model and a hand-cast reference (an unadapted optimizer whose
grads the test casts by hand) side by side on 2 ranks, doing the same thing to both between
steps, and checks after every step: main weights and optimizer state bitwise equal to the
reference, the compute copy fresh, the grads the original bf16 main-grad views again. A step
pre-hook registered after the adaptation records the cast grads the update sees, so the checks
also tell whether the cast views were reused (same objects, same memory) or rebuilt.

Scenarios: steps with ``zero_grad(set_to_none=True)`` and ``False``; ``add_param_group``; grads
replaced by the user; the optimizer's ``load_state_dict``; a model state-dict load and a DCP load
between steps; several optimizers over one model (each holding part of the same groups); undo
(``remove_fully_shard_optimizer``) releasing the buffers; the ``keep_cast_buffers`` knob and
``cast_buffer_bytes``; main weights written outside the adapter reaching the next forward.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from fsdp_patch import cast_buffer_bytes, keep_cast_buffers, parameter_group_of, parameter_groups
from fsdp_patch.adapter import remove_fully_shard_optimizer
from tests.models import lm_loss
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
    local_tokens,
    main_weights,
    optimizer_state,
)

FP32_BYTES = 4


def _adamw(params: Any) -> torch.optim.Optimizer:
    return O.AdamW(params, lr=1e-2, weight_decay=0.1)


class CastSpy:
    """A step pre-hook registered after the adaptation: what the update sees as grads."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.seen: list[dict[int, tuple[int, int, torch.dtype]]] = []
        optimizer.register_step_pre_hook(self)

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.seen.append(
            {
                id(p): (id(p.grad), local(p.grad).data_ptr(), p.grad.dtype)
                for p in fsdp_params(optimizer)
                if p.grad is not None
            }
        )

    def assert_reused(self, params: list[torch.nn.Parameter], what: str, same_memory: bool = True) -> None:
        """Asserts that the last two steps gave ``params`` the same cast views (over the same memory)."""
        assert len(self.seen) >= 2 and params, f"{what}: {len(self.seen)} steps seen, {len(params)} parameters"
        last, before = self.seen[-1], self.seen[-2]
        width = 3 if same_memory else 1
        for index, p in enumerate(params):
            got, had = last.get(id(p)), before.get(id(p))
            assert got is not None and had is not None, f"{what}: parameter {index} cast in {had} then {got}"
            assert got[:width] == had[:width], (
                f"{what}: parameter {index}'s cast view (id, data_ptr, dtype) {got[:width]}, the step before {had[:width]}"
            )


def _expected_cast_bytes(params: list[torch.nn.Parameter]) -> int:
    """Bytes of the cast buffers for an optimizer holding ``params``: per group, the span of
    their slots (padding included) in fp32."""
    spans: dict[int, tuple[int, int]] = {}
    for param in params:
        group = parameter_group_of(param)
        layout = group.layout.params[group.index_of(param)]
        lo, hi = spans.get(id(group), (layout.offset, layout.offset + layout.slot_numel))
        spans[id(group)] = (min(lo, layout.offset), max(hi, layout.offset + layout.slot_numel))
    return sum(hi - lo for lo, hi in spans.values()) * FP32_BYTES


class Pair:
    """An adapted model and its hand-cast reference, trained alike."""

    def __init__(self, observer: str, params_of: Any = list) -> None:
        self.model, self.ref = build_model(), build_model()
        self.opt = _adamw(params_of(list(self.model.parameters())))
        self.ref_opt = _adamw(params_of(list(self.ref.parameters())))
        adapt(self.opt, observer)
        self.spy = CastSpy(self.opt)

    def both(self, fn: Any) -> None:
        """Does ``fn(model, optimizer)`` to the adapted pair and to the reference."""
        fn(self.model, self.opt)
        fn(self.ref, self.ref_opt)

    def step(self, tag: str, tokens: torch.Tensor, zero: bool | None = True, before_step: Any = None) -> None:
        """Backward on both, ``before_step`` on both, the steps, the checks, then ``zero_grad``."""
        backward(self.model, tokens)
        backward(self.ref, tokens)
        if before_step is not None:
            self.both(before_step)
        self.opt.step()
        HandCast(fsdp_params(self.ref_opt)).step(self.ref_opt)
        assert_same(main_weights(self.model), main_weights(self.ref), f"{tag}: main weights vs reference")
        assert_same(optimizer_state(self.opt), optimizer_state(self.ref_opt), f"{tag}: optimizer state vs reference")
        assert_compute_fresh(self.model, tag)
        assert_grads_original(self.opt, f"{tag}: grads are the original views")
        dtypes = [dtype for _, _, dtype in self.spy.seen[-1].values()]
        assert dtypes and set(dtypes) == {torch.float32}, f"{tag}: grad dtypes the update saw: {dtypes}"
        if zero is not None:
            self.both(lambda model, opt: opt.zero_grad(set_to_none=zero))
        if zero:
            # Nothing of the adapter holds the main grads: zero_grad(set_to_none=True) frees them.
            held = [
                g.main_grad_storage_bytes()
                for g in parameter_groups(self.model)
                if all(p.grad is None for p in g.params)
            ]
            assert held and not any(held), f"{tag}: main-grad bytes held after zero_grad(set_to_none=True): {held}"


def _training_changes(observer: str, path: str) -> None:
    data = batches(9)
    # The optimizer starts with the blocks' parameters only; the rest is added later.
    pair = Pair(observer, params_of=lambda params: params[: len(params) // 2])
    first = fsdp_params(pair.opt)
    pair.step("step 1", data[0], zero=True)
    pair.step("step 2", data[1], zero=False)
    pair.spy.assert_reused(first, "after zero_grad(set_to_none=True)")
    pair.step("step 3", data[2], zero=True)
    pair.spy.assert_reused(first, "after zero_grad(set_to_none=False)")

    pair.both(lambda model, opt: opt.add_param_group({"params": list(model.parameters())[len(first) :]}))
    pair.step("add_param_group", data[3])
    added_groups = {parameter_group_of(q) for q in fsdp_params(pair.opt)[len(first) :]}
    unchanged = [p for p in first if parameter_group_of(p) not in added_groups]
    pair.spy.assert_reused(unchanged, "add_param_group: unchanged groups")
    uncast = [i for i, p in enumerate(fsdp_params(pair.opt)) if id(p) not in pair.spy.seen[-1]]
    assert not uncast, f"add_param_group: parameters {uncast} were not cast"

    def replace_grads(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        # A user's grads in place of two main-grad views: a DTensor and a scaled copy.
        params = fsdp_params(opt)
        for param in (params[0], params[-1]):
            param.grad = DTensor.from_local(
                local(param.grad).detach().clone() * 3,
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )

    pair.step("grads replaced by the user", data[4], before_step=replace_grads)
    pair.step("after replaced grads", data[5])
    pair.spy.assert_reused(fsdp_params(pair.opt), "after replaced grads")

    states = {
        id(pair.opt): copy.deepcopy(pair.opt.state_dict()),
        id(pair.ref_opt): copy.deepcopy(pair.ref_opt.state_dict()),
    }
    pair.both(lambda model, opt: opt.load_state_dict(states[id(opt)]))
    pair.step("optimizer load_state_dict", data[6])
    pair.spy.assert_reused(fsdp_params(pair.opt), "optimizer load_state_dict")

    # Model state loaded between steps: through set_model_state_dict (copies into the parameters),
    # then by dcp.load (writes into the local shards of the state dict's tensors). The reference
    # is a fully_shard model too, so the compute copy's freshness is checked on its own.
    saved = {
        id(model): {k: v.clone() for k, v in get_model_state_dict(model).items()} for model in (pair.model, pair.ref)
    }
    weights_at_save = main_weights(pair.model)
    pair.step("before set_model_state_dict", data[7])
    pair.both(lambda model, opt: set_model_state_dict(model, saved[id(model)]))
    assert_same(main_weights(pair.model), weights_at_save, "set_model_state_dict: weights loaded")
    _forward(pair.model, data[7])
    assert_compute_fresh(pair.model, "set_model_state_dict, then a forward")
    pair.step("after set_model_state_dict", data[7])
    weights_at_save = main_weights(pair.model)
    for index, model in enumerate((pair.model, pair.ref)):
        dcp.save(get_model_state_dict(model), checkpoint_id=f"{path}/model{index}")
    pair.step("before dcp.load", data[8])
    for index, model in enumerate((pair.model, pair.ref)):
        dcp.load(get_model_state_dict(model), checkpoint_id=f"{path}/model{index}")
    assert_same(main_weights(pair.model), weights_at_save, "dcp.load: weights loaded in place")
    _forward(pair.model, data[8])
    assert_compute_fresh(pair.model, "dcp.load, then a forward")
    pair.step("after dcp.load", data[8])
    pair.spy.assert_reused(fsdp_params(pair.opt), "after the loads")


@pytest.mark.parametrize("observer", OBSERVERS)
def test_cached_views_stay_valid_across_changes(pool2: Any, observer: str, tmp_path: Any) -> None:
    pool2.run(_training_changes, observer, str(tmp_path))


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
        opts[kind] = [_adamw(rest[0::2]), _adamw(rest[1::2]), O.SGD([bias], lr=0.1)]
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
        got, want = cast_buffer_bytes(opt), _expected_cast_bytes(fsdp_params(opt))
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
            _adamw([p for p in params if id(p) not in middles]),
            _adamw([p for p in params if id(p) in middles]),
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
    opt = _adamw(model.parameters())
    adapt(opt, observer)
    captured: list[torch.Tensor] = []
    opt.register_step_pre_hook(
        lambda o, a, k: captured.append(next(p.grad for p in fsdp_params(o) if p.grad is not None))
    )
    backward(model, data[0])
    opt.step()
    got, want = cast_buffer_bytes(opt), _expected_cast_bytes(fsdp_params(opt))
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
    want = _expected_cast_bytes(fsdp_params(pair.opt))

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
    plain = _adamw(build_model().parameters())
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


def _external_writes() -> None:
    """Main weights written outside the adapter between steps reach the next forward, which
    casts each compute copy once."""
    data = batches(2)
    pair = Pair("null")
    pair.step("step", data[0])
    groups = parameter_groups(pair.model)

    def loss(model: torch.nn.Module) -> torch.Tensor:
        return _forward(model, data[1])

    versions = [g.compute_weight._version for g in groups]
    assert_same(loss(pair.model), loss(pair.ref), "forward vs the reference's")
    # A write need not show in any version counter: each forward casts every compute copy once.
    got, want = [g.compute_weight._version for g in groups], [v + 1 for v in versions]
    assert got == want, f"compute copies' versions after one forward: {got}, want {want} (one cast each)"
    writes = {
        "DTensor parameter edited in place": lambda model: model.head.weight.mul_(0.5),
        "main-weight buffer written": lambda model: parameter_groups(model)[0].main_weight.add_(0.25),
        "local shard written (as dcp.load does)": lambda model: local(model.blocks[0].fc1.weight).sub_(0.125),
    }
    for name, write in writes.items():
        for model in (pair.model, pair.ref):
            with torch.no_grad():
                write(model)
        HandCast(fsdp_params(pair.ref_opt)).refresh()
        assert_same(loss(pair.model), loss(pair.ref), f"{name}: next forward vs the reference's")
        assert_compute_fresh(pair.model, f"{name}, then a forward")


def _forward(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The loss of a forward without grad (gathers the compute copy)."""
    with torch.no_grad():
        return lm_loss(model, local_tokens(tokens))


def test_main_weights_written_outside_the_adapter_reach_the_next_forward(pool2: Any) -> None:
    pool2.run(_external_writes)
