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
    BF16,
    OBSERVERS,
    HandCast,
    adapt,
    assert_changed,
    assert_compute_fresh,
    assert_grads_original,
    assert_same,
    backward,
    batches,
    build_model,
    fsdp_params,
    grad_dtypes,
    main_weights,
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


def _precision_aware(name: str, observer: str) -> None:
    model, ref = build_model(), build_model()
    opt, ropt = MAKERS[name](model.parameters()), MAKERS[name](ref.parameters())
    recording = adapt(opt, observer, precision_aware=True)
    seen: list[set[torch.dtype]] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(grad_dtypes(o)))
    refresh = HandCast(fsdp_params(ref)).refresh
    for step, tokens in enumerate(batches(3)):
        for m in (model, ref):
            backward(m, tokens)
        grad_objects = [p.grad for p in model.parameters()]
        compute_before = [g.compute_weight.clone() for g in parameter_groups(model)]
        opt.step()
        ropt.step()
        refresh()
        tag = f"step {step}"
        assert seen[-1] == {BF16}, f"{tag}: grad dtypes the update saw: {seen[-1]}, want {{{BF16}}}"
        replaced = [i for i, (p, g) in enumerate(zip(model.parameters(), grad_objects, strict=True)) if p.grad is not g]
        assert not replaced, f"{tag}: grads of parameters {replaced} are other objects afterwards"
        assert_grads_original(opt, tag)
        assert_same(main_weights(model), main_weights(ref), f"{tag}: weights vs unadapted on bf16 grads")
        assert_compute_fresh(model, tag)
        assert_changed([g.compute_weight for g in parameter_groups(model)], compute_before, f"{tag}: compute copy")
        for o in (opt, ropt):
            o.zero_grad()
    if isinstance(opt, Bf16MomentumSGD):
        assert opt.seen and all(s == {BF16} for s in opt.seen), f"grad dtypes the optimizer itself saw: {opt.seen}"
    if recording is not None:
        grad_casts = [c for c in recording.casts if c[0] == "grads_cast"]
        assert not grad_casts, f"grad casts recorded: {grad_casts}"
        assert any(kind == "weights_refreshed" for kind, *_ in recording.casts), (
            f"no refresh cast recorded among {recording.casts}"
        )
        assert any(action is MismatchAction.PASSTHROUGH for *_, action, _ in recording.mismatches), (
            f"no passthrough mismatch recorded among {recording.mismatches}"
        )


@pytest.mark.parametrize("observer", OBSERVERS)
@pytest.mark.parametrize("name", list(MAKERS))
def test_precision_aware_passes_bf16_grads_and_refreshes(pool2: Any, name: str, observer: str) -> None:
    pool2.run(_precision_aware, name, observer)
