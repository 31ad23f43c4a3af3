"""Every LR scheduler of ``torch.optim.lr_scheduler`` drives the adapted step.

``LRScheduler`` re-wraps ``optimizer.step`` by binding ``optimizer.step.__func__`` to the
optimizer, and warns ("optimizer.step() has been overridden ...") when the step it finds at
its first ``step()`` no longer carries its mark. For each scheduler, created before or after
the adaptation, telemetry off and with a recording observer, three steps run next to a hand-cast reference with
the same scheduler: no scheduler warning is raised, the learning rates follow the reference
(and change), the weights are bitwise the reference's, and every step went through the
adapter (fp32 grads seen by the update, compute copy refreshed, grads restored).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler as L

from tests.optimizer.support import (
    FP32,
    OBSERVERS,
    HandCast,
    O,
    adapt,
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

STEPS = 3
SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "LambdaLR": lambda o: L.LambdaLR(o, lambda e: 0.7**e),
    "MultiplicativeLR": lambda o: L.MultiplicativeLR(o, lambda e: 0.8),
    "StepLR": lambda o: L.StepLR(o, step_size=1, gamma=0.5),
    "MultiStepLR": lambda o: L.MultiStepLR(o, milestones=[1, 2], gamma=0.5),
    "ConstantLR": lambda o: L.ConstantLR(o, factor=0.5, total_iters=2),
    "LinearLR": lambda o: L.LinearLR(o, start_factor=0.25, total_iters=3),
    "ExponentialLR": lambda o: L.ExponentialLR(o, gamma=0.8),
    "SequentialLR": lambda o: L.SequentialLR(
        o, [L.ConstantLR(o, factor=0.5, total_iters=1), L.ExponentialLR(o, gamma=0.8)], milestones=[1]
    ),
    "PolynomialLR": lambda o: L.PolynomialLR(o, total_iters=4, power=2.0),
    "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, T_max=3),
    "ChainedScheduler": lambda o: L.ChainedScheduler(
        [L.ConstantLR(o, factor=0.5, total_iters=2), L.ExponentialLR(o, gamma=0.8)]
    ),
    "ReduceLROnPlateau": lambda o: L.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "CyclicLR": lambda o: L.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=1),
    "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, T_0=2),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=0.1, total_steps=5),
}


def test_every_scheduler_class_is_covered() -> None:
    public = {
        name
        for name, obj in vars(L).items()
        if isinstance(obj, type)
        and issubclass(obj, L.LRScheduler)
        and not name.startswith("_")
        and name != "LRScheduler"
    }
    assert public <= SCHEDULERS.keys(), f"schedulers without a test: {public - SCHEDULERS.keys()}"


def _schedulers(observer: str) -> None:
    for name, make in SCHEDULERS.items():
        for when in ("before", "after"):
            tag = f"{name} created {when} adaptation"
            model, ref = build_model(layers=1), build_model(layers=1)
            opt = O.SGD(model.parameters(), lr=0.05, momentum=0.9)
            ropt = O.SGD(ref.parameters(), lr=0.05, momentum=0.9)
            hand = HandCast(fsdp_params(ref))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if when == "before":
                    sched = make(opt)
                    recording = adapt(opt, observer)
                else:
                    recording = adapt(opt, observer)
                    sched = make(opt)
                rsched = make(ropt)
                seen: list[set[torch.dtype]] = []
                opt.register_step_pre_hook(lambda o, a, k: seen.append(grad_dtypes(o)))
                lrs: list[list[float]] = []
                for step, tokens in enumerate(batches(STEPS)):
                    for m in (model, ref):
                        backward(m, tokens)
                    opt.step()
                    hand.step(ropt)
                    assert_same(main_weights(model), main_weights(ref), f"{tag}: step {step}: weights vs reference")
                    assert_compute_fresh(model, f"{tag}: step {step}")
                    assert_grads_original(opt, f"{tag}: step {step}: grads restored")
                    if isinstance(sched, L.ReduceLROnPlateau):
                        sched.step(float(step))  # a worsening metric: the plateau cuts lr
                        rsched.step(float(step))
                    else:
                        sched.step()
                        rsched.step()
                    lrs.append([float(g["lr"]) for g in opt.param_groups])
                    want = [float(g["lr"]) for g in ropt.param_groups]
                    assert lrs[-1] == want, f"{tag}: step {step}: lr {lrs[-1]}, reference {want}"
                    opt.zero_grad()
                    ropt.zero_grad()
            step_warnings = [str(w.message) for w in caught if "optimizer.step()" in str(w.message)]
            assert not step_warnings, f"{tag}: scheduler warnings {step_warnings}"
            assert len({tuple(x) for x in lrs}) > 1, f"{tag}: lr never changed: {lrs}"
            assert len(seen) == STEPS and all(s == {FP32} for s in seen), (
                f"{tag}: grad dtypes the update saw per step: {seen}, want {STEPS} x {{{FP32}}}"
            )
            if recording is not None:
                got = len(recording.steps)
                assert got == STEPS, f"{tag}: observer saw {got} steps, want {STEPS}"


@pytest.mark.parametrize("observer", OBSERVERS)
def test_schedulers_drive_the_adapted_step(pool1: Any, observer: str) -> None:
    pool1.run(_schedulers, observer)
