"""``precision_aware=True`` casts nothing, the update sees the bf16 grads, and the
compute copy is still refreshed.

Two optimizers that accept bf16 grads on fp32 parameters: torch's SGD without momentum
(``p.add_(g, alpha=-lr)`` upcasts on the fly) and a small optimizer written for it (fp32
momentum fed with ``g.float()``). On 2 ranks each adapted run is compared, bit for bit, with
the same optimizer unadapted, stepping the same bf16 grads, and refreshed by hand.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_patch import parameter_groups
from fsdp_patch.adapter.events import MismatchAction
from tests.optimizer.support import (
    ATTACHMENTS,
    BF16,
    HandCast,
    adapt,
    assert_all,
    backward,
    batches,
    build_model,
    compute_is_fresh,
    fsdp_params,
    grad_dtypes,
    grads_are_original,
    main_weights,
    same,
)


class Bf16MomentumSGD(torch.optim.Optimizer):
    """SGD with an fp32 momentum buffer that takes low-precision grads as they are."""

    def __init__(self, params: Any, lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})
        self.seen: list[set[torch.dtype]] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.seen.append(grad_dtypes(self))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad.to(p.dtype))
                p.add_(buf, alpha=-group["lr"])


MAKERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "bf16_momentum_sgd": lambda p: Bf16MomentumSGD(p),
}


def _precision_aware(name: str, attachment: str) -> dict[str, bool]:
    model, ref = build_model(), build_model()
    opt, ropt = MAKERS[name](model.parameters()), MAKERS[name](ref.parameters())
    observer = adapt(opt, attachment, precision_aware=True)
    seen: list[set[torch.dtype]] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(grad_dtypes(o)))
    refresh = HandCast(fsdp_params(ref)).refresh
    checks: dict[str, bool] = {}
    for step, tokens in enumerate(batches(3)):
        for m in (model, ref):
            backward(m, tokens)
        grad_objects = [p.grad for p in model.parameters()]
        compute_before = [g.compute_weight.clone() for g in parameter_groups(model)]
        opt.step()
        ropt.step()
        refresh()
        tag = f"step {step}"
        checks[f"{tag}: the update saw bf16 grads"] = seen[-1] == {BF16}
        checks[f"{tag}: same grad objects afterwards"] = all(
            p.grad is g for p, g in zip(model.parameters(), grad_objects, strict=True)
        )
        checks[f"{tag}: grads original"] = grads_are_original(opt) is None
        checks[f"{tag}: weights == unadapted on bf16 grads"] = same(main_weights(model), main_weights(ref))
        checks[f"{tag}: compute copy refreshed"] = compute_is_fresh(model) and not same(
            [g.compute_weight for g in parameter_groups(model)], compute_before
        )
        for o in (opt, ropt):
            o.zero_grad()
    if isinstance(opt, Bf16MomentumSGD):
        checks["the optimizer itself saw bf16 grads"] = bool(opt.seen) and all(s == {BF16} for s in opt.seen)
    if observer is not None:
        checks["no grad cast recorded"] = not any(kind == "grads_cast" for kind, *_ in observer.casts)
        checks["refresh casts recorded"] = any(kind == "weights_refreshed" for kind, *_ in observer.casts)
        checks["passthrough mismatches recorded"] = any(
            action is MismatchAction.PASSTHROUGH for *_, action, _ in observer.mismatches
        )
    return checks


@pytest.mark.parametrize("attachment", ATTACHMENTS)
@pytest.mark.parametrize("name", list(MAKERS))
def test_precision_aware_passes_bf16_grads_and_refreshes(pool2: Any, name: str, attachment: str) -> None:
    assert_all(pool2.run(_precision_aware, name, attachment))
