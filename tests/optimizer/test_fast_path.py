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
    ATTACHMENTS,
    HandCast,
    O,
    adapt,
    assert_all,
    backward,
    batches,
    build_model,
    compute_is_fresh,
    fsdp_params,
    grads_are_original,
    grads_snapshot,
    local,
    local_tokens,
    main_weights,
    optimizer_state,
    same,
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

    def reused(self, params: list[torch.nn.Parameter], same_memory: bool = True) -> bool:
        """Whether the last two steps gave ``params`` the same cast views (over the same memory)."""
        if len(self.seen) < 2 or not params:
            return False
        last, before = self.seen[-1], self.seen[-2]
        width = 3 if same_memory else 1
        return all(id(p) in last and id(p) in before and last[id(p)][:width] == before[id(p)][:width] for p in params)


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

    def __init__(self, attachment: str, params_of: Any = list) -> None:
        self.model, self.ref = build_model(), build_model()
        self.opt = _adamw(params_of(list(self.model.parameters())))
        self.ref_opt = _adamw(params_of(list(self.ref.parameters())))
        adapt(self.opt, attachment)
        self.spy = CastSpy(self.opt)
        self.checks: dict[str, bool] = {}

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
        self.checks[f"{tag}: main weights == reference"] = same(main_weights(self.model), main_weights(self.ref))
        self.checks[f"{tag}: optimizer state == reference"] = same(
            optimizer_state(self.opt), optimizer_state(self.ref_opt)
        )
        self.checks[f"{tag}: compute copy fresh"] = compute_is_fresh(self.model)
        problem = grads_are_original(self.opt)
        self.checks[f"{tag}: grads are the original views ({problem})"] = problem is None
        self.checks[f"{tag}: the update saw fp32 grads"] = bool(self.spy.seen[-1]) and all(
            dtype == torch.float32 for _, _, dtype in self.spy.seen[-1].values()
        )
        if zero is not None:
            self.both(lambda model, opt: opt.zero_grad(set_to_none=zero))
        if zero:
            # Nothing of the adapter holds the main grads: zero_grad(set_to_none=True) frees them.
            held = [
                g.main_grad_storage_bytes()
                for g in parameter_groups(self.model)
                if all(p.grad is None for p in g.params)
            ]
            self.checks[f"{tag}: main grads freed by zero_grad(set_to_none=True) ({held})"] = not any(held) and bool(
                held
            )


def _training_changes(attachment: str, path: str) -> dict[str, bool]:
    data = batches(9)
    # The optimizer starts with the blocks' parameters only; the rest is added later.
    pair = Pair(attachment, params_of=lambda params: params[: len(params) // 2])
    first = fsdp_params(pair.opt)
    pair.step("step 1", data[0], zero=True)
    pair.step("step 2", data[1], zero=False)
    pair.checks["after zero_grad(set_to_none=True): views reused"] = pair.spy.reused(first)
    pair.step("step 3", data[2], zero=True)
    pair.checks["after zero_grad(set_to_none=False): views reused"] = pair.spy.reused(first)

    pair.both(lambda model, opt: opt.add_param_group({"params": list(model.parameters())[len(first) :]}))
    pair.step("add_param_group", data[3])
    pair.checks["add_param_group: unchanged groups keep their views"] = pair.spy.reused(
        [
            p
            for p in first
            if parameter_group_of(p) not in {parameter_group_of(q) for q in fsdp_params(pair.opt)[len(first) :]}
        ]
    )
    pair.checks["add_param_group: the added parameters are cast"] = all(
        id(p) in pair.spy.seen[-1] for p in fsdp_params(pair.opt)
    )

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
    pair.checks["after replaced grads: views reused"] = pair.spy.reused(fsdp_params(pair.opt))

    states = {
        id(pair.opt): copy.deepcopy(pair.opt.state_dict()),
        id(pair.ref_opt): copy.deepcopy(pair.ref_opt.state_dict()),
    }
    pair.both(lambda model, opt: opt.load_state_dict(states[id(opt)]))
    pair.step("optimizer load_state_dict", data[6])
    pair.checks["optimizer load_state_dict: views reused"] = pair.spy.reused(fsdp_params(pair.opt))

    # Model state loaded between steps: through set_model_state_dict (copies into the parameters),
    # then by dcp.load (writes into the local shards of the state dict's tensors). The reference
    # is a fully_shard model too, so the compute copy's freshness is checked on its own.
    saved = {
        id(model): {k: v.clone() for k, v in get_model_state_dict(model).items()} for model in (pair.model, pair.ref)
    }
    weights_at_save = main_weights(pair.model)
    pair.step("before set_model_state_dict", data[7])
    pair.both(lambda model, opt: set_model_state_dict(model, saved[id(model)]))
    pair.checks["set_model_state_dict: weights loaded"] = same(main_weights(pair.model), weights_at_save)
    _forward(pair.model, data[7])
    pair.checks["set_model_state_dict: the next forward refreshed the compute copy"] = compute_is_fresh(pair.model)
    pair.step("after set_model_state_dict", data[7])
    weights_at_save = main_weights(pair.model)
    for index, model in enumerate((pair.model, pair.ref)):
        dcp.save(get_model_state_dict(model), checkpoint_id=f"{path}/model{index}")
    pair.step("before dcp.load", data[8])
    for index, model in enumerate((pair.model, pair.ref)):
        dcp.load(get_model_state_dict(model), checkpoint_id=f"{path}/model{index}")
    pair.checks["dcp.load: weights loaded in place"] = same(main_weights(pair.model), weights_at_save)
    _forward(pair.model, data[8])
    pair.checks["dcp.load: the next forward refreshed the compute copy"] = compute_is_fresh(pair.model)
    pair.step("after dcp.load", data[8])
    pair.checks["after the loads: views reused"] = pair.spy.reused(fsdp_params(pair.opt))
    return pair.checks


@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_cached_views_stay_valid_across_changes(pool2: Any, attachment: str, tmp_path: Any) -> None:
    assert_all(pool2.run(_training_changes, attachment, str(tmp_path)))


def _several_optimizers(attachment: str, keep: bool | None = None) -> dict[str, bool]:
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
        adapt(opt, attachment)
        if keep is not None:
            keep_cast_buffers(opt, keep)
    checks: dict[str, bool] = {}
    for step, tokens in enumerate(data):
        for model in built.values():
            backward(model, tokens)
        for index, (opt, ref_opt) in enumerate(zip(opts["adapted"], opts["ref"], strict=True)):
            opt.step()
            HandCast(fsdp_params(ref_opt)).step(ref_opt)
            checks[f"step {step}, optimizer {index}: grads original"] = grads_are_original(opt) is None
            # Each optimizer zeroes only its own parameters: the next one still finds its grads.
            opt.zero_grad()
            ref_opt.zero_grad()
        checks[f"step {step}: main weights == reference"] = same(
            main_weights(built["adapted"]), main_weights(built["ref"])
        )
        checks[f"step {step}: compute copy fresh"] = compute_is_fresh(built["adapted"])
    if keep is False:
        checks["freed buffers: 0 bytes after the steps"] = all(cast_buffer_bytes(opt) == 0 for opt in opts["adapted"])
        return checks
    for index, opt in enumerate(opts["adapted"]):
        want = _expected_cast_bytes(fsdp_params(opt))
        checks[f"optimizer {index}: cast buffer spans its own parameters ({cast_buffer_bytes(opt)} vs {want})"] = (
            cast_buffer_bytes(opt) == want
        )
    whole = sum(g.layout.shard_numel for g in parameter_groups(built["adapted"])) * FP32_BYTES
    checks["the bias-only optimizer's buffer is a sliver of the model's"] = (
        cast_buffer_bytes(opts["adapted"][2]) * 100 < whole
    )
    return checks


@pytest.mark.parametrize("keep", (None, False), ids=("buffers default", "buffers freed"))
@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_several_optimizers_over_one_model(pool2: Any, attachment: str, keep: bool | None) -> None:
    assert_all(pool2.run(_several_optimizers, attachment, keep))


class _Planted(RuntimeError):
    pass


def _split_group(attachment: str) -> dict[str, bool]:
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
        adapt(opt, attachment)
        keep_cast_buffers(opt, False)
    checks: dict[str, bool] = {"some group has a middle parameter": bool(fsdp_params(opts["adapted"][1]))}
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
            # Under hooks the failed step's cast stays attached: the second optimizer steps
            # while it is, on the middle parameters' main grads.
            try:
                opts["adapted"][0].step()
            except _Planted:
                checks["the planted failure propagated"] = True
        # After the failure the second optimizer goes first (its parameters are disjoint from
        # the first's, so the order changes nothing in the reference).
        order = (1, 0) if step == 0 else (0, 1)
        for index in order:
            opt, ref_opt = opts["adapted"][index], opts["ref"][index]
            opt.step()
            HandCast(fsdp_params(ref_opt)).step(ref_opt)
            if (step, index) != (0, 1):  # under hooks the failed step's cast is still attached then
                checks[f"step {step}, optimizer {index}: grads original"] = grads_are_original(opt) is None
        checks[f"step {step}: main weights == reference"] = same(
            main_weights(built["adapted"]), main_weights(built["ref"])
        )
        for opt in (*opts["adapted"], *opts["ref"]):
            opt.zero_grad()
    return checks


@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_an_optimizer_spanning_a_group_frees_nothing_another_holds(pool2: Any, attachment: str) -> None:
    assert_all(pool2.run(_split_group, attachment))


def _main_grads_released_in_step(attachment: str) -> dict[str, bool]:
    """Buffers freed between steps: while the update runs, the main grads' memory is free (the
    fp32 copies stand in); afterwards they hold exactly what they held before the step, also
    when the step raised after the cast."""
    data = batches(3)
    pair = Pair(attachment)
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
    checks = pair.checks
    checks[f"during the step: no main-grad memory ({during[-1]})"] = during[-1] == [0] * len(groups)
    checks["after the step: main grads bitwise as before it"] = same(grads_snapshot(pair.model), before[id(pair.model)])
    checks["after the step: main-grad memory back"] = all(g.main_grad_storage_bytes() for g in groups)
    pair.both(lambda model, opt: opt.zero_grad(set_to_none=True))

    backward(pair.model, data[1])
    want = grads_snapshot(pair.model)
    fail["now"] = True
    try:
        pair.opt.step()
        checks["the planted failure propagated"] = False
    except _Planted:
        checks["the planted failure propagated"] = True
    fail["now"] = False
    # wrapt restores at once; hooks leave the fp32 copies attached until the next step or
    # backward: either way the grads hold the same values.
    got = [None if g is None else g.to(torch.bfloat16) for g in grads_snapshot(pair.model)]
    checks["after the failed step: grads hold their values"] = same(got, want)
    main_weights_before = main_weights(pair.model)
    pair.opt.step()  # puts the main grads back (hooks), then steps on them
    checks["after the failed step: main grads restored before the next step"] = same(grads_snapshot(pair.model), want)
    checks["the retried step updated the weights"] = not same(main_weights(pair.model), main_weights_before)
    checks["buffers freed after the retried step"] = cast_buffer_bytes(pair.opt) == 0
    return checks


@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_main_grads_released_during_the_step(pool2: Any, attachment: str) -> None:
    assert_all(pool2.run(_main_grads_released_in_step, attachment))


def _undo_releases(attachment: str, fail: bool) -> dict[str, bool]:
    data = batches(2)
    model = build_model()
    opt = _adamw(model.parameters())
    adapt(opt, attachment)
    captured: list[torch.Tensor] = []
    opt.register_step_pre_hook(
        lambda o, a, k: captured.append(next(p.grad for p in fsdp_params(o) if p.grad is not None))
    )
    checks: dict[str, bool] = {}
    backward(model, data[0])
    opt.step()
    want = _expected_cast_bytes(fsdp_params(opt))
    checks[f"kept on the CPU after a step: {cast_buffer_bytes(opt)} == {want} bytes"] = cast_buffer_bytes(opt) == want
    if fail:
        # An update that raises after the cast: the hook attachment leaves the cast grads attached.
        def boom(o: Any, a: Any, k: Any) -> None:
            raise RuntimeError("update failed")

        handle = opt.register_step_pre_hook(boom)
        backward(model, data[1])
        try:
            opt.step()
        except RuntimeError:
            pass
        handle.remove()
    view = captured[-1]
    checks["the captured cast view holds memory before the undo"] = local(view).untyped_storage().nbytes() > 0
    remove_fully_shard_optimizer(opt)
    checks["undo: the cast buffer's memory is released"] = local(view).untyped_storage().nbytes() == 0
    problem = grads_are_original(opt)
    checks[f"undo: grads are the original views ({problem})"] = problem is None
    try:
        cast_buffer_bytes(opt)
        checks["undo: cast_buffer_bytes refuses the unadapted optimizer"] = False
    except ValueError as exc:
        checks["undo: cast_buffer_bytes refuses the unadapted optimizer"] = "unadapted AdamW" in str(exc)
    return checks


@pytest.mark.parametrize("fail", (False, True), ids=("after a step", "after a failed step"))
@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_undo_releases_the_cast_buffers(pool1: Any, attachment: str, fail: bool) -> None:
    assert_all(pool1.run(_undo_releases, attachment, fail))


def _memory_knob(attachment: str) -> dict[str, bool]:
    data = batches(5)
    pair = Pair(attachment)
    want = _expected_cast_bytes(fsdp_params(pair.opt))
    checks = pair.checks
    checks["no buffer before the first step"] = cast_buffer_bytes(pair.opt) == 0
    keep_cast_buffers(pair.opt, False)
    pair.step("freed between steps, step 1", data[0])
    checks[f"freed: 0 bytes between steps (got {cast_buffer_bytes(pair.opt)})"] = cast_buffer_bytes(pair.opt) == 0
    pair.step("freed between steps, step 2", data[1])
    checks["freed: the views are reused, re-materialized"] = pair.spy.reused(fsdp_params(pair.opt), same_memory=False)
    keep_cast_buffers(pair.opt, True)
    pair.step("kept", data[2])
    checks[f"kept: {want} bytes between steps (got {cast_buffer_bytes(pair.opt)})"] = (
        cast_buffer_bytes(pair.opt) == want
    )
    keep_cast_buffers(pair.opt, None)
    pair.step("default (CPU: kept)", data[3])
    checks["default on the CPU: kept"] = cast_buffer_bytes(pair.opt) == want
    plain = _adamw(build_model().parameters())
    for name, call, error, needle in (
        ("unadapted optimizer", lambda: keep_cast_buffers(plain, False), ValueError, "unadapted AdamW"),
        ("not an optimizer", lambda: cast_buffer_bytes("opt"), ValueError, "'opt'"),
        ("keep not a bool", lambda: keep_cast_buffers(pair.opt, "no"), TypeError, "'no'"),
    ):
        try:
            call()
            checks[f"{name}: refused"] = False
        except error as exc:
            checks[f"{name}: refused, naming it"] = needle in str(exc)
    checks["after the refusals: buffers as they were"] = cast_buffer_bytes(pair.opt) == want
    pair.step("after the refusals", data[4])
    return checks


@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_keep_cast_buffers_and_their_bytes(pool2: Any, attachment: str) -> None:
    assert_all(pool2.run(_memory_knob, attachment))


def _external_writes() -> dict[str, bool]:
    """Main weights written outside the adapter between steps reach the next forward, which
    casts each compute copy once."""
    data = batches(2)
    pair = Pair("hooks")
    pair.step("step", data[0])
    checks = pair.checks
    groups = parameter_groups(pair.model)

    def loss(model: torch.nn.Module) -> torch.Tensor:
        return _forward(model, data[1])

    versions = [g.compute_weight._version for g in groups]
    checks["forward equals the reference's"] = same(loss(pair.model), loss(pair.ref))
    # A write need not show in any version counter: each forward casts every compute copy once.
    checks["the forward cast each compute copy once"] = [g.compute_weight._version for g in groups] == [
        v + 1 for v in versions
    ]
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
        checks[f"{name}: next forward equals the reference's"] = same(loss(pair.model), loss(pair.ref))
        checks[f"{name}: compute copy fresh after it"] = compute_is_fresh(pair.model)
    return checks


def _forward(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The loss of a forward without grad (gathers the compute copy)."""
    with torch.no_grad():
        return lm_loss(model, local_tokens(tokens))


def test_main_weights_written_outside_the_adapter_reach_the_next_forward(pool2: Any) -> None:
    assert_all(pool2.run(_external_writes))
