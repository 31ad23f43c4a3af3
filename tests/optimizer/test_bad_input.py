"""Bad input is refused clearly, before anything changes.

- A non-Parameter in a param group: TypeError naming the group and index, at adaptation
  (the optimizer is left unadapted) or, for a group added later, at the step.
- A plain (non-FSDP) parameter whose grad dtype differs from its dtype: TypeError before the
  optimizer runs, unless ``precision_aware`` (then it passes through and the step runs).
- FSDP grads present for only some parameters of a group: RuntimeError naming the missing.
- No adaptation error leaves the optimizer half-adapted: its ``__dict__`` and hook dicts are
  as before, ``adaptation_of`` is None (or the previous adaptation, unchanged).

After each step-time error the optimizer state, the weights and the grads are unchanged
(same tensors, dtypes, ``grad_dtype`` and values), nothing is cast, and the step works once
the input is fixed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fsdp_patch import parameter_group_of
from fsdp_patch.adapter import adapt_optimizer, adaptation_of
from fsdp_patch.adapter.events import MismatchAction
from tests.optimizer.support import (
    BF16,
    FP32,
    OBSERVERS,
    O,
    adapt,
    assert_changed,
    assert_grads_original,
    assert_same,
    backward,
    batches,
    build_model,
    env,
    main_weights,
    optimizer_state,
    same,
)


def _instance_snapshot(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "dict": dict(opt.__dict__),
        "pre": dict(opt._optimizer_step_pre_hooks),
        "post": dict(opt._optimizer_step_post_hooks),
    }


def _assert_unchanged(opt: torch.optim.Optimizer, before: dict[str, Any], what: str, adaptation: Any = None) -> None:
    """The instance's ``__dict__`` holds the same objects, its hook dicts are as before, and
    ``adaptation_of`` is ``adaptation``."""
    now = _instance_snapshot(opt)
    added, removed = now["dict"].keys() - before["dict"].keys(), before["dict"].keys() - now["dict"].keys()
    assert not added and not removed, f"{what}: __dict__ gained {sorted(added)}, lost {sorted(removed)}"
    replaced = sorted(k for k, v in before["dict"].items() if now["dict"][k] is not v)
    assert not replaced, f"{what}: __dict__ values replaced: {replaced}"
    for hooks in ("pre", "post"):
        assert now[hooks] == before[hooks], f"{what}: step {hooks} hooks {now[hooks]}, want {before[hooks]}"
    got = adaptation_of(opt)
    assert got is adaptation, f"{what}: adaptation_of is {got}, want {adaptation}"


def _grad_records(params: list[nn.Parameter]) -> list[Any]:
    return [(p.grad, None if p.grad is None else p.grad.dtype, p.grad_dtype) for p in params]


def _assert_same_grad_records(got: list[Any], want: list[Any], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} grads, want {len(want)}"
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g[0] is w[0], f"{what}: parameter {index}'s grad is another object"
        assert g[1:] == w[1:], f"{what}: parameter {index}'s (grad dtype, grad_dtype) {g[1:]}, want {w[1:]}"


def _adapt_time_errors() -> None:
    model = build_model()
    plain = torch.zeros(3, requires_grad=True)  # a leaf tensor, not an nn.Parameter
    for observer in OBSERVERS:
        opt = O.SGD([{"params": list(model.parameters())}, {"params": [nn.Parameter(torch.ones(2)), plain]}], lr=0.1)
        before = _instance_snapshot(opt)
        with pytest.raises(TypeError, match=r"param_groups\[1\]\['params'\]\[1\].*Tensor"):
            adapt(opt, observer)
        _assert_unchanged(opt, before, f"{observer}: non-Parameter refused")

    opt = O.SGD(model.parameters(), lr=0.1)
    before = _instance_snapshot(opt)
    cases = {
        "precision_aware not a bool": (
            TypeError,
            "precision_aware",
            lambda: adapt_optimizer(opt, precision_aware=1),
        ),
        "observer factory raises": (
            KeyError,
            "no observer",
            lambda: adapt_optimizer(opt, precision_aware=False, observer_factory=lambda: {}["no observer"]),
        ),
    }
    for name, (error, names, call) in cases.items():
        with pytest.raises(error, match=names):
            call()
        _assert_unchanged(opt, before, name)
    with pytest.raises(TypeError, match="object"):
        adapt_optimizer(object(), precision_aware=False)  # type: ignore[arg-type]
    # A malformed FSDP_PATCH_TELEMETRY fails the public entry point before any change.
    from fsdp_patch.optimizer import fully_shard_optimizer

    with env(FSDP_PATCH_TELEMETRY="yes please"), pytest.raises(ValueError, match="FSDP_PATCH_TELEMETRY"):
        fully_shard_optimizer(opt)
    _assert_unchanged(opt, before, "bad FSDP_PATCH_TELEMETRY")
    # An instance attribute the adapter would need is already taken: refused, untouched.
    opt.__dict__["__deepcopy__"] = lambda memo: None
    taken = _instance_snapshot(opt)
    with pytest.raises(ValueError, match="__deepcopy__"):
        adapt(opt, "null")
    _assert_unchanged(opt, taken, "taken __deepcopy__")
    del opt.__dict__["__deepcopy__"]
    # Already adapted with another precision_aware: refused, the existing adaptation stays as it was.
    for observer in OBSERVERS:
        opt = O.SGD(model.parameters(), lr=0.1)
        adapt(opt, observer)
        adaptation = adaptation_of(opt)
        adapted = _instance_snapshot(opt)
        for other in OBSERVERS:
            with pytest.raises(ValueError, match="remove_fully_shard_optimizer"):
                adapt(opt, other, precision_aware=True)
            _assert_unchanged(opt, adapted, f"{observer} then {other}/precision_aware=True", adaptation)


def test_adaptation_errors_leave_optimizer_untouched(pool1: Any) -> None:
    pool1.run(_adapt_time_errors)


def _assert_step_refused(
    tag: str,
    opt: torch.optim.Optimizer,
    model: nn.Module,
    params: list[nn.Parameter],
    error: type[BaseException],
    names: str,
) -> None:
    """Steps ``opt`` expecting ``error`` whose message matches ``names``; asserts nothing changed."""
    records, grads = _grad_records(params), [None if p.grad is None else p.grad.detach().clone() for p in params]
    weights, plain_weights, state = main_weights(model), [p.detach().clone() for p in params], optimizer_state(opt)
    with pytest.raises(error, match=names):
        opt.step()
    _assert_same_grad_records(_grad_records(params), records, f"{tag}: grads (objects, dtypes, grad_dtype)")
    assert_same([None if p.grad is None else p.grad.detach() for p in params], grads, f"{tag}: grad values")
    assert_same(main_weights(model), weights, f"{tag}: main weights")
    assert_same([p.detach() for p in params], plain_weights, f"{tag}: parameters")
    assert_same(optimizer_state(opt), state, f"{tag}: optimizer state")
    assert_grads_original(opt, f"{tag}: nothing cast")


def _step_time_errors(observer: str) -> None:
    data = batches(3)
    model = build_model()
    fsdp = list(model.parameters())
    extra = nn.Parameter(torch.randn(4))  # a plain fp32 parameter, not managed by fully_shard
    opt = O.Adam([{"params": fsdp}, {"params": [extra]}], lr=1e-2)
    recording = adapt(opt, observer)
    params = [*fsdp, extra]

    # A good step first, so that there is state to keep unchanged.
    backward(model, data[0])
    extra.grad = torch.ones(4)
    opt.step()

    # 1. A plain parameter with a bf16 grad on fp32 data.
    backward(model, data[1])
    extra.grad = None
    extra.grad_dtype = BF16
    extra.grad = torch.ones(4, dtype=BF16)
    names = r"(?s)(?=.*param_groups\[1\]\['params'\]\[0\])(?=.*precision_aware)"  # both, in any order
    _assert_step_refused("plain bf16 grad", opt, model, params, TypeError, names)
    if recording is not None:
        want = (FP32, BF16, MismatchAction.REJECTED, 1)
        assert want in recording.mismatches, f"plain bf16 grad: observer mismatches {recording.mismatches}, want {want}"
    extra.grad = None
    extra.grad_dtype = None
    extra.grad = torch.ones(4)

    # 2. FSDP grads present for only part of a group: not an error (several optimizers may
    # each zero their own parameters of one group); like torch, the step skips the grad-less one.
    victim_name, victim = next((n, p) for n, p in model.named_parameters() if n.endswith("fc1.weight"))
    saved = victim.grad
    victim.grad = None
    others = [p for p in fsdp if p is not victim]
    before_victim, before_others = victim.detach().clone(), [p.detach().clone() for p in others]
    opt.step()
    assert_same(victim.detach(), before_victim, f"partial FSDP grads: grad-less {victim_name}")
    assert victim.grad is None, f"partial FSDP grads: {victim_name}'s grad is {victim.grad}, want None"
    unstepped = [i for i, (p, b) in enumerate(zip(others, before_others, strict=True)) if same(p.detach(), b)]
    assert not unstepped, f"partial FSDP grads: the other parameters {unstepped} did not step"
    assert_grads_original(opt, "partial FSDP grads: afterwards")
    victim.grad = saved

    # 3. A non-Parameter in a group added after the adaptation.
    stray = torch.zeros(2, requires_grad=True)
    stray.grad = torch.ones(2)
    opt.add_param_group({"params": [stray]})
    names = r"param_groups\[2\]\['params'\]\[0\]"
    _assert_step_refused("non-Parameter added later", opt, model, params, TypeError, names)
    opt.param_groups.pop()

    # Fixed input: the step works and the grads are as before.
    weights = main_weights(model)
    opt.step()
    assert_changed(main_weights(model), weights, "after the errors: the step")
    assert_grads_original(opt, "after the errors")


@pytest.mark.parametrize("observer", OBSERVERS)
def test_step_time_errors_change_nothing(pool1: Any, observer: str) -> None:
    pool1.run(_step_time_errors, observer)


def _plain_passthrough(observer: str) -> None:
    """precision_aware lets a plain parameter's bf16 grad through to an optimizer that takes it."""
    extra = nn.Parameter(torch.randn(4))
    opt = O.SGD([extra], lr=0.5)
    recording = adapt(opt, observer, precision_aware=True)
    seen: list[torch.dtype] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(extra.grad.dtype))
    extra.grad_dtype = BF16
    grad = torch.randn(4).to(BF16)
    extra.grad = grad
    expected = extra.detach() - 0.5 * grad.float()
    opt.step()
    assert seen == [BF16], f"grad dtypes the update saw: got {seen}, want [{BF16}]"
    assert_same(extra.detach(), expected, "update vs p - lr * float(g)")
    assert extra.grad is grad, "the grad was replaced"
    if recording is not None:
        want = (FP32, BF16, MismatchAction.PASSTHROUGH, 1)
        assert want in recording.mismatches, f"observer mismatches {recording.mismatches}, want {want}"


@pytest.mark.parametrize("observer", OBSERVERS)
def test_plain_mismatch_passes_through_when_precision_aware(pool1: Any, observer: str) -> None:
    pool1.run(_plain_passthrough, observer)


def test_plain_parameters_are_not_fsdp_managed() -> None:
    # Guards the premise of the tests above: an ordinary parameter is not in any group.
    assert parameter_group_of(nn.Parameter(torch.ones(1))) is None
