"""Event ``fsdp.optimizer.lr_jump``: a param group's learning rate rising tenfold or more from one
step to the next, read from the optimizer's param groups at each step (the report ties a NaN/Inf
that follows to it: test_precision_report_iterations.py)."""

from __future__ import annotations

from typing import Any

import torch
from fsdp_patch.telemetry import semconv
from fsdp_patch.telemetry.instrumentation.iterations import IterationWatch


class RecordingSpan:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def add_event(self, name: str, attributes: dict[str, Any]) -> None:
        self.events.append((name, dict(attributes)))

    def set_attribute(self, key: str, value: Any) -> None:
        pass


class Observer:
    """What the iteration watch asks of its observer."""

    rank = 0

    def ensure_ready(self) -> None:
        pass

    def precision_due(self, step: int) -> bool:
        return False


def test_a_tenfold_rise_is_an_event_and_a_warm_up_from_zero_is_not() -> None:
    """Learning rates per step for two param groups, each step's events: a rise of 1e5 (group 0)
    and of exactly 10 (group 1) are jumps; a rise from 0 (a warm-up's first step), a fall, a rise of
    9x and an lr kept in a CPU tensor that rises 100x are read as they are."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    optimizer = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=1e-3)
    watch = IterationWatch(optimizer, Observer(), sdk_disabled=False)
    schedule = [(1e-3, 0.0), (100.0, 1e-3), (1.0, 1e-2), (9.0, 1e-2), (torch.tensor(900.0), 1e-2)]
    got = []
    try:
        for step, (lr0, lr1) in enumerate(schedule, start=1):
            optimizer.param_groups[0]["lr"], optimizer.param_groups[1]["lr"] = lr0, lr1
            span = RecordingSpan()
            watch.begin_step(step, span, rank=0)  # type: ignore[arg-type]
            got.extend(
                (a[semconv.ATTR_STEP], a[semconv.ATTR_PARAM_GROUP], a[semconv.ATTR_LR_BEFORE], a[semconv.ATTR_LR_AFTER])
                for name, a in span.events
                if name == semconv.EVENT_LR_JUMP
            )
    finally:
        watch.close()
    want = [(2, 0, 1e-3, 100.0), (3, 1, 1e-3, 1e-2), (5, 0, 9.0, 900.0)]
    assert got == want, f"want jumps {want}, got {got}"
