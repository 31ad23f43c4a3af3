"""An optimizer step inside backward: post-accumulate-grad hooks registered on the sharded
parameters run once per parameter after its grad is reduced, as torch FSDP2 runs them.

The pattern of ``torch``'s optimizer-in-backward tutorial: one optimizer per parameter, stepped
and zeroed by a hook on that parameter, no step after backward. 4 backwards on 2 gloo ranks
and on 4 (where the last rank's shard of the head is empty and its hooks must still run):
fp32 within 1e-5 of the unsharded model (whose autograd runs the same hooks) with FSDP2 as the
control; bf16 compute bitwise equal to FSDP2 with the same dtypes, both compute-copy lifetimes
(ours steps through the adapter). Every hook runs once per parameter and backward, and every
grad is ``None`` after backward (the hooks zeroed them).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.fsdp.parity import adapt, assert_parity, batches, build, full_params, loss_of, run_contenders

STEPS = 4


def _train(impl: str, precision: str) -> dict[str, Any]:
    model = build(impl, precision)
    names = {id(p): n for n, p in model.named_parameters()}
    optimizers = {
        id(p): adapt(torch.optim.SGD([p], lr=0.05, momentum=0.9), impl, precision) for p in model.parameters()
    }
    calls = dict.fromkeys(names.values(), 0)

    def step_in_backward(param: torch.Tensor) -> None:
        calls[names[id(param)]] += 1
        optimizers[id(param)].step()
        optimizers[id(param)].zero_grad(set_to_none=True)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_in_backward)
    for step, (x, y) in enumerate(batches(STEPS), start=1):
        loss_of(model, impl, precision, x, y).backward()
        left = [n for n, p in model.named_parameters() if p.grad is not None]
        assert not left, f"{impl}: after backward {step} these grads were not zeroed by their hook: {left}"
        wrong = {n: c for n, c in calls.items() if c != step}
        assert not wrong, f"{impl}: after backward {step} hooks ran {wrong} times, want {step} each"
    return {"params": full_params(model)}


def in_backward_run(precision: str) -> None:
    results = run_contenders(lambda impl: _train(impl, precision), precision)
    assert_parity(results, precision, "optimizer in backward")


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("precision", ("fp32", "bf16"))
def test_post_accumulate_grad_hooks_step_each_parameter_after_its_reduce(
    dist_pool: Any, precision: str, world_size: int
) -> None:
    dist_pool(world_size).run(in_backward_run, precision)
