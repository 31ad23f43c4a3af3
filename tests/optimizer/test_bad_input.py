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
    ATTACHMENTS,
    BF16,
    FP32,
    O,
    adapt,
    assert_all,
    backward,
    batches,
    build_model,
    env,
    grads_are_original,
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


def _unchanged(opt: torch.optim.Optimizer, before: dict[str, Any]) -> bool:
    now = _instance_snapshot(opt)
    return (
        now["dict"].keys() == before["dict"].keys()
        and all(now["dict"][k] is v for k, v in before["dict"].items())
        and now["pre"] == before["pre"]
        and now["post"] == before["post"]
    )


def _grad_records(params: list[nn.Parameter]) -> list[Any]:
    return [(p.grad, None if p.grad is None else p.grad.dtype, p.grad_dtype) for p in params]


def _same_grad_records(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(x[0] is y[0] and x[1:] == y[1:] for x, y in zip(a, b, strict=True))


def _adapt_time_errors() -> dict[str, bool]:
    checks: dict[str, bool] = {}
    model = build_model()
    plain = torch.zeros(3, requires_grad=True)  # a leaf tensor, not an nn.Parameter
    for attachment in ATTACHMENTS:
        opt = O.SGD([{"params": list(model.parameters())}, {"params": [nn.Parameter(torch.ones(2)), plain]}], lr=0.1)
        before = _instance_snapshot(opt)
        try:
            adapt(opt, attachment)
            checks[f"{attachment}: non-Parameter refused"] = False
        except TypeError as exc:
            message = str(exc)
            checks[f"{attachment}: non-Parameter refused"] = (
                "param_groups[1]['params'][1]" in message and "Tensor" in message
            )
        checks[f"{attachment}: non-Parameter: optimizer untouched"] = (
            _unchanged(opt, before) and adaptation_of(opt) is None
        )

    opt = O.SGD(model.parameters(), lr=0.1)
    before = _instance_snapshot(opt)
    cases = {
        "precision_aware not a bool": (TypeError, lambda: adapt_optimizer(opt, precision_aware=1, attachment="hooks")),
        "unknown attachment": (ValueError, lambda: adapt_optimizer(opt, precision_aware=False, attachment="patch")),
        "wrapt without observer": (ValueError, lambda: adapt_optimizer(opt, precision_aware=False, attachment="wrapt")),
        "observer factory raises": (
            KeyError,
            lambda: adapt_optimizer(
                opt, precision_aware=False, attachment="wrapt", observer_factory=lambda: {}["no observer"]
            ),
        ),
    }
    for name, (error, call) in cases.items():
        try:
            call()
            checks[f"{name}: raised"] = False
        except error:
            checks[f"{name}: raised"] = True
        checks[f"{name}: optimizer untouched"] = _unchanged(opt, before) and adaptation_of(opt) is None
    try:
        adapt_optimizer(object(), precision_aware=False, attachment="hooks")  # type: ignore[arg-type]
        checks["not an optimizer: TypeError"] = False
    except TypeError:
        checks["not an optimizer: TypeError"] = True
    # A malformed FSDP_PATCH_TELEMETRY fails the public entry point before any change.
    from fsdp_patch.optimizer import fully_shard_optimizer

    with env(FSDP_PATCH_TELEMETRY="yes please"):
        try:
            fully_shard_optimizer(opt)
            checks["bad FSDP_PATCH_TELEMETRY: ValueError"] = False
        except ValueError as exc:
            checks["bad FSDP_PATCH_TELEMETRY: ValueError"] = "FSDP_PATCH_TELEMETRY" in str(exc)
    checks["bad FSDP_PATCH_TELEMETRY: optimizer untouched"] = _unchanged(opt, before) and adaptation_of(opt) is None
    # An instance attribute the adapter would need is already taken: refused, untouched.
    opt.__dict__["__deepcopy__"] = lambda memo: None
    taken = _instance_snapshot(opt)
    try:
        adapt(opt, "hooks")
        checks["taken __deepcopy__: ValueError"] = False
    except ValueError:
        checks["taken __deepcopy__: ValueError"] = True
    checks["taken __deepcopy__: optimizer untouched"] = _unchanged(opt, taken) and adaptation_of(opt) is None
    del opt.__dict__["__deepcopy__"]
    # Registering the post hook fails after the pre hook was registered: both are gone.
    opt.register_step_post_hook = lambda hook: (_ for _ in ()).throw(RuntimeError("no post hooks today"))  # type: ignore[method-assign]
    failing = _instance_snapshot(opt)
    try:
        adapt(opt, "hooks")
        checks["failing hook registration: raised"] = False
    except RuntimeError:
        checks["failing hook registration: raised"] = True
    checks["failing hook registration: optimizer untouched"] = _unchanged(opt, failing) and adaptation_of(opt) is None
    del opt.register_step_post_hook
    # Already adapted with other settings: refused, the existing adaptation stays as it was.
    for attachment in ATTACHMENTS:
        other = "wrapt" if attachment == "hooks" else "hooks"
        opt = O.SGD(model.parameters(), lr=0.1)
        adapt(opt, attachment)
        adaptation = adaptation_of(opt)
        adapted = _instance_snapshot(opt)
        for precision_aware, kind in ((True, attachment), (False, other)):
            try:
                adapt(opt, kind, precision_aware=precision_aware)
                checks[f"{attachment} then {kind}/precision_aware={precision_aware}: refused"] = False
            except ValueError as exc:
                checks[f"{attachment} then {kind}/precision_aware={precision_aware}: refused"] = (
                    "remove_fully_shard_optimizer" in str(exc)
                )
            checks[f"{attachment} then {kind}/precision_aware={precision_aware}: unchanged"] = (
                _unchanged(opt, adapted) and adaptation_of(opt) is adaptation
            )
    return checks


def test_adaptation_errors_leave_optimizer_untouched(pool1: Any) -> None:
    assert_all(pool1.run(_adapt_time_errors))


def _step_error_checks(
    tag: str,
    opt: torch.optim.Optimizer,
    model: nn.Module,
    params: list[nn.Parameter],
    error: type[BaseException],
    needles: tuple[str, ...],
) -> dict[str, bool]:
    """Steps ``opt`` expecting ``error`` whose message holds ``needles``; checks nothing changed."""
    checks: dict[str, bool] = {}
    records, grads = _grad_records(params), [None if p.grad is None else p.grad.detach().clone() for p in params]
    weights, plain_weights, state = main_weights(model), [p.detach().clone() for p in params], optimizer_state(opt)
    try:
        opt.step()
        checks[f"{tag}: raised"] = False
    except error as exc:
        checks[f"{tag}: raised"] = all(n in str(exc) for n in needles)
    checks[f"{tag}: grads unchanged (objects, dtypes, grad_dtype)"] = _same_grad_records(_grad_records(params), records)
    checks[f"{tag}: grad values unchanged"] = same([None if p.grad is None else p.grad.detach() for p in params], grads)
    checks[f"{tag}: weights unchanged"] = same(main_weights(model), weights) and same(
        [p.detach() for p in params], plain_weights
    )
    checks[f"{tag}: state unchanged"] = same(optimizer_state(opt), state)
    checks[f"{tag}: nothing cast"] = grads_are_original(opt) is None
    return checks


def _step_time_errors(attachment: str) -> dict[str, bool]:
    checks: dict[str, bool] = {}
    data = batches(3)
    model = build_model()
    fsdp = list(model.parameters())
    extra = nn.Parameter(torch.randn(4))  # a plain fp32 parameter, not managed by fully_shard
    opt = O.Adam([{"params": fsdp}, {"params": [extra]}], lr=1e-2)
    observer = adapt(opt, attachment)
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
    checks.update(
        _step_error_checks(
            "plain bf16 grad", opt, model, params, TypeError, ("param_groups[1]['params'][0]", "precision_aware")
        )
    )
    if observer is not None:
        checks["plain bf16 grad: observer counted a rejected mismatch"] = (
            FP32,
            BF16,
            MismatchAction.REJECTED,
            1,
        ) in observer.mismatches
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
    checks["partial FSDP grads: grad-less parameter unchanged"] = same(victim.detach(), before_victim)
    checks["partial FSDP grads: its grad stays None"] = victim.grad is None
    checks["partial FSDP grads: the others stepped"] = all(
        not same(p.detach(), b) for p, b in zip(others, before_others, strict=True)
    )
    checks["partial FSDP grads: grads original afterwards"] = grads_are_original(opt) is None
    victim.grad = saved

    # 3. A non-Parameter in a group added after the adaptation.
    stray = torch.zeros(2, requires_grad=True)
    stray.grad = torch.ones(2)
    opt.add_param_group({"params": [stray]})
    checks.update(
        _step_error_checks(
            "non-Parameter added later", opt, model, params, TypeError, ("param_groups[2]['params'][0]",)
        )
    )
    opt.param_groups.pop()

    # Fixed input: the step works and the grads are as before.
    weights = main_weights(model)
    opt.step()
    checks["after the errors: step works"] = not same(main_weights(model), weights)
    checks["after the errors: grads original"] = grads_are_original(opt) is None
    return checks


@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_step_time_errors_change_nothing(pool1: Any, attachment: str) -> None:
    assert_all(pool1.run(_step_time_errors, attachment))


def _plain_passthrough(attachment: str) -> dict[str, bool]:
    """precision_aware lets a plain parameter's bf16 grad through to an optimizer that takes it."""
    extra = nn.Parameter(torch.randn(4))
    opt = O.SGD([extra], lr=0.5)
    observer = adapt(opt, attachment, precision_aware=True)
    seen: list[torch.dtype] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(extra.grad.dtype))
    extra.grad_dtype = BF16
    grad = torch.randn(4).to(BF16)
    extra.grad = grad
    expected = extra.detach() - 0.5 * grad.float()
    opt.step()
    checks = {
        "bf16 grad reached the update": seen == [BF16],
        "update == p - lr * float(g)": same(extra.detach(), expected),
        "grad untouched": extra.grad is grad,
    }
    if observer is not None:
        checks["observer counted a passthrough"] = (FP32, BF16, MismatchAction.PASSTHROUGH, 1) in observer.mismatches
    return checks


@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_plain_mismatch_passes_through_when_precision_aware(pool1: Any, attachment: str) -> None:
    assert_all(pool1.run(_plain_passthrough, attachment))


def test_plain_parameters_are_not_fsdp_managed() -> None:
    # Guards the premise of the tests above: an ordinary parameter is not in any group.
    assert parameter_group_of(nn.Parameter(torch.ones(1))) is None
