"""A parameter replaced in ``optimizer.param_groups`` between steps is stepped as a parameter of
its own group: its grads cast to fp32 for the update, its group's compute copy refreshed, bit for
bit what a hand-cast reference does. The adapter caches what the param groups hold between steps
(``OptimizerShape``); a user who swaps the module an optimizer trains (layer-wise schedules, a
re-sharded or replaced module) keeps the number of parameters but not the parameters."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.optimizer.support import (
    OBSERVERS,
    HandCast,
    adapt,
    backward,
    batches,
    build_model,
    compute_is_fresh,
    difference,
    fsdp_params,
    grads_are_original,
    main_weights,
    optimizer_state,
    same,
)

# AdamW refuses a bf16 grad for an fp32 parameter; SGD with momentum takes it and updates the
# weights with it, so a grad left uncast shows only in the bits and in the refresh.
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01),
}


def _replace(model: nn.Module, opt: torch.optim.Optimizer, how: str) -> None:
    params = opt.param_groups[0]["params"]
    others = list(model.blocks[1].parameters())
    if how == "module_swapped":  # the optimizer now trains the next block: a new list, same length
        opt.param_groups[0]["params"] = others
    else:  # one parameter replaced in place, the list object kept
        params[0] = others[0]


def replacement_run(observer: str, how: str, optimizer: str) -> None:
    data = batches(4)
    model, ref = build_model(), build_model()
    opt = OPTIMIZERS[optimizer](list(model.blocks[0].parameters()))
    ref_opt = OPTIMIZERS[optimizer](list(ref.blocks[0].parameters()))
    recording = adapt(opt, observer)
    seen_dtypes: list[set[torch.dtype]] = []
    opt.register_step_pre_hook(  # after the adapter's own: what the update sees
        lambda o, args, kwargs: seen_dtypes.append({p.grad.dtype for p in fsdp_params(o) if p.grad is not None})
    )
    for step, tokens in enumerate(data, start=1):
        if step == 3:
            _replace(model, opt, how)
            _replace(ref, ref_opt, how)
        backward(model, tokens)
        backward(ref, tokens)
        opt.step()
        HandCast(fsdp_params(ref_opt)).step(ref_opt)
        where = f"{optimizer}, {how}, {observer}, step {step}"
        assert seen_dtypes[-1] == {torch.float32}, f"{where}: the update saw grads of {seen_dtypes[-1]}, want fp32 only"
        got, want = main_weights(model), main_weights(ref)
        found = difference(got, want)
        assert found is None, f"{where}: main weights against the hand-cast reference: {found}"
        got_state, want_state = optimizer_state(opt), optimizer_state(ref_opt)
        assert same(got_state, want_state), f"{where}: optimizer state differs from the reference's"
        assert compute_is_fresh(model), f"{where}: a compute copy was not refreshed from its main weights"
        problem = grads_are_original(opt)
        assert problem is None, f"{where}: grads after the step: {problem}"
        if recording is not None:
            planned = recording.steps[-1].planned[-1]
            want_count = len(opt.param_groups[0]["params"])
            assert planned.params_count == want_count, (
                f"{where}: planned {planned.params_count} params, want {want_count}"
            )
        opt.zero_grad()
        ref_opt.zero_grad()


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("how", ("module_swapped", "one_replaced_in_place"))
@pytest.mark.parametrize("observer", OBSERVERS)
def test_a_replaced_parameter_is_cast_and_refreshed_as_its_own(
    pool2: Any, observer: str, how: str, optimizer: str
) -> None:
    pool2.run(replacement_run, observer, how, optimizer)
